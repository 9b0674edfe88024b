"""fused_reducer.transports.elastic: a restarted torchrun attempt whose process group
fails at FusedReducer's first collective says that the failure is torch's (pytorch#135712) and
what to do; outside a restart the error is left as it is. The end-to-end restarts, with DDP beside
FusedReducer, are tests/test_torchrun_restart.py (which removes the dead keys with
forget_dead_attempt_keys()) and scripts/restart_study.py (many runs, both set-ups).
forget_dead_attempt_keys() is checked on a real TCPStore standing in for torchrun's agent store:
the keys torch's groups wrote in the dead attempt (listed around init_process_group) are removed,
FusedReducer's and the job's own are kept; restart_failure() blames torch only in a restarted
attempt over the agent store, with the advice that fits."""
import os

import pytest
import torch.distributed as dist
from torch import nn

import fused_reducer
import fused_reducer.transports.elastic as elastic
import fused_reducer.core.attachment as reducer_module
from fused_reducer.testing.launch import reserved_port

RESTARTED = {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.fixture
def one_rank_group():
    with reserved_port() as port:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    yield
    dist.destroy_process_group()


def broken_first_collective(*args, **kwargs):
    raise RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:61873: "
                       "Connection reset by peer")


@pytest.mark.parametrize("restarted", [True, False])
def test_a_failed_first_collective_in_a_restarted_attempt_names_torch_and_the_fix(
        one_rank_group, monkeypatch, restarted):
    for key in RESTARTED:
        monkeypatch.delenv(key, raising=False)
    if restarted:
        for key, value in RESTARTED.items():
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(reducer_module, "verify_same_model", broken_first_collective)
    with pytest.raises(RuntimeError) as raised:
        fused_reducer.FusedReducer(nn.Linear(4, 4))
    message = str(raised.value)
    assert "Connection reset by peer" in message, message
    if restarted:
        assert "restarted attempt 1" in message and "pytorch/pytorch#135712" in message, message
        assert "not FusedReducer" in message and "forget_dead_attempt_keys()" in message, message
        assert isinstance(raised.value.__cause__, RuntimeError)
    else:
        assert "#135712" not in message, message  # not a restart: the error as torch raised it


def test_forget_dead_attempt_keys_does_nothing_outside_a_restart_and_refuses_after_init(
        one_rank_group, monkeypatch):
    for key in RESTARTED:
        monkeypatch.delenv(key, raising=False)
    assert elastic.forget_dead_attempt_keys() == {"attempt": 0, "removed": []}
    for key, value in RESTARTED.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match="before dist.init_process_group"):
        elastic.forget_dead_attempt_keys()


# -- forget_dead_attempt_keys on a real store: torch's keys of the dead attempt, and only those ----

