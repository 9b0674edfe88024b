"""FusedReducer end to end on 2 CPU ranks (gloo): per-step all-reduce counts and the bucket layout
before and after a runtime first-bucket change, next to DDP on the same model, and the median
step time of each.

    torchrun --nproc-per-node 2 examples/train_demo.py      # or: python examples/train_demo.py
    torchrun --nproc-per-node 2 examples/train_demo.py --backend process_group   # gloo transport
"""
import argparse
import os
import sys

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_reducer
# All-reduces counted by the profiler, independently of FusedReducer.stats().
from fused_reducer.testing.collectives import count_allreduces

MiB = 1 << 20


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


def median_step_ms(model, steps=30):
    """The median wall time of `steps` training steps (after 3 warm-up steps), in ms."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(dist.get_rank()))
    times = []
    for step in range(steps + 3):
        start = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[3:])


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
    say("  (DDP's layout before its first rebuild is one bucket of every gradient: 1 all-reduce at "
        "step 0; the rebuild after it puts a 1 MiB first bucket in front: 2 from then on, and "
        "nothing DDP offers changes that while training)")

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
    ddp_ms, ours_ms = median_step_ms(ddp), median_step_ms(model)
    say(f"median step time over 30 steps: DDP {ddp_ms:.1f} ms, FusedReducer {ours_ms:.1f} ms "
        f"({ours_ms / ddp_ms:.2f} of DDP's; a demo on a shared machine, not a benchmark: "
        "python bench/step_bench.py measures it)")
    model.close()


def _spawned(rank, world, store_port, backend):
    from fused_reducer.testing.launch import connect_store
    dist.init_process_group("gloo", store=connect_store(store_port, 60), rank=rank,
                            world_size=world)
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
    else:  # two ranks of this process, meeting on a store it holds (no port to pick)
        from fused_reducer.testing.launch import (rendezvous_store, start_ranks,
                                                  wait_for_exit_codes)
        store = rendezvous_store()
        sys.exit(wait_for_exit_codes(start_ranks(_spawned, 2, store, (backend,))))
