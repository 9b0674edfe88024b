"""Step time (forward, backward, optimizer step) and optimizer state per rank of three ways to
train with AdamW across ranks (issue 23):

    ddp      DistributedDataParallel (DDP's best settings) + torch.optim.AdamW
    sharded  FusedReducer + fused_reducer.ShardedOptimizer(AdamW): reduce-scatter in backward,
             each rank updates its shard, all-gather after the step
    sharded-overlap  the same with overlap_param_gather=True: the all-gathers finish in the
             next forward, module by module
    zero     DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
    fsdp2-zero2  torch's FSDP2: fully_shard(reshard_after_forward=False) on a 1-D data-parallel
             mesh, applied as torchtitan does (each block, then the root: bench/models.py
             fsdp2_blocks) + torch.optim.AdamW over its DTensor shards: gradients
             reduce-scattered, parameters all-gathered in forward and kept until the next step
             (ZeRO-2). Where FSDP2 refuses a model (channels_last parameters) the output says so
             with torch's error and the other ways run on.

They run interleaved, one step each per round, on the same model and data; the medians of
the timed rounds are printed with each rank's optimizer state bytes. The parameters of ddp and
sharded (and fsdp2-zero2's, whole: DTensor.full_tensor()) are compared at the end (they must
agree up to the summation order). With
--float64-reference one more, untimed run (DDP + the optimizer on a float64 copy of the model,
the same data) is the independent reference both are measured against.

    python bench/sharded_bench.py --model large,resnet18 --steps 12
    python bench/sharded_bench.py --model real --ways ddp,sharded --steps 47 --warmup 3 \
        --nranks 4 --transport process_group --float64-reference     # exactness, 50 steps

--optimizer sgd runs every way with SGD (momentum 0.9) instead of AdamW.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fused_reducer  # noqa: E402
from common import (FSDP2Refused, add_launch_args, ddp_best_kwargs, fsdp2_wrap,  # noqa: E402
                    full_tensor, launch, print0)
from models import ModelSpec, expand, fsdp2_blocks  # noqa: E402

WAYS = ("ddp", "sharded", "sharded-overlap", "zero", "fsdp2-zero2")
# --optimizer: AdamW (the default), or SGD with momentum, whose update is linear in the gradient
# (to tell whether a difference from DDP grows in the model or in the optimizer).
OPTIMIZERS = {"adamw": (torch.optim.AdamW, dict(lr=1e-4, weight_decay=0.1)),
              "sgd": (torch.optim.SGD, dict(lr=1e-4, momentum=0.9))}


def state_bytes(states):
    """Bytes of the optimizer's state tensors held by this rank (a DTensor's local shard)."""
    local = [v.to_local() if hasattr(v, "to_local") else v
             for s in states for v in s.values() if torch.is_tensor(v)]
    return sum(v.numel() * v.element_size() for v in local if v.dim() > 0)


def build(way, spec, ctx, args):
    module = spec.build(ctx.device)
    optimizer_class, kwargs = OPTIMIZERS[args.optimizer]
    if way == "f64":
        module = module.double()
    if way.startswith("sharded"):
        model = fused_reducer.FusedReducer(module, first_bucket_mb=args.first_mb,
                                           bucket_cap_mb=args.cap_mb, backend=args.transport)
        return model, fused_reducer.ShardedOptimizer(
            model, optimizer_class, overlap_param_gather=way == "sharded-overlap", **kwargs)
    if way == "fsdp2-zero2":  # raises FSDP2Refused with torch's message (channels_last)
        model = fsdp2_wrap(module, "zero2", fsdp2_blocks(spec.name, module), ctx.device.type)
        return model, optimizer_class(model.parameters(), **kwargs)
    ddp_kwargs, why = ddp_best_kwargs(args.first_mb, args.cap_mb)
    if why:
        raise SystemExit(f"sharded_bench: {why}; use --first-mb equal to --cap-mb")
    model = DDP(module, **ddp_kwargs)
    if way == "zero":
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class, **kwargs)
    return model, optimizer_class(model.parameters(), **kwargs)


def optimizer_state(way, opt):
    if way.startswith("sharded"):
        return state_bytes(opt._inner.state.values()) if opt._inner is not None else 0
    if way == "zero":
        return state_bytes(opt.optim.state.values())
    return state_bytes(opt.state.values())


def max_difference(a, b):
    """Largest parameter difference of two models (FSDP2's DTensor shards gathered whole)."""
    return max((full_tensor(x).double() - full_tensor(y).double()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters()))


def train_step(way, model, opt, x):
    opt.zero_grad()
    if way == "f64" and x.is_floating_point():
        x = x.double()
    out = model(x)
    (out.double() if way == "f64" else out.float()).square().mean().backward()
    opt.step()


def worker(ctx, args):
    ways = args.ways.split(",")
    unknown = set(ways) - set(WAYS) or {"ddp", "sharded"} - set(ways)
    if unknown:
        raise SystemExit(f"sharded_bench: --ways takes {', '.join(WAYS)} and needs ddp and "
                         f"sharded; got {args.ways}")
    rows = []
    for name in expand(args.model.split(",")):
        spec = ModelSpec.from_args(name)
        built, refused = {}, {}
        for way in ways:
            try:
                built[way] = build(way, spec, ctx, args)
            except FSDP2Refused as e:
                refused[way] = str(e)
        run_ways = [way for way in ways if way in built]
        reference = build("f64", spec, ctx, args) if args.float64_reference else None
        times = {way: [] for way in run_ways}
        for step in range(args.warmup + args.steps):
            x = spec.input(ctx.rank, step, ctx.device)
            for way in run_ways:
                model, opt = built[way]
                ctx.sync()
                dist.barrier()
                start = time.perf_counter()
                train_step(way, model, opt, x)
                ctx.sync()
                if step >= args.warmup:
                    times[way].append(time.perf_counter() - start)
            if reference is not None:
                train_step("f64", *reference, x)
        states = {way: optimizer_state(way, built[way][1]) for way in run_ways}
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, states)
        ddp, sharded = built["ddp"][0].module, built["sharded"][0].module
        diff = max_difference(ddp, sharded)
        params = sum(p.numel() for p in ddp.parameters())
        base = statistics.median(times["ddp"])
        transport = built["sharded"][0].backend
        print0(ctx, f"{name} ({params / 1e6:.1f}M parameters, {ctx.world_size} ranks, "
                    f"{transport} transport, {args.warmup + args.steps} steps; "
                    f"max |ddp - sharded| parameter {diff:.2e})")
        if "fsdp2-zero2" in built:
            print0(ctx, f"  max |ddp - fsdp2-zero2| parameter "
                        f"{max_difference(ddp, built['fsdp2-zero2'][0]):.2e}")
        if reference is not None:
            f64 = reference[0].module
            print0(ctx, f"  float64 reference: max |ddp - f64| {max_difference(ddp, f64):.2e}, "
                        f"max |sharded - f64| {max_difference(sharded, f64):.2e}")
        for way, error in refused.items():
            print0(ctx, f"  {way:15s} refused by torch: {error}")
        for way in run_ways:
            per_rank = [g[way] for g in gathered]
            print0(ctx, f"  {way:15s} step {statistics.median(times[way]) * 1e3:8.1f} ms  "
                        f"ratio {statistics.median(times[way]) / base:5.3f}  optimizer state per rank "
                        f"{', '.join(f'{b / 2**20:.1f}' for b in per_rank)} MiB")
            rows.append(dict(model=name, way=way, step_ms=statistics.median(times[way]) * 1e3,
                             ratio=statistics.median(times[way]) / base, state_mib=max(per_rank) / 2**20))
        for model, opt in built.values():
            if isinstance(model, fused_reducer.FusedReducer):
                model.close()
        del built, reference
    if args.plot and ctx.rank == 0:
        plot(rows, args.plot, f"{' '.join(sys.argv[1:])[:100]}\n{time.strftime('%Y-%m-%d')}, "
                              f"{ctx.world_size} ranks")
    return 0