@pytest.fixture
def agent_store(monkeypatch):
    """A TCPStore standing in for torchrun's agent store (it outlives the attempts), and the
    environment torchrun gives a one-rank worker that uses it."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "GROUP_WORLD_SIZE": "1",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(elastic, "_forgotten_in_attempt", None)
    yield store
    if dist.is_initialized():
        dist.destroy_process_group()


def dead_attempt(store):
    """Attempt 0 as a worker runs it: torch's default group and two more groups, a FusedReducer
    that trained a step, the job's own keys; then the attempt dies. Returns the keys torch's
    groups wrote (listed from the store around init_process_group / new_group, not from
    elastic.py's prefix), FusedReducer's, and the job's own."""
    import torch
    user_keys = {"trainer/epoch": "3", "trainer/default_pg/0/note": "x"}
    for key, value in user_keys.items():
        store.set(key, value)
    before = set(store.list_keys())
    dist.init_process_group("gloo")  # env://: a client of the agent store, as under torchrun
    dist.new_group([0])
    dist.new_group([0])
    torch_keys = set(store.list_keys()) - before
    model = fused_reducer.FusedReducer(nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    ours = set(store.list_keys()) - before - torch_keys
    model.close()
    dist.destroy_process_group()
    assert len(torch_keys) >= 3 and ours, (torch_keys, ours)
    return torch_keys, ours, set(user_keys)


def test_forget_dead_attempt_keys_removes_exactly_torchs_group_keys_of_the_dead_attempt(
        agent_store, monkeypatch):
    store = agent_store
    torch_keys, ours, user_keys = dead_attempt(store)
    left = set(store.list_keys())
    assert left == torch_keys | ours | user_keys
    # The first attempt has no dead one: nothing removed, nothing written.
    assert elastic.forget_dead_attempt_keys() == {"attempt": 0, "removed": []}
    assert set(store.list_keys()) == left
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    result = elastic.forget_dead_attempt_keys()
    assert result == {"attempt": 1, "removed": sorted(torch_keys)}
    done = "fused_reducer/elastic/attempt1/forgotten"
    # Gone: torch's keys, every one. Kept: FusedReducer's (their namespace is per attempt) and
    # the job's own, even one that spells default_pg/ inside it.
    assert set(store.list_keys()) == ours | user_keys | {done}
    # Another rank of the attempt waits for rank 0 and reports the same keys, removing nothing.
    monkeypatch.setenv("RANK", "1")
    assert elastic.forget_dead_attempt_keys() == result
    assert set(store.list_keys()) == ours | user_keys | {done}
    # The attempt's group now comes up over the cleaned store; a failure at FusedReducer's first
    # collective then points at the peers, not at the fix that was already applied.
    monkeypatch.setenv("RANK", "0")
    dist.init_process_group("gloo")
    message = elastic.restart_failure(RuntimeError("Connection refused"))
    assert "restarted attempt 1" in message and "other ranks' logs" in message, message
    assert "call fused_reducer.transports.elastic.forget_dead_attempt_keys()" not in message, message


def test_forget_dead_attempt_keys_refuses_several_agents_and_leaves_the_store_alone(
        agent_store, monkeypatch):
    store = agent_store
    torch_keys, ours, user_keys = dead_attempt(store)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="one torchrun agent"):
        elastic.forget_dead_attempt_keys()
    assert set(store.list_keys()) == torch_keys | ours | user_keys
    # Without the agent store (each attempt has its own): nothing to forget, nothing touched.
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert elastic.forget_dead_attempt_keys() == {"attempt": 1, "removed": []}
    assert set(store.list_keys()) == torch_keys | ours | user_keys


@pytest.mark.parametrize("attempt,agent_store_env,gws,expected", [
    ("0", "True", "1", None),                       # the first attempt: the error as raised
    ("2", "False", "1", None),                      # a store per attempt: no stale keys
    ("2", None, "1", None),
    ("2", "True", "1", "forget_dead_attempt_keys() on every rank"),
    ("2", "True", "2", "restart the job"),          # several agents: no safe removal
])
def test_restart_failure_attributes_to_torch_only_in_a_restarted_attempt_over_the_agent_store(
        monkeypatch, attempt, agent_store_env, gws, expected):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
    monkeypatch.setenv("GROUP_WORLD_SIZE", gws)
    if agent_store_env is None:
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", agent_store_env)
    monkeypatch.setattr(elastic, "_forgotten_in_attempt", 1)  # an earlier attempt's removal
    message = elastic.restart_failure(RuntimeError("Gloo connectFullMesh failed"))
    if expected is None:
        assert message is None
        return
    assert f"restarted attempt {attempt}: Gloo connectFullMesh failed" in message, message
    assert "not FusedReducer" in message and "pytorch/pytorch#135712" in message, message
    assert expected in message, message
    assert "other ranks' logs" not in message, message


def test_a_torch_dist_error_at_the_first_collective_keeps_its_class_when_explained(
        one_rank_group, monkeypatch):
    for key, value in RESTARTED.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    monkeypatch.setattr(elastic, "_forgotten_in_attempt", None)

    def refused(*args, **kwargs):
        raise dist.DistNetworkError("Gloo connectFullMesh failed: Connection refused")
    monkeypatch.setattr(reducer_module, "verify_same_model", refused)
    with pytest.raises(dist.DistNetworkError) as raised:
        fused_reducer.FusedReducer(nn.Linear(4, 4))
    assert "pytorch/pytorch#135712" in str(raised.value)
    assert isinstance(raised.value.__cause__, dist.DistNetworkError)
    # A FusedReducer error there (a model that differs across ranks) is ours: never explained.
    def ours(*args, **kwargs):
        raise fused_reducer.FusedReducerError("parameter 0 differs across ranks")
    monkeypatch.setattr(reducer_module, "verify_same_model", ours)
    with pytest.raises(fused_reducer.FusedReducerError) as raised:
        fused_reducer.FusedReducer(nn.Linear(4, 4))
    assert "#135712" not in str(raised.value)
