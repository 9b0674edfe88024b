"""Module buffers: broadcast at construction and before forwards as DDP does, and a buffer saved
for backward across two forwards.

Each test checks a behaviour against an independent reference (DDP on the same model and data,
a float64 average of locally computed gradients, the profiler's record of the collectives, or the
test's own count). The checks of the selected tests run in ONE spawn of 2 gloo ranks
(SelectedChecks, the module fixture).
"""
import warnings

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from behaviour_common import fused, fused_with_its_defaults
from dist_utils import SelectedChecks, assert_small, results
from ddp_comparison import (BNNet, HIDDEN, Net, StatNet, build, data, loss_of, max_diff,
                                outcome, params, same_on_all_ranks, sgd)


class ScaledNet(Net):
    """A buffer multiplied into the activations: autograd saves it for backward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, x):
        h = torch.tanh(self.fc1(x)) * self.scale
        return self.out(torch.tanh(self.fc2(h)))


def check_buffer_rules(rank, world):
    """BatchNorm running stats, per rank, equal DDP's: (a) broadcast_buffers=False never
    broadcasts; (b) broadcast_buffers=True with a gradient-accumulation window: the forward
    after a no_sync forward does not broadcast."""
    out = {}
    for label, kwargs, micro in (("broadcast_buffers=False", dict(broadcast_buffers=False), 1),
                                 ("no_sync window", dict(), 3)):
        models = {"ddp": DDP(build(BNNet), **kwargs), "fr": fused(build(BNNet), **kwargs)}
        opts = {k: sgd(m) for k, m in models.items()}
        diffs = []
        for i in range(3):
            for kind, m in models.items():
                opts[kind].zero_grad()
                for j in range(micro - 1):
                    with m.no_sync():
                        x, y = data(rank, i, j)
                        loss_of(m(x), y, rank).backward()
                x, y = data(rank, i, micro - 1)
                loss_of(m(x), y, rank).backward()
                opts[kind].step()
            diffs.append(max_diff({n: b.double() for n, b in models["ddp"].module.named_buffers()},
                                  {n: b.double() for n, b in models["fr"].module.named_buffers()}))
        out[label] = {"buffers": diffs,
                      "params": max_diff(params(models["ddp"].module), params(models["fr"].module)),
                      "ddp_ranks_differ": same_on_all_ranks(list(models["ddp"].module.buffers())[:2]),
                      "fr_ranks_differ": same_on_all_ranks(list(models["fr"].module.buffers())[:2])}
    return out


def check_two_forwards_saved_buffer(rank, world):
    """Two forwards, then one backward of their summed loss, with a buffer that autograd saved
    in the first forward: the buffer broadcast before the second forward must not bump its
    version counter (DDP's does not); the gradients equal DDP's."""
    models = {"ddp": DDP(build(ScaledNet)), "fr": fused(build(ScaledNet))}
    opts = {k: sgd(m) for k, m in models.items()}
    out = {}
    for kind, m in models.items():
        def two_forwards(m=m, kind=kind):
            for i in range(2):
                opts[kind].zero_grad()
                x1, y1 = data(rank, i, 0)
                x2, y2 = data(rank, i, 1)
                first = loss_of(m(x1), y1, rank)
                (first + loss_of(m(x2), y2, rank)).backward()
                opts[kind].step()
        out[kind] = outcome(two_forwards)[:3]
    out["params"] = max_diff(params(models["ddp"].module), params(models["fr"].module))
    return out


def check_buffers_at_construction(rank, world):
    """A buffer that differs by rank before wrapping: what each rank holds right after the
    wrapper's construction, under DDP and FusedReducer, for broadcast_buffers True and False."""
    out = {}
    for flag in (True, False):
        for kind in ("ddp", "fr"):
            module = build(StatNet)
            module.stat.fill_(rank + 1.0)
            with warnings.catch_warnings():  # torch 2.14 deprecates broadcast_buffers in DDP
                warnings.simplefilter("ignore")
                DDP(module, broadcast_buffers=flag) if kind == "ddp" else \
                    fused_with_its_defaults(module, broadcast_buffers=flag)
            out[f"{flag}/{kind}"] = module.stat[0].item()
    return out


CHECKS = SelectedChecks()
outcomes = CHECKS.fixture(timeout=240)  # the selected tests' checks, in one spawn


@CHECKS.uses(check_buffer_rules)
def test_buffer_broadcast_rules_match_ddp(outcomes):
    for rank, r in enumerate(results(outcomes, check_buffer_rules)):
        for label, s in r.items():
            assert_small(s["buffers"], f"{label}: running stats vs DDP's on rank {rank}", 1e-5)
            assert_small([s["params"]], f"{label}: params vs DDP", 1e-5)
            if rank == 1:
                assert s["ddp_ranks_differ"] > 0, f"{label}: DDP side changed"
                assert s["fr_ranks_differ"] > 0, f"{label}: running stats were broadcast"


@CHECKS.uses(check_two_forwards_saved_buffer)
def test_two_forwards_then_backward_with_a_buffer_saved_for_backward(outcomes):
    for r in results(outcomes, check_two_forwards_saved_buffer):
        assert r["ddp"] == ("ok", None), f"DDP side: {r['ddp']}"
        assert r["fr"] == ("ok", None), r["fr"]
        assert_small([r["params"]], "params vs DDP", 1e-5)


@CHECKS.uses(check_buffers_at_construction)
def test_buffers_are_broadcast_at_construction_like_ddp(outcomes):
    for r in results(outcomes, check_buffers_at_construction):
        assert r["True/ddp"] == 1.0, "DDP side changed"
        assert r["True/fr"] == r["True/ddp"], "rank 0's buffer was not broadcast at construction"


@CHECKS.uses(check_buffers_at_construction)
def test_broadcast_buffers_false_keeps_rank_local_buffers_at_construction_like_ddp(outcomes):
    for rank, r in enumerate(results(outcomes, check_buffers_at_construction)):
        assert r["False/ddp"] == rank + 1.0, "DDP side changed"
        assert r["False/fr"] == r["False/ddp"], f"rank {rank}: {r}"
