"""Profile of a real training run, for the planner (python -m fused_reducer.plan).

`export_profile(model, path)` (FusedReducer.export_profile) writes, as versioned JSON, what the
performance model (costmodel.py) needs: per parameter its bytes, (dtype, device) group and
median gradient-ready time, the ready order, the layout and limits in force, the step's phases
(forward, backward end, copy back, the rest), the transport's probed latency and bandwidth, and
the machine. Everything comes from the C++ step telemetry (Note [Step telemetry]), which costs
one clock read per gradient hook; this module runs once, when called, never per step.
docs/PLANNING.md documents the fields.
"""
import datetime
import json
import math
import os
import platform
import socket
import statistics

import numpy as np
import torch
import torch.distributed as dist

from ..core.plugins import provide
from .costmodel import ParamInfo, candidate, limits_json, step_periods
from .probe import probe_transport
from ..settings import MAX_BYTES

FORMAT = "fused_reducer.profile"
VERSION = 1


class ProfileError(ValueError):
    """A profile that cannot be used: missing, malformed, or of another version."""


def export_profile(model, path):
    """Write the profile of `model` (a FusedReducer) to `path`. Collective: call it on every rank
    (the transport probe and the slowest-rank step phases need all ranks). Rank 0 writes `path`;
    with "{rank}" in it, every rank writes its own. Returns the path written, or None on ranks
    that write nothing. Needs at least two completed synchronised steps."""
    from ..transports.transport import control_allreduce  # looked up per call (tests stand it in)
    from ..build import build_info

    reducer = model.attachment.reducer
    group = model.process_group
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    history = reducer.history()
    control = model.attachment.control_device
    # Checked together, so that no rank is left waiting in the probe when another one raises.
    steps, = control_allreduce([len(history)], dist.ReduceOp.MIN, group, control)
    if steps < 2:
        raise RuntimeError(
            f"export_profile needs at least 2 completed synchronised steps of telemetry, a rank "
            f"has {int(steps)}: train a few steps first")

    latency_us, bytes_per_us = probe_transport(model.attachment.transport, model.device, group,
                                               control_device=control)
    phases = _step_phases(history)
    local_backward_us = phases["backward_end_us"]
    # Slowest rank per phase: the step time of data parallelism is the slowest rank's.
    slowest = control_allreduce([phases[k] for k in _PHASES], dist.ReduceOp.MAX, group, control)
    phases.update(zip(_PHASES, slowest))
    # The last bucket waits for whichever rank is slowest in *that* step: the median over
    # steps of the per-step slowest backward, not the slowest rank's median (which forgets the
    # step-to-step skew), when the ranks' recorded steps are the same ones.
    # One MAX all-reduce: the step numbers and their negatives (max and min over ranks agree
    # only if every rank holds the same steps), then the backward times themselves.
    recent = history[-int(steps):]
    numbers = [float(s["step"]) for s in recent]
    agreed = control_allreduce(numbers + [-n for n in numbers]
                               + [s["backward_end_us"] for s in recent],
                               dist.ReduceOp.MAX, group, control)
    k = len(recent)
    if agreed[:k] == numbers and [-n for n in agreed[k:2 * k]] == numbers:
        phases["backward_end_us"] = statistics.median(agreed[2 * k:])
    stretch = phases["backward_end_us"] / local_backward_us if local_backward_us > 0 else 1.0
    # Per bucket after backward: the mean over ranks of each rank's medians (one SUM all-reduce;
    # NaN where a bucket had no such copy back).
    waits, copy_backs = _late_bucket_phases(history)
    summed = control_allreduce(waits + copy_backs, dist.ReduceOp.SUM, group, control)
    phases["bucket_waits_us"] = [v / world for v in summed[:len(waits)]]
    phases["bucket_copy_backs_us"] = [None if math.isnan(v) else v / world
                                      for v in summed[len(waits):]]

    info = ParamInfo(model.attachment.params, model.reduce_dtype)  # ignored ones left out
    ready = _median_ready_times(reducer.last_ready_times(), history, stretch)
    last = history[-1]
    profile = {
        "format": FORMAT,
        "version": VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": world,
        "ranks_per_node": _ranks_per_node(group),
        "device": model.device.type,
        "transport": reducer.stats()["transport"],
        "machine": _machine(model.device),
        "software": {"torch": torch.__version__, "nccl": build_info()["nccl_version"],
                     "fused_reducer_cuda_build": build_info()["cuda"]},
        "limits": limits_json(candidate(last["bucket_caps_bytes"], last["last_bucket_bytes"])),
        "groups": info.group_names,
        "params": [{"name": name, "bytes": size, "group": g,
                    "ready_us": None if math.isnan(t) else t}
                   for name, size, g, t in zip(model.attachment.param_names, info.sizes, info.groups, ready)],
        "ready_order": [int(i) for i in reducer.last_ready_order()],
        "buckets": [[int(i) for i in b] for b in reducer.bucket_params()],
        "steps_recorded": len(history),
        "timing": phases,
        "probe": {"latency_us": latency_us, "bandwidth_GBps": bytes_per_us / 1e3},
    }
    path = str(path)
    if "{rank}" in path:
        path = path.format(rank=rank)
    elif rank != 0:
        return None
    _write_json(path, profile)
    return path


