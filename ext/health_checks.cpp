#include "health_checks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

namespace fused_reducer {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double median(std::vector<double> values) {
  values.erase(std::remove_if(values.begin(), values.end(), [](double v) { return std::isnan(v); }),
               values.end());
  if (values.empty()) {
    return kNaN;
  }
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + mid, values.end());
  double upper = values[mid];
  if (values.size() % 2 == 1) {
    return upper;
  }
  return (upper + *std::max_element(values.begin(), values.begin() + mid)) / 2;
}

// The interquartile range (linear interpolation between order statistics, as numpy's default):
// the step-to-step scatter of a rank's slack. 0 for fewer than two samples.
double interquartile_range(std::vector<double> values) {
  values.erase(std::remove_if(values.begin(), values.end(), [](double v) { return std::isnan(v); }),
               values.end());
  if (values.size() < 2) {
    return 0.0;
  }
  std::sort(values.begin(), values.end());
  auto quantile = [&](double q) {
    const double position = q * static_cast<double>(values.size() - 1);
    const auto below = static_cast<size_t>(position);
    const size_t above = std::min(below + 1, values.size() - 1);
    return values[below] + (values[above] - values[below]) * (position - static_cast<double>(below));
  };
  return quantile(0.75) - quantile(0.25);
}

std::string milliseconds(double ms) {
  std::ostringstream out;
  out.precision(ms < 10 ? 2 : 0);
  out << std::fixed << ms << " ms";
  return out.str();
}

}  // namespace

void check_health_options(const HealthOptions& options) {
  auto refuse = [](const std::string& what) { throw ModelSettingError("FusedReducer: " + what); };
  if (options.straggler_interval < 0) {
    refuse("straggler_interval must be >= 0 steps (0: off), got " +
           std::to_string(options.straggler_interval));
  }
  if (options.straggler_window <= 0) {
    refuse("straggler_window must be a positive number of steps, got " +
           std::to_string(options.straggler_window));
  }
  if (!(options.straggler_threshold_ms >= 0)) {
    refuse("straggler_threshold_ms must be a positive number of milliseconds, or None "
           "(automatic), got " + std::to_string(options.straggler_threshold_ms));
  }
  if (options.straggler_warn_steps <= 0) {
    refuse("straggler_warn_steps must be a positive number of steps, got " +
           std::to_string(options.straggler_warn_steps));
  }
}

HealthChecks::HealthChecks(HealthOptions options, int rank, int world_size)
    : options_(options), rank_(rank), world_size_(world_size), warned_(world_size, 0) {
  check_health_options(options_);
  report_.lateness_ms.assign(world_size, kNaN);
  report_.slack_ms.assign(world_size, kNaN);
  report_.late_steps.assign(world_size, 0);
  report_.interval = options_.straggler_interval;
  report_.window = options_.straggler_window;
}

bool HealthChecks::end_step(const std::vector<double>& slack_ms, double step_ms) {
  slack_ms_.insert(slack_ms_.end(), slack_ms.begin(), slack_ms.end());
  step_ms_.push_back(step_ms);
  while (static_cast<int64_t>(slack_ms_.size()) > options_.straggler_window) {
    slack_ms_.pop_front();
  }
  while (static_cast<int64_t>(step_ms_.size()) > options_.straggler_window) {
    step_ms_.pop_front();
  }
  return shadow_step();
}

bool HealthChecks::next_step_exchanges() const {
  const int64_t next = steps_ + 1;
  const bool stragglers_due =
      options_.straggler_interval > 0 && next % options_.straggler_interval == 0;
  return options_.check_finite || stragglers_due;
}

bool HealthChecks::shadow_step() {
  const bool due = next_step_exchanges();
  steps_ += 1;
  return due;
}

