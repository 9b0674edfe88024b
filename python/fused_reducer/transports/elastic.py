"""Restarting under torchrun: the keys a dead attempt left in torchrun's store.

torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True, the default of its c10d rendezvous,
--standalone included) outlives the workers it restarts, and torch does not separate one
attempt's keys of its default process group from the next (pytorch/pytorch#135712). A restarted
attempt's gloo group can then read the dead attempt's address of a peer: init_process_group
fails with "Gloo connectFullMesh failed ... Connection refused", or hangs until its timeout.
Measured here (scripts/restart_study.py, docs/TESTING.md "torchrun restarts"), DDP and
FusedReducer alike, since it happens before either exists. FusedReducer's own keys live in a
namespace each new group agrees on and need nothing (python/fused_reducer/transports/transport.py,
attempt_token).

    from fused_reducer.transports.elastic import forget_dead_attempt_keys
    forget_dead_attempt_keys()   # on every rank, before init_process_group
    dist.init_process_group("gloo")

One torchrun agent (one node) only: with several, an agent that restarts for another node's
failure keeps its restart count, so the ranks cannot tell the dead attempt's keys apart through
it (it raises there).

It removes the keys of torch's default process group ("default_pg/...") that a dead attempt left,
on rank 0, while the other ranks wait for it; nothing outside torchrun, in the first attempt, or
with a store per attempt. It relies on a torch detail (the key prefix of the default group and
TCPStore.list_keys): it says so when list_keys is missing, and warns when a restarted attempt
finds none of those keys (a torch that names them otherwise would leave them in place).
"""
import json
import os
import warnings
from datetime import timedelta

import torch.distributed as dist

DEFAULT_GROUP_PREFIX = "default_pg/"
FUSED_REDUCER_MARK = "/fused_reducer/"


def forget_dead_attempt_keys(timeout=timedelta(seconds=60), also=()):
    """Remove the keys torch's default process group left in torchrun's store in a dead attempt
    (see the module's docstring), and the keys named in `also` (exact names other libraries
    write there once per attempt, e.g. fused_reducer.torchft's Manager keys). Call on every rank
    before `dist.init_process_group()` in a job that torchrun may restart (--max-restarts).
    Returns {"attempt", "removed": [keys]} (the same on every rank); does nothing (removed: [])
    outside a restarted torchrun attempt."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {"attempt": attempt, "removed": []}
    if dist.is_initialized():
        raise RuntimeError(
            "fused_reducer.transports.elastic.forget_dead_attempt_keys() must run before "
            "dist.init_process_group(): afterwards it would remove this attempt's own keys")
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            "fused_reducer.transports.elastic.forget_dead_attempt_keys() works for one torchrun "
            "agent (one node, e.g. --standalone) only: with several agents, an agent that restarts for "
            "another node's failure keeps its restart count (TORCHELASTIC_RESTART_COUNT), so the "
            "ranks cannot agree through it which keys are the dead attempt's")
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    done = f"fused_reducer/elastic/attempt{attempt}/forgotten"
    if rank == 0:
        if not hasattr(store, "list_keys"):
            raise RuntimeError(
                "fused_reducer.transports.elastic.forget_dead_attempt_keys(): this torch's TCPStore "
                "has no list_keys(), so the dead attempt's keys cannot be found; upgrade torch, or let "
                "torchrun restart with a fresh store (TORCHELASTIC_USE_AGENT_STORE=False)")
        keys = store.list_keys()
        torch_keys = sorted(k for k in keys
                            if k.startswith(DEFAULT_GROUP_PREFIX) and FUSED_REDUCER_MARK not in k)
        removed = torch_keys + sorted(k for k in also if k in keys)
        for key in removed:
            store.delete_key(key)
        if not torch_keys:
            warnings.warn("fused_reducer.transports.elastic.forget_dead_attempt_keys(): "
                          f"attempt {attempt} found no '{DEFAULT_GROUP_PREFIX}' keys in torchrun's store; if this "
                          "torch names its default group's keys otherwise, none were removed")
        store.set(done, json.dumps(removed))
    else:
        store.wait([done])
        removed = json.loads(store.get(done))
    global _forgotten_in_attempt
    _forgotten_in_attempt = attempt
    return {"attempt": attempt, "removed": removed}


_forgotten_in_attempt = None  # the attempt whose dead keys forget_dead_attempt_keys() removed


def restart_failure(error):
    """The message for a process-group failure at FusedReducer's first collective, or None: in a
    restarted torchrun attempt with the agent store, such a failure is torch's group re-created
    over the dead attempt's keys (pytorch/pytorch#135712), and the user must learn that it is not
    FusedReducer's, and what to do. Outside a restart, None (the error stands as it is)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if _forgotten_in_attempt == attempt:
        advice = ("forget_dead_attempt_keys() had removed the dead attempt's keys, so look at the "
                  "other ranks' logs for why a peer did not join")
    elif int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        advice = ("restart the job (on several nodes no key can be told apart safely: an agent "
                  "restarting for another node's failure keeps its restart count)")
    else:
        advice = ("call fused_reducer.transports.elastic.forget_dead_attempt_keys() on every rank "
                  "before dist.init_process_group() (it removes those keys; measured in "
                  "scripts/restart_study.py)")
    return (f"FusedReducer: the process group's first collective (checking the model across "
            f"ranks, at construction) failed in torchrun's restarted attempt {attempt}: {error}. "
            "The failing part is torch's process group, not FusedReducer: torchrun's store keeps "
            "the dead attempt's keys of the default group, and gloo can connect to a dead peer's "
            "address (pytorch/pytorch#135712; DDP's construction fails alike). To restart "
            f"cleanly, {advice}.")
