"""What rank 0 decides every rank applies, before any bucket moves: the rebuilt layout, the
reduce dtype in force, the autotuner's plan and choice.

Each test checks a behaviour against an independent reference (DDP on the same model and data,
a float64 average of locally computed gradients, the profiler's record of the collectives, or the
test's own count). The checks of the selected tests run in ONE spawn of 2 gloo ranks
(SelectedChecks, the module fixture).
"""
import time

import torch
import torch.distributed as dist

from behaviour_common import SwappedBranches, fused, reference_grads
from dist_utils import SelectedChecks, assert_small, observe_ready_order, results
from ddp_comparison import Net, build, data, grads, loss_of, max_diff, sgd


def check_autotune_agreement(rank, world):
    """autotune() with explicit candidates: the plan (trials, predictions) and every trial's step
    times are rank 0's / the slowest rank's, identical on every rank, and so is the choice."""
    model = fused(build(Net, d_in=8, hidden=64), first_bucket_mb=1e-3, bucket_cap_mb=1e-3)
    opt = sgd(model)
    candidates = [(4096, 4096, 0), (1 << 20, 1 << 20, 0), (1024, 8192, 1024)]
    steps = 0

    def one():
        nonlocal steps
        opt.zero_grad()
        x, y = data(rank, steps, d_in=8)
        if rank == 1:
            time.sleep(0.002 * (steps % 3))  # step times that differ by rank
        loss_of(model(x), y, rank).backward()
        opt.step()
        steps += 1
    for _ in range(2):
        one()
    model.autotune(candidates=candidates, round_steps=(2, 2))
    while not model.autotune_report()["done"]:
        one()
        assert steps < 80, "autotune did not finish"
    report = model.autotune_report()
    return {"trials": [(t["first_bucket_bytes"], t["bucket_cap_bytes"], t["last_bucket_bytes"],
                        t["predicted_ms"], t["samples_ms"]) for t in report["trials"]],
            "choice": report["choice"],
            "limits": (model.first_bucket_bytes, model.bucket_cap_bytes, model.last_bucket_bytes)}


def check_layout_agreement(rank, world):
    """The rebuilt layout is computed from rank 0's observed order and rank 0's limits on every
    rank: compared (gathered, before any bucket collective of the new layout runs) with an
    independent statement of the rule applied to rank 0's order as seen by plain PyTorch hooks.
    A backward runs only when the ranks agree, so a wrong layout fails here, not in gloo."""
    from test_bucket_assignment import reference_assign
    model = fused(build(SwappedBranches), first_bucket_mb=1e-6, bucket_cap_mb=1e-6)
    module = model.module
    names = [n for n, _ in module.named_parameters()]
    sizes = [p.numel() * p.element_size() for p in module.parameters()]
    order, handles = observe_ready_order(module)
    x, y = data(rank, 0)
    loss_of(model(x), y, rank).backward()
    for h in handles:
        h.remove()
    orders = [None] * world
    dist.all_gather_object(orders, list(order))
    out = {"orders_differ": orders[0] != orders[1], "phases": []}

    def phase(label, first, cap, limits):
        x, y = data(rank, len(out["phases"]) + 1)
        state = {k: v.clone() for k, v in module.state_dict().items()}
        output = model(x)  # the rebuild happens in this forward
        layout = model.bucket_parameter_names()
        layouts = [None] * world
        dist.all_gather_object(layouts, layout)
        expected = [[names[i] for i in b] for b in reference_assign(sizes, [0] * len(sizes),
                                                                     orders[0], first, cap)]
        record = {"label": label, "layout": layout, "expected": expected,
                  "same_on_all_ranks": all(lay == layouts[0] for lay in layouts),
                  "limits": limits()}
        out["phases"].append(record)
        if record["same_on_all_ranks"]:
            model.zero_grad(set_to_none=True)
            loss_of(output, y, rank).backward()
            record["vs_reference"] = max_diff(reference_grads(state, SwappedBranches, (x, y), rank),
                                              grads(module))
        return record["same_on_all_ranks"]

    def limits():
        s = model.stats()
        return (model.first_bucket_bytes, model.bucket_cap_bytes,
                s["first_bucket_bytes"], s["bucket_cap_bytes"])
    if not phase("rebuild after the first step", 1, 1, limits):
        return out
    # Different limits on different ranks: rank 0's (300, 300) win at the rebuild.
    model.first_bucket_bytes = 300 + 300 * rank
    model.bucket_cap_bytes = 300 + 300 * rank
    phase("limits set differently per rank", 300, 300, limits)
    return out


def check_reduce_dtype_agreement(rank, world):
    """Ranks that set different reduce dtypes all reduce rank 0's from the rebuilding forward on:
    gathered right after that forward, before any bucket of the new layout is all-reduced (a
    disagreement would otherwise surface as a gloo abort, not as a value)."""
    model = fused(build(Net))
    x, y = data(rank, 0)
    loss_of(model(x), y, rank).backward()
    model.reduce_dtype = torch.bfloat16 if rank == 0 else torch.float16
    x, y = data(rank, 1)
    output = model(x)  # the rebuild happens in this forward
    seen = (str(model.reduce_dtype), model.stats()["reduce_dtype"], model.bucket_sizes())
    everyone = [None] * world
    dist.all_gather_object(everyone, seen)
    out = {"seen": everyone}
    if all(s == everyone[0] for s in everyone):
        loss_of(output, y, rank).backward()
        out["stepped"] = True
    return out


CHECKS = SelectedChecks()
outcomes = CHECKS.fixture(timeout=240)  # the selected tests' checks, in one spawn


@CHECKS.uses(check_layout_agreement)
def test_rebuilt_layout_is_rank0s_on_every_rank_before_any_bucket_moves(outcomes):
    for r in results(outcomes, check_layout_agreement):
        assert r["orders_differ"], "precondition: the ranks' ready orders must differ"
        for phase in r["phases"]:
            assert phase["layout"] == phase["expected"], phase
            assert phase["same_on_all_ranks"], f"{phase['label']}: layouts differ across ranks"
            assert_small([phase["vs_reference"]], f"{phase['label']}: grads vs float64 average")
        assert len(r["phases"]) == 2, r
        assert r["phases"][1]["limits"] == (300, 300, 300, 300), r["phases"][1]


@CHECKS.uses(check_reduce_dtype_agreement)
def test_reduce_dtype_in_force_is_rank0s_on_every_rank_before_any_bucket_moves(outcomes):
    for r in results(outcomes, check_reduce_dtype_agreement):
        for rank, (prop, in_force, sizes) in enumerate(r["seen"]):
            assert (prop, in_force) == ("torch.bfloat16", "torch.bfloat16"), (rank, r["seen"])
            assert sizes == r["seen"][0][2], f"bucket sizes differ across ranks: {r['seen']}"
        assert r.get("stepped"), r


@CHECKS.uses(check_autotune_agreement)
def test_autotune_plan_and_choice_are_rank0s(outcomes):
    a, b = results(outcomes, check_autotune_agreement)
    assert len(a["trials"]) >= 2
    assert a["trials"] == b["trials"], "ranks measured different plans or step times"
    assert a["choice"] == b["choice"]
    assert a["limits"] == b["limits"] == (a["choice"]["first_bucket_bytes"],
                                          a["choice"]["bucket_cap_bytes"],
                                          a["choice"]["last_bucket_bytes"])
