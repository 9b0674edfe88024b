#!/usr/bin/env python
"""FusedReducer(reduce_dtype=...) next to DDP + its compress hook and DDP in fp32.

    python bench/reduce_dtype_bench.py --reduce-dtype bf16            # spawns 2 gloo ranks (CPU)
    python bench/reduce_dtype_bench.py --reduce-dtype fp16 --nranks 3
    torchrun --nproc-per-node 8 bench/reduce_dtype_bench.py --reduce-dtype bf16   # GPU: NCCL

Per model (fp32 parameters), four wrappers train side by side on the same inputs, interleaved
step by step (so machine noise hits all alike):
  ddp        DistributedDataParallel, fp32 buckets (its defaults: 1 MiB first bucket, 25 MiB cap)
  ddp_hook   the same DDP + bf16_compress_hook / fp16_compress_hook (the DDP way to halve bytes)
  fused      FusedReducer(reduce_dtype=bf16|fp16) with the SAME buckets: its limits count bytes
             of the reduce dtype, so it gets DDP's limits halved (first 0.5 MiB, cap 12.5 MiB);
             the run checks that the bucket byte sizes are exactly half of DDP's
  fused_aa   a second, identical `fused` (A/A: the noise band of the ratio), with --aa

Reported per wrapper: median step time (forward + backward + gradients ready) and its IQR, the
ratio of medians to ddp_hook and to ddp, all-reduces and all-reduce bytes per step (counted with
torch.profiler from the c10d/gloo events where the process group runs them; FusedReducer on its
own NCCL transport is invisible there, then its stats() are used and the row says so), and the
distance of the parameters after the run from an fp32 FusedReducer trained alongside on the same
data (accuracy: ours vs the hook's).

--json FILE writes {meta, rows}; exit status 0.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}
ELEMENT = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4}
COLLECTIVE_EVENTS = ("gloo:all_reduce", "nccl:all_reduce")


class MLP(nn.Module):
    """`layers` x Linear(width, width) with ReLU: large tensors, communication-bound."""

    def __init__(self, width, layers):
        super().__init__()
        self.width = width
        self.body = nn.Sequential(*[m for _ in range(layers)
                                    for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x):
        return self.body(x)


MODELS = {
    # name: (constructor, input width, batch)
    "mlp": (lambda: MLP(1024, 8), 1024, 32),      # 8.4 M params, 33.6 MB of fp32 gradients
    "small": (lambda: MLP(64, 100), 64, 32),      # 200 tensors of 16 KB / 256 B
}


def build(name, device):
    torch.manual_seed(0)
    return MODELS[name][0]().to(device)


def make_input(name, rank, index, device):
    width, batch = MODELS[name][1], MODELS[name][2]
    g = torch.Generator().manual_seed(7919 * index + rank)
    return torch.randn(batch, width, generator=g).to(device)


def train_step(model, x, opt):
    model.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    if opt is not None:
        opt.step()


def timed_step(ctx, model, x, opt):
    ctx.sync()
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    ctx.sync()
    elapsed = (time.perf_counter() - start) * 1e3
    opt.step()
    return elapsed


def ddp_layout(ddp):
    data = ddp._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(s) for s in str(sizes).replace(" ", "").split(",") if s]


def profiled_collectives(ctx, model, x):
    """(all-reduces, bytes, dtypes) of one step, from the profiler's process-group events."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        train_step(model, x, None)
        ctx.sync()
    count, nbytes, dtypes = 0, 0, set()
    for e in prof.events():
        if e.name in COLLECTIVE_EVENTS and e.input_shapes and e.input_dtypes:
            numel = 1
            for d in e.input_shapes[0]:
                numel *= d
            count += 1
            nbytes += numel * ELEMENT.get(e.input_dtypes[0], 0)
            dtypes.add(e.input_dtypes[0])
    return count, nbytes, sorted(dtypes)


def distance(a, b):
    return sum(((x.double() - y.double()) ** 2).sum().item()
               for x, y in zip(a.parameters(), b.parameters())) ** 0.5


