"""All-reduces per step, counted independently of FusedReducer.stats() with torch.profiler: every
collective a c10d process group runs passes through the dispatcher op 'c10d::allreduce_' (checked
for a plain dist.all_reduce and for a DDP step below); FusedReducer's shared-memory transport
records 'shm:all_reduce' (dist_utils.ALLREDUCE_EVENTS).

Scenario: 8 x Linear(512, 512) (8.4 MB of fp32 gradients), 2 gloo ranks. DDP does
2 all-reduces per step after its rebuild (first bucket 1 MiB); FusedReducer must do the same by
default, and 1 per step once the first bucket is 16 MiB, however that value was set.
"""
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from dist_utils import ALLREDUCE_EVENTS, per_rank, run_checks

ALLREDUCE_EVENT = "c10d::allreduce_"
MiB = 1 << 20
SIXTEEN_MIB = 16 << 20
GRAD_BYTES = 8 * (512 * 512 + 512) * 4
STEPS = 4


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])


def count_allreduces(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name in ALLREDUCE_EVENTS)


def train(model, rank, steps, report):
    """Profile each step (forward + backward) and record the profiler count next to stats()."""
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(rank))

    def one_step():
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    for _ in range(steps):
        report.setdefault("profiled", []).append(count_allreduces(one_step))
        if hasattr(model, "stats"):
            stats = model.stats()
            report.setdefault("stats", []).append(stats["allreduces"])
            report.setdefault("bytes", []).append(stats["allreduce_bytes"])
            report.setdefault("health", []).append(stats["health_exchanges"])
            report.setdefault("health_bytes", []).append(stats["health_exchange_bytes"])
            report.setdefault("rebuilds", []).append(stats["rebuilds"])
            report.setdefault("sizes", []).append(model.bucket_sizes())
            report.setdefault("first", []).append((model.first_bucket_bytes,
                                                   stats["first_bucket_bytes"]))


def scenario_event_name(rank, world_size):
    events = {}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(torch.ones(8))
    events["plain"] = sorted({e.name for e in prof.events()})
    return events


def scenario_ddp_default(rank, world_size):
    report = {}
    train(nn.parallel.DistributedDataParallel(make_model()), rank, STEPS, report)
    return report


def scenario_fr_default(rank, world_size):
    import fused_reducer
    report = {}
    train(fused_reducer.FusedReducer(make_model()), rank, STEPS, report)
    return report


def scenario_fr_first_bucket_at_construction(rank, world_size):
    import fused_reducer
    report = {}
    train(fused_reducer.FusedReducer(make_model(), first_bucket_mb=16), rank, STEPS, report)
    return report


def scenario_fr_process_default(rank, world_size):
    import fused_reducer
    from fused_reducer import settings
    report = {}
    previous = settings._default_first_bucket_bytes
    fused_reducer.set_default_first_bucket_bytes(SIXTEEN_MIB)
    try:
        report["default"] = fused_reducer.get_default_first_bucket_bytes()
        model = fused_reducer.FusedReducer(make_model())
    finally:
        settings._default_first_bucket_bytes = previous
    train(model, rank, STEPS, report)
    model.rebuild_buckets()  # a forced rebuild after the default changed back keeps 16 MiB
    train(model, rank, 1, report)
    return report


def scenario_fr_env_var(rank, world_size):
    import fused_reducer
    report = {}
    os.environ["FUSED_REDUCER_FIRST_BUCKET_BYTES"] = str(SIXTEEN_MIB)
    try:
        report["default"] = fused_reducer.get_default_first_bucket_bytes()
        model = fused_reducer.FusedReducer(make_model())
    finally:
        del os.environ["FUSED_REDUCER_FIRST_BUCKET_BYTES"]
    train(model, rank, STEPS, report)
    return report


def scenario_fr_runtime(rank, world_size):
    import fused_reducer
    report = {}
    model = fused_reducer.FusedReducer(make_model())
    train(model, rank, 3, report)  # default layout, automatic rebuild after step 0
    model.first_bucket_bytes = SIXTEEN_MIB
    train(model, rank, 2, report)
    for _ in range(2):
        model.rebuild_buckets()
        train(model, rank, 2, report)
    return report


def scenario_fr_health_exchanges(rank, world_size):
    """One bucket; the straggler exchange every 10 steps by default, none with
    straggler_interval=0, every step with check_finite."""
    import fused_reducer
    reports = {}
    for name, steps, settings in (("default", 21, {}), ("off", 11, {"straggler_interval": 0}),
                                  ("check_finite", 3, {"check_finite": True})):
        reports[name] = {}
        model = fused_reducer.FusedReducer(make_model(), first_bucket_mb=16, **settings)
        train(model, rank, steps, reports[name])
        model.close()
    return reports


def scenario_ddp_plain_event(rank, world_size):
    """The event name also appears for DDP's own collectives (sanity for the counting method)."""
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ddp(torch.ones(2, 4)).sum().backward()
    return sorted({e.name for e in prof.events() if "allreduce" in e.name})


