"""Bad input and faults: each a clear Python exception, on every rank, never a hang.

Multi-rank checks run in spawned gloo jobs with timeouts (dist_utils), so a hang fails the test
instead of stalling the suite. Checks that can share a job do (a spawn costs seconds here).
"""
import os
import subprocess
import sys
import pickle
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fused_reducer
from fused_reducer import FusedReducer
from dist_utils import per_rank, run_checks, spawn_ranks

ENV = "FUSED_REDUCER_FIRST_BUCKET_BYTES"


def small_model(out=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, out))


# Errors about the wrapped model: a RuntimeError where DDP raises one, and a ValueError.
MODEL_ERROR = "FusedReducerError"


def test_model_errors_are_runtime_and_value_errors():
    from fused_reducer.core.wrapper import FusedReducerError
    assert issubclass(FusedReducerError, RuntimeError) and issubclass(FusedReducerError, ValueError)


def outcome(fn):
    """(exception type name, message) of fn(), or ('ok', None)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "ok", None


# -- no spawn needed -----------------------------------------------------------------------------

NO_GROUP_SCRIPT = """
import torch.distributed as dist
from torch import nn
from fused_reducer import FusedReducer
assert not dist.is_initialized()
try:
    FusedReducer(nn.Linear(4, 3))
except Exception as e:
    print(type(e).__name__ + ": " + str(e))
else:
    print("no error")
"""


def test_no_initialised_process_group_raises_runtime_error_naming_init_process_group():
    # A fresh interpreter: the pytest process may hold a group from another test module.
    result = subprocess.run([sys.executable, "-c", NO_GROUP_SCRIPT], capture_output=True,
                            text=True, timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 0 and lines, result.stderr[-2000:]
    assert lines[-1].startswith("RuntimeError: "), lines[-1]
    assert "init_process_group" in lines[-1], lines[-1]


@pytest.mark.parametrize("value, exc", [
    (0, ValueError), (-1, ValueError), (-(1 << 40), ValueError), (1 << 63, ValueError),
    (1.5, TypeError), ("x", TypeError), (None, TypeError), (True, TypeError),
])
def test_set_default_first_bucket_bytes_rejects_bad_values_naming_the_setting(value, exc):
    before = fused_reducer.get_default_first_bucket_bytes()
    with pytest.raises(exc, match="first_bucket_bytes"):
        fused_reducer.set_default_first_bucket_bytes(value)
    assert fused_reducer.get_default_first_bucket_bytes() == before  # unchanged


def test_sizes_beyond_any_memory_are_refused_naming_the_setting():
    """Above 2**62 bytes a limit would not fit the C++ reducer's int64: a plain error naming it,
    not pybind's "incompatible function arguments"."""
    from fused_reducer.settings import as_byte_list, megabytes_to_bytes
    with pytest.raises(ValueError, match=r"bucket_caps_bytes\[1\].*2\*\*62"):
        as_byte_list([1 << 20, 1 << 64])
    with pytest.raises(ValueError, match="bucket_cap_mb.*beyond any memory"):
        megabytes_to_bytes("bucket_cap_mb", 1e30)


@pytest.mark.parametrize("raw", ["abc", "0", "-3", "1.5", "16MiB"])
def test_bad_env_var_raises_value_error_naming_the_variable(monkeypatch, raw):
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(ValueError, match=ENV):
        fused_reducer.get_default_first_bucket_bytes()


# -- one job for the construction-time and step-time errors ----------------------------------------

class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)

    def forward(self, x):
        return self.used(x)


class WithSparseEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(4, 4)
        self.lookup = nn.Embedding(10, 4, sparse=True)

    def forward(self, idx):
        return self.dense(self.lookup(idx))


class Holder(nn.Module):
    def __init__(self, *shapes, dtype=torch.float32):
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes)


BAD_MB = [0, -1, -0.5, float("nan"), float("inf"), 1e-9, "abc", None, True]
BAD_BYTES = [0, -1, 1.5, "x", None]


def check_construction_arguments(rank, world_size):
    out = {}
    for arg in ("bucket_cap_mb", "first_bucket_mb"):
        for bad in BAD_MB:
            if bad is None:
                continue  # both default to None (bucket_cap_mb as in DDP: 25 MiB)  # None means "use the process-wide default"
            out[(arg, repr(bad))] = outcome(lambda: FusedReducer(small_model(), **{arg: bad}))
    for raw in ("abc", "0", "-3", "1.5"):
        os.environ[ENV] = raw
        try:
            out[("env", raw)] = outcome(lambda: FusedReducer(small_model()))
        finally:
            del os.environ[ENV]
    return out