_PHASES = ("forward_us", "backward_end_us", "finalize_us", "other_us", "step_us",
           "exposed_wait_us", "late_bytes")


def _step_phases(history):
    """Median phases of the recorded steps (us): forward start -> first gradient, first gradient
    -> end of backward, copying results back after backward (waits excluded), gradients written
    back -> next forward (optimizer, zero_grad, data), forward to forward, exposed waits; and
    the copy rate into buckets; late_bytes: the bytes of the buckets unpacked after backward
    (their collective had not completed when it ended), which finalize_us copied back."""
    forward = [-s["forward_us"] for s in history]
    backward = [s["backward_end_us"] for s in history]
    finalize = [max(0.0, s["finalize_end_us"] - s["backward_end_us"] - s["exposed_wait_us"])
                for s in history]
    # The rest of the step lies between one step's end and the next forward.
    periods = step_periods(history)
    period = [p for _, p in periods]
    other = [max(0.0, p - (a["finalize_end_us"] - a["forward_us"])) for a, p in periods]
    packed = [(b["bytes"], b["pack_us"]) for s in history for b in s["buckets"]
              if b["pack_us"] is not None and b["pack_us"] > 0]
    copy_GBps = (sum(n for n, _ in packed) / sum(t for _, t in packed) / 1e3) if packed else 10.0
    steps = [s["finalize_end_us"] - s["forward_us"] for s in history]
    return {"forward_us": statistics.median(forward),
            "backward_end_us": statistics.median(backward),
            "finalize_us": statistics.median(finalize),
            "other_us": statistics.median(other) if other else 0.0,
            "step_us": statistics.median(period) if period else statistics.median(steps),
            "exposed_wait_us": statistics.median(s["exposed_wait_us"] for s in history),
            "late_bytes": statistics.median(
                sum(b["bytes"] for b, late in zip(s["buckets"], _late_buckets(s)) if late)
                for s in history),
            "copy_GBps": copy_GBps}


def _late_buckets(step):
    """Per bucket of a recorded step: whether it was unpacked after backward (its collective
    had not completed when backward ended, so the end of backward waited for it)."""
    return [b["complete_us"] is not None and b["complete_us"] >= step["backward_end_us"]
            for b in step["buckets"]]


def _late_bucket_phases(history):
    """Per bucket of the last step's layout, medians over the recorded steps with that layout:
    how long the end of backward waited for it (0: unpacked during backward), and how long its
    copy back into .grad took before the next bucket's wait began (NaN: the last bucket, or one
    unpacked during backward). The planner reads from them how long a bucket after backward
    waits beyond its collective for the ranks' previous copy backs (plan.Planner)."""
    last = history[-1]
    sizes = [b["bytes"] for b in last["buckets"]]
    same = [s for s in history if [b["bytes"] for b in s["buckets"]] == sizes]
    waits = [[] for _ in sizes]
    copy_backs = [[] for _ in sizes]
    for step in same:
        buckets = step["buckets"]
        late = _late_buckets(step)
        for k, bucket in enumerate(buckets):
            waits[k].append((bucket["wait_us"] or 0.0) if late[k] else 0.0)
            if late[k] and k + 1 < len(buckets) and late[k + 1]:
                following = buckets[k + 1]
                started_waiting = following["complete_us"] - (following["wait_us"] or 0.0)
                copy_backs[k].append(max(0.0, started_waiting - bucket["complete_us"]))
    return ([statistics.median(w) for w in waits],
            [statistics.median(c) if c else math.nan for c in copy_backs])


