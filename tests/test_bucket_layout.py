"""The bucket layout follows DDP's rules, checked against an independent
re-statement of the rule and against gradient-ready orders observed with plain PyTorch hooks
(Tensor.register_post_accumulate_grad_hook), not against FusedReducer's own bookkeeping:

* before the first rebuild, parameters are bucketed in reverse registration order;
* after the first step, in the observed ready order of rank 0, on every rank, even when the
  ranks' ready orders differ; the limits in force are rank 0's;
* a bucket is launched while backward is still running (reduction overlaps backward).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from dist_utils import ALLREDUCE_EVENTS, observe_ready_order, per_rank, run_checks
from test_bucket_assignment import reference_assign


class TwoBranches(nn.Module):
    """out = head(a(x) + b(x)), with a and b computed in a rank-dependent order, so the
    autograd engine delivers their gradients in a different order on each rank."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8, bias=False)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        if dist.get_rank() % 2 == 0:
            ya, yb = self.a(x), self.b(x)
        else:
            yb, ya = self.b(x), self.a(x)
        return self.head(torch.tanh(self.mid(torch.tanh(ya + yb))))


def expected_layout(model, order, first, cap):
    """Names per bucket by the independent statement of the rule (test_bucket_assignment), one
    group per (dtype, device) as the reducer buckets them."""
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    keys = {}
    groups = [keys.setdefault((p.dtype, p.device), len(keys)) for p in params]
    sizes = [p.numel() * p.element_size() for p in params]
    return [[names[i] for i in b] for b in reference_assign(sizes, groups, order, first, cap)]


def check_layout(rank, world_size):
    import fused_reducer
    torch.manual_seed(0)
    first, cap = 200, 300  # bytes: a few parameters per bucket
    model = fused_reducer.FusedReducer(TwoBranches(), first_bucket_mb=first / 2**20,
                                       bucket_cap_mb=cap / 2**20)
    module = model.module
    n = len(list(module.parameters()))
    report = {"initial": model.bucket_parameter_names(),
              "initial_expected": expected_layout(module, list(range(n - 1, -1, -1)), first, cap)}
    order, handles = observe_ready_order(module)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    report["ready_order"] = list(order)
    orders = [None] * world_size
    dist.all_gather_object(orders, report["ready_order"])
    report["rank0_order"] = orders[0]
    model(x).sum().backward()  # this forward rebuilt the layout
    report["rebuilt"] = model.bucket_parameter_names()
    report["rebuilt_expected"] = expected_layout(module, orders[0], first, cap)

    # Different limits on different ranks: rank 0's win at the rebuild.
    model.first_bucket_bytes = 100 + 50 * rank
    model.bucket_cap_bytes = 150 + 50 * rank
    model(x).sum().backward()
    report["limits_after"] = (model.first_bucket_bytes, model.bucket_cap_bytes,
                              model.stats()["first_bucket_bytes"], model.stats()["bucket_cap_bytes"])
    report["after_limits"] = model.bucket_parameter_names()
    report["after_limits_expected"] = expected_layout(module, orders[0], 100, 150)
    for h in handles:
        h.remove()
    return report


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])

    def forward(self, x):
        return self.layers(x)


def check_overlap(rank, world_size):
    """With one parameter per bucket, the first all-reduce must start before the last backward
    op starts: buckets are launched as soon as they are complete."""
    import fused_reducer
    torch.manual_seed(0)
    model = fused_reducer.FusedReducer(Deep(), first_bucket_mb=1e-6, bucket_cap_mb=1e-6)
    x = torch.randn(16, 64)
    model(x).sum().backward()
    model(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    events = prof.events()
    allreduce = sorted(e.time_range.start for e in events if e.name in ALLREDUCE_EVENTS)
    backward = sorted(e.time_range.start for e in events
                      if e.name.startswith("autograd::engine::evaluate_function: AddmmBackward"))
    return {"allreduces": len(allreduce), "first_allreduce": allreduce[0],
            "backward_ops": len(backward), "last_backward_start": backward[-1],
            "params": len(list(model.parameters()))}


CHECKS = [check_layout, check_overlap]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(CHECKS, 2, timeout=180)


def test_initial_layout_is_reverse_registration_order(outcomes):
    for r in per_rank(outcomes, "check_layout"):
        assert r["initial"] == r["initial_expected"]
        assert r["initial"][0][0] == "head.bias"  # the last parameters launch first


def test_ranks_really_observe_different_ready_orders(outcomes):
    orders = [r["ready_order"] for r in per_rank(outcomes, "check_layout")]
    assert orders[0] != orders[1]  # precondition of the next test


def test_rebuilt_layout_follows_rank0_ready_order_on_every_rank(outcomes):
    reports = per_rank(outcomes, "check_layout")
    for r in reports:
        assert r["rebuilt"] == r["rebuilt_expected"]
    assert reports[0]["rebuilt"] == reports[1]["rebuilt"]


def test_limits_that_differ_by_rank_resolve_to_rank0_values_at_rebuild(outcomes):
    reports = per_rank(outcomes, "check_layout")
    for r in reports:
        assert r["after_limits"] == r["after_limits_expected"]
        assert r["limits_after"] == (100, 150, 100, 150)


def test_buckets_launch_while_backward_is_still_running(outcomes):
    for r in per_rank(outcomes, "check_overlap"):
        assert r["allreduces"] == r["params"]
        assert r["backward_ops"] == 6
        assert r["first_allreduce"] < r["last_backward_start"]
