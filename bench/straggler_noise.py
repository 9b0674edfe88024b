#!/usr/bin/env python
"""Does the straggler report stay quiet on a healthy job on a loaded machine, and still name a
rank that is late by a fifth of the step? (issue 38; Note [A straggler is late relative to the
step] in ext/training_health.cpp)

    python bench/straggler_noise.py                        # 20 balanced + 10 late runs, 2 busy loops
    python bench/straggler_noise.py --runs 5 --late-runs 2 --steps 30 --json out.json

Each run is a toy job as a new user writes it: 2 gloo ranks, an MLP (256-1024-1024-10, batch
64), SGD, FusedReducer with every default (an exchange every 10 steps, the automatic
threshold), one intra-op thread per rank (what torchrun sets with 2 ranks per host). `--busy` processes spin beside it for the whole
measurement (a shared, loaded machine). Balanced runs: counted are the runs with a logged
straggler warning (the target: none) and those whose report named a rank at some exchange.
Late runs: rank 1 sleeps `--late-fraction` (0.2) of its own median step time before each
backward; reported is the first exchange that names it (the target: step 10, the first) and the
step of the warning. --json FILE writes {meta, balanced, late}; exit status 0.
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
    import fused_reducer
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("fused_reducer").addHandler(handler)
    torch.manual_seed(0)
    model = fused_reducer.FusedReducer(nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
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
                                                     "threshold_ms", "median_step_ms",
                                                     "jitter_ms")})
    if ctx.rank == 0:
        warned = [w for w in warnings if "straggler" in w]
        with open(args.result_path, "w") as f:
            json.dump({"exchanges": exchanges, "warnings": warned}, f)
    model.close()
    return 0


def one_run(args, late_fraction):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        args.result_path = f.name
    args.late_fraction_now = late_fraction
    try:
        code = common.launch(toy_job, args)
        if code != 0:
            raise SystemExit(f"straggler_noise: a run failed (exit {code})")
        with open(args.result_path) as f:
            return json.load(f)
    finally:
        os.unlink(args.result_path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="balanced runs (default 20)")
    parser.add_argument("--late-runs", type=int, default=10, help="runs with rank 1 late (10)")
    parser.add_argument("--late-fraction", type=float, default=0.2,
                        help="rank 1's extra sleep, as a fraction of its median step (0.2)")
    parser.add_argument("--steps", type=int, default=50, help="steps per run (default 50)")
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the job (2)")
    parser.add_argument("--json", default=None, help="write the results here")
    common.add_launch_args(parser)
    args = parser.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]
    try:
        balanced = [one_run(args, 0.0) for _ in range(args.runs)]
        late = [one_run(args, args.late_fraction) for _ in range(args.late_runs)]
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    if balanced:
        warned = sum(1 for r in balanced if r["warnings"])
        named = sum(1 for r in balanced if any(e["stragglers"] for e in r["exchanges"]))
        steps = [e["median_step_ms"] for r in balanced for e in r["exchanges"]]
        print(f"balanced, {args.runs} runs x {args.steps} steps beside {args.busy} busy loops "
              f"(median step {statistics.median(steps):.1f} ms): {warned} with a warning, "
              f"{named} with a rank named at some exchange")
    if late:
        first_named = [next((e["step"] for e in r["exchanges"] if 1 in e["stragglers"]), None)
                       for r in late]
        warned_late = [bool(r["warnings"]) for r in late]
        steps = [e["median_step_ms"] for r in late for e in r["exchanges"]]
        print(f"rank 1 late by {args.late_fraction:.0%} of its step, {args.late_runs} runs x "
              f"{args.steps} steps beside {args.busy} busy loops (median step "
              f"{statistics.median(steps):.1f} ms): first named at steps {first_named}; warned "
              f"in {sum(warned_late)} of {args.late_runs}")
    if args.json:
        common.write_json(args.json, {"meta": {"runs": args.runs, "late_runs": args.late_runs,
                                               "steps": args.steps, "busy": args.busy,
                                               "threads": args.threads,
                                               "late_fraction": args.late_fraction},
                                      "balanced": balanced, "late": late})
    return 0


if __name__ == "__main__":
    sys.exit(main())
