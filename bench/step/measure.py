"""How step_bench.py measures: one timed training step (LastGradClock: when the last gradient
is written), the collectives of a step counted with torch.profiler, one configuration's
interleaved rounds (run_config, round_order), and the summary of its rows (medians, p90,
bootstrap intervals of the ratios, telemetry)."""
import contextlib
import gc
import math
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import common
from step.configs import (ddp_layout, fused_bytes_as_fp32, make_ddp, make_ddp_default,
                          make_ddp_hook, make_fsdp2_replicate, make_fused)

MiB = 1024 * 1024



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
FSDP2 = "fsdp2-replicate"  # torch's replicate_with_fsdp.replicate (DDP rebuilt on FSDP2)


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
    refused = {}  # impl -> torch's error, where it would not take the model
    fsdp2 = fsdp2_groups = None
    if not args.no_fsdp2:  # torch's own successor of DDP, same model, same inputs
        try:
            fsdp2, fsdp2_groups = make_fsdp2_replicate(spec, ctx, reduce_dtype=rd)
            variants.append((FSDP2, fsdp2))
        except common.FSDP2Refused as e:
            refused[FSDP2] = str(e)
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
    fsdp2_diff = None
    if fsdp2 is not None:  # FSDP2's parameters and gradients are DTensors: compare the whole
        train_step(ctx, fsdp2, x, gv)
        fsdp2_diff = max((a.grad - common.full_tensor(b.grad)).abs().max().item()
                         for a, b in zip(twin.module.parameters(), fsdp2.parameters()))

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
        if name == FSDP2:
            # Not probed: FSDP2's gradients accumulate in unsharded parameters that exist only
            # inside its hooks (its DTensor parameters get theirs assigned, no hook fires there).
            exposed[name] = []
            collectives[name] = count_collectives(ctx, model, next_input(), gv)
            continue
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
              "fsdp2_grad_max_abs_diff": fsdp2_diff, "fsdp2_groups": fsdp2_groups,
              "refused": refused,
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
    del ddp, fused, tuned, fsdp2, variants
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
    in the same round on the same input): resample step indices with replacement (numpy; the
    interval's ends are linear-interpolated percentiles of the resampled ratios)."""
    n = min(len(num), len(den))
    if n < 2:
        r = statistics.median(num) / statistics.median(den)
        return [r, r]
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    ratios = (np.median(np.asarray(num[:n])[idx], axis=1)
              / np.median(np.asarray(den[:n])[idx], axis=1))
    tail = (100 - level) / 2
    return [float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))]


def _telemetry_summary(per_rank, name):
    """Median over timed steps (per step the minimum over ranks for exposed/wait, as the probe
    does), and per bucket the per-rank medians of pack_us, wait_us, launch_lag_us, comm_us."""
    tel = [r["telemetry"][name] for r in per_rank]
    n = min(len(t) for t in tel)
    if not n:
        return None
    out = {}
    for key in ("exposed_ms", "wait_ms", "finalize_ms"):
        out[key] = statistics.median([min(t[i][key] for t in tel) for i in range(n)])
        out[key + "_per_rank"] = [statistics.median([t[i][key] for i in range(n)]) for t in tel]
    out["overlap_per_rank"] = [statistics.median([t[i]["overlap"] for i in range(n)]) for t in tel]
    nb = min(len(t[i]["buckets"]) for t in tel for i in range(n))
    buckets = []
    for b in range(nb):
        entry = {"bytes": tel[0][0]["buckets"][b]["bytes"], "params": tel[0][0]["buckets"][b]["params"]}
        for key in ("pack_us", "wait_us", "launch_lag_us", "comm_us"):
            entry[key] = [statistics.median([t[i]["buckets"][b][key] for i in range(n)]) for t in tel]
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
            "median_ms": statistics.median(steps), "p90_ms": float(np.percentile(steps, 90)),
            "mean_ms": sum(steps) / len(steps), "min_ms": min(steps),
            "backward_host_ms": statistics.median(backward_host),
            "collectives_per_step": count, "collectives_source": how,
            "bytes_per_step": nbytes, "bytes_source": bytes_source,
            "exposed_comm_ms": statistics.median(exposed) if exposed else None,
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
        if name == FSDP2:
            row["bucket_sizes"] = per_rank[0]["fsdp2_groups"]
            row["constructed_as"] = ("replicate_with_fsdp.replicate(block) for each block, "
                                     "then replicate(model), 1-D mesh")
            row["grad_max_abs_diff"] = max(r["fsdp2_grad_max_abs_diff"] for r in per_rank)
            row["grad_max_abs"] = max(r["grad_max_abs"] for r in per_rank)
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


