#!/usr/bin/env python
"""Does the straggler report stay quiet on a healthy job on a loaded machine, and still name a
rank that is late by a fifth of the step? (issues 38 and 48; Note [A straggler is late relative
to the step] in ext/health_checks.cpp)

    python bench/straggler_noise.py                        # 20 balanced + 10 late runs, 2 busy loops
    python bench/straggler_noise.py --runs 100 --late-runs 0 --runs-per-launch 25 --json h.json
    python bench/straggler_noise.py --runs 10 --late-runs 20 --runs-per-launch 10 --busy 0

Each run is a toy job as a new user writes it: 2 gloo ranks, an MLP (256-1024-1024-10, batch
32, 30 steps: issue 48's job; --batch, --steps), SGD, FusedReducer with every default (an
exchange every 10 steps, the automatic threshold), one intra-op thread per rank (what torchrun
sets with 2 ranks per host). `--busy` processes spin beside it for the whole measurement (a
shared, loaded machine). --runs-per-launch N: one launch of the ranks runs N of them one after
another, each a fresh model and FusedReducer (so a fresh report; the processes' own start-up
is then not repeated: on a loaded host it costs more than the run). Balanced runs: counted are
the runs with a logged straggler warning (the target: none) and those whose report named a
rank at some exchange. Late runs: rank 1 sleeps `--late-fraction` (0.2) of its own median step
time before each backward from its 4th step; reported is the first exchange that names it
(the target: step 10, the first) and whether it was warned about (logged at the forward after
the exchange of step 20, the last of a 30-step run that can be). The load average (/proc/loadavg)
is printed before, during and after. --json FILE writes {meta, balanced, late} as the runs
come in (an interrupted measurement keeps what it measured); exit status 0.
"""
import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def toy_job(ctx, args):
    """`args.jobs_now` toy jobs one after another in these processes (each a fresh model and
    FusedReducer, so a fresh straggler report); rank 0 writes [{exchanges, warnings}]."""
    import fused_reducer
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("fused_reducer").addHandler(handler)
    results = []
    for _ in range(args.jobs_now):
        warnings.clear()
        torch.manual_seed(0)
        model = fused_reducer.FusedReducer(nn.Sequential(
            nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
            nn.Linear(1024, 10)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(args.batch, 256), torch.randint(0, 10, (args.batch,))
        late = ctx.rank == 1 and args.late_fraction_now > 0
        durations, exchanges = [], []
        for step in range(args.steps):
            start = time.perf_counter()
            loss = nn.functional.cross_entropy(model(x), y)
            if late and len(durations) >= 3:
                time.sleep(args.late_fraction_now * statistics.median(durations[-10:]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            durations.append(time.perf_counter() - start)
            report = model.straggler_report()
            if report["step"] == step + 1:
                exchanges.append({k: report[k] for k in ("step", "stragglers", "lateness_ms",
                                                         "slack_ms", "threshold_ms",
                                                         "median_step_ms", "jitter_ms")})
        model.close()
        results.append({"exchanges": exchanges,
                        "warnings": [w for w in warnings if "straggler" in w]})
    if ctx.rank == 0:
        with open(args.result_path, "w") as f:
            json.dump(results, f)
    return 0


def _loadavg():
    """/proc/loadavg's 1, 5 and 15 minute averages (the machine may be shared), or None."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[:3]
    except OSError:
        return None


def one_launch(args, late_fraction, jobs):
    """`jobs` runs in one launch of the ranks: a list of {exchanges, warnings}."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        args.result_path = f.name
    args.late_fraction_now, args.jobs_now = late_fraction, jobs
    try:
        code = common.launch(toy_job, args)
        if code != 0:
            raise SystemExit(f"straggler_noise: a run failed (exit {code})")
        with open(args.result_path) as f:
            return json.load(f)
    finally:
        os.unlink(args.result_path)


def _summary(name, runs, args):
    """Counts of a list of runs, and how far their windows' lateness went (as a fraction of
    the median step and of the step-to-step scatter, each exchange's latest rank)."""
    if not runs:
        return
    warned = sum(1 for r in runs if r["warnings"])
    first_named = [next((e["step"] for e in r["exchanges"] if 1 in e["stragglers"]), None)
                   for r in runs]
    exchanges = [e for r in runs for e in r["exchanges"]]
    latest = [max(e["lateness_ms"]) for e in exchanges]
    of_step = [l / e["median_step_ms"] for l, e in zip(latest, exchanges)]
    print(f"{name}, {len(runs)} runs x {args.steps} steps (batch {args.batch}) beside {args.busy} "
          f"busy loops (median step "
          f"{statistics.median(e['median_step_ms'] for e in exchanges):.1f} ms): "
          f"{warned} with a warning, {sum(1 for f in first_named if f is not None)} with rank 1 "
          f"named (first at steps {first_named if name != 'balanced' else '-'}), "
          f"{sum(1 for r in runs if any(e['stragglers'] for e in r['exchanges']))} with a rank "
          f"named at some exchange; the latest rank's lateness, of the median step: median "
          f"{statistics.median(of_step):.0%}, max {max(of_step):.0%}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="balanced runs (default 20)")
    parser.add_argument("--late-runs", type=int, default=10, help="runs with rank 1 late (10)")
    parser.add_argument("--late-fraction", type=float, default=0.2,
                        help="rank 1's extra sleep, as a fraction of its median step (0.2)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    parser.add_argument("--batch", type=int, default=32, help="batch per rank (default 32)")
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the job (2)")
    parser.add_argument("--runs-per-launch", type=int, default=1,
                        help="runs one launch of the ranks does one after another, each a fresh "
                             "model and FusedReducer (default 1: every run a new job)")
    parser.add_argument("--json", default=None, help="write the results here")
    common.add_launch_args(parser)
    args = parser.parse_args()
    loadavg_before = _loadavg()
    print(f"load average before: {loadavg_before}")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]
    runs = {"balanced": [], "late": []}

    def write():
        if args.json:
            common.write_json(args.json, {"meta": {
                "runs": args.runs, "late_runs": args.late_runs, "steps": args.steps,
                "batch": args.batch, "busy": args.busy, "threads": args.threads,
                "runs_per_launch": args.runs_per_launch, "late_fraction": args.late_fraction,
                "loadavg_before": loadavg_before, "loadavg_after": _loadavg()}, **runs})

    try:
        for name, total, fraction in (("balanced", args.runs, 0.0),
                                      ("late", args.late_runs, args.late_fraction)):
            while len(runs[name]) < total:
                jobs = min(args.runs_per_launch, total - len(runs[name]))
                runs[name] += one_launch(args, fraction, jobs)
                write()  # so far: an interrupted measurement keeps what it measured
                print(f"{name}: {len(runs[name])} runs, "
                      f"{sum(1 for r in runs[name] if r['warnings'])} with a warning; load "
                      f"average {_loadavg()}", flush=True)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    _summary("balanced", runs["balanced"], args)
    _summary(f"rank 1 late by {args.late_fraction:.0%} of its step", runs["late"], args)
    print(f"load average after: {_loadavg()}")
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
