"""Save and load time and peak memory of a ShardedOptimizer's checkpoint, two ways (issue 41):

    sharded  dcp.save({"optim": opt.sharded_state_dict()}): each rank writes its fragments;
             load: a fresh optimizer, dcp.load + load_sharded_state_dict
    plain    torch.save(opt.state_dict()) on rank 0: the state consolidated on every rank;
             load: torch.load + load_state_dict on every rank
    placing  after a load, the first forward's sharded layout: the loaded state moves into this
             rank's fragments (timed in the grad_norm() that triggers it)

Memory is each rank's resident set (RSS, sampled every millisecond by a thread) above what it
was just before the operation: its peak, against the rank's own share of the optimizer state
(what a sharded optimizer holds anyway) and the largest parameter's state. The step after a
dcp.async_save are timed against
ordinary steps (the write in DCP's background thread). The state's numbers are AdamW's (two fp32
moments per element).

    python bench/checkpoint_bench.py --nranks 2          # ~50M parameters, in /tmp
    python bench/checkpoint_bench.py --nranks 4 --layers 12 --width 2048 --dir /tmp/ckpt
"""
import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fused_reducer  # noqa: E402
from common import add_launch_args, launch, print0  # noqa: E402

MB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Two peaks above the start while in the block: the resident set (sampled every
    millisecond: what the OS sees, allocator caching included) and the bytes of live tensors
    (torch's profiler, profile_memory: what the code materialises at once)."""

    def __enter__(self):
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                profile_memory=True)
        self._profiler.__enter__()
        self.start = rss()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        self.extra = self.peak - self.start
        self._profiler.__exit__(*exc)
        # An op's own allocations and frees are its self_cpu_memory_usage; frees outside any
        # op (a tensor's last reference dropped) are "[memory]" events.
        live = peak = 0
        for event in sorted(self._profiler.events(), key=lambda e: e.time_range.start):
            live += (event.cpu_memory_usage if event.name == "[memory]"
                     else event.self_cpu_memory_usage)
            peak = max(peak, live)
        self.tensors = peak


def build(args, ctx):
    torch.manual_seed(0)
    layers = [nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = fused_reducer.FusedReducer(nn.Sequential(*layers), bucket_cap_mb=args.cap_mb)
    return model, fused_reducer.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-4)


def step(model, opt, args, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(args.batch, args.width, generator=g)).pow(2).mean().backward()
    opt.step()


def state_bytes(opt):
    """This rank's optimizer state (its fragments' moments)."""
    return sum(v.numel() * v.element_size() for s in opt._inner.state.values()
               for v in s.values() if torch.is_tensor(v) and v.dim() > 0)


def gather(ctx, value):
    values = [None] * ctx.world_size
    dist.all_gather_object(values, value)
    return values