def plot(rows, path, title):
    """Two panels per model: step time relative to DDP's, and the largest optimizer state
    of a rank (MiB), one bar per way."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(r["model"] for r in rows))
    ways = list(dict.fromkeys(r["way"] for r in rows))
    width = 0.8 / len(ways)
    fig, axes = plt.subplots(1, 2, figsize=(3 + 2.2 * len(models), 3.6))
    for ax, key, label in ((axes[0], "ratio", "step time / DDP's"),
                           (axes[1], "state_mib", "optimizer state per rank (MiB)")):
        for k, way in enumerate(ways):
            got = {r["model"]: r[key] for r in rows if r["way"] == way}
            xs = [i + (k - (len(ways) - 1) / 2) * width for i in range(len(models))]
            ax.bar(xs, [got.get(m, 0) for m in models], width, label=way)
        ax.set_xticks(range(len(models)), models, fontsize=7)
        ax.set_ylabel(label)
        if key == "ratio":
            ax.axhline(1.0, color="black", linewidth=0.6)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="large,resnet18",
                        help="comma-separated models of bench/models.py (default large,resnet18)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--first-mb", type=float, default=1.0)
    parser.add_argument("--cap-mb", type=float, default=25.0)
    parser.add_argument("--ways", default=",".join(WAYS),
                        help=f"comma-separated, of {', '.join(WAYS)} (default all)")
    parser.add_argument("--transport", choices=("auto", "shm", "process_group"), default="auto",
                        help="FusedReducer's transport (default auto: shared memory on one host)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                        help="the torch optimizer of every way (default adamw)")
    parser.add_argument("--float64-reference", action="store_true",
                        help="also train DDP + the optimizer on a float64 copy (untimed) and "
                             "print both runs' distance from it")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also a bar chart: step time relative to DDP and optimizer state "
                             "per rank, per model and way")
    add_launch_args(parser)
    args = parser.parse_args(argv)
    return launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
