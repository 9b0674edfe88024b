"""fused_reducer.elastic (issue 29 item 4): a restarted torchrun attempt whose process group
fails at FusedReducer's first collective says that the failure is torch's (pytorch#135712) and
what to do; outside a restart the error is left as it is. The end-to-end restarts, with DDP beside
FusedReducer, are tests/test_torchrun_restart.py (which removes the dead keys with
forget_dead_attempt_keys()) and scripts/restart_study.py (many runs, both set-ups)."""
import os
import socket

import pytest
import torch.distributed as dist
from torch import nn

import fused_reducer
import fused_reducer.elastic as elastic
import fused_reducer.reducer as reducer_module

RESTARTED = {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.fixture
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
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
    monkeypatch.setattr(reducer_module, "_verify_same_model", broken_first_collective)
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
