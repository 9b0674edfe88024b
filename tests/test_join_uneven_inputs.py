"""Uneven inputs: `with model.join(...)` as with DDP, built on
torch.distributed.algorithms.Join so it composes with ZeroRedundancyOptimizer.

Rank 0 gets 5 batches, rank 1 gets 3. The same loop runs under DDP.join and FusedReducer.join;
after the context both must hold the same parameters (and buffers) on every rank: with
divide_by_initial_world_size True and False, find_unused_parameters, BatchNorm buffers, and
Join([model, ZeroRedundancyOptimizer]). throw_on_early_termination=True raises on every rank.

A broken join leaves the rank with more batches waiting for collectives its peer never starts:
every scenario runs on a side group with a short timeout (ddp_comparison.risky_kwargs), so
that is an error, not a hang.
"""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable
from torch.distributed.optim import ZeroRedundancyOptimizer

from dist_utils import per_rank, run_checks
from ddp_comparison import (
    BNNet, ExtraNet, LR, Net, WRAP, assert_close, build, buffers, data, loss_of, max_diff,
    outcome, params, risky_kwargs, same_on_all_ranks, sgd)

KINDS = ("ddp", "fr")
BATCHES = {0: 5, 1: 3}


def uneven_run(rank, kind, cls=Net, join_kwargs=None, zero=False, fwd=None, **wrap_kwargs):
    """Train rank-dependent numbers of batches inside join; the final state, or the outcome."""
    kw = risky_kwargs()
    m = WRAP[kind](build(cls), **kw, **wrap_kwargs)
    if zero:
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.SGD,
                                      process_group=kw["process_group"], lr=LR, momentum=0.9)
        context = Join([m, opt], **(join_kwargs or {}))
    else:
        opt = sgd(m)
        context = m.join(**(join_kwargs or {}))
    steps = 0

    def loop():
        nonlocal steps
        with context:
            for i in range(BATCHES[rank]):
                opt.zero_grad()
                x, y = data(rank, i)
                extra = fwd(i) if fwd else {}
                loss_of(m(x, **extra), y, rank).backward()
                opt.step()
                steps += 1
    res = outcome(loop)
    if res[0] == "raised":
        return {"outcome": res, "steps": steps}
    return {"outcome": ("ok",), "steps": steps, "params": params(m), "buffers": buffers(m),
            "synced": same_on_all_ranks(list(m.parameters()))}


def compare(rank, **kwargs):
    runs = {}
    for kind in KINDS:
        runs[kind] = uneven_run(rank, kind, **kwargs)
        dist.barrier()
    out = {kind: {k: v for k, v in r.items() if k not in ("params", "buffers")}
           for kind, r in runs.items()}
    if all("params" in r for r in runs.values()):
        out["params"] = max_diff(runs["ddp"]["params"], runs["fr"]["params"])
        out["buffers"] = max_diff(runs["ddp"]["buffers"], runs["fr"]["buffers"])
    return out


def check_is_joinable(rank, world):
    m = WRAP["fr"](build(Net))
    return {"joinable": isinstance(m, Joinable),
            "has_join_hook": callable(getattr(m, "join_hook", None)),
            "join_process_group_is_its_group": getattr(m, "join_process_group", None)
            is m.process_group,
            "join_device": str(getattr(m, "join_device", None))}


def check_join_divide_by_initial_world_size(rank, world):
    return compare(rank, join_kwargs=dict(divide_by_initial_world_size=True))


def check_join_divide_by_current_world_size(rank, world):
    return compare(rank, join_kwargs=dict(divide_by_initial_world_size=False))


def check_join_with_find_unused_parameters(rank, world):
    # `extra` is used on even steps only: joined ranks must shadow the unused-parameter map too
    return compare(rank, cls=ExtraNet, find_unused_parameters=True,
                   fwd=lambda i: {"use_extra": i % 2 == 0})


