"""fused_reducer.torchft with replica groups of several ranks (issue 47, part 2).

Two replica groups of two ranks, every rank a process (tests/ft_worker.py with `group_size` and
`rank`; a group's ranks share their own gloo group, as torchrun starts them, and each rank has
its own Manager), around a Lighthouse started in this process. Inside a group a bucket is
reduced over the group's process group; across groups by each rank's Manager (the same group
rank of every group). The test replays the committed steps in float64 on one process (the global
batch: every rank of every participating group) and compares.

Bounded as tests/test_fault_tolerance.py: every rank gives up after `max_s`, the test waits at
most WAIT_S and kills only the processes it started (by pid).
"""
import os
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install .[ft])")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fused_reducer.torchft as ft  # noqa: E402
from fused_reducer.errors import FusedReducerError  # noqa: E402

from ft_common import (TOLERANCE, WAIT_S, final_parameters, max_error, records,  # noqa: E402
                       replay, start, start_lighthouse, start_together, wait_all)

GROUPS, RANKS = 2, 2
MEMBERS = [(g, r) for g in range(GROUPS) for r in range(RANKS)]


@pytest.fixture
def lighthouse():
    server = start_lighthouse()
    yield server.address()
    server.shutdown()


@pytest.fixture
def own_group():
    """A one-rank gloo group in this process, removed afterwards."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


class PeerGroupManager:
    """What GroupReduction calls on a Manager, for a quorum of this group and one peer group of
    `peer_size` ranks whose every rank contributes `peer_value`: the all-reduce adds the peer's
    sum and the peer's size (the count that every tensor across groups carries), completed."""

    def __init__(self, peer_size, peer_value):
        self.peer_size, self.peer_value = peer_size, peer_value
        self.errors = []

    def allreduce(self, tensor, reduce_op=None):
        tensor[:-1] += self.peer_size * self.peer_value
        tensor[-1] += self.peer_size
        done = torch.futures.Future()
        done.set_result([tensor])
        return SimpleNamespace(_work=SimpleNamespace(get_future=lambda: done))

    def num_participants(self):
        return 2

    def wrap_future(self, fut, default):
        return fut

    def report_error(self, e):
        self.errors.append(e)

    def errored(self):
        return self.errors[-1] if self.errors else None


@pytest.mark.parametrize("method", ft.GROUP_REDUCTIONS)
def test_group_reduction_averages_over_global_ranks_and_refuses_groups_of_other_sizes(
        own_group, method):
    """A bucket's average is over every rank of the participating groups; a peer group of
    another size is refused at that very step (the Manager records the error, so the step is
    not committed, and the reducer raises it at the end of backward)."""
    flat = torch.full((7,), 4.0)  # 7: not a multiple of a group size, padded for reduce_scatter
    same = ft.GroupReduction(PeerGroupManager(peer_size=1, peer_value=2.0), own_group, method)
    assert torch.equal(same.launch(flat).wait(), torch.full((7,), 3.0))  # (4 + 2) / 2 ranks
    manager = PeerGroupManager(peer_size=3, peer_value=2.0)
    other = ft.GroupReduction(manager, own_group, method)
    with pytest.raises(FusedReducerError, match="same number of ranks"):
        other.launch(torch.full((7,), 4.0)).wait()
    assert manager.errored() is not None
    with pytest.raises(FusedReducerError, match="group_reduction must be one of"):
        ft.GroupReduction(manager, own_group, "ring")
    for reduction in (same, other):
        reduction.close()


class OneGroupManager:
    """What the adapter calls on a Manager, for a quorum of this replica group alone (no
    Lighthouse): the all-reduce across groups leaves the tensor as it is, completed."""
    _use_async_quorum = False

    def allreduce(self, tensor, reduce_op=None):
        done = torch.futures.Future()
        done.set_result([tensor])
        return SimpleNamespace(_work=SimpleNamespace(get_future=lambda: done), wait=lambda: True)

    def num_participants(self):
        return 1

    def participating_rank(self):
        return 0

    def current_step(self):
        return 1  # not a step of the health exchange (straggler_interval=10: steps 0, 10, ...)

    def wrap_future(self, fut, default):
        return fut

    def report_error(self, e):
        raise AssertionError(f"unexpected error reported to the Manager: {e}")

    def errored(self):
        return None