def check_setters(rank, world_size):
    model = FusedReducer(small_model(), first_bucket_mb=1, bucket_cap_mb=2)
    out = {}
    for attr in ("first_bucket_bytes", "bucket_cap_bytes"):
        for bad in BAD_BYTES:
            out[(attr, repr(bad))] = outcome(lambda: setattr(model, attr, bad))
    out["unchanged"] = (model.first_bucket_bytes, model.bucket_cap_bytes)
    # The reducer still trains after refusing the values.
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    out["still_works"] = all(p.grad is not None for p in model.parameters())
    return out


def check_no_trainable_params(rank, world_size):
    frozen = small_model().requires_grad_(False)
    return {"frozen": outcome(lambda: FusedReducer(frozen)),
            "parameterless": outcome(lambda: FusedReducer(nn.ReLU()))}


def check_sparse(rank, world_size):
    return outcome(lambda: FusedReducer(WithSparseEmbedding()))


def check_shapes(rank, world_size):
    last = rank == world_size - 1
    return {
        # layer '2' has 3 outputs on every rank but the last, 5 there
        "shape": outcome(lambda: FusedReducer(small_model(out=5 if last else 3))),
        # same numel, transposed
        "transposed": outcome(lambda: FusedReducer(Holder((4,), (2, 3) if not last else (3, 2)))),
        "dtype": outcome(lambda: FusedReducer(
            Holder((4,), (2, 3), dtype=torch.float64 if last else torch.float32))),
        "count": outcome(lambda: FusedReducer(Holder(*([(2,)] * (3 if last else 2))))),
    }


def check_unused_without_find_unused(rank, world_size):
    model = FusedReducer(WithUnused())
    x = torch.randn(2, 4)
    first = outcome(lambda: model(x).sum().backward())
    second = outcome(lambda: model(x))
    return {"first_backward": first, "next_forward": second}


def check_ready_twice(rank, world_size):
    """One forward, backward(retain_graph=True) twice: both backwards are averaged (DDP keeps the
    second local and the ranks silently diverge); inside no_sync() a third stays local."""
    torch.manual_seed(0)
    model = FusedReducer(small_model())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    loss = model(x).sum() * (1 + rank)  # local gradients 1x and 2x: a local second shows
    loss.backward(retain_graph=True)
    twice = outcome(lambda: loss.backward(retain_graph=True))
    after_two = [p.grad.clone() for p in model.module.parameters()]
    with model.no_sync():
        loss.backward()
    # Reference: the local gradient of one backward, summed over ranks in float64 (all_reduce).
    local = small_model()
    local.load_state_dict(model.module.state_dict())
    (local(x).sum() * (1 + rank)).backward()
    second, third = 0.0, 0.0
    for p, two, q in zip(model.module.parameters(), after_two, local.parameters()):
        g = q.grad.double()
        averaged = g.clone()
        dist.all_reduce(averaged)
        averaged /= world_size
        second = max(second, (two.double() - 2 * averaged).abs().max().item())
        third = max(third, (p.grad.double() - 2 * averaged - g).abs().max().item())
    # Afterwards a normal step still averages correctly (reference: plain all_reduce in float64).
    model.zero_grad(set_to_none=True)
    reference = small_model()
    reference.load_state_dict(model.module.state_dict())
    reference(x).sum().backward()
    model(x).sum().backward()
    worst = 0.0
    for p, q in zip(model.module.parameters(), reference.parameters()):
        expected = q.grad.double()
        dist.all_reduce(expected)
        worst = max(worst, (p.grad.double() - expected / world_size).abs().max().item())
    return {"twice": twice, "second": second, "third": third, "after": worst}


def check_wrapped_twice(rank, world_size):
    """A model already wrapped, at its root or in a submodule, by FusedReducer or DDP."""
    inner = FusedReducer(small_model())
    ddp = nn.parallel.DistributedDataParallel(small_model())
    holder = nn.Sequential(nn.Linear(4, 4), nn.Sequential(FusedReducer(small_model())))
    return {"fused_in_fused": outcome(lambda: FusedReducer(inner)),
            "ddp_in_fused": outcome(lambda: FusedReducer(ddp)),
            "fused_in_a_submodule": outcome(lambda: FusedReducer(holder)),
            # the inner wrapper still trains alone
            "inner_alone": outcome(lambda: inner(torch.randn(2, 4)).sum().backward())}


