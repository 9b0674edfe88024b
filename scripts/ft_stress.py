"""Fault-tolerance stress (issue 47): torchft replica groups training through
fused_reducer.torchft, one replica SIGKILLed per run at a random point, restarted at once (as
torchelastic restarts a dead worker), and each run given a verdict.

    .venv/bin/python scripts/ft_stress.py --runs 30 --seed 0
    .venv/bin/python scripts/ft_stress.py --runs 10 --replicas 3 --out /tmp/ft3.json

A run: a Lighthouse in this process, --replicas replicas of tests/ft_worker.py started together
(tests/ft_common.py), one victim chosen at random and killed (SIGKILL) in one phase:
  forward         in the forward of a random step (the replica kills itself, its own pid)
  backward        in the backward of a random step, once 1 or 2 of its buckets went out (in flight)
  after_backward  between backward and the optimizer step (before should_commit)
  step            inside the optimizer step (after should_commit)
  timer           from a timer thread here, a random time into training (anywhere: a quorum, a
                  collective, a heal, between steps)
(a timer that fires after the victim finished is a missed kill, counted apart, not a wrong run)
then restarted with the same replica id after a random delay (0 to --restart-delay-max-s). A run is wrong unless
  - no replica hung (every run bounded by --run-timeout-s; a hang is killed and counted),
  - every survivor ran in one process to the end (same pid in all its records, exit code 0),
  - the victim died by SIGKILL in the chosen phase and its restart exited 0,
  - the restarted victim healed (received the live state, unless nothing was committed yet) and
    rejoined (committed a step with every replica),
  - every replica of a committed step had the same bucket layout,
  - every replica's final parameters equal the float64 replay of the committed steps and their
    participants (ft_common.replay) within 1e-5.
"kill to next commit": from the SIGKILL to the survivors' next committed step (the killed step
itself when the victim's gradients had all gone out); "to rejoin": to the first step the restart
committed with every replica. Prints a line per run and a summary; writes JSON (every run, the summary) to --out
(default bench/out/ft_stress.json). Exits 1 if any run was wrong or hung.
"""
import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # ft_common; the package as installed
import ft_common  # noqa: E402

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Lighthouse and Managers: no quorum chatter

PHASES = ("forward", "backward", "after_backward", "step", "timer")