def run_model(ctx, args, name, progress):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fused_reducer import FusedReducer
    dtype = args.reduce_dtype
    hook = dh.bf16_compress_hook if dtype == torch.bfloat16 else dh.fp16_compress_hook
    ids = [ctx.local_rank] if ctx.is_cuda else None
    ddp = DDP(build(name, ctx.device), device_ids=ids)
    ddp_hook = DDP(build(name, ctx.device), device_ids=ids)
    ddp_hook.register_comm_hook(dist.group.WORLD, hook)
    # DDP's limits (1 MiB, 25 MiB of fp32) in bytes of the reduce dtype: the same buckets.
    fused_kwargs = dict(first_bucket_mb=0.5, bucket_cap_mb=12.5, reduce_dtype=dtype)
    variants = [("ddp", ddp), ("ddp_hook", ddp_hook),
                ("fused", FusedReducer(build(name, ctx.device), **fused_kwargs))]
    if args.aa:
        variants.append(("fused_aa", FusedReducer(build(name, ctx.device), **fused_kwargs)))
    reference = FusedReducer(build(name, ctx.device), first_bucket_mb=1, bucket_cap_mb=25)
    opts = {n: torch.optim.SGD(m.parameters(), lr=args.lr) for n, m in variants}
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr)

    index = 0
    for w in range(args.warmup):  # the wrappers rebuild from the observed order after step 1
        index += 1
        x = make_input(name, ctx.rank, index, ctx.device)
        for n, m in variants:
            train_step(m, x, opts[n])
        train_step(reference, x, ref_opt)
    times = {n: [] for n, _ in variants}
    for s in range(args.steps):
        index += 1
        x = make_input(name, ctx.rank, index, ctx.device)
        order = variants if s % 2 == 0 else variants[::-1]
        for n, m in order:
            times[n].append(timed_step(ctx, m, x, opts[n]))
        train_step(reference, x, ref_opt)
        progress(f"{name}: step {s + 1}/{args.steps}")

    # The slowest rank's time per step counts.
    per_step = torch.tensor([times[n] for n, _ in variants], dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    rows = []
    index += 1
    x = make_input(name, ctx.rank, index, ctx.device)
    for i, (n, m) in enumerate(variants):
        samples = per_step[i].tolist()
        count, nbytes, dtypes = profiled_collectives(ctx, m, x)
        source = "profiler"
        if n.startswith("fused") and count == 0:  # its own NCCL transport
            stats = m.stats()
            count, nbytes, dtypes, source = (stats["allreduces"], stats["allreduce_bytes"],
                                             [stats["reduce_dtype"]], "FusedReducer.stats()")
        q = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
        rows.append({"model": name, "variant": n, "median_ms": statistics.median(samples),
                     "iqr_ms": q[2] - q[0], "allreduces": count, "allreduce_bytes": nbytes,
                     "dtypes": dtypes, "bytes_source": source,
                     "distance_from_fp32": distance(m, reference)})
    med = {r["variant"]: r["median_ms"] for r in rows}
    for r in rows:
        r["vs_ddp_hook"] = r["median_ms"] / med["ddp_hook"]
        r["vs_ddp"] = r["median_ms"] / med["ddp"]
    fused_sizes = variants[2][1].bucket_sizes()
    layout = {"ddp_bucket_bytes": ddp_layout(ddp), "fused_bucket_bytes": fused_sizes}
    layout["same_buckets"] = [2 * b for b in fused_sizes] == layout["ddp_bucket_bytes"]
    return rows, layout


def fmt_row(r):
    return (f"{r['model']:<6} {r['variant']:<9} {r['median_ms']:9.2f} {r['iqr_ms']:8.2f} "
            f"{r['vs_ddp_hook']:8.3f} {r['vs_ddp']:7.3f} {r['allreduces']:5d} "
            f"{r['allreduce_bytes']:12d}  {','.join(map(str, r['dtypes'])):<14} "
            f"{r['distance_from_fp32']:.3e}")


def worker(ctx, args):
    progress = common.Progress(ctx, enabled=not args.quiet)
    all_rows, layouts = [], {}
    for name in args.models:
        rows, layout = run_model(ctx, args, name, progress)
        all_rows += rows
        layouts[name] = layout
    common.print0(ctx, f"# reduce_dtype={args.reduce_dtype}, {ctx.world_size} ranks, "
                       f"{ctx.backend}, {args.steps} interleaved steps (median of the slowest "
                       f"rank per step)")
    common.print0(ctx, f"{'model':<6} {'variant':<9} {'median_ms':>9} {'iqr_ms':>8} "
                       f"{'/ddp_hk':>8} {'/ddp':>7} {'#ar':>5} {'bytes/step':>12}  "
                       f"{'dtype':<14} {'dist_fp32':>9}")
    for r in all_rows:
        common.print0(ctx, fmt_row(r))
    for name, layout in layouts.items():
        common.print0(ctx, f"# {name}: same buckets as DDP (bytes halved): "
                           f"{layout['same_buckets']} (DDP {layout['ddp_bucket_bytes']}, "
                           f"fused {layout['fused_bucket_bytes']})")
    if args.json:
        meta = common.collect_meta(ctx, extra={"reduce_dtype": str(args.reduce_dtype),
                                               "steps": args.steps})  # collective
        if ctx.rank == 0:
            common.write_json(args.json, {"meta": meta, "rows": all_rows, "layouts": layouts})
    return 0


def _dtype(text):
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown reduce dtype {text!r}; one of bf16, fp16") from None


def _models(text):
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in MODELS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown model(s) {bad}; choose from {sorted(MODELS)}")
    return names


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reduce-dtype", type=_dtype, default=torch.bfloat16,
                   help="bf16 (against bf16_compress_hook) or fp16 (fp16_compress_hook)")
    p.add_argument("--models", type=_models, default=list(MODELS),
                   help=f"comma-separated, from {sorted(MODELS)} (default all)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per wrapper (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--aa", action="store_true", help="add an identical second FusedReducer")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--quiet", action="store_true")
    common.add_launch_args(p)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    return common.launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
