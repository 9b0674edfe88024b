"""Several forwards before their backwards outside no_sync(): the orders pipeline
schedules produce (GPipe F1 F2 F3 F4 B1 B2 B3 B4, 1F1B F1 F2 B1 F3 B2 F4 B3 B4, a reversed F1 F2 B2
B1), run by hand on 2 gloo ranks without the pipelining package, are reduced exactly: after the
step every param.grad is the average over the ranks of the sum of its microbatch gradients, as a
float64 single-process model computes it on the global batch (Note [Several forwards before
their backwards] in core/wrapper.py). DDP in the same orders is wrong by ~0.04 (measured here
too, as a control that the orders matter). Each backward is then a reduction of its own; with
the protocol torch's PipelineStage drives DDP with (forwards and all but the last backward inside
no_sync(), prepare_for_backward() before the last) a step reduces each bucket once; a forward whose output is dropped changes nothing; with a
ShardedOptimizer the second backward is refused naming no_sync and the pipelining stage.
"""
import contextlib

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_reducer
from fused_reducer import FusedReducer
from dist_utils import SelectedChecks, per_rank

WORLD = 2
MICRO = 4      # microbatches per rank and step
ROWS = 3       # rows per microbatch
STEPS = 3
LR = 0.1
TOL = 2e-6

ORDERS = {
    # (kind, microbatch) in execution order
    "gpipe": [("F", k) for k in range(MICRO)] + [("B", k) for k in range(MICRO)],
    "1f1b": [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
    "reversed": [("F", k) for k in range(MICRO)] + [("B", k) for k in reversed(range(MICRO))],
}

checks = SelectedChecks()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 5)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return MLP().to(dtype)


def _micro(rank, step, k, dtype=torch.float32):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + k)
    return torch.randn(ROWS, 6, generator=g).to(dtype)


def _loss(out):
    """Per microbatch: its mean scaled by 1/MICRO, so a rank's sum is its batch mean and the
    ranks' average is the global batch mean (what the reference computes)."""
    return out.pow(2).mean() / MICRO


def _reference(steps, micro=range(MICRO)):
    """float64, one process, the global batch of every step (the microbatches `micro` of every
    rank): the gradients before each SGD step and the parameters after the last."""
    model = _model(torch.float64)
    grads = []
    for step in range(steps):
        x = torch.cat([_micro(r, step, k, torch.float64) for r in range(WORLD) for k in micro])
        model.zero_grad()
        (model(x).pow(2).mean() * len(micro) / MICRO).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return grads, [p.detach().clone() for p in model.parameters()]


def _max_diff(ours, reference):
    return max(float((a.detach().double() - b).abs().max()) for a, b in zip(ours, reference))