def run_once(index, rng, args, out):
    phase = rng.choice(args.phases) if args.random_phases else args.schedule[index]
    victim = rng.randrange(args.replicas)
    plan = {"run": index, "phase": phase, "victim": victim}
    base = dict(steps=args.steps, final_participants=args.replicas, pause_s=args.pause_s,
                timeout_s=args.timeout_s, max_s=args.run_timeout_s - 5)
    configs = {r: dict(base) for r in range(args.replicas)}
    if phase == "timer":
        plan["offset_s"] = round(rng.uniform(0.0, args.timer_max_s), 3)
    else:
        plan["kill_step"] = rng.randint(1, args.steps - 2)
        # From step 2 (ft_worker.limits_at) the layout has 3 buckets, before it 2; the backward
        # kill fires in the last bucket's gradients, once this many went out.
        plan["kill_after_buckets"] = rng.choice([1, 2] if plan["kill_step"] >= 2 else [1])
        configs[victim].update(kill_step=plan["kill_step"], kill_in=phase,
                               kill_after_buckets=plan["kill_after_buckets"])
    plan["restart_delay_s"] = round(rng.uniform(0.0, args.restart_delay_max_s), 3)
    problems = []
    lighthouse = ft_common.start_lighthouse()
    started = time.monotonic()
    deadline = started + args.run_timeout_s
    try:
        procs = ft_common.start_together(out, lighthouse.address(), configs)
    except AssertionError as e:
        lighthouse.shutdown()
        return dict(plan, problems=[f"did not start: {e}"], wrong=True, hung=False, missed=False,
                    survivor_restarts=0, seconds=round(time.monotonic() - started, 1))
    try:
        first_pid = procs[victim].pid
        timer_kill = {}
        if phase == "timer":
            while not ft_common.records_or_none(out, victim) and procs[victim].poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.01)

            def kill():
                if procs[victim].poll() is None:  # only our own child, while it runs
                    timer_kill["time"] = time.time()
                    procs[victim].send_signal(signal.SIGKILL)

            timer = threading.Timer(plan["offset_s"], kill)
            timer.start()
        codes = ft_common.wait_all({victim: procs[victim]}, out, deadline, check=False)
        if phase == "timer":
            timer.cancel()
        code = codes[victim]
        missed = phase == "timer" and code == 0  # it finished before the timer: no kill
        if code != -signal.SIGKILL and not missed:
            problems.append(f"victim ended with {code}, not by SIGKILL")
        else:
            # Restarted with the same replica id, as torchelastic restarts a dead worker once
            # its monitor sees it (after a random delay: the survivor may train alone meanwhile).
            time.sleep(plan["restart_delay_s"])
            procs[victim] = ft_common.start(out, victim, lighthouse.address(), restarted=True,
                                            **base)
        codes.update(ft_common.wait_all(procs, out, deadline, check=False))
    finally:
        lighthouse.shutdown()
    result = dict(plan, codes={str(r): c for r, c in codes.items()}, missed=missed,
                  hung=any(c == "hung" for c in codes.values()),
                  seconds=round(time.monotonic() - started, 1))
    logs = {r: ft_common.records(out, r) if os.path.exists(os.path.join(out, f"replica{r}.log"))
            else [] for r in range(args.replicas)}
    survivors = [r for r in range(args.replicas) if r != victim]
    result["survivor_restarts"] = sum(
        1 for r in survivors
        if codes[r] != 0 or len({rec["pid"] for rec in logs[r] if "step" in rec}) != 1)
    for r in survivors:
        if codes[r] != 0:
            problems.append(f"survivor {r} ended with {codes[r]}")
    if code == -signal.SIGKILL and codes[victim] != 0:
        problems.append(f"restarted victim ended with {codes[victim]}")

    # Where the victim died.
    kills = [rec for rec in logs[victim] if "killed" in rec]
    if phase == "timer":
        if "time" in timer_kill:
            kills = [{"killed": None, "replica": victim, "phase": "timer", "contributed": None,
                      "time": timer_kill["time"]}]
        elif not problems and not missed:
            problems.append("the timer did not kill the victim")
    elif code == -signal.SIGKILL:
        if len(kills) != 1 or kills[0]["phase"] != phase or kills[0]["killed"] != plan["kill_step"]:
            problems.append(f"killed elsewhere than planned: {kills}")
        elif phase == "backward":
            # Buckets in flight: some launched, not all (the survivors' layout of that step).
            buckets = [rec["buckets"] for r in survivors for rec in logs[r]
                       if rec["step"] == plan["kill_step"]]
            if not buckets or not 1 <= kills[0]["launched"] < buckets[0]:
                problems.append(f"backward kill without buckets in flight: {kills[0]}, "
                                f"buckets {buckets}")
    if kills:
        result["kill"] = {k: kills[0][k] for k in ("killed", "phase", "launched", "contributed")
                          if k in kills[0]}
        t_kill = kills[0]["time"]
        after = [rec["time"] for r in survivors for rec in logs[r]
                 if rec.get("commit") and rec["time"] > t_kill]
        result["kill_to_next_commit_s"] = round(min(after) - t_kill, 3) if after else None
        restarted = [rec for rec in logs[victim] if "step" in rec and rec["pid"] != first_pid]
        together = [rec["time"] for rec in restarted
                    if rec["commit"] and rec["participants"] == args.replicas]
        result["kill_to_rejoin_s"] = round(min(together) - t_kill, 3) if together else None
        if code == -signal.SIGKILL and not problems:
            if not restarted:
                problems.append("the restarted victim recorded no step")
            else:
                # A fresh Manager starts at step 0: a later first step came with the live state.
                result["healed_at"] = restarted[0]["healed_at"]
                result["heals"] = restarted[-1]["heals"]
                if restarted[0]["step"] > 0 and restarted[-1]["heals"] < 1:
                    problems.append("the restarted victim did not heal")
                if not together:
                    problems.append("the restarted victim never committed with every replica")

    # The parameters against the float64 replay.
    if not problems and not result["hung"]:
        everything = [rec for r in range(args.replicas) for rec in logs[r]
                      if "killed" not in rec] + kills
        try:
            reference, steps, committed = ft_common.replay(everything)
            errors = {r: ft_common.max_error(ft_common.final_parameters(out, r), reference)
                      for r in range(args.replicas)}
            result["max_error"] = max(errors.values())
            result["committed_steps"] = len(steps)
            result["steps_alone"] = sum(1 for s in steps if len(committed[s]) < args.replicas)
            if result["max_error"] >= ft_common.TOLERANCE:
                problems.append(f"parameters off the float64 replay: {errors}")
            # Every replica of a committed step had the same bucket layout.
            layouts = {}
            for r in range(args.replicas):
                for rec in logs[r]:
                    if rec.get("commit"):
                        layouts.setdefault(rec["step"], set()).add(json.dumps(rec["layout"]))
            differing = sorted(s for s, seen in layouts.items() if len(seen) > 1)
            if differing:
                problems.append(f"bucket layouts differ between replicas at steps {differing}")
        except AssertionError as e:
            problems.append(f"replay: {e}")
    result["problems"] = problems
    result["wrong"] = bool(problems) or result["hung"]
    if result["wrong"]:
        result["tails"] = ft_common.output_tails(out, range(args.replicas), chars=1500)
    return result


