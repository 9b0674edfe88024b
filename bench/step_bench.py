#!/usr/bin/env python
"""Training-step time of FusedReducer against torch DDP on the same synthetic models, with the
same bucket settings, measured interleaved in one run.

    python bench/step_bench.py                                  # CPU: spawns 2 gloo ranks
    python bench/step_bench.py --model large --sweep-first 1,4,16 --sweep-cap 25,100 \\
        --json bench/out/sweep.json                             # + bench/out/sweep.png heatmap
    torchrun --nproc-per-node 8 bench/step_bench.py --model large --hidden 2048

    python bench/step_bench.py --model all --json bench/out/real.json   # the issue-10 set
    python bench/step_bench.py --model resnet18 --channels-last --autotune

Models (bench/models.py; identical weights for both wrappers: same seed; same inputs per step
index):
  large       transformer-like blocks (LayerNorm, single-head causal attention qkv + proj, MLP
              4x): 12 tensors and ~12*hidden^2 parameters per block; the defaults (4 blocks,
              hidden 768, batch 2 x seq 16) give 28.4M parameters in 50 tensors (113 MB of
              fp32 gradients).
  many-small  hundreds of tiny residual Linear(hidden, hidden) layers; defaults 200 x 64, batch
              32: 400 tensors, 0.83M parameters (3.3 MB).
  resnet18, resnet50 (and -cl: channels_last)
              torchvision, num_classes=10, batch 8 / 4 of 32x32 images: 11.2M params in 62
              tensors / 23.5M in 161.
  gpt2        transformers GPT2LMHeadModel from a config: 2 layers, 128 wide, tied embeddings,
              batch 4 x seq 32: 6.9M params in 28 tensors.
  bert        transformers BertForMaskedLM, 2 layers, 128 wide: 4.4M params in 42 tensors.
  Sets: synthetic (default), real, all. The real models need `pip install '.[bench]'`.

One step = zero_grad + forward + loss + backward (no optimizer: the weights stay identical,
so the gradients of the two wrappers can be compared, and the optimizer would cost both the
same). A step's time is the slowest rank's wall time for it (device synchronised on GPU, before
and after the step only); the median and p90 are over the timed steps. "bwd host" is the host
time loss.backward() itself takes (slowest rank, median): on GPU, how long backward holds the CPU
before it can queue the optimizer and the next forward; a reducer that waits on the host for its
all-reduces shows it here even when the step time hides it.

Two DDP rows. 'ddp' is DDP with its best settings for the configuration, and every ratio is to
it: the same bucket limits as FusedReducer's, passed the way the installed torch takes them
(bucket_cap_mb_list=[first, cap], or bucket_cap_mb=cap when first == cap: an explicit cap makes
DDP's first bucket the cap too), and batched_grad_copy=True (one _foreach_copy_ + one div_ per
bucket instead of a copy per parameter), each only where inspect.signature(DDP.__init__) has it
(an older torch gets the limits through _DEFAULT_FIRST_BUCKET_BYTES / _DEFAULT_BUCKET_CAP_MB,
set just before it is built with bucket_cap_mb=None). 'ddp_default' is DDP(model), what most
code runs: 1 MiB first bucket, 25 MiB cap, a copy per parameter (--no-ddp-default drops it).
FusedReducer gets first_bucket_mb= and bucket_cap_mb=. The rows report the layouts (DDP's
rebuilt_bucket_sizes, FusedReducer.bucket_sizes()) and whether DDP best's and FusedReducer's
match.

Interleaving: timed steps run in rounds of --block steps per wrapper; the rounds cycle through
every order of the wrappers (DDP,fused / fused,DDP / ...; with the A/A twin or --autotune all 6
or 24 orders), so machine noise, drift and position effects (a wrapper running right after
itself finds warm caches) hit all alike.

A/A noise band: --aa ddp (the default) adds a second, identical DDP, timed in the same rounds;
its median over the first DDP's is the ratio noise alone produces on this machine, printed next
to FusedReducer/DDP together with bootstrap 90 % intervals of both ratios (resampling paired
steps). --autotune adds FusedReducer(autotune=True), tuned to its choice before the timed steps,
compared with the same DDP rows (its limits start from the configuration's). FusedReducer's own
telemetry of the timed steps (Note [Step telemetry]) is summarised under each configuration: last
gradient -> gradients written, time blocked in waits, and per bucket pack, ready->launch,
launch->complete, wait.

Collectives per step are counted independently of FusedReducer's stats, with torch.profiler on
one extra step per wrapper: on CPU the c10d dispatcher op events 'c10d::allreduce_' (every
ProcessGroup.allreduce, from DDP's reducer or from ours, goes through it) plus the
'shm:all_reduce' events of FusedReducer's shared-memory transport (which bypasses c10d; it
records one per bucket as it takes it, as gloo records 'gloo:all_reduce'); on GPU the NCCL
all-reduce kernels ('nccl...AllReduce...', which also catches a transport that calls NCCL
directly). Bytes per step come from the backends' 'gloo:all_reduce'/'nccl:all_reduce'/
'shm:all_reduce' events (shape x dtype); where there are none (FusedReducer's own NCCL transport) from
FusedReducer.stats()['allreduce_bytes'] (the row says which).

Exposed communication time = time from the moment the last gradient of the step is accumulated
(a post-accumulate-grad hook on every parameter records the time; on GPU a CUDA event) to
backward() returning (on GPU: an event after backward on the current stream). It is the part of
the reduction backward did not hide behind computation: the reducer's handling of the last
gradient (copy into its bucket, launch), waiting for all outstanding all-reduces, and copying
results back into .grad. Measured on --probe-steps extra steps, each started after a barrier
(the hooks are not installed during the timed steps). Per step the minimum over ranks is kept:
the rank whose computation ends last waits least, and that wait is the communication backward
did not hide; the other ranks' longer waits add their load imbalance. The median over the probe
steps is reported (per-rank samples are in the JSON). --baseline adds a wrapper-free model,
whose exposed time (~0) shows the floor of the method and whose step time the pure compute.
"""
import argparse
import contextlib
import gc
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MiB = 1024 * 1024
# The model zoo lives in bench/models.py; these names stay importable from here.
from models import (MODEL_DEFAULTS, MODELS, Block, ManySmall, MissingLibrary,  # noqa: E402,F401
                    ModelSpec, TransformerLike)
import models as zoo  # noqa: E402


