"""Step time (forward, backward, optimizer step) and optimizer state per rank of three ways to
train with AdamW across ranks (issue 23):

    ddp      DistributedDataParallel (DDP's best settings) + torch.optim.AdamW
    sharded  FusedReducer + fused_reducer.ShardedOptimizer(AdamW): reduce-scatter in backward,
             each rank updates its shard, all-gather after the step
    sharded-overlap  the same with overlap_param_gather=True: the all-gathers finish in the
             next forward, module by module
    zero     DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)

The three run interleaved, one step each per round, on the same model and data; the medians of
the timed rounds are printed with each rank's optimizer state bytes. The parameters of ddp and
sharded are compared at the end (they must agree up to the summation order).

    python bench/sharded_bench.py --model large,resnet18 --steps 12
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fused_reducer  # noqa: E402
from common import add_launch_args, ddp_best_kwargs, launch, median, print0  # noqa: E402
from models import ModelSpec, expand  # noqa: E402

WAYS = ("ddp", "sharded", "sharded-overlap", "zero")


def state_bytes(states):
    return sum(v.numel() * v.element_size() for s in states for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def build(way, spec, ctx, args):
    module = spec.build(ctx.device)
    kwargs = dict(lr=1e-4, weight_decay=0.1)
    if way.startswith("sharded"):
        model = fused_reducer.FusedReducer(module, first_bucket_mb=args.first_mb,
                                           bucket_cap_mb=args.cap_mb)
        return model, fused_reducer.ShardedOptimizer(
            model, torch.optim.AdamW, overlap_param_gather=way == "sharded-overlap", **kwargs)
    ddp_kwargs, why = ddp_best_kwargs(args.first_mb, args.cap_mb)
    if why:
        raise SystemExit(f"sharded_bench: {why}; use --first-mb equal to --cap-mb")
    model = DDP(module, **ddp_kwargs)
    if way == "zero":
        return model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **kwargs)
    return model, torch.optim.AdamW(model.parameters(), **kwargs)


def optimizer_state(way, opt):
    if way.startswith("sharded"):
        return state_bytes(opt._inner.state.values()) if opt._inner is not None else 0
    if way == "zero":
        return state_bytes(opt.optim.state.values())
    return state_bytes(opt.state.values())


def worker(ctx, args):
    for name in expand(args.model.split(",")):
        spec = ModelSpec.from_args(name)
        built = {way: build(way, spec, ctx, args) for way in WAYS}
        times = {way: [] for way in WAYS}
        for step in range(args.warmup + args.steps):
            x = spec.input(ctx.rank, step, ctx.device)
            for way in WAYS:
                model, opt = built[way]
                ctx.sync()
                dist.barrier()
                start = time.perf_counter()
                opt.zero_grad()
                model(x).float().square().mean().backward()
                opt.step()
                ctx.sync()
                if step >= args.warmup:
                    times[way].append(time.perf_counter() - start)
        states = {way: optimizer_state(way, built[way][1]) for way in WAYS}
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, states)
        ddp, sharded = built["ddp"][0].module, built["sharded"][0].module
        diff = max((a - b).abs().max().item()
                   for a, b in zip(ddp.parameters(), sharded.parameters()))
        params = sum(p.numel() for p in ddp.parameters())
        base = median(times["ddp"])
        print0(ctx, f"{name} ({params / 1e6:.1f}M parameters, {ctx.world_size} ranks, "
                    f"{args.steps} timed steps; max |ddp - sharded| parameter {diff:.2e})")
        for way in WAYS:
            per_rank = [g[way] for g in gathered]
            print0(ctx, f"  {way:15s} step {median(times[way]) * 1e3:8.1f} ms  "
                        f"ratio {median(times[way]) / base:5.3f}  optimizer state per rank "
                        f"{', '.join(f'{b / 2**20:.1f}' for b in per_rank)} MiB")
        for model, opt in built.values():
            if isinstance(model, fused_reducer.FusedReducer):
                model.close()
        del built
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="large,resnet18",
                        help="comma-separated models of bench/models.py (default large,resnet18)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--first-mb", type=float, default=1.0)
    parser.add_argument("--cap-mb", type=float, default=25.0)
    add_launch_args(parser)
    args = parser.parse_args(argv)
    return launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