def median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=2, choices=(2, 3))
    parser.add_argument("--phases", default=",".join(PHASES),
                        help="comma-separated subset of " + ",".join(PHASES))
    parser.add_argument("--random-phases", action="store_true",
                        help="draw each run's phase independently (default: every phase equally "
                             "often, in a random order)")
    parser.add_argument("--steps", type=int, default=12, help="steps each replica trains")
    parser.add_argument("--pause-s", type=float, default=0.05, help="pause between steps")
    parser.add_argument("--timeout-s", type=float, default=10, help="the Managers' timeout")
    parser.add_argument("--timer-max-s", type=float, default=0.4,
                        help="timer kills: at most this long after the victim's first step")
    parser.add_argument("--restart-delay-max-s", type=float, default=5.0,
                        help="the victim is restarted a random delay up to this after its death")
    parser.add_argument("--run-timeout-s", type=float, default=120)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "ft_stress.json"))
    parser.add_argument("--keep", help="keep every run's logs under this folder")
    args = parser.parse_args()
    args.phases = args.phases.split(",")
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}")
    rng = random.Random(args.seed)
    args.schedule = [args.phases[i % len(args.phases)] for i in range(args.runs)]
    rng.shuffle(args.schedule)

    results, began = [], time.monotonic()
    for index in range(args.runs):
        out = tempfile.mkdtemp(prefix=f"ft_stress{index}_")
        try:
            result = run_once(index, rng, args, out)
        finally:
            if args.keep:
                shutil.copytree(out, os.path.join(args.keep, f"run{index}"), dirs_exist_ok=True)
            shutil.rmtree(out, ignore_errors=True)
        results.append(result)
        where = (f"timer +{result['offset_s']}s" if result["phase"] == "timer" else
                 f"{result['phase']} of step {result['kill_step']}")
        print(f"run {index:3d} victim {result['victim']} {where:26s} "
              f"{'WRONG' if result['wrong'] else 'ok':5s} {result['seconds']:5.1f}s "
              f"next commit +{result.get('kill_to_next_commit_s')}s "
              f"rejoined +{result.get('kill_to_rejoin_s')}s "
              f"err {result.get('max_error')} alone {result.get('steps_alone')}"
              + (f"  {result['problems']}" if result["problems"] else ""), flush=True)
        if result["wrong"]:
            print(result["tails"], flush=True)

    per_phase = {p: {"runs": sum(r["phase"] == p for r in results),
                     "wrong": sum(r["phase"] == p and r["wrong"] for r in results),
                     "median_kill_to_next_commit_s": median(
                         r.get("kill_to_next_commit_s") for r in results if r["phase"] == p),
                     "median_kill_to_rejoin_s": median(
                         r.get("kill_to_rejoin_s") for r in results if r["phase"] == p)}
                 for p in args.phases}
    summary = {
        "runs": len(results), "wrong": sum(r["wrong"] for r in results),
        "hangs": sum(r["hung"] for r in results),
        "missed_timer_kills": sum(r["missed"] for r in results),
        "survivor_restarts": sum(r["survivor_restarts"] for r in results),
        "per_phase": per_phase, "replicas": args.replicas, "seed": args.seed,
        "median_kill_to_next_commit_s": median(r.get("kill_to_next_commit_s") for r in results),
        "median_kill_to_rejoin_s": median(r.get("kill_to_rejoin_s") for r in results),
        "max_error": max((r.get("max_error", 0.0) for r in results), default=None),
        "seconds": round(time.monotonic() - began, 1),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(), "load_average": os.getloadavg(),
    }
    print("summary: " + " ".join(
        f"{k}={v}" for k, v in summary.items() if k not in ("per_phase",)) + " per_phase=" +
        ",".join(f"{p}:{c['runs']}/{c['wrong']}wrong" for p, c in per_phase.items()))
    for p, c in per_phase.items():
        print(f"  {p:15s} runs {c['runs']:3d} wrong {c['wrong']:3d} median kill to next commit "
              f"{c['median_kill_to_next_commit_s']} s, to rejoin {c['median_kill_to_rejoin_s']} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "runs": results}, f, indent=1)
    print(f"wrote {args.out}")
    sys.exit(1 if summary["wrong"] else 0)


if __name__ == "__main__":
    main()