def worker(ctx, args):
    folder = args.dir or tempfile.gettempdir()
    path = os.path.join(folder, f"fr_ckpt_bench_{os.getppid()}")
    model, opt = build(args, ctx)
    for s in range(2):  # the layout after the first step's rebuild, and AdamW's state
        step(model, opt, args, s)
    params = sum(p.numel() for p in model.module.parameters())
    largest = max(p.numel() for p in model.module.parameters()) * 8  # its two fp32 moments
    mine = state_bytes(opt)
    total = params * 8
    results = {}

    # -- save --------------------------------------------------------------------------------
    dist.barrier()
    with PeakRSS() as m:
        dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=path + ".dcp")
    results["sharded save"] = (m.seconds, m.extra, m.tensors)
    dist.barrier()
    with PeakRSS() as m:
        sd = opt.state_dict()
        if ctx.rank == 0:
            torch.save(sd, path + ".pt")
        del sd
    dist.barrier()
    results["plain save"] = (m.seconds, m.extra, m.tensors)
    files = [os.path.getsize(os.path.join(path + ".dcp", f))
             for f in sorted(os.listdir(path + ".dcp")) if f.endswith(".distcp")]

    # -- async save: the steps after it, the write in a background thread -----------------------
    # (AsyncCheckpointerType.PROCESS takes ~17 s here to start its process on the first save)
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    group = dist.new_group(backend="gloo")
    asynchronous = {}
    for kind in (AsyncCheckpointerType.THREAD,):
        plain_steps = []
        for s in range(3):
            t0 = time.perf_counter()
            step(model, opt, args, 20 + s)
            plain_steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        future = dcp.async_save({"optim": opt.sharded_state_dict()},
                                checkpoint_id=f"{path}.async.{kind.value}", process_group=group,
                                async_checkpointer_type=kind)
        staged = time.perf_counter() - t0
        after, pending = [], 0
        for s in range(3):
            t0 = time.perf_counter()
            step(model, opt, args, 30 + s)
            after.append(time.perf_counter() - t0)
            pending += not future.done()
        t0 = time.perf_counter()
        future.result()
        asynchronous[kind.value] = (staged, sorted(plain_steps)[1], sorted(after)[1],
                                    max(after), pending, time.perf_counter() - t0)
    dist.destroy_process_group(group)
    model.close()
    del model, opt

    # -- load into a fresh job ---------------------------------------------------------------
    for way in ("sharded", "plain"):
        model, opt = build(args, ctx)
        dist.barrier()
        with PeakRSS() as m:
            if way == "sharded":
                sd = {"optim": opt.sharded_state_dict()}
                dcp.load(sd, checkpoint_id=path + ".dcp")
                opt.load_sharded_state_dict(sd["optim"])
                del sd
            else:
                opt.load_state_dict(torch.load(path + ".pt"))
        results[f"{way} load"] = (m.seconds, m.extra, m.tensors)
        g = torch.Generator().manual_seed(12)
        model(torch.randn(args.batch, args.width, generator=g)).pow(2).mean().backward()
        with PeakRSS() as m:
            opt.grad_norm()  # the first sharded layout: the loaded state moves into its fragments
        results[f"{way} placing"] = (m.seconds, m.extra, m.tensors)
        opt.step()
        model.close()
        del model, opt
    dist.barrier()

    everyone = gather(ctx, dict(results=results, mine=mine))
    if ctx.rank == 0:
        shutil.rmtree(path + ".dcp", ignore_errors=True)
        for kind in asynchronous:
            shutil.rmtree(f"{path}.async.{kind}", ignore_errors=True)
        if os.path.exists(path + ".pt"):
            os.remove(path + ".pt")
    print0(ctx, f"{params / 1e6:.1f}M parameters ({args.layers} x Linear({args.width}, "
                f"{args.width})), AdamW state {total / MB:.0f} MB in all, {ctx.world_size} ranks; "
                f"each rank's share {max(e['mine'] for e in everyone) / MB:.0f} MB, the largest "
                f"parameter's state {largest / MB:.1f} MB")
    print0(ctx, f"rank files: {', '.join(f'{b / MB:.1f} MB' for b in files)} "
                f"(1/world = {total / ctx.world_size / MB:.1f} MB)")
    print0(ctx, f"{'max over ranks':14} {'time s':>8} {'peak extra RSS MB':>18} "
                f"{'peak live tensors MB':>21}")
    for name in ("sharded save", "plain save", "sharded load", "sharded placing", "plain load",
                 "plain placing"):
        seconds, extra, tensors = (max(e["results"][name][i] for e in everyone)
                                   for i in range(3))
        print0(ctx, f"{name:14} {seconds:8.2f} {extra / MB:18.0f} {tensors / MB:21.0f}")
    for kind, (staged, plain, median_after, worst_after, pending, waited) in asynchronous.items():
        print0(ctx, f"dcp.async_save ({kind}): {staged:.2f} s to stage; the 3 steps after it "
                    f"median {median_after:.2f} s, worst {worst_after:.2f} s (steps without a "
                    f"save: median {plain:.2f} s); the write still ran at the end of {pending} "
                    f"of them, {waited:.2f} s left to wait")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--cap-mb", type=float, default=25.0)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: /tmp)")
    add_launch_args(parser)
    args = parser.parse_args(argv)
    return launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