at::Tensor HealthChecks::row(int64_t nonfinite, bool joined) const {
  at::Tensor row = at::zeros({kRow * static_cast<int64_t>(world_size_)}, at::kDouble);
  double* entries = row.mutable_data_ptr<double>() + kRow * rank_;
  entries[kNonfinite] = static_cast<double>(nonfinite);
  entries[kSlackMs] = joined ? kNaN : median({slack_ms_.begin(), slack_ms_.end()});
  entries[kStepMs] = joined ? kNaN : median({step_ms_.begin(), step_ms_.end()});
  entries[kSlackIqrMs] = joined ? kNaN : interquartile_range({slack_ms_.begin(), slack_ms_.end()});
  return row;
}

int64_t HealthChecks::total_nonfinite(const at::Tensor& summed_rows) {
  const double* rows = summed_rows.const_data_ptr<double>();
  double total = 0;
  for (int64_t r = 0; r < summed_rows.numel() / kRow; ++r) {
    total += rows[kRow * r + kNonfinite];
  }
  return static_cast<int64_t>(total);
}

// Note [Lateness from slack]
// Clocks of different hosts do not agree, so a rank's lateness is not read off its own
// clock. The collective of the last bucket is what every rank waits in: it completes
// at about the same moment on every rank (within its own latency), once the last rank
// has contributed. So a rank's slack (from its last bucket being ready to that
// collective's completion, both on its own clock) is long on an early rank and short on
// the late one, and lateness(r) = max over ranks of slack - slack(r): how long after the
// earliest rank r's buckets were ready. The collectives of a training forward (buffer
// broadcast, join's all-reduce) are a meeting point too: with them a rank late before its
// forward (data loading) is waited for there, and every rank's buckets are then in step; so
// a step's slack is its wait there plus its last bucket's (Reducer::begin_forward_sync). Each
// rank reports the median of its last `straggler_window` slacks, so one slow step does not
// name a rank. See Note [A straggler is late relative to the step] for who is named and warned.
void HealthChecks::update_stragglers(const at::Tensor& summed_rows) {
  const int64_t step = steps_;  // counted alike on joined ranks: the report is the same on all
  const double* rows = summed_rows.const_data_ptr<double>();
  double earliest = -std::numeric_limits<double>::infinity();
  std::vector<double> steps;
  std::vector<double> scatters;
  for (int r = 0; r < world_size_; ++r) {
    const double* entries = rows + kRow * r;
    if (!std::isnan(entries[kSlackMs])) earliest = std::max(earliest, entries[kSlackMs]);
    steps.push_back(entries[kStepMs]);
    scatters.push_back(entries[kSlackIqrMs]);
  }
  report_.median_step_ms = median(steps);
  report_.jitter_ms = median(scatters);
  report_.threshold_ms = options_.straggler_threshold_ms > 0
                             ? options_.straggler_threshold_ms
                             : automatic_threshold_ms(report_.median_step_ms, report_.jitter_ms);
  const int64_t elapsed = step - last_update_step_;
  last_update_step_ = step;
  report_.step = step;
  report_.stragglers.clear();
  report_.slowest = -1;
  double slowest = -1;
  std::ostringstream warning;
  for (int r = 0; r < world_size_; ++r) {
    const double slack = rows[kRow * r + kSlackMs];
    const double lateness = std::isnan(slack) ? kNaN : earliest - slack;
    report_.lateness_ms[r] = lateness;
    report_.slack_ms[r] = slack;
    if (!std::isnan(lateness) && lateness > slowest) {
      slowest = lateness;
      report_.slowest = r;
    }
    const bool late = !std::isnan(lateness) && lateness > report_.threshold_ms;
    if (!late) {
      report_.late_steps[r] = 0;
      warned_[r] = 0;  // a later episode warns again
      continue;
    }
    report_.stragglers.push_back(r);
    report_.late_steps[r] += elapsed;
    if (report_.late_steps[r] >= options_.straggler_warn_steps && !warned_[r]) {
      warned_[r] = 1;
      warning << (warning.tellp() > 0 ? "; " : "") << "rank " << r << " has been late for "
              << report_.late_steps[r] << " steps: it reaches the step's collectives "
              << milliseconds(lateness) << " after the earliest rank (median of its last "
              << options_.straggler_window << " steps; threshold "
              << milliseconds(report_.threshold_ms) << ", median step "
              << milliseconds(report_.median_step_ms) << ", step-to-step scatter "
              << milliseconds(report_.jitter_ms) << ")";
    }
  }
  if (warning.tellp() > 0) {
    warning_ = "FusedReducer: straggler: " + warning.str() +
               ". Every rank waits for the latest one each step; look at the late ranks' hosts "
               "(GPU clocks, data loading, other processes). model.straggler_report() has every "
               "rank's lateness.";
  }
}