def check_join_with_batchnorm_buffers(rank, world):
    return compare(rank, cls=BNNet)


def check_join_with_zero_redundancy_optimizer(rank, world):
    return compare(rank, zero=True)


def check_join_throw_on_early_termination(rank, world):
    return compare(rank, join_kwargs=dict(throw_on_early_termination=True))


def check_join_disabled_with_even_inputs(rank, world):
    """enable=False with the same number of batches everywhere: plain training, as DDP."""
    saved = dict(BATCHES)
    BATCHES[1] = BATCHES[0]
    try:
        return compare(rank, join_kwargs=dict(enable=False))
    finally:
        BATCHES.update(saved)


CHECKS = [check_is_joinable, check_join_divide_by_initial_world_size,
          check_join_divide_by_current_world_size, check_join_with_find_unused_parameters,
          check_join_with_batchnorm_buffers, check_join_with_zero_redundancy_optimizer,
          check_join_disabled_with_even_inputs, check_join_throw_on_early_termination]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(CHECKS, timeout=270)


def assert_equal_to_ddp(outcomes, check):
    for rank, r in enumerate(per_rank(outcomes, check)):
        assert r["ddp"]["outcome"] == ("ok",), f"DDP side: {r['ddp']}"
        assert r["fr"]["outcome"] == ("ok",), f"rank {rank}: {r['fr']['outcome']}"
        assert r["fr"]["steps"] == BATCHES[rank] or check.endswith("even_inputs")
        assert_close(r["params"], what=f"rank {rank}: params after join")
        assert_close(r["buffers"], what=f"rank {rank}: buffers after join")
        assert r["ddp"]["synced"] == 0.0, "DDP side changed"
        assert r["fr"]["synced"] == 0.0, "parameters differ across ranks after join"


# -- tests ---------------------------------------------------------------------------------------

def test_fused_reducer_is_a_joinable_with_hook_group_and_device(outcomes):
    for r in per_rank(outcomes, "check_is_joinable"):
        assert r["joinable"] and r["has_join_hook"], r
        assert r["join_process_group_is_its_group"], r
        assert r["join_device"] == "cpu", r


def test_join_uneven_inputs_dividing_by_initial_world_size_matches_ddp(outcomes):
    assert_equal_to_ddp(outcomes, "check_join_divide_by_initial_world_size")


def test_join_uneven_inputs_dividing_by_current_world_size_matches_ddp(outcomes):
    assert_equal_to_ddp(outcomes, "check_join_divide_by_current_world_size")


def test_join_uneven_inputs_with_find_unused_parameters_matches_ddp(outcomes):
    assert_equal_to_ddp(outcomes, "check_join_with_find_unused_parameters")


def test_join_uneven_inputs_with_batchnorm_buffers_matches_ddp(outcomes):
    assert_equal_to_ddp(outcomes, "check_join_with_batchnorm_buffers")


def test_join_composes_with_zero_redundancy_optimizer_like_ddp(outcomes):
    assert_equal_to_ddp(outcomes, "check_join_with_zero_redundancy_optimizer")


def test_join_disabled_with_even_inputs_trains_like_ddp(outcomes):
    assert_equal_to_ddp(outcomes, "check_join_disabled_with_even_inputs")


def test_join_throw_on_early_termination_raises_runtime_error_on_every_rank(outcomes):
    for rank, r in enumerate(per_rank(outcomes, "check_join_throw_on_early_termination")):
        assert r["ddp"]["outcome"][0] == "raised", "DDP side changed"
        res = r["fr"]["outcome"]
        assert res[0] == "raised", f"rank {rank} finished its {r['fr']['steps']} batches"
        assert res[3], f"rank {rank}: not a RuntimeError: {res[1]}: {res[2]}"
        assert r["fr"]["steps"] == r["ddp"]["steps"], \
            f"rank {rank} raised after {r['fr']['steps']} steps, DDP after {r['ddp']['steps']}"
