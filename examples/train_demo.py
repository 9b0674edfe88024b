"""FusedReducer end to end on 2 CPU ranks (gloo): per-step all-reduce counts and the bucket layout
before and after a runtime first-bucket change, next to DDP on the same model.

    torchrun --nproc-per-node 2 examples/train_demo.py      # or: python examples/train_demo.py
    torchrun --nproc-per-node 2 examples/train_demo.py --backend process_group   # gloo transport
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_reducer

MiB = 1 << 20
# Each all-reduce shows in torch.profiler as exactly one of these: a collective of a c10d process
# group (DDP's, and FusedReducer's backend="process_group") passes through the dispatcher op
# 'c10d::allreduce_' (gloo adds its own 'gloo:all_reduce' inside it: not counted, or it would
# count twice); FusedReducer's shared-memory transport (the default for CPU ranks of one host)
# bypasses c10d and records 'shm:all_reduce' (ext/shm_transport.cpp).
ALLREDUCE_EVENTS = ("c10d::allreduce_", "shm:all_reduce")


def count_allreduces(step_fn):
    """All-reduces in one step, counted by the profiler (independently of FusedReducer.stats())."""
    saved = os.dup(2)  # the profiler prints a start/stop line per use on stderr: hide them
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step_fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    return sum(1 for e in prof.events() if e.name in ALLREDUCE_EVENTS)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])  # 8.4 MB of fp32 gradients


def train(model, steps, on_step=None, count=count_allreduces):
    """`steps` SGD steps; the all-reduces of each, as `count(step_fn)` returns them."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rank = dist.get_rank()
    rows = []
    for step in range(steps):
        if on_step:
            on_step(step)
        x = torch.randn(16, 512, generator=torch.Generator().manual_seed(100 * step + rank))

        def one_step():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        rows.append(count(one_step))
    return rows


def describe_stats(stats):
    """stats() read as a user should: the gradients' all-reduces (one per bucket) apart from the
    training-health exchange (a small all-reduce every straggler_interval steps)."""
    return (f"step {stats['step']}: {stats['allreduces']} gradient all-reduce(s) of "
            f"{stats['allreduce_bytes'] / MiB:.1f} MiB in {stats['buckets']} bucket(s), "
            f"{stats['health_exchanges']} health exchange(s) ({stats['health_exchange_bytes']} B), "
            f"{stats['rebuilds']} layout rebuild(s), transport {stats['transport']}")


def main(backend="auto"):
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"FusedReducer demo: {world} ranks, gloo, model 8 x Linear(512,512), "
        f"{fused_reducer.build_info()}")

    ddp = DDP(make_model())
    counts = train(ddp, 4)
    say(f"DDP (default buckets):                all-reduces per step {counts}")

    model = fused_reducer.FusedReducer(make_model(), backend=backend)
    say(f"FusedReducer transport: {model.backend} (backend={backend!r})")
    layouts = []

    def change(step):
        if step == 3:
            model.first_bucket_bytes = 16 * MiB  # takes effect at the next forward
        layouts.append(model.bucket_sizes())

    counts = train(model, 6, change)
    say(f"FusedReducer, first bucket 1 MiB -> 16 MiB at step 3: all-reduces per step {counts}")
    say(f"  layout (bytes per bucket, launch order) before the change: {layouts[2]}")
    say(f"  layout after the change:                                  {model.bucket_sizes()}")
    say(f"  stats() of the last step: {describe_stats(model.stats())}")
    model.rebuild_buckets()
    counts = train(model, 2)
    say(f"  after a forced rebuild the first bucket still holds: {model.bucket_sizes()} "
        f"(all-reduces per step {counts})")


def _spawned(rank, world, port, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    dist.init_process_group("gloo")
    main(backend)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="auto", choices=("auto", "shm", "process_group"),
                        help="FusedReducer's transport (default auto: shared memory here)")
    backend = parser.parse_args().backend
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
        main(backend)
        dist.destroy_process_group()
    else:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(2, port, backend), nprocs=2)
        sys.exit(0)
