"""find_unused_parameters: unused parameters, here or on other ranks.

Each test checks a behaviour against an independent reference (DDP on the same model and data,
a float64 average of locally computed gradients, the profiler's record of the collectives, or the
test's own count). The checks of the selected tests run in ONE spawn of 2 gloo ranks
(SelectedChecks, the module fixture).
"""
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from behaviour_common import collectives, fused, fused_with_its_defaults
from dist_utils import SelectedChecks, assert_small, per_rank, results
from ddp_comparison import (ExtraNet, HIDDEN, build, data, grads, loss_of, max_diff, params,
                                sgd, step)


class _NoGradFor(torch.autograd.Function):
    """y = x + 0 * w.sum(): backward gives x its gradient and w an undefined one, so w's
    gradient hook fires with nothing in it (w is used by no rank)."""

    @staticmethod
    def forward(ctx, x, w):
        return x + 0 * w.sum()

    @staticmethod
    def backward(ctx, g):
        return g, None


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the buckets launched before it have completed by the time
    the gradients after it become ready."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.3)
        return g


class GateNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.gate = nn.Parameter(torch.ones(HIDDEN))
        self.out = nn.Linear(HIDDEN, 4)

    def forward(self, x):
        h = _SlowBackward.apply(torch.tanh(self.inp(x)))
        h = _NoGradFor.apply(torch.tanh(self.mid(h)), self.gate)
        return self.out(h)


def check_unused_grad_none_early_bucket(rank, world):
    """find_unused_parameters: `gate`'s hook fires with an undefined gradient on every rank, so
    no rank used it and DDP leaves gate.grad None. Its bucket completes early in backward (one
    parameter per bucket, a slow op after it): unpacking it before the used map is known would
    give gate a zero gradient."""
    kwargs = dict(find_unused_parameters=True, bucket_cap_mb=1e-6)
    models = {"ddp": DDP(build(GateNet), **kwargs),
              "fr": fused(build(GateNet), first_bucket_mb=1e-6, **kwargs)}
    opts = {k: sgd(m) for k, m in models.items()}
    out = {"gate_grad": {"ddp": [], "fr": []}, "grads": [], "params": []}
    for i in range(3):
        for kind, m in models.items():
            opts[kind].zero_grad(set_to_none=True)
            x, y = data(rank, i)
            loss_of(m(x), y, rank).backward()
            g = m.module.gate.grad
            out["gate_grad"][kind].append(None if g is None else float(g.abs().sum()))
        out["grads"].append(max_diff(grads(models["ddp"].module), grads(models["fr"].module)))
        for opt in opts.values():
            opt.step()
        out["params"].append(max_diff(params(models["ddp"].module), params(models["fr"].module)))
    return out


def check_unused_here_used_there_bf16(rank, world):
    """`extra` is used on rank 0 only; buckets in bfloat16. Each rank's param.grad (dtype and
    value) against the float64 average of the ranks' local gradients (plain all_reduce)."""
    from fused_reducer import FusedReducer
    model = FusedReducer(build(ExtraNet), find_unused_parameters=True,
                         reduce_dtype=torch.bfloat16)
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    out = []
    for i in range(3):  # the first steps and after the automatic rebuild
        use_extra = rank == 0
        model.zero_grad(set_to_none=True)
        x, y = data(rank, i)
        loss_of(model(x, use_extra=use_extra), y, rank).backward()
        # reference: the same parameters, this rank's batch, local backward, float64 average
        ref = ExtraNet()
        ref.load_state_dict(state)
        loss_of(ref(x, use_extra=use_extra), y, rank).backward()
        step = {}
        for name, p in ref.named_parameters():
            g = torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double()
            dist.all_reduce(g)
            average = g / world
            got = dict(model.module.named_parameters())[name].grad
            step[name] = {
                "dtype": None if got is None else str(got.dtype),
                "param_dtype": str(p.dtype),
                # bfloat16 buckets: relative to the largest value, within bf16's rounding
                "rel_err": None if got is None else ((got.double() - average).abs().max()
                                                     / average.abs().max().clamp_min(1e-30)).item(),
                "nonzero": bool((g != 0).any()),
            }
        out.append(step)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.05 * p.grad)
        state = {k: v.clone() for k, v in model.module.state_dict().items()}
    return out


def check_find_unused_collectives(rank, world):
    """find_unused_parameters=True ('extra' never used): the collectives of a step (profiler:
    count, bytes and dtype of each) are DDP's: the buckets plus one small int32 map."""
    out = {}
    for kind in ("ddp", "fr", "fr_all_used"):
        if kind == "ddp":
            m = DDP(build(ExtraNet), find_unused_parameters=True)
        else:
            m = fused_with_its_defaults(build(ExtraNet), find_unused_parameters=kind == "fr")
        fwd = {"use_extra": kind == "fr_all_used"}
        opt = sgd(m)
        for i in range(2):
            step(m, opt, rank, i, **fwd)
        count, moved = collectives(lambda: step(m, opt, rank, 2, **fwd))
        out[kind] = {"count": count, "moved": moved,
                     "buckets": None if kind == "ddp" else len(m.bucket_sizes()),
                     "params": len(list(m.parameters()))}
    return out


CHECKS = SelectedChecks()
outcomes = CHECKS.fixture(timeout=240)  # the selected tests' checks, in one spawn


@CHECKS.uses(check_unused_grad_none_early_bucket)
def test_globally_unused_parameter_keeps_grad_none_when_its_bucket_finishes_early(outcomes):
    for r in results(outcomes, check_unused_grad_none_early_bucket):
        assert r["gate_grad"]["ddp"] == [None] * 3, "DDP side changed"
        assert r["gate_grad"]["fr"] == [None] * 3, r["gate_grad"]
        assert_small(r["grads"], "grads vs DDP", 1e-5)
        assert_small(r["params"], "params vs DDP", 1e-5)


@CHECKS.uses(check_unused_here_used_there_bf16)
def test_unused_here_used_elsewhere_gets_the_average_in_the_parameters_own_dtype(outcomes):
    """Slip: the gradient created for a locally unused parameter copied from its bucket in the
    bucket's dtype (bfloat16) instead of the parameter's (ext/reducer.cpp unpack_bucket)."""
    for rank, steps in enumerate(per_rank(outcomes, "check_unused_here_used_there_bf16")):
        for i, step in enumerate(steps):
            assert step["extra.weight"]["nonzero"], "reference: rank 0 uses `extra`"
            for name, r in step.items():
                assert r["dtype"] == r["param_dtype"] == "torch.float32", \
                    f"rank {rank} step {i} {name}: grad dtype {r['dtype']}"
                assert r["rel_err"] <= 2 ** -7, \
                    f"rank {rank} step {i} {name}: {r['rel_err']:.3g} from the float64 average"


@CHECKS.uses(check_find_unused_collectives)
def test_find_unused_parameters_runs_ddps_collectives(outcomes):
    for r in results(outcomes, check_find_unused_collectives):
        ddp, fr, plain = r["ddp"], r["fr"], r["fr_all_used"]
        assert plain["count"] == plain["buckets"], plain
        assert fr["count"] == fr["buckets"] + 1, fr  # one extra all-reduce per step
        assert fr["count"] == ddp["count"], (fr, ddp)
        assert fr["moved"] == ddp["moved"], (fr["moved"], ddp["moved"])
        assert (4 * fr["params"], "int") in fr["moved"], fr["moved"]  # small: one int32/param