# -- wrappers -----------------------------------------------------------------------------------
def make_ddp(module, ctx, first_mb, cap_mb, grad_as_view):
    """DDP with its best settings for the run (common.ddp_best_kwargs): batched_grad_copy=True and
    FusedReducer's layout passed as arguments (bucket_cap_mb_list=[first, cap], or bucket_cap_mb
    when they are equal). A torch without bucket_cap_mb_list gets the limits through DDP's own
    defaults (_DEFAULT_FIRST_BUCKET_BYTES, _DEFAULT_BUCKET_CAP_MB, set just before it is built
    with bucket_cap_mb=None), as this benchmark did before."""
    import torch.nn.parallel.distributed as ddp_module
    kwargs, by_defaults = common.ddp_best_kwargs(first_mb, cap_mb)
    device_ids = [ctx.device.index] if ctx.is_cuda else None
    if not by_defaults:
        return nn.parallel.DistributedDataParallel(
            module, device_ids=device_ids, gradient_as_bucket_view=grad_as_view, **kwargs)
    saved_first = dist._DEFAULT_FIRST_BUCKET_BYTES
    saved_cap = ddp_module._DEFAULT_BUCKET_CAP_MB
    try:
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(first_mb * MiB)
        ddp_module._DEFAULT_BUCKET_CAP_MB = cap_mb
        return nn.parallel.DistributedDataParallel(
            module, device_ids=device_ids, bucket_cap_mb=None,
            gradient_as_bucket_view=grad_as_view, **kwargs)
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = saved_first
        ddp_module._DEFAULT_BUCKET_CAP_MB = saved_cap


def make_ddp_default(module, ctx, grad_as_view):
    """DDP as most users construct it: DDP(model) (gradient_as_bucket_view as the run asks):
    its own limits (first bucket 1 MiB, cap 25 MiB), one copy per parameter."""
    return nn.parallel.DistributedDataParallel(
        module, device_ids=[ctx.device.index] if ctx.is_cuda else None,
        gradient_as_bucket_view=grad_as_view)


def ddp_settings(first_mb, cap_mb):
    """How the run builds its DDP rows, for the JSON and the header."""
    kwargs, by_defaults = common.ddp_best_kwargs(first_mb, cap_mb)
    text = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    if by_defaults:
        text += (f"{', ' if text else ''}first {first_mb:g} / cap {cap_mb:g} MiB through DDP's "
                 f"module defaults ({by_defaults})")
    return {"ddp": f"DDP({text})", "ddp_default": "DDP(model)"}


def make_ddp_hook(module, ctx, first_mb, cap_mb, grad_as_view, reduce_dtype):
    """DDP as make_ddp plus its compress hook for `reduce_dtype` (bf16/fp16_compress_hook): the
    DDP way to all-reduce fp32 gradients in half precision."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    ddp = make_ddp(module, ctx, first_mb, cap_mb, grad_as_view)
    hook = dh.bf16_compress_hook if reduce_dtype == torch.bfloat16 else dh.fp16_compress_hook
    ddp.register_comm_hook(dist.group.WORLD, hook)
    return ddp


def make_fused(module, first_mb, cap_mb, grad_as_view, autotune=False, reduce_dtype=None,
               backend="auto"):
    """FusedReducer with DDP's limits. With a 2-byte reduce_dtype the limits count bytes of the
    reduce dtype (Note [Reduce dtype]), so they are halved: the same parameters per bucket as
    DDP's fp32 buckets."""
    from fused_reducer import FusedReducer
    factor = 0.5 if reduce_dtype in (torch.bfloat16, torch.float16) else 1.0
    return FusedReducer(module, bucket_cap_mb=cap_mb * factor, first_bucket_mb=first_mb * factor,
                        gradient_as_bucket_view=grad_as_view, autotune=autotune,
                        reduce_dtype=reduce_dtype, backend=backend)


def fused_bytes_as_fp32(fused, reduce_dtype):
    """FusedReducer's bucket sizes in bytes of fp32 gradients (comparable with DDP's): with a
    2-byte reduce dtype its buckets hold half the bytes."""
    factor = 2 if reduce_dtype in (torch.bfloat16, torch.float16) else 1
    return [b * factor for b in fused.bucket_sizes()]


def ddp_layout(ddp):
    data = ddp._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(s) for s in str(sizes).replace(" ", "").split(",") if s]


# -- one step -----------------------------------------------------------------------------------
def train_step(ctx, model, x, grad_as_view):
    """One step; returns the host time backward() took (ms): on GPU, how long the CPU is held
    before it can queue the optimizer and the next forward (no device sync inside)."""
    model.zero_grad(set_to_none=not grad_as_view)
    loss = model(x).float().pow(2).mean()
    start = time.perf_counter()
    loss.backward()
    return (time.perf_counter() - start) * 1e3


def timed_step(ctx, model, x, grad_as_view):
    """(step ms, backward() host ms); the device is synchronised only around the whole step."""
    ctx.sync()
    start = time.perf_counter()
    backward_ms = train_step(ctx, model, x, grad_as_view)
    ctx.sync()
    return (time.perf_counter() - start) * 1e3, backward_ms


class LastGradClock:
    """Records when the last parameter gradient of a backward is accumulated."""

    def __init__(self, ctx, params):
        self.ctx = ctx
        self.last = None
        if ctx.is_cuda:
            self.last_event = torch.cuda.Event(enable_timing=True)
            self.end_event = torch.cuda.Event(enable_timing=True)
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    def _hook(self, _param):
        if self.ctx.is_cuda:
            self.last_event.record()
        self.last = time.perf_counter()

    def exposed_ms(self, model, x, grad_as_view):
        model.zero_grad(set_to_none=not grad_as_view)
        loss = model(x).float().pow(2).mean()
        self.ctx.sync()
        self.last = None
        loss.backward()
        end = time.perf_counter()
        if self.ctx.is_cuda:
            self.end_event.record()
            self.ctx.sync()
            return self.last_event.elapsed_time(self.end_event)
        return (end - self.last) * 1e3

    def remove(self):
        for h in self.handles:
            h.remove()


_ELEMENT_SIZE = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8,
                 "int": 4, "signed char": 1, "unsigned char": 1, "short int": 2, "bool": 1}


