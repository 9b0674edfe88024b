"""no_sync(): what a window of accumulation keeps and gives back.

Each test checks a behaviour against an independent reference (DDP on the same model and data,
a float64 average of locally computed gradients, the profiler's record of the collectives, or the
test's own count). The checks of the selected tests run in ONE spawn of 2 gloo ranks
(SelectedChecks, the module fixture).
"""
from datetime import timedelta

from torch.nn.parallel import DistributedDataParallel as DDP

from behaviour_common import fused, wrap
from dist_utils import SelectedChecks, assert_small, per_rank, results
from ddp_comparison import (ExtraNet, Net, build, data, grads, loss_of, max_diff, params,
                                same_on_all_ranks, sgd, side_group)


def check_no_sync_usage(rank, world):
    """`extra` is used only in the no_sync micro-step: its accumulated gradient is averaged at
    the synchronised step (DDP's local_used_map persists across no_sync)."""
    models = {"ddp": DDP(build(ExtraNet), find_unused_parameters=True),
              "fr": fused(build(ExtraNet), find_unused_parameters=True)}
    opts = {k: sgd(m) for k, m in models.items()}
    out = {"grads": [], "extra_synced": [], "params": []}
    for i in range(3):
        for kind, m in models.items():
            opts[kind].zero_grad()
            with m.no_sync():
                x, y = data(rank, i, 0)
                loss_of(m(x, use_extra=True), y, rank).backward()
            x, y = data(rank, i, 1)
            loss_of(m(x, use_extra=False), y, rank).backward()
        out["grads"].append(max_diff(grads(models["ddp"].module), grads(models["fr"].module)))
        out["extra_synced"].append(same_on_all_ranks([models["fr"].module.extra.weight.grad]))
        for opt in opts.values():
            opt.step()
        out["params"].append(max_diff(params(models["ddp"].module), params(models["fr"].module)))
    return out


def check_no_sync_exception(rank, world):
    """An exception inside `with model.no_sync():` must not leave synchronisation off."""
    models = {"ddp": DDP(build(Net)), "fr": fused(build(Net), process_group=side_group(20),
                                                    timeout=timedelta(seconds=20))}
    for m in models.values():
        try:
            with m.no_sync():
                x, y = data(rank, 0)
                loss_of(m(x), y, rank).backward()
                raise KeyError("user error inside no_sync")
        except KeyError:
            pass
    opts = {k: sgd(m) for k, m in models.items()}
    for kind, m in models.items():
        opts[kind].zero_grad()
        x, y = data(rank, 1)
        loss_of(m(x), y, rank).backward()
    return {"grads": max_diff(grads(models["ddp"].module), grads(models["fr"].module)),
            "fr_synced": same_on_all_ranks([p.grad for p in models["fr"].module.parameters()])}


def check_limit_changed_between_no_sync_and_sync(rank, world):
    """Per step: a no_sync micro-step, then new limits (by hand), then the synchronised
    micro-step (the rebuild happens at its forward); DDP runs the same micro-steps."""
    runs = {}
    limits = [(256, 512), (1 << 20, 1 << 20), (512, 256)]
    for kind in ("ddp", "fr"):
        m = wrap(kind, build(Net), gradient_as_bucket_view=True)
        opt = sgd(m)
        layouts, history = [], []
        for i, (first, cap) in enumerate(limits):
            opt.zero_grad(set_to_none=False)  # from step 1 on the gradients are bucket views
            with m.no_sync():
                x, y = data(rank, i, 0)
                loss_of(m(x), y, rank).backward()
            if kind == "fr":
                m.first_bucket_bytes, m.bucket_cap_bytes = first, cap
            x, y = data(rank, i, 1)
            loss_of(m(x), y, rank).backward()
            if kind == "fr":
                layouts.append(m.bucket_sizes())
            history.append(grads(m))
            opt.step()
        runs[kind] = {"grads": history, "layouts": layouts, "params": params(m)}
    return {"grads": [max_diff(a, b) for a, b in zip(runs["ddp"]["grads"], runs["fr"]["grads"])],
            "params": max_diff(runs["ddp"]["params"], runs["fr"]["params"]),
            "layouts": runs["fr"]["layouts"]}