def one_group_of_two_ranks(rank, world_size):
    """On each of 2 spawned ranks (one replica group; tests/dist_utils.py's gloo group): what is
    refused with a group of several ranks, then one step per method: every rank's gradients
    are the average over both ranks' batches."""
    import ft_worker
    from fused_reducer import ShardedOptimizer

    with pytest.raises(FusedReducerError, match="find_unused_parameters=True is not supported"):
        ft.DistributedDataParallel(OneGroupManager(), ft_worker.make_model(),
                                   find_unused_parameters=True)
    reference = ft_worker.make_model(torch.float64)
    for r in range(world_size):
        x, y = ft_worker.batch(0, 0, torch.float64, rank=r)
        (ft_worker.loss_fn(reference(x), y) / world_size).backward()
    errors = {}
    for method in ft.GROUP_REDUCTIONS:
        model = ft.DistributedDataParallel(OneGroupManager(), ft_worker.make_model(),
                                           first_bucket_mb=0.004, bucket_cap_mb=0.04,
                                           group_reduction=method)
        if method == ft.GROUP_REDUCTIONS[0]:
            with pytest.raises(FusedReducerError, match="within a replica group"):
                ShardedOptimizer(model, torch.optim.SGD, lr=0.1)
        x, y = ft_worker.batch(0, 0, rank=rank)
        ft_worker.loss_fn(model(x), y).backward()
        errors[method] = max((p.grad.double() - q.grad).abs().max().item()
                             for p, q in zip(model.module.parameters(), reference.parameters()))
        model.close()
    return errors


def test_one_group_of_two_ranks_averages_inside_and_refuses():
    """Both methods average over the group's ranks (stand-in Manager: the group alone);
    find_unused_parameters and ShardedOptimizer are refused with a group of several ranks."""
    from dist_utils import run_ranks
    for errors in run_ranks(one_group_of_two_ranks, 2):
        assert all(e < 1e-6 for e in errors.values()), errors


def group_configs(**cfg):
    return {key: dict(group_size=RANKS, final_participants=GROUPS, **cfg) for key in MEMBERS}


def replay_members(recs):
    """ft_common.replay of every member's records ({key: records})."""
    return replay([rec for key in MEMBERS for rec in recs[key]])


def check_group_agreement(recs):
    """Both ranks of a group took the same decision at every step (should_commit is the
    group's), with the same layout."""
    for g in range(GROUPS):
        decisions = [[(rec["step"], rec["commit"], rec["participants"], rec["layout"])
                      for rec in recs[(g, r)] if "step" in rec] for r in range(RANKS)]
        assert decisions[0] == decisions[1], (g, decisions)


# Each multi-process test runs one of the two methods, so both are checked against float64
# without a third run of four processes (the kill test: the one that is not the default).
OTHER_GROUP_REDUCTION = next(method for method in ft.GROUP_REDUCTIONS
                             if method != ft.DEFAULT_GROUP_REDUCTION)


def test_two_groups_of_two_ranks_match_float64(tmp_path, lighthouse):
    """2 groups x 2 ranks, no failure, the default method: every step commits with both groups,
    every rank's parameters equal the float64 model trained on the global batch (4 batches a
    step), every rank ends with the same parameters, and the buckets overlap backward."""
    steps = 5
    procs = start_together(tmp_path, lighthouse, group_configs(steps=steps, together=2))
    wait_all(procs, tmp_path, time.monotonic() + WAIT_S)
    recs = {key: records(tmp_path, key) for key in MEMBERS}
    check_group_agreement(recs)
    reference, steps_done, committed = replay_members(recs)
    assert all(len(committed[s]) == GROUPS for s in steps_done), committed
    assert all(rec["commit"] and rec["participants"] == GROUPS
               for key in MEMBERS for rec in recs[key])
    finals = {key: final_parameters(tmp_path, key) for key in MEMBERS}
    for key, final in finals.items():
        assert max_error(final, reference) < TOLERANCE, key
        assert max_error(final, {n: t.double() for n, t in finals[MEMBERS[0]].items()}) == 0.0
    # Asynchronous: backward computed gradients while buckets were being reduced.
    overlapped = [rec["overlapped"] for key in MEMBERS for rec in recs[key]]
    assert sum(overlapped) >= steps, overlapped