class SharedLayerCheckpointedTwice(nn.Module):
    """One layer applied twice, each time under a reentrant checkpoint: its gradient is
    accumulated twice within one backward."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.shared = nn.Linear(4, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        x = self.first(x)
        x = checkpoint(self.shared, x, use_reentrant=True)
        return checkpoint(self.shared, x, use_reentrant=True)


def check_ready_twice_in_one_backward(rank, world_size):
    model = FusedReducer(SharedLayerCheckpointedTwice())
    return outcome(lambda: model(torch.randn(2, 4)).sum().backward())


CHECKS = [check_construction_arguments, check_setters, check_no_trainable_params, check_sparse,
          check_shapes, check_ready_twice, check_ready_twice_in_one_backward,
          check_unused_without_find_unused, check_wrapped_twice]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(CHECKS, 2, timeout=180)


@pytest.mark.parametrize("arg", ["bucket_cap_mb", "first_bucket_mb"])
def test_invalid_mb_sizes_raise_value_or_type_error_naming_the_argument_on_every_rank(outcomes,
                                                                                      arg):
    for rank, results in enumerate(per_rank(outcomes, "check_construction_arguments")):
        for bad in BAD_MB:
            if bad is None:
                continue  # both default to None (bucket_cap_mb as in DDP: 25 MiB)
            kind, message = results[(arg, repr(bad))]
            numeric = isinstance(bad, (int, float)) and not isinstance(bad, bool)
            assert kind == ("ValueError" if numeric else "TypeError"), (rank, bad, kind, message)
            assert arg in message, (rank, bad, message)


def test_bad_env_var_at_construction_raises_value_error_naming_it_on_every_rank(outcomes):
    for results in per_rank(outcomes, "check_construction_arguments"):
        for raw in ("abc", "0", "-3", "1.5"):
            kind, message = results[("env", raw)]
            assert kind == "ValueError" and ENV in message, (raw, kind, message)


@pytest.mark.parametrize("attr", ["first_bucket_bytes", "bucket_cap_bytes"])
def test_setters_reject_bad_values_naming_the_setting_and_keep_the_old_value(outcomes, attr):
    for results in per_rank(outcomes, "check_setters"):
        for bad in BAD_BYTES:
            kind, message = results[(attr, repr(bad))]
            expected = "ValueError" if isinstance(bad, int) else "TypeError"
            assert kind == expected and attr in message, (bad, kind, message)
        assert results["unchanged"] == (1 << 20, 2 << 20)
        assert results["still_works"]


def test_module_without_trainable_parameters_raises_on_every_rank(outcomes):
    for results in per_rank(outcomes, "check_no_trainable_params"):
        for case in ("frozen", "parameterless"):
            kind, message = results[case]
            assert kind == MODEL_ERROR and "trainable" in message, (case, kind, message)


def test_sparse_embedding_is_refused_at_construction_naming_the_module(outcomes):
    for kind, message in per_rank(outcomes, "check_sparse"):
        assert kind == MODEL_ERROR, (kind, message)
        assert "'lookup'" in message and "sparse" in message, message


def test_shape_mismatch_across_ranks_names_first_parameter_and_both_shapes_on_every_rank(outcomes):
    for kind, message in (r["shape"] for r in per_rank(outcomes, "check_shapes")):
        assert kind == MODEL_ERROR, (kind, message)
        assert "'2.weight'" in message and "(3, 6)" in message and "(5, 6)" in message, message
    for kind, message in (r["transposed"] for r in per_rank(outcomes, "check_shapes")):
        assert kind == MODEL_ERROR, (kind, message)
        assert "'params.1'" in message and "(2, 3)" in message and "(3, 2)" in message, message


def test_dtype_or_count_mismatch_across_ranks_raises_on_every_rank(outcomes):
    for results in per_rank(outcomes, "check_shapes"):
        kind, message = results["dtype"]
        assert kind == MODEL_ERROR and "'params.0'" in message, message
        assert "float32" in message and "float64" in message, message
        kind, message = results["count"]
        assert kind == MODEL_ERROR and "[2, 3]" in message, message


def test_unused_parameter_without_find_unused_raises_at_next_forward_on_every_rank(outcomes):
    for results in per_rank(outcomes, "check_unused_without_find_unused"):
        assert results["first_backward"] == ("ok", None)
        kind, message = results["next_forward"]
        assert kind == "RuntimeError", (kind, message)
        assert "'unused.weight'" in message and "'unused.bias'" in message, message
        assert "'used.weight'" not in message, message
        assert "find_unused_parameters" in message, message


def test_second_backward_of_one_forward_is_averaged_unless_inside_no_sync(outcomes):
    for results in per_rank(outcomes, "check_ready_twice"):
        assert results["twice"][0] == "ok", results["twice"]
        assert results["second"] <= 1e-6, results  # avg(g) + avg(g), the same on every rank
        assert results["third"] <= 1e-6, results  # + the local g inside no_sync()
        assert results["after"] <= 1e-6


def test_a_model_wrapped_twice_is_refused_naming_the_inner_wrapper(outcomes):
    for results in per_rank(outcomes, "check_wrapped_twice"):
        for case, inner in (("fused_in_fused", "FusedReducer"),
                            ("ddp_in_fused", "DistributedDataParallel"),
                            ("fused_in_a_submodule", "FusedReducer")):
            kind, message = results[case]
            assert kind == MODEL_ERROR, (case, kind, message)
            assert f"already a {inner}" in message and "twice" in message, (case, message)
        assert "submodule '1.0'" in results["fused_in_a_submodule"][1]
        assert "its place (the FusedReducer's .module)" in results["fused_in_a_submodule"][1]
        assert results["inner_alone"] == ("ok", None)


def test_gradient_marked_ready_twice_in_one_backward_raises_naming_the_parameter(outcomes):
    for kind, message in per_rank(outcomes, "check_ready_twice_in_one_backward"):
        assert kind == "RuntimeError" and "marked ready twice" in message, (kind, message)
        assert "'shared.weight'" in message or "'shared.bias'" in message, message


# -- a peer dying mid-step -------------------------------------------------------------------------

def die_before_backward(rank, world_size):
    torch.manual_seed(0)
    model = FusedReducer(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]),
                         first_bucket_mb=0.001, bucket_cap_mb=0.001)
    x = torch.randn(4, 32)
    for step in range(4):
        loss = model(x).sum()
        if step == 2 and rank == 1:
            os._exit(1)
        start = time.monotonic()
        try:
            loss.backward()
        except Exception as e:  # noqa: BLE001
            return step, type(e).__name__, str(e), time.monotonic() - start, model.backend
    return "no error"


def test_peer_dying_mid_step_makes_survivor_raise_promptly_naming_the_bucket():
    outcomes = spawn_ranks(die_before_backward, 2, timeout=90, reporting={0})
    status, payload = outcomes[0]
    assert status == "ok", payload
    assert payload != "no error"
    step, kind, message, elapsed, backend = payload
    assert step == 2
    assert kind == "RuntimeError", message
    assert "bucket" in message and "all-reduce" in message, message
    if backend == "shm":  # both ranks on this host: the transport watches the peer's process
        assert "rank 1 (pid" in message and "exited" in message, message
        assert elapsed < 10, elapsed
    assert elapsed < 60, elapsed


def stall_past_the_group_timeout(rank, world_size):
    """FusedReducer without `timeout` waits as long as its process group's collectives: the
    default group's (spawn_ranks' pg_timeout, 60 s), a new_group's own (9 s, 4 s); an explicit
    timeout wins. On the 4 s group rank 1 then stalls 10 s before its backward (alive: only a
    timeout can end rank 0's wait)."""
    on_group = FusedReducer(nn.Linear(4, 4), process_group=dist.new_group(
        [0, 1], timeout=timedelta(seconds=9)))
    explicit = FusedReducer(nn.Linear(4, 4), timeout=7)
    timeouts = dict(default=FusedReducer(nn.Linear(4, 4)).attachment.timeout_s,
                    explicit=explicit.attachment.timeout_s, group=on_group.attachment.timeout_s)
    # Unpickled, a model attaches to the default group at its first forward: that group's
    # timeout when none was asked for, the one asked for otherwise.
    for name, original in (("unpickled", on_group), ("unpickled_explicit", explicit)):
        copy = pickle.loads(pickle.dumps(original))
        copy(torch.randn(2, 4))
        timeouts[name] = copy.attachment.timeout_s
    model = FusedReducer(nn.Linear(4, 4), process_group=dist.new_group(
        [0, 1], timeout=timedelta(seconds=4)))
    loss = model(torch.randn(2, 4)).sum()
    if rank == 1:
        time.sleep(10)
    start = time.monotonic()
    try:
        loss.backward()
        raised = None
    except RuntimeError as e:
        raised = str(e)
    return dict(timeouts=timeouts, raised=raised, elapsed=time.monotonic() - start)


def test_the_process_groups_timeout_is_the_default_as_in_ddp():
    outcomes = spawn_ranks(stall_past_the_group_timeout, 2, timeout=90, pg_timeout=60)
    status, payload = outcomes[0]
    assert status == "ok", payload
    assert payload["timeouts"] == dict(default=60.0, explicit=7.0, group=9.0, unpickled=60.0,
                                       unpickled_explicit=7.0), payload
    assert payload["raised"] is not None and "timed out" in payload["raised"], payload
    assert 3 < payload["elapsed"] < 9, payload  # its group's 4 s, not the default group's 60 s