// Note [A straggler is late relative to the step]
// What makes a rank a straggler is how much of the step the others lose waiting for it, so
// the automatic threshold is a fraction of the median step, never a fixed number of
// milliseconds: kLateFractionOfStep, 15 %. A rank late by 20 % of its own step reaches the
// collectives 20-25 % of median_step_ms (forward to the end of backward) after the others, so
// it is named at the first exchange after it turned slow; a balanced job on a quiet host came
// to 12-13 % (rank 0 about 1 ms behind at an 8.5 ms step, the window holding the first step),
// which the 10 % of before named.
// On a shared, loaded host the ranks also arrive in a random order by a few milliseconds each
// step (the scheduler, not the job): measured on 2 cores, 2 ranks, a 17 ms step, the per-step
// lateness of a balanced job was +-5 ms, a coin flip, and a window's median of it reached 26 %
// of the step. A lateness within that step-to-step scatter says nothing, so the threshold is
// also at least kJitterFactor (1) times the ranks' median interquartile range of their slacks
// (jitter_ms: near 0 on a quiet host, where the fraction decides). A balanced window's
// lateness is the difference of two ranks' medians of `straggler_window` (10) slacks: its
// standard error is about 0.4 of a rank's interquartile range (1.25 sigma sqrt(2 / 10) against
// 1.35 sigma, for a normal scatter), so half the range (the factor of before) is 1.2 standard
// errors: one balanced window in 4 crosses it, and the same rank two in a row, the warning,
// one run in 40 (issue 48 measured 2 of 45 runs of its job, an MLP, batch 32, 30 steps, beside
// 2 busy loops); the whole range is 2.4 standard errors: one window in 60, the same rank two
// in a row one run in 7000. And never below kSchedulerNoiseMs, what the host's scheduler alone
// moves a process by (steps of a few ms on a loaded CPU host named a rank 0.3 ms late).
// Naming in the report follows one exchange; the logged warning waits for
// straggler_warn_steps late steps in a row (20: two exchanges), and comes again for a later
// episode once an exchange found the rank on time.
// Measured with bench/straggler_noise.py on issue 48's job (docs/HEALTH.md, 2026-12-07): beside
// 2 busy loops, 100 healthy runs, no warning (the rule of before named a rank in 8 of 300
// windows where this one names 2); rank 1 late by 20 % of its step on an otherwise idle host,
// 30 runs: named by step 20 in 29 (the other one was only 9-11 % late), warned at step 20 in
// 24. That is the price of the quiet: on a noisy host (load 4.5 in bursts, 15 ms steps) it was
// warned at step 20 in 3 of 20 runs (the rule of before: 8).
double HealthChecks::automatic_threshold_ms(double median_step_ms, double jitter_ms) {
  const double of_step = std::isnan(median_step_ms) ? 0.0 : kLateFractionOfStep * median_step_ms;
  const double of_jitter = std::isnan(jitter_ms) ? 0.0 : kJitterFactor * jitter_ms;
  return std::max({of_step, of_jitter, kSchedulerNoiseMs});
}

std::string HealthChecks::take_warning() {
  std::string warning;
  warning.swap(warning_);
  return warning;
}

