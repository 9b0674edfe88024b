"""Chrome trace (Perfetto-compatible JSON) of the reducer's step telemetry.

Input: FusedReducer.step_history() (see Note [Step telemetry] in ext/reducer.h). Output: the
Trace Event Format's JSON object form, {"traceEvents": [...], "displayTimeUnit": "ms", ...},
with complete events (ph "X", ts and dur in microseconds), one process per rank and these rows
(threads, in this order):

  tid 0  "step"                 forward start -> gradients written back, one span per step
  tid 1  "backward"             first gradient ready -> end of backward, then "end of backward"
                                (waiting for the buckets and copying results into .grad)
  tid 10 + b  "bucket b"        "fill" (first -> last gradient of the bucket ready), "copy in"
                                (scaled copy into the flat buffer), "all-reduce" (launch ->
                                completion seen), inside it "exposed wait" (blocked after
                                backward)

plus an "overlap" counter per step. Open the file at https://ui.perfetto.dev or chrome://tracing.
"""
import json
import math
import os

from ..core.plugins import provide

STEP_TID = 0
BACKWARD_TID = 1
BUCKET_TID0 = 10


def _x(name, pid, tid, ts, dur, args=None, cat="fused_reducer"):
    event = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
             "ts": round(ts, 3), "dur": round(max(dur, 0.0), 3)}
    if args:
        event["args"] = args
    return event


def _ok(*values):
    return all(v is not None and not math.isnan(v) for v in values)


def chrome_trace(history, rank=0, meta=None):
    """The trace as a dict, from a list of step telemetry dicts (oldest first)."""
    pid = rank
    events = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {rank}"}},
              {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": rank}}]
    rows = {STEP_TID: "step", BACKWARD_TID: "backward"}
    base = min((s["origin_us"] + min(s["forward_us"], 0.0) for s in history), default=0.0)
    for s in history:
        t0 = s["origin_us"] - base  # the step's first gradient, on the trace's time axis
        limits = {k: s[k] for k in ("first_bucket_bytes", "bucket_cap_bytes", "last_bucket_bytes")}
        events.append(_x(f"step {s['step']}", pid, STEP_TID, t0 + s["forward_us"],
                         s["finalize_end_us"] - s["forward_us"],
                         dict(limits, reduce_dtype=s.get("reduce_dtype"),
                              buckets=len(s["buckets"]), overlap=round(s["overlap"], 4),
                              exposed_wait_us=round(s["exposed_wait_us"], 1))))
        events.append(_x("backward", pid, BACKWARD_TID, t0, s["backward_end_us"],
                         {"note": "first gradient ready -> end of backward"}))
        events.append(_x("end of backward", pid, BACKWARD_TID, t0 + s["backward_end_us"],
                         s["finalize_end_us"] - s["backward_end_us"],
                         {"exposed_wait_us": round(s["exposed_wait_us"], 1)}))
        events.append({"name": "overlap", "ph": "C", "pid": pid, "ts": round(t0, 3),
                       "args": {"overlap": round(s["overlap"], 4)}})
        for r, late in enumerate(s.get("lateness_ms") or []):
            # One counter row per rank: its lateness (straggler_report) where it was exchanged.
            if _ok(late):
                events.append({"name": f"lateness of rank {r} (ms)", "ph": "C", "pid": pid,
                               "ts": round(t0, 3), "args": {"lateness_ms": round(late, 3)}})
        for b in s["buckets"]:
            tid = BUCKET_TID0 + b["bucket"]
            rows[tid] = f"bucket {b['bucket']}"
            args = {"bytes": b["bytes"], "params": b["params"]}
            if _ok(b["ready_first_us"], b["ready_last_us"]):
                events.append(_x("fill", pid, tid, t0 + b["ready_first_us"],
                                 b["ready_last_us"] - b["ready_first_us"], args))
            if _ok(b["launch_us"], b["pack_us"]):
                events.append(_x("copy in", pid, tid, t0 + b["launch_us"] - b["pack_us"],
                                 b["pack_us"], args))
            if _ok(b["launch_us"], b["complete_us"]):
                events.append(_x(f"all-reduce {b['bucket']}", pid, tid, t0 + b["launch_us"],
                                 b["complete_us"] - b["launch_us"],
                                 dict(args, wait_us=round(b["wait_us"] or 0.0, 1))))
            if _ok(b["complete_us"], b["wait_us"]) and b["wait_us"] > 0:
                events.append(_x("exposed wait", pid, tid, t0 + b["complete_us"] - b["wait_us"],
                                 b["wait_us"], args))
    for tid, name in sorted(rows.items()):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"name": name}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"sort_index": tid}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": dict(meta or {}, rank=rank, steps=len(history),
                              clock="steady clock, microseconds")}


def write_chrome_trace(path, history, rank=0, meta=None):
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(chrome_trace(history, rank, meta), f)
    os.replace(tmp, path)
    return path


def export_trace(model, path, steps=None):
    """FusedReducer.export_trace(): the telemetry of the last `steps` steps of `model` (default
    all kept) written to `path` ("{rank}" replaced); returns the path written."""
    import torch.distributed as dist
    history = model.step_history()
    if steps is not None:
        history = history[-int(steps):] if int(steps) > 0 else []
    rank = dist.get_rank(model.process_group)
    path = str(path).format(rank=rank)
    write_chrome_trace(path, history, rank=rank,
                       meta={"transport": model.stats()["transport"],
                             "world_size": dist.get_world_size(model.process_group)})
    return path


provide("export_trace", export_trace)  # FusedReducer's hook point: see core/plugins.py