def _profiled_events(prof):
    """(name, input shapes, input dtypes, on_device) of every event of a finished profile.

    Reads kineto's raw events (a few times faster than building FunctionEvents, which matters
    for models with hundreds of parameters), falling back to the public prof.events()."""
    try:
        raw = prof.profiler.kineto_results.events()
    except AttributeError:
        raw = None
    if raw is None:
        for e in prof.events():
            yield (e.name, e.input_shapes or [], getattr(e, "input_dtypes", None) or [],
                   e.device_type != torch.autograd.DeviceType.CPU)
        return
    for e in raw:
        yield (e.name(), e.shapes() or [], e.dtypes() or [],
               e.device_type() != torch.autograd.DeviceType.CPU)


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence the profiler's native log lines (kineto prints 'USDT: profiler_start' etc. on
    fd 2 and has no switch for them); Python exceptions still propagate."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def count_collectives(ctx, model, x, grad_as_view):
    """(count, bytes or None, how) of the all-reduces one step launches, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.is_cuda else [])
    ctx.sync()
    with _quiet_native_stderr(), profile(activities=activities, record_shapes=True) as prof:
        train_step(ctx, model, x, grad_as_view)
        ctx.sync()
    dispatcher, kernels, nbytes, backend, shm = 0, 0, 0, 0, 0
    for name, shapes, dtypes, on_device in _profiled_events(prof):
        if on_device:
            low = name.lower()
            if low.startswith("nccl") and "allreduce" in low.replace("_", ""):
                kernels += 1
        elif name == "c10d::allreduce_":
            dispatcher += 1
        elif name.endswith(":all_reduce"):  # gloo:, nccl:, shm:all_reduce: [[numel]], [dtype]
            backend += 1
            shm += name == "shm:all_reduce"
            size = _ELEMENT_SIZE.get(str(dtypes[0])) if dtypes else None
            if nbytes is None or not shapes or not shapes[0] or size is None:
                nbytes = None
            else:
                nbytes += math.prod(shapes[0]) * size
    if ctx.is_cuda:
        count, how = kernels, "profiler: NCCL AllReduce kernels"
    elif shm:  # FusedReducer's shared-memory transport does not go through c10d
        count, how = dispatcher + shm, "profiler: c10d::allreduce_ + shm:all_reduce events"
    else:
        count, how = dispatcher, "profiler: c10d::allreduce_ events"
    if not backend:
        nbytes = None
    return count, nbytes, how


# -- one configuration --------------------------------------------------------------------------
AA_NAMES = {"ddp": "ddp_aa", "fused": "fused_aa"}
FUSED_KINDS = ("fused", "fused_aa", "fused_pg", "tuned")


def fused_telemetry(history):
    """Per step, from FusedReducer's own telemetry (Note [Step telemetry]): exposed_ms = last
    gradient hook -> gradients written back (the reducer's view of what step_bench's probe
    measures from outside), wait_ms = time blocked waiting for collectives, finalize_ms = end of
    backward callback -> gradients written back, and per bucket pack_us, wait_us, launch_lag_us
    (last gradient of the bucket -> its collective launched) and comm_us (launch -> seen
    complete; an upper bound)."""
    steps = []
    for h in history:
        buckets = h["buckets"]
        readies = [b["ready_last_us"] for b in buckets if b["ready_last_us"] == b["ready_last_us"]]
        last_ready = max(readies) if readies else 0.0
        steps.append({
            "step": h["step"],
            "exposed_ms": (h["finalize_end_us"] - last_ready) / 1e3,
            "wait_ms": h["exposed_wait_us"] / 1e3,
            "finalize_ms": (h["finalize_end_us"] - h["backward_end_us"]) / 1e3,
            "overlap": h["overlap"],
            "buckets": [{"bytes": b["bytes"], "params": b["params"], "pack_us": b["pack_us"],
                         "wait_us": b["wait_us"],
                         "launch_lag_us": b["launch_us"] - b["ready_last_us"],
                         "comm_us": b["complete_us"] - b["launch_us"]} for b in buckets],
        })
    return steps


def run_config(ctx, args, spec, first_mb, cap_mb, progress, label):
    """DDP and FusedReducer (and the A/A twin, the tuned FusedReducer, the baseline) on one
    (model, first, cap), interleaved: per-rank measurements."""
    gv = args.grad_as_bucket_view
    rd = args.reduce_dtype
    ddp = make_ddp(spec.build(ctx.device), ctx, first_mb, cap_mb, gv)
    backend = args.transport
    fused = make_fused(spec.build(ctx.device), first_mb, cap_mb, gv, reduce_dtype=rd,
                       backend=backend)
    variants = [("ddp", ddp), ("fused", fused)]
    if not args.no_ddp_default:  # DDP as constructed by default, next to its best settings
        variants.insert(1, ("ddp_default", make_ddp_default(spec.build(ctx.device), ctx, gv)))
    if args.fused_pg:  # the same reducer on DDP's own transport: what the reducer alone gives
        variants.append(("fused_pg", make_fused(spec.build(ctx.device), first_mb, cap_mb, gv,
                                                reduce_dtype=rd, backend="process_group")))
    # With --reduce-dtype, FusedReducer's gradients are compared with DDP + compress hook's.
    twin = ddp
    if rd is not None:
        twin = make_ddp_hook(spec.build(ctx.device), ctx, first_mb, cap_mb, gv, rd)
        variants.append(("ddp_hook", twin))
    if args.aa == "ddp":  # A/A: a second, identical DDP, timed the same way (the noise band)
        variants.append(("ddp_aa", make_ddp(spec.build(ctx.device), ctx, first_mb, cap_mb, gv)))
    elif args.aa == "fused":
        variants.append(("fused_aa", make_fused(spec.build(ctx.device), first_mb, cap_mb, gv,
                                                reduce_dtype=rd, backend=backend)))
    tuned = None
    if args.autotune:  # starts from the same limits, then picks its own
        tuned = make_fused(spec.build(ctx.device), first_mb, cap_mb, gv, autotune=True,
                           reduce_dtype=rd, backend=backend)
        variants.append(("tuned", tuned))
    if args.baseline:
        variants.append(("local", spec.build(ctx.device)))
    index = 0

    def next_input():
        nonlocal index
        index += 1
        return spec.input(ctx.rank, index, ctx.device)

    # Warm-up: the wrappers rebuild their buckets from the observed order after step 1.
    for w in range(args.warmup):
        x = next_input()
        for _, model in variants:
            train_step(ctx, model, x, gv)
        progress(f"{label}: warm-up {w + 1}/{args.warmup}")

    # The tuner runs to its choice before anything is timed (its trial steps are its own).
    tune_steps = 0
    if tuned is not None:
        while not tuned.autotune_report()["done"]:
            train_step(ctx, tuned, next_input(), gv)
            tune_steps += 1
            if tune_steps > args.autotune_max_steps:
                raise SystemExit(f"{label}: the tuner did not finish in {tune_steps} steps")
            progress(f"{label}: tuning, step {tune_steps}")
        for _ in range(2):  # the chosen layout is applied at the next forward
            train_step(ctx, tuned, next_input(), gv)
        progress(f"{label}: tuned after {tune_steps} steps: {tuned.bucket_sizes()}", force=True)

    # Same weights, same input -> the averaged gradients must agree.
    x = next_input()
    train_step(ctx, twin, x, gv)
    train_step(ctx, fused, x, gv)
    diff = 0.0
    scale = 0.0
    for a, b in zip(twin.module.parameters(), fused.module.parameters()):
        diff = max(diff, (a.grad - b.grad).abs().max().item())
        scale = max(scale, a.grad.abs().max().item())

    # Timed steps, interleaved in blocks, cycling through the orders (round_order). FusedReducer keeps the
    # telemetry of every timed step (its history ring is sized to hold them).
    for name, model in variants:
        if name in FUSED_KINDS:
            model.trace_steps = max(model.trace_steps, args.steps)
    times = {name: [] for name, _ in variants}
    backward_host = {name: [] for name, _ in variants}
    done, rnd = 0, 0
    while done < args.steps:
        block = min(args.block, args.steps - done)
        inputs = [next_input() for _ in range(block)]
        for name, model in round_order(variants, rnd):
            for x in inputs:
                step_ms, backward_ms = timed_step(ctx, model, x, gv)
                times[name].append(step_ms)
                backward_host[name].append(backward_ms)
        done += block
        rnd += 1
        progress(f"{label}: timed step {done}/{args.steps}")
    telemetry = {name: fused_telemetry(model.step_history()[-args.steps:])
                 for name, model in variants if name in FUSED_KINDS}
    if args.trace_dir and ctx.rank == 0:  # the last timed steps as a timeline per transport
        from report import render_trace
        for name, model in variants:
            if name in FUSED_KINDS:
                stem = os.path.join(args.trace_dir, f"{spec.name}_{name}")
                common.ensure_parent(stem + ".json")
                model.export_trace(stem + ".json", steps=2)
                render_trace(stem + ".json", stem + ".png",
                             title=f"{spec.name}, {name} ({model.stats()['transport']}), world "
                                   f"{ctx.world_size}: last 2 timed steps of rank 0")

    exposed, collectives = {}, {}
    for name, model in variants:
        clock = LastGradClock(ctx, [p for p in _module(model).parameters() if p.requires_grad])
        try:
            exposed[name] = []
            for _ in range(args.probe_steps):
                x = next_input()
                dist.barrier()  # start aligned: less rank skew in what follows
                exposed[name].append(clock.exposed_ms(model, x, gv))
        finally:
            clock.remove()
        collectives[name] = count_collectives(ctx, model, next_input(), gv)
    progress(f"{label}: probes done", force=True)

    result = {"times": times, "backward_host": backward_host, "exposed": exposed, "collectives": collectives,
              "telemetry": telemetry,
              "grad_max_abs_diff": diff, "grad_max_abs": scale,
              "ddp_buckets": ddp_layout(ddp),
              "ddp_layouts": {name: ddp_layout(model) for name, model in variants
                              if name.startswith("ddp")},
              "fused_buckets": fused_bytes_as_fp32(fused, rd),
              "fused_stats": fused.stats(),
              "fr_stats": {name: model.stats() for name, model in variants if name in FUSED_KINDS},
              "fr_buckets": {name: model.bucket_sizes() for name, model in variants
                             if name in FUSED_KINDS},
              "ddp_num_buckets_reduced": ddp._get_ddp_logging_data().get("num_buckets_reduced")}
    if tuned is not None:
        result["autotune"] = {"report": tuned.autotune_report(), "tune_steps": tune_steps,
                              "limits": [tuned.first_bucket_bytes, tuned.bucket_cap_bytes,
                                         tuned.last_bucket_bytes]}
    del ddp, fused, tuned, variants
    gc.collect()
    return result


def _order_cycle(n):
    """A cycle through all n! orders of n wrappers in which no round starts with the wrapper
    that ended the previous one (n >= 3; for n = 2: A,B / B,A, each wrapper repeated once per
    cycle across the boundary, equally)."""
    import itertools
    perms = list(itertools.permutations(range(n)))
    if n <= 2:
        return perms
    path, used = [perms[0]], {perms[0]}

    def extend():
        if len(path) == len(perms):
            return path[-1][-1] != path[0][0]
        for q in perms:
            if q not in used and q[0] != path[-1][-1]:
                path.append(q)
                used.add(q)
                if extend():
                    return True
                path.pop()
                used.discard(q)
        return False

    extend()
    return path


def round_order(variants, rnd):
    """The order of round `rnd`. The rounds cycle through every order of the wrappers, so over
    a cycle each runs in each position equally often, and (from three wrappers on) none runs
    right after itself: reversing alone is not enough for three, where the middle one would
    never follow itself (warm caches) while the ends would at every round boundary."""
    if len(variants) > 4:  # 5! rounds would not complete: rotations
        k = rnd % len(variants)
        return variants[k:] + variants[:k]
    cycle = _order_cycle(len(variants))
    return [variants[i] for i in cycle[rnd % len(cycle)]]


def _module(model):
    return getattr(model, "module", model)


def ratio_ci(num, den, level=90, resamples=2000, seed=0):
    """Bootstrap interval of median(num) / median(den) over paired steps (step i of both ran
    in the same round on the same input): resample step indices with replacement."""
    import random
    rng = random.Random(seed)
    n = min(len(num), len(den))
    if n < 2:
        r = common.median(num) / common.median(den)
        return [r, r]
    ratios = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(common.median([num[i] for i in idx]) / common.median([den[i] for i in idx]))
    tail = (100 - level) / 2
    return [common.percentile(ratios, tail), common.percentile(ratios, 100 - tail)]


def _telemetry_summary(per_rank, name):
    """Median over timed steps (per step the minimum over ranks for exposed/wait, as the probe
    does), and per bucket the per-rank medians of pack_us, wait_us, launch_lag_us, comm_us."""
    tel = [r["telemetry"][name] for r in per_rank]
    n = min(len(t) for t in tel)
    if not n:
        return None
    out = {}
    for key in ("exposed_ms", "wait_ms", "finalize_ms"):
        out[key] = common.median([min(t[i][key] for t in tel) for i in range(n)])
        out[key + "_per_rank"] = [common.median([t[i][key] for i in range(n)]) for t in tel]
    out["overlap_per_rank"] = [common.median([t[i]["overlap"] for i in range(n)]) for t in tel]
    nb = min(len(t[i]["buckets"]) for t in tel for i in range(n))
    buckets = []
    for b in range(nb):
        entry = {"bytes": tel[0][0]["buckets"][b]["bytes"], "params": tel[0][0]["buckets"][b]["params"]}
        for key in ("pack_us", "wait_us", "launch_lag_us", "comm_us"):
            entry[key] = [common.median([t[i]["buckets"][b][key] for i in range(n)]) for t in tel]
        buckets.append(entry)
    out["buckets"] = buckets
    return out


def _ddp_buckets(measured, name):
    """The rebuilt layout of DDP variant `name` (JSON of older runs: the one DDP layout)."""
    return measured.get("ddp_layouts", {}).get(name, measured["ddp_buckets"])


def summarise(per_rank, spec_info, first_mb, cap_mb, world):
    """Rows for one configuration from every rank's measurements (rank 0)."""
    names = list(per_rank[0]["times"])
    rows = {}
    for name in names:
        steps = [max(r["times"][name][i] for r in per_rank) for i in range(len(per_rank[0]["times"][name]))]
        backward_host = [max(r["backward_host"][name][i] for r in per_rank)
                         for i in range(len(steps))]
        exposed = [min(r["exposed"][name][i] for r in per_rank)
                   for i in range(len(per_rank[0]["exposed"][name]))]
        count, nbytes, how = per_rank[0]["collectives"][name]
        bytes_source = "profiler: backend all_reduce events (shape x dtype)"
        stats = per_rank[0]["fr_stats"].get(name)
        if nbytes is None and stats is not None:
            nbytes, bytes_source = stats["allreduce_bytes"], "FusedReducer.stats()"
        elif nbytes is None and name == "ddp_hook":
            nbytes = (sum(per_rank[0]["ddp_buckets"]) // 2) or None
            bytes_source = "DDP bucket sizes / 2 (compress hook)"
        elif nbytes is None and name.startswith("ddp"):
            nbytes, bytes_source = sum(_ddp_buckets(per_rank[0], name)) or None, "DDP bucket sizes"
        elif name == "local":
            bytes_source = "no communication"
        row = {
            "model": spec_info["model"], "first_bucket_mb": first_mb, "bucket_cap_mb": cap_mb,
            "impl": name, "world_size": world, "steps": len(steps),
            "params": spec_info["params"], "tensors": spec_info["tensors"],
            "median_ms": common.median(steps), "p90_ms": common.percentile(steps, 90),
            "mean_ms": sum(steps) / len(steps), "min_ms": min(steps),
            "backward_host_ms": common.median(backward_host),
            "collectives_per_step": count, "collectives_source": how,
            "bytes_per_step": nbytes, "bytes_source": bytes_source,
            "exposed_comm_ms": common.median(exposed) if exposed else None,
            "step_times_ms": steps, "exposed_samples_ms": exposed,
            "exposed_per_rank_ms": [r["exposed"][name] for r in per_rank],
        }
        if name.startswith("ddp"):
            row["bucket_sizes"] = _ddp_buckets(per_rank[0], name)
            row["ddp_num_buckets_reduced"] = per_rank[0]["ddp_num_buckets_reduced"]
        elif stats is not None:
            row["bucket_sizes"] = per_rank[0]["fr_buckets"][name]
            row["stats"] = stats
            row["telemetry"] = _telemetry_summary(per_rank, name)
        if name == "tuned":
            row["autotune"] = per_rank[0]["autotune"]
        rows[name] = row
    ddp = rows["ddp"]
    for row in rows.values():
        if "ddp_hook" in rows:
            row["ratio_to_ddp_hook"] = row["median_ms"] / rows["ddp_hook"]["median_ms"]
            row["ratio_to_ddp_hook_ci90"] = ratio_ci(row["step_times_ms"],
                                                     rows["ddp_hook"]["step_times_ms"])
        row["ratio_to_ddp"] = row["median_ms"] / ddp["median_ms"]
        row["p90_ratio_to_ddp"] = row["p90_ms"] / ddp["p90_ms"]
        row["ratio_ci90"] = ratio_ci(row["step_times_ms"], ddp["step_times_ms"])
        if "ddp_default" in rows:
            default = rows["ddp_default"]
            row["ratio_to_ddp_default"] = row["median_ms"] / default["median_ms"]
            row["ratio_to_ddp_default_ci90"] = ratio_ci(row["step_times_ms"],
                                                        default["step_times_ms"])
    check = {"grad_max_abs_diff": max(r["grad_max_abs_diff"] for r in per_rank),
             "grad_max_abs": max(r["grad_max_abs"] for r in per_rank),
             "layout_match": per_rank[0]["ddp_buckets"] == per_rank[0]["fused_buckets"]}
    rows["fused"].update(check)
    # The A/A pair: the same wrapper twice; its ratio is what noise alone gives.
    for twin, ref in (("ddp_aa", "ddp"), ("fused_aa", "fused")):
        if twin in rows:
            aa = rows[twin]["median_ms"] / rows[ref]["median_ms"]
            aa_ci = ratio_ci(rows[twin]["step_times_ms"], rows[ref]["step_times_ms"])
            for row in rows.values():
                row["aa"] = f"{twin}/{ref}"
                row["aa_ratio"] = aa
                row["aa_ci90"] = aa_ci
    return list(rows.values())


# -- output -------------------------------------------------------------------------------------
TABLE_HEAD = (
    "#  first     cap  impl          median      p90  bwd host  colls    MB/step  exposed   ratio  buckets\n"
    "#  (MiB)   (MiB)                  (ms)     (ms)      (ms)  /step    (1e6 B)     (ms)  /DDP best")


def format_row(row):
    mb = "-" if row["bytes_per_step"] is None else f"{row['bytes_per_step'] / 1e6:.2f}"
    buckets = len(row.get("bucket_sizes") or []) or "-"
    return (f"  {row['first_bucket_mb']:6g}  {row['bucket_cap_mb']:6g}  {row['impl']:<11}"
            f"{row['median_ms']:9.2f}{row['p90_ms']:9.2f}{row['backward_host_ms']:10.2f}"
            f"  {row['collectives_per_step']:5d}"
            f"  {mb:>9}  {row['exposed_comm_ms']:7.2f}  {row['ratio_to_ddp']:6.3f}  {buckets:>7}")


def heatmap(path, rows, meta, firsts, caps, models):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = (("ddp", "DDP median step (ms)"), ("fused", "FusedReducer median step (ms)"),
              ("ratio", "FusedReducer / DDP"))
    fig, axes = plt.subplots(len(models), 3, figsize=(4.2 * 3 + 1, 3.2 * len(models) + 1),
                             squeeze=False)
    for mi, model in enumerate(models):
        grids = {}
        for key, _ in panels:
            grid = np.full((len(firsts), len(caps)), np.nan)
            for r in rows:
                if r["model"] == model and r["impl"] == ("fused" if key == "ratio" else key):
                    i, j = firsts.index(r["first_bucket_mb"]), caps.index(r["bucket_cap_mb"])
                    grid[i, j] = r["ratio_to_ddp"] if key == "ratio" else r["median_ms"]
            grids[key] = grid
        times = np.concatenate([grids["ddp"].ravel(), grids["fused"].ravel()])
        times = times[np.isfinite(times)]
        ratios = grids["ratio"][np.isfinite(grids["ratio"])]
        spread = max(0.05, float(np.max(np.abs(ratios - 1.0)))) if ratios.size else 0.05
        for pi, (key, title) in enumerate(panels):
            grid = grids[key]
            if key == "ratio":  # green = FusedReducer faster, red = slower, 1.0 in the middle
                cmap, vmin, vmax = plt.get_cmap("RdYlGn_r"), 1 - spread, 1 + spread
            else:  # one scale for DDP and FusedReducer so the colours compare
                cmap = plt.get_cmap("viridis")
                vmin, vmax = (float(times.min()), float(times.max())) if times.size else (0, 1)
                if vmax <= vmin:
                    vmax = vmin + 1e-9
            ax = axes[mi][pi]
            im = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, origin="lower", aspect="auto")
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
            for i in range(len(firsts)):
                for j in range(len(caps)):
                    value = grid[i, j]
                    if not np.isfinite(value):
                        continue
                    r, g, b, _ = cmap((value - vmin) / (vmax - vmin))
                    ink = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
                    ax.text(j, i, f"{value:.3f}" if key == "ratio" else f"{value:.1f}",
                            ha="center", va="center", fontsize=8, color=ink)
            ax.set_xticks(range(len(caps)), [f"{c:g}" for c in caps])
            ax.set_yticks(range(len(firsts)), [f"{f:g}" for f in firsts])
            ax.set_xlabel("bucket cap (MiB)")
            ax.set_ylabel("first bucket (MiB)")
            ax.set_title(f"{model}: {title}", fontsize=9)
    fig.suptitle(f"step time over (first bucket, cap) - {common.meta_label(meta)}", fontsize=9)
    fig.tight_layout()
    common.ensure_parent(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------------
def worker(ctx, args):
    firsts = args.sweep_first or [args.first_bucket_mb]
    caps = args.sweep_cap or [args.bucket_cap_mb]
    configs = [(f, c) for f in firsts for c in caps]
    specs = []
    for name in args.model:
        specs.append(ModelSpec.from_args(name, args.layers, args.hidden, args.batch, args.seq,
                                         args.seed))
    meta = common.collect_meta(ctx, extra={
        "benchmark": "step_bench", "steps": args.steps, "warmup": args.warmup,
        "probe_steps": args.probe_steps, "block": args.block, "seed": args.seed,
        "gradient_as_bucket_view": args.grad_as_bucket_view, "aa": args.aa,
        "autotune": args.autotune,
        "reduce_dtype": str(args.reduce_dtype) if args.reduce_dtype is not None else None,
        "step": "zero_grad + forward + loss + backward; slowest rank per step",
        "backward_host": ("host time inside loss.backward() (no device sync in it); slowest rank "
                          "per step, median"),
        "exposed_comm": ("last post-accumulate-grad hook -> backward() returns; min over ranks per "
                         "probe step, median over probe steps")})
    p = lambda *a: common.print0(ctx, *a)  # noqa: E731
    progress = common.Progress(ctx, enabled=not args.quiet)
    p(f"# step_bench: DDP vs FusedReducer, {ctx.world_size} ranks {ctx.backend} on {ctx.device.type}, "
      f"torch {meta['torch_version']}, {meta['hostname']} ({meta['usable_cpus']} usable cores, "
      f"{meta['threads_per_rank']} threads/rank), {meta['date']}")
    p(f"# {args.steps} timed steps per wrapper after {args.warmup} warm-up, interleaved in blocks of "
      f"{args.block} (the rounds cycle through every order of the wrappers); {args.probe_steps} probe steps for exposed comm; "
      f"seed {args.seed}" + (f"; A/A pair: {AA_NAMES[args.aa]} vs {args.aa}" if args.aa != "none" else ""))
    p("# DDP rows: 'ddp' = DDP's best settings for each configuration's limits ("
      + ddp_settings(firsts[0], caps[0])["ddp"] + " for the first"
      + ("" if args.no_ddp_default else "); 'ddp_default' = DDP(model), DDP's own limits (1 MiB "
                                        "first bucket, 25 MiB cap)") + "; ratios are to 'ddp'")

    rows, models_info = [], []
    total = len(specs) * len(configs)
    n = 0
    for spec in specs:
        info = spec.describe(spec.build("cpu"))
        models_info.append(info)
        p(f"#\n# model {spec.name}: {info['shape']}: {info['params'] / 1e6:.3g}M params in "
          f"{info['tensors']} tensors, {info['grad_bytes'] / 1e6:.1f} MB of fp32 gradients")
        p(TABLE_HEAD)
        for first_mb, cap_mb in configs:
            n += 1
            label = f"[{n}/{total}] {spec.name} first {first_mb:g} MiB cap {cap_mb:g} MiB"
            progress(f"{label}: start", force=True)
            mine = run_config(ctx, args, spec, first_mb, cap_mb, progress, label)
            per_rank = [None] * ctx.world_size
            dist.all_gather_object(per_rank, mine)
            if ctx.rank == 0:
                config_rows = summarise(per_rank, info, first_mb, cap_mb, ctx.world_size)
                built = ddp_settings(first_mb, cap_mb)
                for row in config_rows:
                    if row["impl"] == "ddp_default":
                        row["constructed_as"] = built["ddp_default"]
                    elif row["impl"] in ("ddp", "ddp_aa"):
                        row["constructed_as"] = built["ddp"]
                    elif row["impl"] == "ddp_hook":
                        row["constructed_as"] = built["ddp"] + " + compress hook"
                rows.extend(config_rows)
                for row in config_rows:
                    p(format_row(row))
                fused = next(r for r in config_rows if r["impl"] == "fused")
                rel = fused["grad_max_abs_diff"] / max(fused["grad_max_abs"], 1e-30)
                # half-precision all-reduces: DDP + compress hook and FusedReducer round alike
                # at 2 ranks; other world sizes divide before/after the cast (bf16 rounding)
                twin, limit = ("DDP+hook", 1e-2) if args.reduce_dtype is not None else ("DDP", 1e-4)
                p(f"#   grads {twin} vs FusedReducer: max abs diff {fused['grad_max_abs_diff']:.2e} "
                  f"(relative {rel:.1e}{', MISMATCH' if rel > limit else ''}); layouts "
                  + ("match" if fused["layout_match"] else
                     f"DIFFER: DDP {next(r for r in config_rows if r['impl'] == 'ddp')['bucket_sizes']} "
                     f"vs fused {fused['bucket_sizes']}"))
                for line in describe_config(config_rows):
                    p(line)

    if ctx.rank == 0:
        p("#")
        for info in models_info:
            for first_mb, cap_mb in configs:
                fr = [r for r in rows if r["model"] == info["model"] and r["impl"] == "fused"
                      and r["first_bucket_mb"] == first_mb and r["bucket_cap_mb"] == cap_mb]
                if fr:
                    f = fr[0]
                    aa = (f" (A/A {f['aa']} {f['aa_ratio']:.3f})" if "aa_ratio" in f else "")
                    default = (f"; FusedReducer/DDP default {f['ratio_to_ddp_default']:.3f}"
                               if "ratio_to_ddp_default" in f else "")
                    p(f"# ratio FusedReducer/DDP median step, {info['model']} (first {first_mb:g}, "
                      f"cap {cap_mb:g} MiB; DDP best): {f['ratio_to_ddp']:.3f}{aa}{default}")
                    if "ratio_to_ddp_hook" in f:
                        lo, hi = f["ratio_to_ddp_hook_ci90"]
                        p(f"# ratio FusedReducer({args.reduce_dtype})/DDP+compress hook median step, "
                          f"{info['model']}: {f['ratio_to_ddp_hook']:.3f} (90% interval "
                          f"{lo:.3f}-{hi:.3f}); all-reduce bytes per step: FusedReducer "
                          f"{fused_mb(f)} MB, DDP fp32 {fused_mb(ddp_row(rows, f))} MB")
                tr = [r for r in rows if r["model"] == info["model"] and r["impl"] == "tuned"
                      and r["first_bucket_mb"] == first_mb and r["bucket_cap_mb"] == cap_mb]
                if tr:
                    default = (f"; tuned/DDP default {tr[0]['ratio_to_ddp_default']:.3f}"
                               if "ratio_to_ddp_default" in tr[0] else "")
                    p(f"# ratio tuned FusedReducer/DDP median step, {info['model']} (DDP best, "
                      f"first {first_mb:g}, cap {cap_mb:g} MiB): {tr[0]['ratio_to_ddp']:.3f}"
                      f"{default}")
        fused_rows = [r for r in rows if r["impl"] == "fused"]
        if len(fused_rows) > 1:
            gm = math.exp(sum(math.log(r["ratio_to_ddp"]) for r in fused_rows) / len(fused_rows))
            default = (f"; over DDP default {_geomean(fused_rows, 'ratio_to_ddp_default'):.3f}"
                       if all("ratio_to_ddp_default" in r for r in fused_rows) else "")
            p(f"# geometric mean of FusedReducer/DDP over {len(fused_rows)} configurations: "
              f"{gm:.3f} (DDP best){default}")
        settings = {k: (str(v) if isinstance(v, torch.dtype) else v)
                    for k, v in vars(args).items() if k != "corrupt"}
        if args.json:
            common.write_json(args.json, {"meta": meta, "settings": settings, "models": models_info,
                                          "grid": {"first_bucket_mb": firsts, "bucket_cap_mb": caps},
                                          "rows": rows})
            p(f"# wrote {args.json}")
        plot_path = args.plot
        if plot_path is None and args.json and (args.sweep_first or args.sweep_cap):
            plot_path = os.path.splitext(args.json)[0] + ".png"
        if plot_path:
            heatmap(plot_path, rows, meta, firsts, caps, [s.name for s in specs])
            p(f"# wrote {plot_path}")
    return 0


def _geomean(rows, key):
    return math.exp(sum(math.log(r[key]) for r in rows) / len(rows))


def fused_mb(row):
    return "-" if row["bytes_per_step"] is None else f"{row['bytes_per_step'] / 1e6:.2f}"


def ddp_row(rows, like):
    return next(r for r in rows if r["impl"] == "ddp" and r["model"] == like["model"]
                and r["first_bucket_mb"] == like["first_bucket_mb"]
                and r["bucket_cap_mb"] == like["bucket_cap_mb"])


def describe_config(config_rows):
    """Comment lines under a configuration's rows: the A/A band and the ratio's interval,
    FusedReducer's own telemetry (exposed, blocked waits, per bucket) and the tuner's choice."""
    by = {r["impl"]: r for r in config_rows}
    fused = by["fused"]
    lines = []
    lo, hi = fused["ratio_ci90"]
    line = (f"#   FusedReducer/DDP best {fused['ratio_to_ddp']:.3f} (bootstrap 90% interval "
            f"{lo:.3f}-{hi:.3f})")
    if "aa_ratio" in fused:
        alo, ahi = fused["aa_ci90"]
        line += (f"; A/A {fused['aa']} {fused['aa_ratio']:.3f} (interval {alo:.3f}-{ahi:.3f}): "
                 f"noise band +-{abs(fused['aa_ratio'] - 1):.3f}")
    lines.append(line)
    if "ddp_default" in by:
        dlo, dhi = fused["ratio_to_ddp_default_ci90"]
        lines.append(f"#   FusedReducer/DDP default {fused['ratio_to_ddp_default']:.3f} (interval "
                     f"{dlo:.3f}-{dhi:.3f}); DDP best/DDP default "
                     f"{by['ddp']['ratio_to_ddp_default']:.3f}")
    lines.append("#   DDP rows: " + "; ".join(f"{r['impl']} = {r['constructed_as']}"
                                           for r in config_rows if "constructed_as" in r))
    lines.append("#   transports: " + ", ".join(
        f"{name} {by[name]['stats']['transport']}" for name in FUSED_KINDS
        if "stats" in by.get(name, {})))
    if "fused_pg" in by:
        lines.append(f"#   fused_pg/DDP {by['fused_pg']['ratio_to_ddp']:.3f} (the reducer alone: "
                     "FusedReducer on DDP's process group)")
    for name in FUSED_KINDS:
        tel = by.get(name, {}).get("telemetry")
        if not tel:
            continue
        lines.append(
            f"#   {name} telemetry (median of timed steps): last gradient -> grads written "
            f"{tel['exposed_ms']:.2f} ms, blocked in waits {tel['wait_ms']:.2f} ms, end-of-backward "
            f"callback {tel['finalize_ms']:.2f} ms; overlap per rank "
            + "/".join(f"{o:.2f}" for o in tel["overlap_per_rank"]))
        for i, b in enumerate(tel["buckets"]):
            per = lambda key: "/".join(f"{v / 1e3:.2f}" for v in b[key])  # noqa: E731
            lines.append(f"#     bucket {i}: {b['bytes'] / 1e6:7.2f} MB {b['params']:4d} params: pack "
                         f"{per('pack_us')} ms, ready->launch {per('launch_lag_us')} ms, "
                         f"launch->complete {per('comm_us')} ms, wait {per('wait_us')} ms (per rank)")
    tuned = by.get("tuned")
    if tuned:
        f, c, last = tuned["autotune"]["limits"]
        lines.append(f"#   tuned: first {common.format_size(f)} cap {common.format_size(c)} last "
                     f"{common.format_size(last) if last else 'off'} after "
                     f"{tuned['autotune']['tune_steps']} tuning steps; tuned/DDP "
                     f"{tuned['ratio_to_ddp']:.3f}")
    return lines


def _models(text):
    names = zoo.expand(n.strip() for n in text.split(",") if n.strip())
    if not names or any(n not in MODELS for n in names):
        raise argparse.ArgumentTypeError(
            f"--model takes a comma list of {', '.join(MODELS)} or of the sets "
            f"{', '.join(zoo.ALIASES)}; got {text!r}")
    return names


def _reduce_dtype(text):
    dtypes = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
              "fp16": torch.float16, "float16": torch.float16}
    if text not in dtypes:
        raise argparse.ArgumentTypeError(f"--reduce-dtype {text!r}: use bf16 or fp16")
    return dtypes[text]


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def build_parser():
    parser = argparse.ArgumentParser(prog="step_bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    m = parser.add_argument_group("model")
    m.add_argument("--model", type=_models, default=list(zoo.SYNTHETIC),
                   help="comma list of models to run: " + ", ".join(MODELS) + "; or a set: "
                        "synthetic (large, many-small; the default), real (the ResNets in both "
                        "formats, gpt2, bert), all (real + synthetic: the issue-10 set). The real "
                        "models need the bench extra (pip install '.[bench]')")
    m.add_argument("--channels-last", action="store_true",
                   help="run the ResNets in channels_last (resnet18 -> resnet18-cl, ...)")
    m.add_argument("--layers", type=_positive_int, default=None,
                   help="blocks (large), Linear layers (many-small) or transformer layers (gpt2, "
                        "bert); default 4 / 200 / 2")
    m.add_argument("--hidden", type=_positive_int, default=None,
                   help="hidden size; default 768 (large) / 64 (many-small) / 128 (gpt2, bert)")
    m.add_argument("--batch", type=_positive_int, default=None,
                   help="per-rank batch; default 2 (large) / 32 (many-small) / 8 (resnet18) / "
                        "4 (resnet50, gpt2, bert)")
    m.add_argument("--seq", type=_positive_int, default=None,
                   help="sequence length of the large model's input (default 16; the small "
                        "default keeps a CPU step communication-heavy, ~0.3 s of compute on one "
                        "core, so the reducers' differences show; raise it on GPUs); of gpt2 and "
                        "bert (default 32); the image side of the ResNets (default 32)")
    b = parser.add_argument_group("buckets (the same for DDP and FusedReducer)")
    b.add_argument("--first-bucket-mb", type=_positive_float, default=1.0,
                   help="first bucket limit in MiB (default 1, DDP's default)")
    b.add_argument("--bucket-cap-mb", type=_positive_float, default=25.0,
                   help="limit of every later bucket in MiB (default 25, DDP's default)")
    b.add_argument("--sweep-first", type=common.parse_float_list, default=None, metavar="MiB,...",
                   help="grid of first-bucket limits (replaces --first-bucket-mb), e.g. 1,4,16")
    b.add_argument("--sweep-cap", type=common.parse_float_list, default=None, metavar="MiB,...",
                   help="grid of bucket caps (replaces --bucket-cap-mb), e.g. 5,25,100; every "
                        "(first, cap) pair of the two grids is a configuration")
    b.add_argument("--reduce-dtype", type=_reduce_dtype, default=None, metavar="bf16|fp16",
                   help="FusedReducer(reduce_dtype=...) with its limits halved (the same "
                        "parameters per bucket), next to DDP + bf16/fp16_compress_hook ('ddp_hook', "
                        "same limits) and plain fp32 DDP; gradients are compared with the hook's")
    b.add_argument("--grad-as-bucket-view", action="store_true",
                   help="gradient_as_bucket_view=True for both wrappers")
    b.add_argument("--transport", choices=("auto", "shm", "process_group", "nccl"), default="auto",
                   help="FusedReducer's transport (default auto: NCCL for CUDA; for CPU ranks of "
                        "one host shared memory, else the process group DDP uses)")
    b.add_argument("--fused-pg", action="store_true",
                   help="also time FusedReducer(backend='process_group') (row fused_pg): the "
                        "same reducer on DDP's own transport")
    r = parser.add_argument_group("measurement")
    r.add_argument("--steps", type=_positive_int, default=20,
                   help="timed steps per wrapper and configuration (default 20)")
    r.add_argument("--warmup", type=_positive_int, default=3,
                   help="untimed steps per wrapper first; >= 2 so both have rebuilt their buckets "
                        "(default 3)")
    r.add_argument("--block", type=_positive_int, default=1,
                   help="consecutive steps of one wrapper before switching (default 1: alternate)")
    r.add_argument("--probe-steps", type=_positive_int, default=3,
                   help="extra steps per wrapper with the exposed-communication hooks (default 3)")
    r.add_argument("--no-ddp-default", action="store_true",
                   help="leave out the 'ddp_default' row (DDP(model), DDP's own limits), timed "
                        "next to DDP with its best settings ('ddp') by default")
    r.add_argument("--aa", choices=("ddp", "fused", "none"), default="ddp",
                   help="A/A pair for the noise band: a second DDP (ddp, the default) or "
                        "FusedReducer (fused) interleaved with the others; its median over the "
                        "first's is the ratio noise alone gives")
    r.add_argument("--autotune", action="store_true",
                   help="also time FusedReducer(autotune=True) ('tuned', started from the same "
                        "limits and tuned to its choice before the timed steps) against the DDP")
    r.add_argument("--autotune-max-steps", type=_positive_int, default=400,
                   help="fail if the tuner has not chosen after this many steps (default 400)")
    r.add_argument("--baseline", action="store_true",
                   help="also time the bare model without any wrapper or communication ('local')")
    r.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default 0)")
    o = parser.add_argument_group("output")
    o.add_argument("--trace-dir", metavar="DIR",
                   help="rank 0 writes each FusedReducer variant's last 2 timed steps as a Chrome "
                        "trace and a timeline picture: DIR/<model>_<variant>.json/.png")
    o.add_argument("--json", metavar="FILE",
                   help="write {meta, settings, models, grid, rows} to FILE; one row per (model, "
                        "first, cap, impl) with median_ms, p90_ms, collectives_per_step, "
                        "bytes_per_step, exposed_comm_ms, ratio_to_ddp, bucket_sizes, step times")
    o.add_argument("--plot", metavar="FILE.png",
                   help="heatmap PNG of median step time (DDP, FusedReducer) and their ratio over "
                        "(first bucket, cap); default with --sweep-* and --json: the JSON path "
                        "with .png")
    o.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    common.add_launch_args(parser)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.channels_last:
        args.model = list(dict.fromkeys(f"{n}-cl" if n in ("resnet18", "resnet50") else n
                                        for n in args.model))
    for name in args.model:
        try:
            zoo.require(name)
        except MissingLibrary as e:
            parser.error(str(e))
    if args.warmup < 2:
        parser.error("--warmup must be >= 2: DDP and FusedReducer rebuild their buckets after step 1")
    return common.launch(worker, args)


if __name__ == "__main__":
    sys.exit(main())