def _median_ready_times(last_ready, history, stretch):
    """Per-parameter ready times, from the last step (the C++ telemetry keeps only that one per
    parameter), moved onto the median over the recorded steps: a piecewise-linear map through
    the buckets' last-ready times and the end of backward (last step -> median over the steps
    with the same layout), times `stretch` (slowest rank's backward / this rank's), so that the
    times follow the slowest rank, which every collective waits for."""
    last = history[-1]
    same = [s for s in history if [b["bytes"] for b in s["buckets"]]
            == [b["bytes"] for b in last["buckets"]]]
    anchors = [(0.0, 0.0)]
    for i, bucket in enumerate(last["buckets"]):
        times = [s["buckets"][i]["ready_last_us"] for s in same
                 if s["buckets"][i]["ready_last_us"] is not None]
        if bucket["ready_last_us"] is not None and times:
            anchors.append((bucket["ready_last_us"], stretch * statistics.median(times)))
    anchors.append((last["backward_end_us"],
                    stretch * statistics.median(s["backward_end_us"] for s in same)))
    anchors.sort()
    xs, ys = [], []
    for x, y in anchors:  # strictly increasing x, non-decreasing y, as np.interp needs
        if xs and x <= xs[-1]:
            continue
        xs.append(x)
        ys.append(max(y, ys[-1]) if ys else y)
    times = np.asarray(list(last_ready), dtype=np.float64)
    return [float(v) for v in np.interp(times, xs, ys)]  # NaN (never ready) stays NaN


