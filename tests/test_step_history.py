"""step_history() and export_trace(): what they time and how much they keep.

Each test checks a behaviour against an independent reference (DDP on the same model and data,
a float64 average of locally computed gradients, the profiler's record of the collectives, or the
test's own count). The checks of the selected tests run in ONE spawn of 2 gloo ranks
(SelectedChecks, the module fixture).
"""
import json
import os
import tempfile
import time

import torch
from torch import nn

from behaviour_common import MiB, fused, fused_with_its_defaults
from dist_utils import SelectedChecks, results
from ddp_comparison import Net, build, data, loss_of, sgd, step


SLEEP_S = 0.25


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sleep):
        ctx.sleep = sleep
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.sleep:
            time.sleep(SLEEP_S)
        return g, None


class Slow(nn.Module):
    """Backward makes out.* and mid.* ready, sleeps SLEEP_S (when asked), then makes inp.* ready."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x, sleep=False):
        h = _SleepInBackward.apply(torch.tanh(self.inp(x)), sleep)
        return self.out(torch.tanh(self.mid(h)))


def check_trace_steps(rank, world):
    model = fused(build(Net))
    opt = sgd(model)

    def steps(n, start):
        for i in range(start, start + n):
            opt.zero_grad()
            x, y = data(rank, i)
            loss_of(model(x), y, rank).backward()
            opt.step()
    steps(5, 0)
    out = {"before": len(model.step_history())}
    model.trace_steps = 2
    out["right_after"] = len(model.step_history())
    steps(3, 5)
    out["after_more_steps"] = len(model.step_history())
    out["last_steps"] = [s["step"] for s in model.step_history()]
    return out


def check_step_history_timing(rank, world):
    """Per-bucket times of step_history() and export_trace() against the gradient-ready times
    the test itself records (time.monotonic in plain PyTorch hooks), with a SLEEP_S pause in
    backward between the first bucket's gradients and the last bucket's."""
    m = fused_with_its_defaults(build(Slow), first_bucket_mb=1000 / MiB, bucket_cap_mb=1000 / MiB)
    module = m.module
    seen = {}
    handles = [p.register_post_accumulate_grad_hook(
        lambda p, n=n: seen.__setitem__(n, time.monotonic() * 1e6))
        for n, p in module.named_parameters()]
    opt = sgd(m)
    step(m, opt, rank, 0)
    step(m, opt, rank, 1)
    seen.clear()
    step(m, opt, rank, 2, sleep=True)
    for h in handles:
        h.remove()
    layout = m.bucket_parameter_names()
    origin = min(seen.values())
    history = m.step_history()[-1]
    out = {"layout": layout, "buckets": []}
    for names, b in zip(layout, history["buckets"]):
        out["buckets"].append({
            "names": names,
            "ready_first": (b["ready_first_us"], min(seen[n] for n in names) - origin),
            "ready_last": (b["ready_last_us"], max(seen[n] for n in names) - origin),
            "launch": b["launch_us"]})
    with tempfile.TemporaryDirectory() as tmp:
        path = m.export_trace(os.path.join(tmp, "trace_{rank}.json"), steps=1)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e["name"] == "thread_name"}
    out["fills"] = {rows[e["tid"]]: e["ts"] for e in events if e.get("name") == "fill"}
    return out


CHECKS = SelectedChecks()
outcomes = CHECKS.fixture(timeout=240)  # the selected tests' checks, in one spawn


@CHECKS.uses(check_trace_steps)
def test_trace_steps_bounds_the_step_history(outcomes):
    for r in results(outcomes, check_trace_steps):
        assert r["before"] == 5
        assert r["right_after"] == 2
        assert r["after_more_steps"] == 2
        assert r["last_steps"] == [7, 8]


@CHECKS.uses(check_step_history_timing)
def test_step_history_and_trace_time_each_bucket_like_the_tests_own_clock(outcomes):
    tol = 0.3 * SLEEP_S * 1e6  # µs: room for a loaded 2-core machine, well below the pause
    for r in results(outcomes, check_step_history_timing):
        first, last = r["buckets"][0], r["buckets"][-1]
        assert len(r["buckets"]) == 2 and set(last["names"]) == {"inp.weight", "inp.bias"}, r
        for b in r["buckets"]:
            for what in ("ready_first", "ready_last"):
                got, expected = b[what]
                assert abs(got - expected) < tol, (b["names"], what, got, expected)
        assert last["ready_first"][1] - first["ready_last"][1] > 0.9 * SLEEP_S * 1e6, r
        # The first bucket was launched before the pause ended: overlapping backward.
        assert first["launch"] < last["ready_first"][0] - 0.5 * SLEEP_S * 1e6, r
        gap = r["fills"]["bucket 1"] - r["fills"]["bucket 0"]
        expected_gap = last["ready_first"][1] - first["ready_first"][1]
        assert abs(gap - expected_gap) < tol, (r["fills"], expected_gap)