SCENARIOS = [scenario_event_name, scenario_ddp_plain_event, scenario_ddp_default,
             scenario_fr_default, scenario_fr_first_bucket_at_construction, scenario_fr_env_var,
             scenario_fr_runtime, scenario_fr_process_default, scenario_fr_health_exchanges]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(SCENARIOS, 2, timeout=300)


def check_stats_agree(report):
    """stats()' counts add up to the profiler's: the gradients' all-reduces, each step all of
    the gradients' bytes, and the health exchanges apart."""
    counted = [a + h for a, h in zip(report["stats"], report["health"])]
    assert counted == report["profiled"], "stats()' allreduces + health_exchanges vs profiler"
    assert report["bytes"] == [GRAD_BYTES] * len(report["bytes"]), "stats()['allreduce_bytes']"


def test_profiler_names_c10d_allreduce_for_plain_all_reduce_and_ddp(outcomes):
    for r in per_rank(outcomes, "scenario_event_name"):
        assert ALLREDUCE_EVENT in r["plain"]
    for r in per_rank(outcomes, "scenario_ddp_plain_event"):
        assert ALLREDUCE_EVENT in r


def test_ddp_reference_does_two_allreduces_per_step_after_its_rebuild(outcomes):
    for r in per_rank(outcomes, "scenario_ddp_default"):
        assert r["profiled"][1:] == [2] * (STEPS - 1)


def test_fused_reducer_default_does_two_allreduces_per_step_after_rebuild(outcomes):
    for r in per_rank(outcomes, "scenario_fr_default"):
        assert r["profiled"][1:] == [2] * (STEPS - 1)
        check_stats_agree(r)
        assert all(sum(s) == GRAD_BYTES for s in r["sizes"])
        assert r["first"][-1] == (MiB, MiB)


def test_first_bucket_16mib_at_construction_gives_one_allreduce_per_step(outcomes):
    for r in per_rank(outcomes, "scenario_fr_first_bucket_at_construction"):
        assert r["profiled"] == [1] * STEPS
        check_stats_agree(r)
        assert r["sizes"][-1] == [GRAD_BYTES]


def test_process_wide_default_16mib_gives_one_allreduce_per_step_also_after_rebuild(outcomes):
    for r in per_rank(outcomes, "scenario_fr_process_default"):
        assert r["default"] == SIXTEEN_MIB
        assert r["profiled"] == [1] * (STEPS + 1)
        check_stats_agree(r)
        assert r["rebuilds"][-1] > r["rebuilds"][STEPS - 1]  # the forced rebuild happened
        assert r["sizes"][-1] == [GRAD_BYTES]
        assert r["first"][-1] == (SIXTEEN_MIB, SIXTEEN_MIB)


def test_env_var_first_bucket_16mib_gives_one_allreduce_per_step(outcomes):
    for r in per_rank(outcomes, "scenario_fr_env_var"):
        assert r["default"] == SIXTEEN_MIB
        assert r["profiled"] == [1] * STEPS
        check_stats_agree(r)
        assert r["sizes"][-1] == [GRAD_BYTES]


def test_runtime_first_bucket_change_gives_one_allreduce_and_survives_forced_rebuilds(outcomes):
    for r in per_rank(outcomes, "scenario_fr_runtime"):
        # steps 0-2 default, 3-4 after the change, 5-6 and 7-8 after each forced rebuild
        assert r["profiled"][1:3] == [2, 2]
        assert r["profiled"][3:] == [1] * 6
        check_stats_agree(r)
        rebuilds = r["rebuilds"]
        assert rebuilds[3] > rebuilds[2]  # the change rebuilt the layout
        assert rebuilds[5] > rebuilds[4] and rebuilds[7] > rebuilds[6]  # each forced rebuild
        assert rebuilds[4] == rebuilds[3] and rebuilds[8] == rebuilds[7]  # and only then
        for sizes in r["sizes"]:
            assert sum(sizes) == GRAD_BYTES
        assert r["sizes"][3:] == [[GRAD_BYTES]] * 6
        assert r["first"][3:] == [(SIXTEEN_MIB, SIXTEEN_MIB)] * 6


def test_the_health_exchange_is_counted_apart_from_the_gradients_all_reduces(outcomes):
    for r in per_rank(outcomes, "scenario_fr_health_exchanges"):
        default, off, finite = r["default"], r["off"], r["check_finite"]
        # The profiler sees one more collective at steps 10 and 20 (the straggler exchange):
        # stats()["allreduces"] stays the one bucket, the exchange is counted apart.
        assert default["profiled"] == [2 if step in (9, 19) else 1 for step in range(21)]
        assert default["stats"] == [1] * 21
        assert default["health"] == [1 if step in (9, 19) else 0 for step in range(21)]
        row_bytes = 4 * 8 * 2  # four float64 entries per rank, 2 ranks
        assert default["health_bytes"] == [row_bytes * h for h in default["health"]]
        check_stats_agree(default)
        assert off["profiled"] == off["stats"] == [1] * 11 and off["health"] == [0] * 11
        assert finite["profiled"] == [2] * 3 and finite["stats"] == [1] * 3
        assert finite["health"] == [1] * 3
        check_stats_agree(finite)