def test_killed_rank_group_restarted_heals_per_rank(tmp_path, lighthouse):
    """Rank 1 of group 1 is SIGKILLed (its own pid) in the backward of step 3 with a bucket in
    flight; its group's other rank is then killed by the test (by pid), as torchrun's agent stops
    a group's remaining workers. Group 0 never applies a partial average (that step is not
    committed on either of its ranks) and goes on in the same processes, alone; group 1,
    restarted as a whole, heals rank by rank from group 0's same rank (model, optimizer, limits,
    layout, step) and joins; all four ranks end equal to the float64 replay of the committed
    steps and to each other. With the method that is not the default."""
    kill_step, steps = 3, 8
    configs = group_configs(steps=steps, pause_s=0.05, group_reduction=OTHER_GROUP_REDUCTION)
    configs[(1, 1)].update(kill_step=kill_step, kill_in="backward", kill_after_buckets=1)
    procs = start_together(tmp_path, lighthouse, configs)
    deadline = time.monotonic() + WAIT_S
    try:
        code = procs[(1, 1)].wait(timeout=WAIT_S / 2)
    except subprocess.TimeoutExpired:
        code = None
    assert code == -signal.SIGKILL, f"rank 1 of group 1 was to kill itself, ended with {code}"
    if procs[(1, 0)].poll() is None:  # as torchrun does when a worker of its group dies
        procs[(1, 0)].send_signal(signal.SIGKILL)
    procs[(1, 0)].wait()
    killed = [rec for rec in records(tmp_path, (1, 1)) if "killed" in rec]
    assert killed and killed[0]["killed"] == kill_step and 1 <= killed[0]["launched"] < 3, killed
    first_pids = {key: procs[key].pid for key in MEMBERS}
    # Group 1 restarted at once (its processes import meanwhile), held before its Managers
    # exist until group 0 has committed a step alone: it goes on without its peer group.
    os.remove(os.path.join(tmp_path, "replica1.store"))  # group 1's next store is a new one
    go_again = os.path.join(tmp_path, "go_restarted")
    for r in range(RANKS):
        procs[(1, r)] = start(tmp_path, (1, r), lighthouse, restarted=True, hold=go_again,
                              **configs[(1, 0)])
    while not any(rec.get("commit") and rec["participants"] == 1
                  for r in range(RANKS) for rec in records(tmp_path, (0, r))):
        if time.monotonic() > deadline - 60 or procs[(0, 0)].poll() is not None:
            wait_all(procs, tmp_path, time.monotonic(), check=False)
            raise AssertionError("group 0 did not commit a step alone")
        time.sleep(0.1)
    open(go_again, "w").close()
    wait_all(procs, tmp_path, deadline)

    recs = {key: records(tmp_path, key) for key in MEMBERS}
    check_group_agreement({key: [rec for rec in recs[key] if rec.get("pid") == procs[key].pid]
                           for key in MEMBERS})
    for r in range(RANKS):
        survivor = recs[(0, r)]
        assert {rec["pid"] for rec in survivor} == {first_pids[(0, r)]}  # never restarted
        at_kill = [rec for rec in survivor if rec["step"] == kill_step][0]
        assert not at_kill["commit"], at_kill
        restarted = [rec for rec in recs[(1, r)] if rec.get("pid") == procs[(1, r)].pid]
        joined = restarted[0]
        assert joined["healed_at"] > kill_step and joined["step"] == joined["healed_at"]
        assert joined["participants"] == GROUPS and joined["healed_from_ranks"] == [r], joined
        same_step = [rec for rec in survivor if rec["step"] == joined["step"]][0]
        assert same_step["commit"] and joined["commit"]
        assert joined["layout"] == same_step["layout"] and joined["caps"] == same_step["caps"]
    reference, _, _ = replay_members(recs)
    finals = {key: final_parameters(tmp_path, key) for key in MEMBERS}
    for key, final in finals.items():
        assert max_error(final, reference) < TOLERANCE, key
        assert max_error(final, {n: t.double() for n, t in finals[MEMBERS[0]].items()}) == 0.0


def test_forget_dead_attempt_keys_removes_the_dead_managers_address(monkeypatch):
    """In a restarted torchrun attempt, fused_reducer.torchft.forget_dead_attempt_keys removes
    what the dead attempt's Manager left in torchrun's store (its server's address, the replica
    id: a restarted rank other than 0 would connect to the dead server) with torch's default-group
    keys, and nothing else."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": "0",
           "WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RESTART_COUNT": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    dead = {"manager_addr": "http://dead:1", "replica_id": "train_1:dead", "default_pg/0//0": "x"}
    for key, value in dict(dead, **{"trainer/epoch": "3"}).items():
        store.set(key, value)
    assert not dist.is_initialized()
    removed = ft.forget_dead_attempt_keys()["removed"]
    assert sorted(removed) == sorted(dead)
    assert sorted(store.list_keys()) == sorted(["trainer/epoch",
                                                "fused_reducer/elastic/attempt1/forgotten"])
