#!/usr/bin/env python
"""What training health costs (issue 30): check_finite, and the gradient norm from the copy.

    python bench/health_bench.py                          # spawns 2 gloo ranks (CPU)
    python bench/health_bench.py --models resnet18,bert --steps 20
    torchrun --nproc-per-node 8 bench/health_bench.py     # GPU: NCCL

Per model of the step bench's set (bench/models.py), on the same inputs, interleaved step by step
(so machine noise hits all alike), each a FusedReducer with the default limits:
  off        check_finite=False (the default)
  on         check_finite=True: NaN/Inf counted in the copy into the buckets, one small
             all-reduce per step
  clip_torch step + torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
  clip_ours  step + model.clip_grad_norm_(1.0) (the norm from the unpack's statistics)
The step is forward + backward + SGD step (+ clip). Reported: median step time and IQR per row,
the ratios on/off and clip_ours/clip_torch (medians), the difference of the two norms, and each
norm against float64 over the same gradients (one more, untimed step).
--json FILE writes {meta, rows}; exit status 0.
"""
import argparse
import math
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import models as zoo  # noqa: E402

ROWS = ("off", "on", "clip_torch", "clip_ours")


def _loss(output):
    return output.float().pow(2).mean()


def worker(ctx, args):
    from fused_reducer import FusedReducer
    results = []
    for name in args.models:
        zoo.require(name)
        spec = zoo.ModelSpec.from_args(name)
        wrapped = {}
        for row in ROWS:
            model = FusedReducer(spec.build(ctx.device), check_finite=row == "on")
            wrapped[row] = (model, torch.optim.SGD(model.parameters(), lr=1e-4))
        times = {row: [] for row in ROWS}
        norm_diff = 0.0
        exact = {}  # the last, untimed step: both norms against float64 over the same gradients
        for index in range(args.warmup + args.steps + 1):
            timed = args.warmup <= index < args.warmup + args.steps
            x = spec.input(ctx.rank, index, ctx.device)
            for row in ROWS:
                model, opt = wrapped[row]
                ctx.sync()
                start = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                _loss(model(x)).backward()
                if not timed and row.startswith("clip"):
                    exact[row] = math.sqrt(sum(float(p.grad.double().square().sum())
                                               for p in model.parameters() if p.grad is not None))
                if row == "clip_torch":
                    theirs = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                elif row == "clip_ours":
                    ours = model.clip_grad_norm_(1.0)
                opt.step()
                ctx.sync()
                if timed:
                    times[row].append((time.perf_counter() - start) * 1e3)
            norm_diff = max(norm_diff, abs(float(ours) - float(theirs)) / float(theirs))
        ours_vs_f64 = abs(float(ours) - exact["clip_ours"]) / exact["clip_ours"]
        torch_vs_f64 = abs(float(theirs) - exact["clip_torch"]) / exact["clip_torch"]
        row = {"model": name}
        for r in ROWS:
            row[r] = {"median_ms": statistics.median(times[r]),
                      "p25_ms": float(np.percentile(times[r], 25)),
                      "p75_ms": float(np.percentile(times[r], 75))}
        row["on_over_off"] = row["on"]["median_ms"] / row["off"]["median_ms"]
        row["clip_ours_over_torch"] = row["clip_ours"]["median_ms"] / row["clip_torch"]["median_ms"]
        row["norm_rel_diff"] = norm_diff
        row["norm_ours_vs_float64"] = ours_vs_f64
        row["norm_torch_vs_float64"] = torch_vs_f64
        row["norm_source"] = wrapped["clip_ours"][0]._norm_source
        results.append(row)
        common.print0(ctx, f"{name:10s} " + "  ".join(
            f"{r} {row[r]['median_ms']:.1f} ms [{row[r]['p25_ms']:.1f}, {row[r]['p75_ms']:.1f}]"
            for r in ROWS) + f"  on/off {row['on_over_off']:.3f}  clip ours/torch "
            f"{row['clip_ours_over_torch']:.3f}  norm rel diff {norm_diff:.1e} "
            f"(from {row['norm_source']}); against float64: ours {ours_vs_f64:.1e}, torch "
            f"{torch_vs_f64:.1e}")
        for model, _ in wrapped.values():
            model.close()
    meta = common.collect_meta(ctx)  # collective
    if args.json and ctx.rank == 0:
        common.write_json(args.json, {"meta": meta, "rows": results})
    return 0


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=lambda s: zoo.expand(s.split(",")),
                   default=["resnet18", "bert", "gpt2"],
                   help="comma-separated (default resnet18,bert,gpt2; 'real' for all six)")
    p.add_argument("--steps", type=int, default=15, help="timed steps per row (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--json", metavar="FILE")
    common.add_launch_args(p)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    return common.launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
