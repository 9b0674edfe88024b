"""Autotune, step telemetry, the Chrome trace and last_bucket_bytes (2 gloo ranks).

* Exactness: a FusedReducer(autotune=True) trains side by side with torch DDP (same model, data,
  SGD) through the whole tuning run and after it; parameters must stay within 1e-5 of DDP's at
  every step although the tuner changes the bucket layout many times.
* Agreement: both ranks report the same trials, step times and choice; the choice is in force
  on both; exactly one INFO line (rank 0) announces it; FUSED_REDUCER_DEBUG=1 logs rebuilds and
  decisions.
* Persistence: the chosen limits survive later forced rebuilds (rebuild_buckets()).
* Formats: autotune_report(), stats()['buckets_detail'] / ['overlap'], export_trace() JSON.
* last_bucket_bytes: layout (checked against the independent Python reference of
  tests/test_bucket_assignment.py and gradient-ready orders observed with plain PyTorch hooks),
  gradients equal to DDP's across the change, persistence, rank 0's value wins, validation.

All checks run in one spawned job (a spawn costs seconds here); each test reads its part.
"""
import json
import logging
import os
import tempfile
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_utils import observe_ready_order, per_rank, run_checks
from test_bucket_assignment import reference_assign

TOL = 1e-5
LR = 0.05
MiB = 1 << 20


def make_model(width=256, depth=8, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def batch(rank, step, width=256):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, width, generator=g), torch.randn(8, width, generator=g)


def train_step(model, opt, rank, step, width=256):
    x, y = batch(rank, step, width)
    opt.zero_grad(set_to_none=True)
    ((model(x) - y) ** 2).mean().mul(1 + rank).backward()
    opt.step()


