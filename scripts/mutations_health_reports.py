"""Mutation entries for the straggler report and the step's counts (issue 38); same format as
scripts/mutations.py's MUTATIONS."""

HEALTH_CPP = "ext/health_checks.cpp"
HEALTH = "tests/test_health.py::"
REPORT = HEALTH + "test_the_straggler_report_is_the_median_of_each_ranks_measured_slack[world2]"
NAMED = HEALTH + "test_a_rank_sleeping_40_ms_is_named_within_10_steps_and_a_balanced_run_is_never_warned_about[world2]"
COUNTS = "tests/test_collective_counts.py::"
STEP_CLOCK = HEALTH + "test_median_step_ms_is_the_forward_and_backward_on_each_ranks_own_clock[world2]"
EPISODES = HEALTH + "test_a_second_late_episode_after_a_quiet_spell_is_warned_about_again[world2]"

MUTATIONS = [
    dict(
        id="straggler-median-of-an-even-window-is-its-upper-middle",
        file=HEALTH_CPP,
        edits=[("  return (upper + *std::max_element(values.begin(), values.begin() + mid)) / 2;",
                "  return upper;")],
        why="the median of an even window (10 steps) is its upper middle sample: every rank's "
            "slack and lateness read high by half a sample gap",
        tests=[REPORT],
    ),
    dict(
        id="straggler-scatter-from-the-wrong-quantiles",
        file=HEALTH_CPP,
        edits=[("  return quantile(0.75) - quantile(0.25);", "  return quantile(0.9) - quantile(0.1);")],
        why="the step-to-step scatter is the 10-90 % range instead of the interquartile one: "
            "the automatic threshold rises and real stragglers go unnamed",
        tests=[REPORT],
    ),
    dict(
        id="straggler-threshold-ignores-the-scatter",
        file=HEALTH_CPP,
        edits=[("  const double of_jitter = std::isnan(jitter_ms) ? 0.0 : kJitterFactor * jitter_ms;",
                "  const double of_jitter = 0.0;")],
        why="a lateness within the job's step-to-step scatter names a rank: a healthy job on a "
            "loaded host is warned about (the issue's 5.28 ms warning)",
        tests=[NAMED, REPORT],
    ),
    dict(
        id="straggler-threshold-a-fixed-5-ms",
        file=HEALTH_CPP,
        edits=[("  return std::max({of_step, of_jitter, kSchedulerNoiseMs});",
                "  return std::max({5.0, of_jitter, kSchedulerNoiseMs});")],
        why="the automatic threshold is a fixed 5 ms again instead of a fraction of the step: a "
            "slow job's noise names ranks, a fast job's stragglers go unnamed",
        tests=[REPORT],
    ),
    dict(
        id="straggler-lateness-from-the-latest-rank",
        file=HEALTH_CPP,
        edits=[("    if (!std::isnan(entries[kSlackMs])) earliest = std::max(earliest, entries[kSlackMs]);",
                "    if (!std::isnan(entries[kSlackMs])) earliest = entries[kSlackMs];")],
        why="lateness is measured from the last rank's slack instead of the earliest rank's: "
            "with 3 ranks the wrong rank is named",
        tests=[REPORT],
    ),
    dict(
        id="straggler-warning-after-one-exchange",
        file="python/fused_reducer/core/wrapper.py",
        edits=[("straggler_threshold_ms=None, straggler_warn_steps=20):",
                "straggler_threshold_ms=None, straggler_warn_steps=10):")],
        why="the warning comes after one late exchange: one noisy window on a loaded host "
            "warns about a healthy job",
        tests=[NAMED],
    ),
    dict(
        id="health-exchange-counted-as-a-gradient-all-reduce",
        file="ext/reducer.cpp",
        edits=[("  stats_.health_exchanges += 1;  // of the step that just completed, apart from "
                "its gradients'",
                "  stats_.allreduces += 1;")],
        why="stats()['allreduces'] says 2 where the layout has one bucket, every straggler "
            "interval (the issue's 3 for 2 buckets)",
        tests=[COUNTS + "test_the_health_exchange_is_counted_apart_from_the_gradients_all_reduces"],
    ),
]

MUTATIONS += [
    dict(
        id="straggler-measured-only-when-every-rank-is",
        file="python/fused_reducer/core/reports.py",
        edits=[('report["measured"] = any(v is not None for v in report["lateness_ms"])',
                'report["measured"] = all(v is not None for v in report["lateness_ms"])')],
        why="a report with a joined rank (uneven inputs under join) says nothing was measured, "
            "though the ranks still training were",
        tests=[HEALTH + "test_join_with_check_finite_and_straggler_exchanges_matches_ddps_join[world2]"],
    ),
    dict(
        id="straggler-joined-rank-reports-its-stale-median",
        file=HEALTH_CPP,
        edits=[("  entries[kSlackMs] = joined ? kNaN : median({slack_ms_.begin(), slack_ms_.end()});",
                "  entries[kSlackMs] = median({slack_ms_.begin(), slack_ms_.end()});")],
        why="a joined rank contributes the median of slacks from before it joined: it can be "
            "named late (or make others late) for steps it did not train",
        tests=[HEALTH + "test_join_with_check_finite_and_straggler_exchanges_matches_ddps_join[world2]"],
    ),
]

MUTATIONS += [
    dict(
        id="straggler-step-time-in-seconds",
        file="ext/health_exchange.cpp",
        edits=[("(now_us() - telemetry.forward_time_us()) / 1000.0);",
                "(now_us() - telemetry.forward_time_us()) / 1e6);")],
        why="median_step_ms holds seconds (a unit slip): the automatic threshold's fraction of "
            "the step falls to the 1 ms floor, and the report's own threshold check still "
            "agrees with itself (issue 48)",
        tests=[STEP_CLOCK],
    ),
    dict(
        id="straggler-warned-about-only-once",
        file=HEALTH_CPP,
        edits=[("      warned_[r] = 0;  // a later episode warns again\n", "")],
        why="a rank is warned about once per run: a second late episode after a quiet spell "
            "goes unwarned (issue 48)",
        tests=[EPISODES],
    ),
]
