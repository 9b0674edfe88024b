"""export_profile() on ranks of unequal speed: the faster rank's ready times are scaled to the
slowest rank's backward.

Each test checks a behaviour against an independent reference (DDP on the same model and data,
a float64 average of locally computed gradients, the profiler's record of the collectives, or the
test's own count). The checks of the selected tests run in ONE spawn of 2 gloo ranks
(SelectedChecks, the module fixture).
"""
import json
import os
import statistics
import tempfile
import time

import pytest
import torch

from dist_utils import SelectedChecks, per_rank
from ddp_comparison import Net, build, data, loss_of, sgd


SLOW_MS = 40  # rank 1 sleeps this long in the middle of every backward


class SlowMiddle(Net):
    """Net whose backward sleeps between `out` and `fc2` on the rank given `slow`: its first
    gradients (out's) are ready on time, the rest SLOW_MS later."""

    slow = False

    def forward(self, x):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        if self.slow and h.requires_grad:
            h.register_hook(lambda g: time.sleep(SLOW_MS / 1e3))
        return self.out(h)


def check_profile_of_unequal_ranks(rank, world):
    from fused_reducer import FusedReducer
    module = build(SlowMiddle)
    module.slow = rank == 1
    model = FusedReducer(module, first_bucket_mb=1)
    opt = sgd(model)
    for i in range(5):
        opt.zero_grad()
        x, y = data(rank, i)
        loss_of(model(x), y, rank).backward()
        opt.step()
    folder = tempfile.mkdtemp(prefix="fr_slips_profile_")
    path = model.export_profile(os.path.join(folder, "profile_{rank}.json"))
    with open(path) as f:
        profile = json.load(f)
    history = model.step_history()
    return {"profile": profile,
            "backward": {s["step"]: s["backward_end_us"] for s in history},
            # this rank's own medians: its last gradient and the end of its backward
            "local_last_ready": statistics.median(
                max(b["ready_last_us"] for b in s["buckets"] if b["ready_last_us"] is not None)
                for s in history),
            "local_backward": statistics.median(s["backward_end_us"] for s in history),
            "buckets": [len(s["buckets"]) for s in history]}


CHECKS = SelectedChecks()
outcomes = CHECKS.fixture(timeout=240)  # the selected tests' checks, in one spawn


@CHECKS.uses(check_profile_of_unequal_ranks)
def test_export_profile_on_the_faster_rank_scales_ready_times_to_the_slowest_rank(outcomes):
    """Slips: the stretch inverted (this rank's backward / the slowest's) or left out: the fast
    rank's profile would then describe a backward the slow rank never lets happen."""
    fast, slow = per_rank(outcomes, "check_profile_of_unequal_ranks")
    # reference: the slow rank's own telemetry, step by step; the slower of the two per step
    steps = sorted(set(fast["backward"]) & set(slow["backward"]))
    assert len(steps) >= 2
    slowest = statistics.median(max(fast["backward"][s], slow["backward"][s]) for s in steps)
    assert slowest >= SLOW_MS * 1e3 * 0.9, "reference: rank 1 is not slower"
    for name, r in (("fast", fast), ("slow", slow)):
        assert r["buckets"] == [1] * len(r["buckets"]), "reference: one bucket every step"
        p = r["profile"]
        assert p["timing"]["backward_end_us"] == pytest.approx(slowest, rel=1e-6), name
        ready = [q["ready_us"] for q in p["params"] if q["ready_us"] is not None]
        # profile.py: this rank's (median) times x slowest backward / this rank's backward
        expected = r["local_last_ready"] * slowest / r["local_backward"]
        assert max(ready) == pytest.approx(expected, rel=0.02), \
            f"{name} rank: last ready {max(ready):.0f} us, expected {expected:.0f} us"
        assert min(ready) == pytest.approx(0.0, abs=1.0), name
    assert fast["local_backward"] < 0.5 * slowest, "reference: rank 0 is not faster"