def max_param_diff(a, b):
    return max((p.detach() - q.detach()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


class ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append((record.levelname, record.getMessage()))


# -- checks (run on every rank) ----------------------------------------------------------------

def check_tuning(rank, world_size):
    """autotune=True at construction, DDP alongside, debug logging on."""
    import fused_reducer
    handler = ListHandler()
    logger = logging.getLogger("fused_reducer")
    logger.addHandler(handler)
    os.environ["FUSED_REDUCER_DEBUG"] = "1"
    try:
        ddp = DDP(make_model())
        fr = fused_reducer.FusedReducer(make_model(), autotune=True)
    finally:
        del os.environ["FUSED_REDUCER_DEBUG"]
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    opt_fr = torch.optim.SGD(fr.parameters(), lr=LR, momentum=0.9)
    report = {"diffs": [], "layouts": [], "before_start": fr.autotune_report()}
    step = 0
    while not fr.autotune_report()["done"] and step < 200:
        train_step(ddp, opt_ddp, rank, step)
        train_step(fr, opt_fr, rank, step)
        report["diffs"].append(max_param_diff(ddp.module, fr.module))
        report["layouts"].append(tuple(fr.bucket_sizes()))
        step += 1
    report["tuning_steps"] = step
    report["report"] = fr.autotune_report()
    for _ in range(2):  # the choice in force, then kept by forced rebuilds
        train_step(ddp, opt_ddp, rank, step)
        train_step(fr, opt_fr, rank, step)
        report["diffs"].append(max_param_diff(ddp.module, fr.module))
        step += 1
    report["limits_after"] = (fr.first_bucket_bytes, fr.bucket_cap_bytes, fr.last_bucket_bytes)
    report["layout_after"] = fr.bucket_sizes()
    rebuilds = fr.stats()["rebuilds"]
    persisted = []
    for _ in range(2):
        fr.rebuild_buckets()
        train_step(ddp, opt_ddp, rank, step)
        train_step(fr, opt_fr, rank, step)
        report["diffs"].append(max_param_diff(ddp.module, fr.module))
        step += 1
        s = fr.stats()
        persisted.append({"limits": (fr.first_bucket_bytes, fr.bucket_cap_bytes,
                                     fr.last_bucket_bytes),
                          "stats_limits": (s["first_bucket_bytes"], s["bucket_cap_bytes"],
                                           s["last_bucket_bytes"]),
                          "layout": fr.bucket_sizes()})
    report["persisted"] = persisted
    report["forced_rebuilds"] = fr.stats()["rebuilds"] - rebuilds
    report["stats"] = fr.stats()
    with tempfile.TemporaryDirectory() as tmp:
        path = fr.export_trace(os.path.join(tmp, "trace_{rank}.json"), steps=3)
        report["trace_path_name"] = os.path.basename(path)
        with open(path) as f:
            report["trace"] = json.load(f)
    report["history_len"] = len(fr.step_history())
    report["logs"] = handler.records
    logger.removeHandler(handler)
    return report


def check_autotune_method(rank, world_size):
    """model.autotune() started mid-training with an explicit candidate list; each step
    accumulates one micro-batch under no_sync() first (those forwards are not tuner steps)."""
    import fused_reducer
    fr = fused_reducer.FusedReducer(make_model(width=64, depth=4), first_bucket_mb=1)
    opt = torch.optim.SGD(fr.parameters(), lr=LR)
    for step in range(3):
        train_step(fr, opt, rank, step, width=64)
    candidates = [(1024, 1024, 0), (8192, 20000, 4096), (1 << 30, 1 << 30, 4096)]
    fr.autotune(candidates=candidates, round_steps=(1, 2))
    steps = 0
    while not fr.autotune_report()["done"]:
        opt.zero_grad(set_to_none=True)
        for micro in range(2):
            x, y = batch(rank, 100 * steps + micro, 64)
            if micro == 0:
                with fr.no_sync():
                    ((fr(x) - y) ** 2).mean().backward()
            else:
                ((fr(x) - y) ** 2).mean().backward()
        opt.step()
        steps += 1
        assert steps < 100, "autotune did not finish"
    return {"report": fr.autotune_report(), "steps": steps, "candidates": candidates,
            "limits": (fr.first_bucket_bytes, fr.bucket_cap_bytes, fr.last_bucket_bytes)}


def check_finds_faster(rank, world_size):
    """Start from a clearly slow configuration: one collective per parameter (40 of them, each
    paying gloo's latency, ~1 ms here; on the shared-memory transport a collective costs tens
    of microseconds and 40 of them are not clearly slow); the grid has layouts with one or two
    buckets."""
    import fused_reducer
    fr = fused_reducer.FusedReducer(make_model(width=16, depth=20), first_bucket_mb=1e-6,
                                    bucket_cap_mb=1e-6, autotune=True, backend="process_group")
    opt = torch.optim.SGD(fr.parameters(), lr=LR)
    start_buckets = None
    step = 0
    while not fr.autotune_report()["done"]:
        train_step(fr, opt, rank, step, width=16)
        start_buckets = start_buckets or len(fr.bucket_sizes())
        step += 1
        assert step < 100, "autotune did not finish"
    train_step(fr, opt, rank, step, width=16)
    return {"report": fr.autotune_report(), "start_buckets": start_buckets,
            "buckets": len(fr.bucket_sizes()), "allreduces": fr.stats()["allreduces"]}


def check_last_bucket(rank, world_size):
    import fused_reducer
    width = 32
    ddp = DDP(make_model(width=width, depth=6), bucket_cap_mb=1 / 1024)
    fr = fused_reducer.FusedReducer(make_model(width=width, depth=6), first_bucket_mb=64,
                                    bucket_cap_mb=64)
    module = fr.module
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    opt_fr = torch.optim.SGD(fr.parameters(), lr=LR, momentum=0.9)
    names = [n for n, _ in module.named_parameters()]
    sizes = [p.numel() * p.element_size() for p in module.parameters()]
    order, handles = observe_ready_order(module)
    report = {"diffs": []}

    def step(i):
        del order[:]
        train_step(ddp, opt_ddp, rank, i, width)
        train_step(fr, opt_fr, rank, i, width)
        report["diffs"].append(max_param_diff(ddp.module, fr.module))

    step(0)
    step(1)  # rebuilt from the observed order: one bucket (limits 64 MiB)
    report["one_bucket"] = fr.bucket_sizes()
    last = sizes[0] + sizes[1]  # layer 0's weight and bias: the last gradients of backward
    fr.last_bucket_bytes = last
    report["value_before_forward"] = fr.last_bucket_bytes
    orders = [None] * world_size
    dist.all_gather_object(orders, list(order))
    step(2)
    report["with_last"] = fr.bucket_parameter_names()
    report["with_last_expected"] = [[names[i] for i in b] for b in
                                    reference_assign(sizes, [0] * len(sizes), orders[0],
                                                     64 * MiB, 64 * MiB, last)]
    report["stats_last"] = fr.stats()["last_bucket_bytes"]
    fr.rebuild_buckets()
    step(3)
    report["after_rebuild"] = fr.bucket_parameter_names()
    report["after_rebuild_last"] = fr.last_bucket_bytes
    # Different values on the ranks: rank 0's wins at the rebuild.
    fr.last_bucket_bytes = 2 * last if rank == 0 else 3 * last
    step(4)
    report["rank0_wins"] = (fr.last_bucket_bytes, fr.bucket_sizes())
    fr.last_bucket_bytes = None  # off
    step(5)
    report["off"] = (fr.last_bucket_bytes, fr.bucket_sizes())
    for h in handles:
        h.remove()

    errors = {}
    for value in (-1, 1.5, "8", True):
        try:
            fr.last_bucket_bytes = value
            errors[repr(value)] = None
        except (TypeError, ValueError) as e:
            errors[repr(value)] = (type(e).__name__, str(e))
    report["errors"] = errors
    fr.last_bucket_bytes = 0
    report["zero_is_off"] = fr.last_bucket_bytes
    try:
        fused_reducer.FusedReducer(make_model(width=8, depth=1), last_bucket_mb=-1)
        report["ctor_error"] = None
    except ValueError as e:
        report["ctor_error"] = str(e)
    ctor = fused_reducer.FusedReducer(make_model(width=8, depth=1), last_bucket_mb=0.5)
    report["ctor_last"] = ctor.last_bucket_bytes
    return report


def check_misuse(rank, world_size):
    """What a user gets wrong, answered on every rank with an error naming the option, never a
    hang: bad options (refused by autotune() itself, before any forward), a failure while rank
    0 plans (every rank raises, training goes on), a restart mid-measurement (starts from the
    user's limits, not the trial layout in force), ignored parameters (DDP's ignore list: the
    tuner plans for the reducer's parameters), and a closed model."""
    import fused_reducer
    from torch.nn.parallel import DistributedDataParallel as DDP
    out = {}
    fr = fused_reducer.FusedReducer(make_model(width=64, depth=4))
    opt = torch.optim.SGD(fr.parameters(), lr=LR)
    refused = {}
    for name, options in {"zero_layout": dict(candidates=[(0, 0, 0)]),
                          "negative_last": dict(candidates=[(MiB, MiB, -5)]),
                          "empty": dict(candidates=[]),
                          "min_steps": dict(min_steps=0),
                          "round_steps": dict(round_steps=()),
                          "margin": dict(margin=float("nan")),
                          "huge": dict(candidates=[(1 << 63, 1 << 63, 0)])}.items():
        try:
            fr.autotune(**options)
            refused[name] = None
        except ValueError as e:
            refused[name] = str(e)
    out["refused"] = refused
    out["tuner_after_refusals"] = fr.attachment.tuner
    # A planner_hint file only rank 0 can read: every rank raises, none tunes alone.
    hint = [(4096, 4096, 0)] if rank == 0 else "/nonexistent/plan.json"
    try:
        fr.autotune(planner_hint=hint)
        out["hint_on_one_rank"] = None
    except Exception as e:  # noqa: BLE001 - which error each rank gets is the point
        out["hint_on_one_rank"] = (type(e).__name__, str(e))
    out["tuner_after_hint"] = fr.attachment.tuner
    # Rank 0 fails while planning: every rank hears it in the same forward.
    fr.autotune(candidates=[(4096, 4096, 0)])
    fr.attachment.tuner._rank0_plan = None if rank == 0 else fr.attachment.tuner._rank0_plan  # not callable
    raised = []
    for step in range(4):
        try:
            train_step(fr, opt, rank, step, width=64)
        except RuntimeError as e:
            raised.append((step, "rank 0 could not plan" in str(e)))
    out["plan_failure"] = (raised, fr.autotune_report()["state"])
    # A restart mid-measurement starts from the user's limits.
    user = (fr.bucket_caps_bytes, fr.last_bucket_bytes)
    fr.autotune(candidates=[(4096, 4096, 8192)], round_steps=(3,))
    step = 10
    while fr.autotune_report()["state"] != "measuring" or fr.last_bucket_bytes != 8192:
        train_step(fr, opt, rank, step, width=64)
        step += 1
        assert step < 40, fr.autotune_report()
    fr.autotune(candidates=[(2048, 2048, 0)])
    out["restart"] = (user, (fr.bucket_caps_bytes, fr.last_bucket_bytes))
    while not fr.autotune_report()["done"]:
        train_step(fr, opt, rank, step, width=64)
        step += 1
        assert step < 80, fr.autotune_report()
    out["restart_incumbent"] = fr.autotune_report()["incumbent"]
    fr.close()
    # Ignored parameters are not the reducer's: the tuner's layouts cover the others only.
    net = make_model(width=64, depth=4)
    DDP._set_params_and_buffers_to_ignore_for_model(net, ["0.weight", "0.bias"])
    fr = fused_reducer.FusedReducer(net)
    opt = torch.optim.SGD(fr.parameters(), lr=LR)
    fr.autotune(candidates=[(4096, 4096, 0)], round_steps=(1,))
    step = 0
    while not fr.autotune_report()["done"]:
        train_step(fr, opt, rank, step, width=64)
        step += 1
        assert step < 40, fr.autotune_report()
    out["ignored"] = (fr.autotune_report()["state"],
                      sorted(n for b in fr.bucket_parameter_names() for n in b))
    fr.close()
    closed = {}
    for what, call in {"first_bucket_bytes": lambda: fr.first_bucket_bytes,
                       "bucket_sizes": fr.bucket_sizes, "stats": fr.stats,
                       "autotune": fr.autotune}.items():
        try:
            call()
            closed[what] = None
        except RuntimeError as e:
            closed[what] = str(e)
    out["closed"] = closed
    return out


CHECKS = [check_tuning, check_autotune_method, check_finds_faster, check_last_bucket,
          check_misuse]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(CHECKS, 2, timeout=240)


# -- tuning ------------------------------------------------------------------------------------

def test_params_match_ddp_throughout_tuning_and_after(outcomes):
    for rank, r in enumerate(per_rank(outcomes, "check_tuning")):
        assert r["report"]["done"], "tuning did not finish"
        assert len(set(r["layouts"])) >= 2, "the tuner never changed the layout"
        for step, diff in enumerate(r["diffs"]):
            assert diff <= TOL, f"rank {rank}, step {step}: params differ from DDP by {diff}"


def test_ranks_agree_on_trials_and_choice_and_apply_it(outcomes):
    a, b = per_rank(outcomes, "check_tuning")
    assert a["report"]["choice"] == b["report"]["choice"]
    assert a["report"]["trials"] == b["report"]["trials"]  # step times are max over ranks
    for r in (a, b):
        c = r["report"]["choice"]
        assert r["limits_after"] == (c["first_bucket_bytes"], c["bucket_cap_bytes"],
                                     c["last_bucket_bytes"])
    assert a["layout_after"] == b["layout_after"]


def test_choice_persists_across_forced_rebuilds(outcomes):
    for r in per_rank(outcomes, "check_tuning"):
        c = r["report"]["choice"]
        choice = (c["first_bucket_bytes"], c["bucket_cap_bytes"], c["last_bucket_bytes"])
        assert r["forced_rebuilds"] == 2
        for p in r["persisted"]:
            assert p["limits"] == choice
            assert p["stats_limits"] == choice
            assert p["layout"] == r["layout_after"]


def test_report_format(outcomes):
    r = per_rank(outcomes, "check_tuning")[0]
    assert r["before_start"]["done"] is False
    rep = r["report"]
    assert rep["done"] is True and rep["state"] == "done"
    assert isinstance(rep["steps_used"], int) and 0 < rep["steps_used"] <= r["tuning_steps"]
    assert rep["configurations_considered"] >= len(rep["trials"]) >= 2
    keys = {"first_bucket_bytes", "bucket_cap_bytes", "last_bucket_bytes", "step_ms"}
    for t in rep["trials"]:
        assert keys <= set(t)
        assert all(isinstance(t[k], int) for k in keys - {"step_ms"})
        assert t["step_ms"] is None or t["step_ms"] > 0
        assert len(t["samples_ms"]) >= 1
    assert sum(t["incumbent"] for t in rep["trials"]) == 1
    incumbent = next(t for t in rep["trials"] if t["incumbent"])
    assert (incumbent["first_bucket_bytes"], incumbent["bucket_cap_bytes"]) == (MiB, 25 * MiB)
    choice = rep["choice"]
    assert {"first_bucket_bytes", "bucket_cap_bytes", "last_bucket_bytes"} <= set(choice)
    sizes = [(t["first_bucket_bytes"], t["bucket_cap_bytes"], t["last_bucket_bytes"])
             for t in rep["trials"]]
    assert (choice["first_bucket_bytes"], choice["bucket_cap_bytes"],
            choice["last_bucket_bytes"]) in sizes
    # The choice is the fastest of the last round, or the incumbent when that was not clearly
    # faster; either way it was measured at least as often as any configuration.
    chosen = rep["trials"][sizes.index((choice["first_bucket_bytes"], choice["bucket_cap_bytes"],
                                        choice["last_bucket_bytes"]))]
    assert choice["step_ms"] == chosen["step_ms"]
    assert len(chosen["samples_ms"]) == max(len(t["samples_ms"]) for t in rep["trials"])
    if not chosen["incumbent"]:
        assert chosen["step_ms"] < incumbent["step_ms"]


def test_one_info_line_announces_the_choice_and_debug_logs_rebuilds_and_decisions(outcomes):
    for rank, r in enumerate(per_rank(outcomes, "check_tuning")):
        infos = [m for level, m in r["logs"] if level == "INFO" and "autotune: chose" in m]
        assert len(infos) == (1 if rank == 0 else 0)
        debug = [m for level, m in r["logs"] if level == "DEBUG"]
        assert any("layout rebuilt" in m for m in debug)
        assert any("autotune plan" in m for m in debug)
        assert any("autotune trial" in m for m in debug)
    c = per_rank(outcomes, "check_tuning")[0]["report"]["choice"]
    line = next(m for level, m in per_rank(outcomes, "check_tuning")[0]["logs"]
                if "autotune: chose" in m)
    assert f"first_bucket_bytes={c['first_bucket_bytes']}" in line


def test_autotune_method_with_explicit_candidates(outcomes):
    reports = per_rank(outcomes, "check_autotune_method")
    assert reports[0]["report"] == reports[1]["report"]
    for r in reports:
        rep = r["report"]
        measured = [(t["first_bucket_bytes"], t["bucket_cap_bytes"], t["last_bucket_bytes"])
                    for t in rep["trials"]]
        assert measured[0] == (MiB, 25 * MiB, 0)  # the incumbent
        assert set(measured[1:]) == set(map(tuple, r["candidates"]))
        c = rep["choice"]
        assert (c["first_bucket_bytes"], c["bucket_cap_bytes"], c["last_bucket_bytes"]) in measured
        assert r["limits"] == (c["first_bucket_bytes"], c["bucket_cap_bytes"],
                               c["last_bucket_bytes"])
        # 4 configurations x (1 warm-up + 1), then incumbent + 1 challenger x (1 + 2).
        assert rep["steps_used"] == 4 * 2 + 2 * 3


def test_tuner_leaves_a_clearly_slow_configuration(outcomes):
    for r in per_rank(outcomes, "check_finds_faster"):
        rep = r["report"]
        assert r["start_buckets"] == 40
        incumbent = next(t for t in rep["trials"] if t["incumbent"])
        assert incumbent["buckets"] == 40
        assert (rep["choice"]["first_bucket_bytes"], rep["choice"]["bucket_cap_bytes"]) != (1, 1)
        assert rep["choice"]["step_ms"] < incumbent["step_ms"]
        assert r["buckets"] <= 2 and r["allreduces"] == r["buckets"]


# -- telemetry and trace -----------------------------------------------------------------------

def test_stats_have_per_bucket_telemetry_of_the_last_step(outcomes):
    for r in per_rank(outcomes, "check_tuning"):
        s = r["stats"]
        detail = s["buckets_detail"]
        assert len(detail) == s["buckets"] == len(r["layout_after"])
        assert [d["bytes"] for d in detail] == r["layout_after"]
        assert 0.0 <= s["overlap"] <= 1.0
        assert s["exposed_wait_us"] == pytest.approx(sum(d["wait_us"] for d in detail))
        for d in detail:
            assert d["params"] >= 1
            assert 0.0 <= d["ready_first_us"] <= d["ready_last_us"] <= d["launch_us"]
            assert d["launch_us"] <= d["complete_us"] <= s["backward_end_us"] + 1e6
            if d["complete_us"] < s["backward_end_us"]:
                assert d["wait_us"] == 0.0  # seen complete and unpacked during backward
            else:
                assert d["complete_us"] - d["wait_us"] >= s["backward_end_us"] - 1.0  # end wait
            assert d["wait_us"] >= 0 and d["pack_us"] >= 0
        assert min(d["ready_first_us"] for d in detail) == 0.0  # times from the first hook


def test_trace_is_chrome_json_with_a_row_per_bucket_and_the_backward_span(outcomes):
    for rank, r in enumerate(per_rank(outcomes, "check_tuning")):
        assert r["trace_path_name"] == f"trace_{rank}.json"
        trace = r["trace"]
        events = trace["traceEvents"]
        assert isinstance(events, list) and events
        spans = [e for e in events if e["ph"] == "X"]
        for e in spans:
            assert {"name", "ts", "dur", "pid", "tid"} <= set(e)
            assert e["pid"] == rank and e["dur"] >= 0
        rows = {e["tid"]: e["args"]["name"] for e in events
                if e["ph"] == "M" and e["name"] == "thread_name"}
        steps = [e for e in spans if e["name"].startswith("step ")]
        assert len(steps) == 3
        assert sum(e["name"] == "backward" for e in spans) == 3
        reduces = [e for e in spans if e["name"].startswith("all-reduce")]
        assert len(reduces) == 3 * len(r["layout_after"])  # every bucket of every step
        reduce_rows = {e["tid"] for e in reduces}
        assert len(reduce_rows) == len(r["layout_after"])  # one row per bucket
        assert all(rows[t].startswith("bucket ") for t in reduce_rows)
        assert {rows[t] for t in rows} >= {"step", "backward"}


# -- last_bucket_bytes -------------------------------------------------------------------------

def test_last_bucket_layout_follows_the_rule_and_grads_match_ddp(outcomes):
    for rank, r in enumerate(per_rank(outcomes, "check_last_bucket")):
        assert len(r["one_bucket"]) == 1
        assert r["value_before_forward"] == r["stats_last"]
        assert r["with_last"] == r["with_last_expected"]
        assert len(r["with_last"]) == 2
        assert set(r["with_last"][-1]) == {"0.weight", "0.bias"}
        for step, diff in enumerate(r["diffs"]):
            assert diff <= TOL, f"rank {rank}, step {step}: {diff}"


def test_last_bucket_persists_across_rebuilds_and_rank0_value_wins(outcomes):
    reports = per_rank(outcomes, "check_last_bucket")
    for r in reports:
        assert r["after_rebuild"] == r["with_last"]
        assert r["after_rebuild_last"] == r["stats_last"]
    last = reports[0]["stats_last"]
    assert reports[0]["rank0_wins"] == reports[1]["rank0_wins"]
    assert reports[1]["rank0_wins"][0] == 2 * last
    for r in reports:
        assert r["off"][0] == 0 and len(r["off"][1]) == 1


def test_last_bucket_bytes_validation(outcomes):
    r = per_rank(outcomes, "check_last_bucket")[0]
    assert r["errors"]["-1"][0] == "ValueError" and "last_bucket_bytes" in r["errors"]["-1"][1]
    for value in ("1.5", "'8'", "True"):
        assert r["errors"][value][0] == "TypeError", value
        assert "last_bucket_bytes" in r["errors"][value][1]
    assert r["zero_is_off"] == 0
    assert "last_bucket_mb" in r["ctor_error"]
    assert r["ctor_last"] == MiB // 2


# -- the step clock: CUDA trials are timed by events, not host gaps -----------------------------
# In process, no process group: a stub model and one trial of the starting configuration.

class _StubReducer:
    def __init__(self):
        self.steps = 0

    def completed_steps(self):
        return self.steps


class _StubModel:
    """What the tuner reads of a FusedReducer to measure a trial."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.process_group = None
        # The tuner reads the reducer and the control device through model.attachment.
        self.attachment = types.SimpleNamespace(reducer=_StubReducer(),
                                                control_device=torch.device("cpu"))
        self.bucket_caps_bytes = [MiB, 4 * MiB]
        self.last_bucket_bytes = MiB


def _one_trial_samples(monkeypatch, device, steps=3):
    """Runs the tuner on a stub model on `device` through one trial of `steps` timed steps
    (after the warm-up step); returns its samples (ms)."""
    from fused_reducer.tuning import autotune
    monkeypatch.setattr(autotune.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(autotune.dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(autotune.dist, "broadcast_object_list", lambda box, **kwargs: None)
    monkeypatch.setattr(autotune, "control_allreduce", lambda values, *args: list(values))
    model = _StubModel(device)
    tuner = autotune.Autotuner(model, round_steps=(steps,), min_steps=1)
    model.attachment.reducer.steps = 1  # a backward completed before tuning starts

    def plan(last_step_ms=None):  # only the incumbent: no probe, no collectives
        tuner.incumbent = tuner.current = autotune.candidate(model.bucket_caps_bytes,
                                                             model.last_bucket_bytes)
        tuner.plan = [{"candidate": list(tuner.incumbent), "predicted_ms": 0.0,
                       "predicted_contended_ms": 0.0, "buckets": 2}]
        tuner.alive, tuner.queue = [tuner.incumbent], [tuner.incumbent]
        tuner.samples = {tuner.incumbent: []}

    monkeypatch.setattr(tuner, "_make_plan", plan)
    tuner.on_forward()  # plans, starts the trial
    for _ in range(1 + steps):  # the warm-up step, then the timed ones
        model.attachment.reducer.steps += 1  # a backward completed
        tuner.on_forward()
    assert tuner.state == "done"
    return tuner.report()["trials"][0]["samples_ms"]


def test_step_clock_follows_the_device():
    from fused_reducer.tuning import autotune
    assert isinstance(autotune.step_clock(torch.device("cpu")), autotune.HostClock)
    assert isinstance(autotune.step_clock("cuda:1"), autotune.CudaClock)
    assert autotune.step_clock("cuda:1").device == torch.device("cuda", 1)


def test_cpu_trials_are_timed_by_the_host_clock(monkeypatch):
    from fused_reducer.tuning import autotune
    ticks = iter([0.0, 1.0, 3.0, 6.0, 10.0])  # forwards at these host times (s)
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: next(ticks))
    assert _one_trial_samples(monkeypatch, "cpu") == [2000.0, 3000.0, 4000.0]


def test_cuda_trials_are_timed_by_events_on_the_current_stream(monkeypatch):
    """Each forward records an event on the model's current stream (no host sync); the trial's
    samples are the events' elapsed times, read at its end after the later event is done. Host
    gaps between forwards (perf_counter) must not be the measure."""
    from fused_reducer.tuning import autotune
    calls = []

    class FakeEvent:
        count = 0

        def __init__(self, enable_timing=False):
            assert enable_timing, "a timing event"
            self.gpu_ms = 5.0 * FakeEvent.count ** 2  # when the GPU reaches it
            self.done = False
            FakeEvent.count += 1

        def record(self, stream=None):
            calls.append(("record", stream))

        def synchronize(self):
            calls.append(("synchronize",))
            self.done = True

        def elapsed_time(self, end):
            assert end.done, "read only once the later event is done"
            calls.append(("elapsed_time",))
            return end.gpu_ms - self.gpu_ms

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: 0.0)  # host gaps: all zero
    samples = _one_trial_samples(monkeypatch, "cuda:0")
    assert samples == [15.0, 25.0, 35.0], samples  # events 1-2, 2-3, 3-4 (0-1: the warm-up)
    records = [c for c in calls if c[0] == "record"]
    assert records == [("record", ("stream of", torch.device("cuda", 0)))] * 5
    first_sync = calls.index(("synchronize",))
    assert all(c[0] == "record" for c in calls[:first_sync]), "no host sync while stepping"
    assert calls[first_sync:] == [("synchronize",), ("elapsed_time",)] * 3


def test_misuse_is_an_error_naming_the_option_on_every_rank_never_a_hang(outcomes):
    for rank, r in enumerate(per_rank(outcomes, "check_misuse")):
        refused = r["refused"]
        assert all(refused.values()), refused
        assert "candidates layout (0, 0, 0)" in refused["zero_layout"], refused
        assert "candidates layout" in refused["negative_last"], refused
        assert "candidates is empty" in refused["empty"], refused
        assert "min_steps" in refused["min_steps"] and "round_steps" in refused["round_steps"]
        assert "margin" in refused["margin"] and "2**62" in refused["huge"], refused
        assert r["tuner_after_refusals"] is None  # nothing started
        kind, text = r["hint_on_one_rank"]
        assert r["tuner_after_hint"] is None, r
        assert ("another rank refused" if rank == 0 else "/nonexistent/plan.json") in text, text
        raised, state = r["plan_failure"]
        assert [ok for _, ok in raised] == [True] and state == "done", r["plan_failure"]
        user, after_restart = r["restart"]
        assert after_restart == user, r["restart"]
        assert (r["restart_incumbent"]["bucket_caps_bytes"],
                r["restart_incumbent"]["last_bucket_bytes"]) == user, r["restart_incumbent"]
        state, names = r["ignored"]
        assert state == "done" and "0.weight" not in names and "2.weight" in names, r["ignored"]
        assert all(v and "closed" in v for v in r["closed"].values()), r["closed"]