def _train_in_order(model, rank, order, steps, stage_protocol=False):
    """Per step: the forwards and backwards of the microbatches in `order`, then SGD. Returns the
    max difference from the float64 reference per step (gradients) and at the end (parameters),
    and the reductions (FusedReducer steps) and collectives of each training step.
    stage_protocol: what torch's PipelineStage does with DDP (and fused_reducer.pipelining's
    with FusedReducer): every forward and all but the last backward inside no_sync(),
    prepare_for_backward() before the last backward."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_grads, ref_params = _reference(steps, sorted({k for _, k in order}))
    last_backward = [k for kind, k in order if kind == "B"][-1]
    grad_diffs, reductions, allreduces = [], [], []
    fused = isinstance(model, FusedReducer)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        before = model.stats()["step"] if fused else 0
        losses = {}
        for kind, k in order:
            quiet = stage_protocol and (kind == "F" or k != last_backward)
            with model.no_sync() if quiet else contextlib.nullcontext():
                if kind == "F":
                    losses[k] = _loss(model(_micro(rank, step, k)))
                else:
                    if stage_protocol and not quiet:
                        model.prepare_for_backward()
                    losses.pop(k).backward()
        if fused:
            reductions.append(model.stats()["step"] - before)
            allreduces.append(model.stats()["allreduces"])
        grad_diffs.append(_max_diff([p.grad for p in model.parameters()], ref_grads[step]))
        opt.step()
    return {"grads": grad_diffs, "params": _max_diff(list(model.parameters()), ref_params),
            "reductions": reductions, "allreduces": allreduces}


# -- checks ------------------------------------------------------------------------------------

def check_orders_are_exact(rank, world):
    out = {}
    for name, order in ORDERS.items():
        for backend in ("shm", "process_group"):
            out[(name, backend)] = _train_in_order(FusedReducer(_model(), backend=backend), rank,
                                                   order, STEPS)
        out[(name, "ddp")] = _train_in_order(DDP(_model()), rank, order, STEPS)
    # Two microbatches, the smallest case of several forwards before their backwards (F1 F2 B1 B2).
    two = [("F", 2), ("F", 3), ("B", 2), ("B", 3)]
    out[("two", "shm")] = _train_in_order(FusedReducer(_model()), rank, two, 1)
    return out


def check_stage_protocol_reduces_once_per_bucket(rank, world):
    out = {}
    for name in sorted(ORDERS):
        model = FusedReducer(_model(), bucket_cap_mb=0.0005, first_bucket_mb=0.0005)
        out[name] = _train_in_order(model, rank, ORDERS[name], STEPS, stage_protocol=True)
        out[name]["buckets"] = len(model.bucket_sizes())
    return out


def check_dropped_forward_changes_nothing(rank, world):
    """A forward whose output is never backpropagated (a metric with grad enabled) before the
    real one: one reduction, exact."""
    model = FusedReducer(_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_grads, _ = _reference(1)
    model(_micro(rank, 99, 0))  # dropped
    losses = [_loss(model(_micro(rank, 0, k))) for k in range(MICRO)]
    steps_before = model.stats()["step"]
    sum(losses).backward()  # one backward through all four forwards
    diff = _max_diff([p.grad for p in model.parameters()], ref_grads[0])
    opt.step()
    return {"grads": diff, "steps": model.stats()["step"] - steps_before}


def check_sharded_optimizer_refuses_a_second_backward(rank, world):
    model = FusedReducer(_model())
    opt = fused_reducer.ShardedOptimizer(model, torch.optim.SGD, lr=LR)
    opt.zero_grad()
    l1 = _loss(model(_micro(rank, 0, 0)))
    l2 = _loss(model(_micro(rank, 0, 1)))
    l1.backward()
    try:
        l2.backward()
    except Exception as e:  # noqa: BLE001 - what the user sees
        return f"{type(e).__name__}: {e}"
    return "no error"


# -- tests ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def outcomes(request):
    return checks.run(request, world_size=WORLD, timeout=240)


@pytest.mark.parametrize("order", sorted(ORDERS))
@checks.uses(check_orders_are_exact)
def test_several_forwards_before_backwards_match_the_float64_global_batch(outcomes, order):
    for r in per_rank(outcomes, "check_orders_are_exact"):
        for backend in ("shm", "process_group"):
            res = r[(order, backend)]
            assert max(res["grads"]) < TOL, (order, backend, res)
            assert res["params"] < TOL, (order, backend, res)
            # One reduction per backward: a step of its own each.
            assert res["reductions"] == [MICRO] * STEPS, res
        # The control: DDP in the same order is silently wrong.
        assert r[(order, "ddp")]["params"] > 1e-3, r[(order, "ddp")]
        assert r[("two", "shm")]["grads"][0] < TOL, r[("two", "shm")]


@checks.uses(check_stage_protocol_reduces_once_per_bucket)
def test_stage_protocol_reduces_each_bucket_once_per_step(outcomes):
    """Forwards and all but the last backward in no_sync(), prepare_for_backward() before the
    last: one reduction of each bucket per training step, exact, in every order."""
    for r in per_rank(outcomes, "check_stage_protocol_reduces_once_per_bucket"):
        for name, res in r.items():
            assert res["buckets"] > 1, res
            assert max(res["grads"]) < TOL and res["params"] < TOL, (name, res)
            assert res["reductions"] == [1] * STEPS, (name, res)
            assert res["allreduces"] == [res["buckets"]] * STEPS, (name, res)


@checks.uses(check_dropped_forward_changes_nothing)
def test_a_dropped_forward_before_the_step_changes_nothing(outcomes):
    for r in per_rank(outcomes, "check_dropped_forward_changes_nothing"):
        assert r["grads"] < TOL and r["steps"] == 1, r


@checks.uses(check_sharded_optimizer_refuses_a_second_backward)
def test_sharded_optimizer_refuses_a_second_backward_naming_no_sync(outcomes):
    for r in per_rank(outcomes, "check_sharded_optimizer_refuses_a_second_backward"):
        assert r.startswith("FusedReducerError"), r
        assert "no_sync()" in r and "fused_reducer.pipelining.PipelineStage" in r, r