at::Tensor HealthChecks::detail_row(const std::vector<int64_t>& counts,
                                      const std::vector<int64_t>& order) const {
  at::Tensor row = at::zeros({kDetail * world_size_}, at::kDouble);
  double* entries = row.mutable_data_ptr<double>() + kDetail * rank_;
  std::vector<char> seen(counts.size(), 0);
  int64_t named = 0;
  auto note = [&](int64_t index) {
    if (seen[index] || counts[index] == 0) return;
    seen[index] = 1;
    entries[0] += 1;
    if (named < kNamed) {
      entries[1 + 2 * named] = static_cast<double>(index);
      entries[2 + 2 * named] = static_cast<double>(counts[index]);
      named += 1;
    }
  };
  for (const int64_t index : order) note(index);  // first produced in this backward first
  for (int64_t index = 0; index < static_cast<int64_t>(counts.size()); ++index) note(index);
  return row;
}

std::string HealthChecks::nonfinite_message(const at::Tensor& summed_rows,
                                              const at::Tensor& summed_detail,
                                              const std::vector<std::string>& names,
                                              int64_t step, bool sharded) const {
  const double* rows = summed_rows.const_data_ptr<double>();
  const double* detail = summed_detail.const_data_ptr<double>();
  std::ostringstream out;
  out << "FusedReducer: non-finite gradients (NaN or Inf) in step " << step
      << " (check_finite=True), in the local gradients of ";
  bool first_rank = true;
  for (int r = 0; r < world_size_; ++r) {
    const auto count = static_cast<int64_t>(rows[kRow * r + kNonfinite]);
    if (count == 0) continue;
    const double* entries = detail + kDetail * r;
    const auto params = static_cast<int64_t>(entries[0]);
    out << (first_rank ? "" : "; ") << "rank " << r << ": " << count << " element"
        << (count == 1 ? "" : "s") << " in " << params << " parameter" << (params == 1 ? "" : "s")
        << ", first ";
    first_rank = false;
    for (int64_t k = 0; k < std::min(params, kNamed); ++k) {
      const auto index = static_cast<size_t>(entries[1 + 2 * k]);
      out << (k ? ", " : "") << "'" << (index < names.size() ? names[index] : "?") << "' ("
          << static_cast<int64_t>(entries[2 + 2 * k]) << ")";
    }
    if (params > kNamed) out << " and " << params - kNamed << " more";
  }
  out << ". They were averaged into every rank's gradients, so every rank raises this: "
      << (sharded ? "the ShardedOptimizer's gradient shards hold that average (non-finite where "
                    "they were; param.grad holds the released-gradient placeholder). "
                  : "param.grad holds that average (non-finite where they were). ")
      << "Call optimizer.zero_grad() and skip optimizer.step() for this batch: the next step then "
         "trains as DDP would from the same parameters. To find the cause, look at the named "
         "rank's batch, loss scale and learning rate.";
  return out.str();
}

std::string HealthChecks::averaged_nonfinite_message(
    const std::vector<std::pair<std::string, int64_t>>& found, int64_t step,
    const std::string& reduction) const {
  std::ostringstream out;
  out << "FusedReducer: non-finite gradients (NaN or Inf) in step " << step
      << " (check_finite=True): every rank's local gradients were finite, but their average is "
         "not: "
      << reduction << " overflowed, in " << found.size() << " parameter"
      << (found.size() == 1 ? "" : "s") << ", first ";
  for (size_t k = 0; k < std::min<size_t>(found.size(), kNamed); ++k) {
    out << (k ? ", " : "") << "'" << found[k].first << "' (" << found[k].second << ")";
  }
  if (found.size() > static_cast<size_t>(kNamed)) out << " and " << found.size() - kNamed << " more";
  out << ". param.grad holds that average on every rank, so every rank raises this. Call "
         "optimizer.zero_grad() and skip optimizer.step() for this batch; to keep the sums in "
         "range reduce in bfloat16 or float32 (reduce_dtype) or lower the loss scale.";
  return out.str();
}

}  // namespace fused_reducer
