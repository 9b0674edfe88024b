#!/usr/bin/env python
"""Which value a gradient norm should be compared with (issue 30, point 3).

    python bench/norm_reference.py                         # 2 gloo ranks, 4M and 38.6M elements
    python bench/norm_reference.py --sizes 4194304 --threads-list 1,2,16

A module with one parameter of N float32 elements, its gradient a fixed random tensor per rank
(scaled as a trained model's gradients are, about 1e-3), reduced by FusedReducer; then, on the
averaged param.grad:
  ours       model.grad_norm(p): the norm the unpack into param.grad accumulated
  float64    torch.nn.utils.get_total_norm on the gradient cast to float64 (torch's own clip,
             computed in float64: the exact norm of those float32 values to ~1e-15)
  torch@T    torch.nn.utils.get_total_norm on the float32 gradient with torch.set_num_threads(T)
             (what clip_grad_norm_(model.parameters()) returns on a CPU with T threads)
Printed: each one's relative distance from float64. On large CPU tensors torch's float32 value
depends on the thread count (each thread's chunk summed in float32 lanes without cascading,
pytorch/pytorch#169237, #151761), so "equal to torch's clip within 1e-6" has no single answer
there; float64 is the value all of them approximate.
--json FILE writes {meta, rows}; exit status 0.
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


class _OneTensor(torch.nn.Module):
    def __init__(self, numel):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(numel))

    def forward(self, direction):
        return (self.weight * direction).sum()  # d loss / d weight = direction


def worker(ctx, args):
    from fused_reducer import FusedReducer
    rows = []
    for numel in args.sizes:
        model = FusedReducer(_OneTensor(numel))
        model.grad_norm()  # asked once: from now on it comes from the copy
        g = torch.Generator().manual_seed(1000 + ctx.rank)
        direction = torch.randn(numel, generator=g) * 1e-3
        direction[::7] *= 5  # a few larger entries, as a layer's gradient has
        model(direction).backward()
        grad = model.module.weight.grad
        default_threads = torch.get_num_threads()
        for norm_type in args.norm_types:
            exact = float(torch.nn.utils.get_total_norm([grad.double()], norm_type))
            row = dict(numel=numel, norm_type=norm_type, float64=exact,
                       ours=float(model.grad_norm(norm_type)), source=model._norm_source)
            for threads in args.threads_list:
                torch.set_num_threads(threads)
                row[f"torch@{threads}"] = float(torch.nn.utils.get_total_norm([grad], norm_type))
            torch.set_num_threads(default_threads)
            rows.append(row)
        model.close()
    meta = common.collect_meta(ctx)  # collective: every rank
    if ctx.rank == 0:
        columns = ["ours"] + [f"torch@{t}" for t in args.threads_list]
        print(f"{'numel':>10} {'p':>4} {'float64':>14}  relative distance from float64")
        print(f"{'':>10} {'':>4} {'':>14}  " + "  ".join(f"{c:>9}" for c in columns))
        for row in rows:
            rel = [abs(row[c] - row["float64"]) / row["float64"] for c in columns]
            print(f"{row['numel']:>10} {row['norm_type']:>4g} {row['float64']:>14.7g}  "
                  + "  ".join(f"{r:>9.1e}" for r in rel))
        if args.json:
            common.write_json(args.json, dict(meta=meta, rows=rows))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")],
                        default=[4 * 1024 * 1024, 38_597_376],
                        help="elements of the one parameter, comma-separated (default 4M and "
                             "38597376, gpt2's embedding)")
    parser.add_argument("--norm-types", type=lambda s: [float(v) for v in s.split(",")],
                        default=[1.0, 2.0, math.inf], help="default 1,2,inf")
    parser.add_argument("--threads-list", type=lambda s: [int(v) for v in s.split(",")],
                        default=[1, 2, 4, 16], help="torch thread counts to compare (default 1,2,4,16)")
    parser.add_argument("--json", default=None)
    common.add_launch_args(parser)
    args = parser.parse_args(argv)
    return common.launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