def _ranks_per_node(group):
    """The ranks of `group` on this node. LOCAL_WORLD_SIZE counts every rank of the node; with
    tensor or pipeline parallelism the data-parallel group holds only some of them: torchrun
    numbers the ranks node by node, so this node's are those r with r // LOCAL_WORLD_SIZE equal."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if not (local and local.isdigit() and int(local) > 0):
        return None
    node = dist.get_rank() // int(local)
    return sum(1 for r in dist.get_process_group_ranks(group) if r // int(local) == node)


def _machine(device):
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "usable_cpus": cpus,
            "torch_threads": torch.get_num_threads(), "gpu": gpu}


def _write_json(path, data):
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)  # a reader never sees half a profile


# -- reading --------------------------------------------------------------------------------------
_MISSING = object()
MAX_WORLD = 1 << 24  # more ranks than any job has had: beyond it, a corrupt world size


class _Malformed(Exception):
    """One field the planner cannot use; load_profile names the file."""


def _bad(field, value, expected):
    shown = "missing" if value is _MISSING else repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return _Malformed(f"{field!r} is {shown}, not {expected}")


def _number(value, field, positive=False):
    """A finite number >= 0 (> 0 when `positive`), as a float."""
    expected = "a finite number " + ("> 0" if positive else ">= 0")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(field, value, expected)
    try:
        number = float(value)
    except OverflowError:
        raise _bad(field, value, expected) from None
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise _bad(field, value, expected)
    return number


def _integer(value, field, low, high, expected):
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(field, value, expected)
    return value


def _nbytes(value, field, zero_means=""):
    expected = (f"0 ({zero_means}) or " if zero_means else "") + "a positive int number of bytes"
    return _integer(value, field, 0 if zero_means else 1, MAX_BYTES, expected)


def _index(value, field, count, what):
    return _integer(value, field, 0, count - 1, f"an index into {what} (0..{count - 1})")


def _typed(value, field, kind, expected):
    if not isinstance(value, kind):
        raise _bad(field, value, expected)
    return value


def _check_profile(data):
    """Every field the planner reads (plan.Planner, costmodel.candidate_from_json, step_compute),
    with its type and range (numbers finite, byte counts positive, indices in range);
    _Malformed naming the first one that is wrong. May be absent, as the planner does without
    them: timing.late_bytes, bucket_waits_us and bucket_copy_backs_us (older profiles),
    backward_no_comm_us (added by hand), buckets and limits.bucket_caps_bytes (derived from the
    limits), transport and machine (only shown)."""
    _integer(data.get("world_size", _MISSING), "world_size", 1, MAX_WORLD,
             f"a positive int number of ranks (at most {MAX_WORLD})")
    _typed(data.get("device", _MISSING), "device", str, "a device type ('cpu', 'cuda')")
    _typed(data.get("transport"), "transport", (str, type(None)), "a string")
    machine = _typed(data.get("machine", {}), "machine", dict, "an object")
    _typed(machine.get("hostname"), "machine.hostname", (str, type(None)), "a string")

    limits = _typed(data.get("limits", _MISSING), "limits", dict, "an object")
    for key in ("first_bucket_bytes", "bucket_cap_bytes"):
        _nbytes(limits.get(key, _MISSING), f"limits.{key}")
    _nbytes(limits.get("last_bucket_bytes", _MISSING), "limits.last_bucket_bytes",
            zero_means="no last bucket")
    caps = _typed(limits.get("bucket_caps_bytes") or [], "limits.bucket_caps_bytes", list,
                  "a list of byte counts")
    for k, cap in enumerate(caps):
        _nbytes(cap, f"limits.bucket_caps_bytes[{k}]")

    groups = _typed(data.get("groups", _MISSING), "groups", list, "a list of group names")
    if not groups:
        raise _bad("groups", groups, "a non-empty list of group names")
    params = _typed(data.get("params", _MISSING), "params", list, "a list of parameters")
    if not params:
        raise _bad("params", params, "a non-empty list of parameters")
    for i, p in enumerate(params):
        _typed(p, f"params[{i}]", dict, "an object")
        _nbytes(p.get("bytes", _MISSING), f"params[{i}].bytes", zero_means="an empty parameter")
        _index(p.get("group", _MISSING), f"params[{i}].group", len(groups), "groups")
        if p.get("ready_us", _MISSING) is not None:  # None: never ready in the recorded step
            _number(p.get("ready_us", _MISSING), f"params[{i}].ready_us")

    n = len(params)
    order = _typed(data.get("ready_order", _MISSING), "ready_order", list, "a list of indices")
    for k, i in enumerate(order):
        _index(i, f"ready_order[{k}]", n, "params")
    if sorted(order) != list(range(n)):
        raise _bad("ready_order", order, f"a permutation of the {n} parameters")
    buckets = _typed(data.get("buckets") or [], "buckets", list, "a list of buckets")
    seen = set()
    for b, bucket in enumerate(buckets):
        if not isinstance(bucket, list) or not bucket:
            raise _bad(f"buckets[{b}]", bucket, "a non-empty list of parameter indices")
        for k, i in enumerate(bucket):
            if _index(i, f"buckets[{b}][{k}]", n, "params") in seen:
                raise _bad(f"buckets[{b}][{k}]", i, "a parameter in no other bucket")
            seen.add(i)
    if buckets and len(seen) != n:
        missing = min(set(range(n)) - seen)
        raise _bad("buckets", buckets, f"a layout of every parameter (params[{missing}] is in "
                                       f"none)")

    timing = _typed(data.get("timing", _MISSING), "timing", dict, "an object")
    for key in ("forward_us", "backward_end_us", "finalize_us", "other_us", "step_us",
                "exposed_wait_us"):
        _number(timing.get(key, _MISSING), f"timing.{key}")
    _number(timing.get("copy_GBps", _MISSING), "timing.copy_GBps", positive=True)
    for key in ("late_bytes", "backward_no_comm_us"):
        if timing.get(key) is not None:
            _number(timing[key], f"timing.{key}")
    for key in ("bucket_waits_us", "bucket_copy_backs_us"):
        values = _typed(timing.get(key) or [], f"timing.{key}", list, "a list of times")
        for k, value in enumerate(values):
            if value is not None or key == "bucket_waits_us":  # None: no copy back measured
                _number(value, f"timing.{key}[{k}]")

    probe = _typed(data.get("probe", _MISSING), "probe", dict, "an object")
    for key in ("latency_us", "bandwidth_GBps"):
        _number(probe.get(key, _MISSING), f"probe.{key}", positive=True)


def load_profile(path):
    """The profile at `path`, checked; ProfileError naming the file and what is wrong."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ProfileError(f"profile {path!r} does not exist: record one with "
                           f"model.export_profile(path) after a few training steps") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"profile {path!r} is not readable JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f"{path!r} is not a FusedReducer profile (its 'format' is "
                           f"{data.get('format') if isinstance(data, dict) else None!r}, expected "
                           f"{FORMAT!r}): record one with model.export_profile(path)")
    version = data.get("version")
    if isinstance(version, bool) or version != VERSION:
        raise ProfileError(f"profile {path!r} has version {version!r}; this "
                           f"fused_reducer reads version {VERSION}: record it again with "
                           f"model.export_profile(path)")
    try:
        _check_profile(data)
    except _Malformed as e:
        raise ProfileError(f"profile {path!r} is malformed: {e}") from None
    return data


def step_compute(profile):
    """costmodel.StepCompute of a loaded profile."""
    from .costmodel import StepCompute
    t = profile["timing"]
    ready = [math.nan if p["ready_us"] is None else float(p["ready_us"])
             for p in profile["params"]]
    return StepCompute(float(t["forward_us"]), ready, float(t["backward_end_us"]),
                       float(t["finalize_us"]), float(t["other_us"]),
                       float(t["copy_GBps"]) * 1e3)


provide("export_profile", export_profile)  # FusedReducer's hook point: see core/plugins.py