def check_autotune_between_no_sync_and_sync(rank, world):
    """The same with the tuner changing the limits: it acts at synchronised forwards only, so
    each of its rebuilds comes right after a no_sync micro-step here."""
    out = {}
    for kind in ("ddp", "fr"):
        m = wrap(kind, build(Net), gradient_as_bucket_view=True)
        if kind == "fr":
            m.autotune(candidates=[(256, 512, 0), (512, 256, 0), (1 << 20, 1 << 20, 0)],
                       round_steps=(1,), min_steps=1)
        opt = sgd(m)
        history, rebuilds = [], []
        for i in range(10):
            opt.zero_grad(set_to_none=False)
            with m.no_sync():
                x, y = data(rank, i, 0)
                loss_of(m(x), y, rank).backward()
            x, y = data(rank, i, 1)
            loss_of(m(x), y, rank).backward()
            history.append(grads(m))
            if kind == "fr":
                rebuilds.append(m.stats()["rebuilds"])
            opt.step()
        out[kind] = {"grads": history, "rebuilds": rebuilds, "params": params(m),
                     "done": kind == "ddp" or m.autotune_report()["done"]}
    return {"grads": [max_diff(a, b) for a, b in zip(out["ddp"]["grads"], out["fr"]["grads"])],
            "params": max_diff(out["ddp"]["params"], out["fr"]["params"]),
            "rebuilds": out["fr"]["rebuilds"], "done": out["fr"]["done"]}


CHECKS = SelectedChecks()
outcomes = CHECKS.fixture(timeout=240)  # the selected tests' checks, in one spawn


@CHECKS.uses(check_no_sync_usage)
def test_usage_inside_no_sync_counts_for_find_unused_parameters(outcomes):
    for r in results(outcomes, check_no_sync_usage):
        assert all(d == 0.0 for d in r["extra_synced"]), \
            f"'extra' gradient not averaged: differs across ranks by {r['extra_synced']}"
        assert_small(r["grads"], "grads vs DDP", 1e-5)
        assert_small(r["params"], "params vs DDP", 1e-5)


@CHECKS.uses(check_no_sync_exception)
def test_exception_inside_no_sync_leaves_sync_on(outcomes):
    for r in results(outcomes, check_no_sync_exception):
        assert r["fr_synced"] <= 1e-7, "the step after the exception was not averaged"
        assert_small([r["grads"]], "grads vs DDP", 1e-5)


@CHECKS.uses(check_limit_changed_between_no_sync_and_sync)
def test_bucket_view_limit_change_inside_no_sync_window_keeps_the_accumulated_gradient(outcomes):
    """Slip: the rebuild gives bucket views fresh (zeroed) buckets without copying the
    gradients accumulated under no_sync into them (ext/reducer.cpp build_buckets)."""
    for rank, r in enumerate(per_rank(outcomes, "check_limit_changed_between_no_sync_and_sync")):
        sizes = [tuple(s) for s in r["layouts"]]
        assert len(set(sizes)) == len(sizes), f"the layout did not change every step: {sizes}"
        for i, d in enumerate(r["grads"]):
            assert isinstance(d, float) and d <= 1e-6, f"rank {rank} step {i}: grads vs DDP {d}"
        assert isinstance(r["params"], float) and r["params"] <= 1e-6, r["params"]


@CHECKS.uses(check_autotune_between_no_sync_and_sync)
def test_bucket_view_autotune_rebuild_after_no_sync_window_keeps_the_accumulated_gradient(
        outcomes):
    """Slip: as above, reached through the tuner's limits."""
    for rank, r in enumerate(per_rank(outcomes, "check_autotune_between_no_sync_and_sync")):
        changes = sum(b > a for a, b in zip(r["rebuilds"], r["rebuilds"][1:]))
        assert changes >= 2, f"the tuner rebuilt too rarely to test anything: {r['rebuilds']}"
        for i, d in enumerate(r["grads"]):
            assert isinstance(d, float) and d <= 1e-6, f"rank {rank} step {i}: grads vs DDP {d}"
        assert isinstance(r["params"], float) and r["params"] <= 1e-6, r["params"]
