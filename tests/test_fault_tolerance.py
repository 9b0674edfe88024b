"""fused_reducer.torchft: FusedReducer as the reducer of torchft replica groups (issue 47).

Replicas are processes (tests/ft_worker.py, one rank each, gloo on 127.0.0.1) around a Lighthouse
started in this process (torchft._torchft.LighthouseServer). Each replica logs every step (the
step, whether it committed, the participants, what its buckets did) and writes its final
parameters; the test replays the committed steps in float64 on one process (the global batch of
each step: the participants' batches, their gradients averaged) and compares.

Bounded: every replica gives up after `max_s`, the test waits for it at most WAIT_S, and kills
only the processes it started (by pid) if they outlive that.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install .[ft])")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchft.work import _DummyWork  # noqa: E402

import fused_reducer.torchft as ft  # noqa: E402
from fused_reducer.errors import FusedReducerError  # noqa: E402

import ft_worker  # noqa: E402
from ft_common import (TOLERANCE, WAIT_S, max_error, records, records_or_none,  # noqa: E402
                       replay, start, start_together, start_lighthouse, wait_all)


@pytest.fixture
def lighthouse():
    server = start_lighthouse()
    yield server.address()
    server.shutdown()


class LocalManager:
    """What the adapter calls on a Manager, for one replica alone (no Lighthouse): every
    all-reduce is torchft's completed work of a replica on its own."""
    _use_async_quorum = False

    def allreduce(self, tensor, reduce_op=None):
        return _DummyWork(tensor)

    def num_participants(self):
        return 1

    def participating_rank(self):
        return 0

    def current_step(self):
        return 0

    def errored(self):
        return None


@pytest.fixture
def own_group():
    """A one-rank gloo group in this process (a replica group of one), removed afterwards."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def train_locally(model, steps, first_step=0):
    for step in range(first_step, first_step + steps):
        x, y = ft_worker.batch(step, 0)
        ft_worker.loss_fn(model(x), y).backward()


def test_healing_state_gives_a_fresh_replica_the_live_layout(own_group):
    """reducer_state of a replica that rebuilt (after its first step, then for a new cap) makes
    a fresh replica's next forward build exactly that layout; the limits alone would not (this
    model's ready order is not its reverse registration order)."""
    live = ft.DistributedDataParallel(LocalManager(), ft_worker.make_model(),
                                      process_group=own_group, first_bucket_mb=0.004,
                                      bucket_cap_mb=0.04)
    train_locally(live, 2)
    live.bucket_cap_bytes = 15_000
    train_locally(live, 1, first_step=2)
    state = ft.reducer_state(live)
    assert state["bucket_caps_bytes"][-1] == 15_000

    limits_only = ft.DistributedDataParallel(LocalManager(), ft_worker.make_model(),
                                             process_group=own_group)
    limits_only.bucket_caps_bytes = state["bucket_caps_bytes"]
    train_locally(limits_only, 1)
    assert limits_only.bucket_parameter_names() != live.bucket_parameter_names()

    joining = ft.DistributedDataParallel(LocalManager(), ft_worker.make_model(),
                                         process_group=own_group)
    ft.load_reducer_state(joining, state)
    train_locally(joining, 1)  # the forward rebuilds, and checks the result
    assert joining.bucket_parameter_names() == live.bucket_parameter_names()
    assert joining.bucket_caps_bytes == live.bucket_caps_bytes
    train_locally(joining, 1, first_step=1)  # no rebuild after its first step: kept
    assert joining.bucket_parameter_names() == live.bucket_parameter_names()
    for model in (live, limits_only, joining):
        model.close()


def test_limits_changed_after_a_heal_rebuild_the_received_order(own_group):
    """A replica healed at the step where every replica changes its limits (after the quorum,
    before the forward): its forward rebuilds the received order with the new limits, as the
    live replica's does, instead of refusing the sender's layout from before the change
    (scripts/ft_stress.py found that refusal: a heal at step 2 of tests/ft_worker.py)."""
    live = ft.DistributedDataParallel(LocalManager(), ft_worker.make_model(),
                                      process_group=own_group, first_bucket_mb=0.004,
                                      bucket_cap_mb=0.04)
    train_locally(live, 2)
    state = ft.reducer_state(live)
    joining = ft.DistributedDataParallel(LocalManager(), ft_worker.make_model(),
                                         process_group=own_group)
    ft.load_reducer_state(joining, state)
    for model in (live, joining):
        model.bucket_cap_bytes = 15_000
        train_locally(model, 1, first_step=2)
    assert joining.bucket_parameter_names() == live.bucket_parameter_names()
    assert [list(b) for b in live.bucket_parameter_names()] != state["bucket_parameter_names"]
    for model in (live, joining):
        model.close()


def test_heal_after_the_first_step_gives_the_layout_the_live_replica_rebuilds(own_group):
    """A replica healed from a peer that has completed only its first step (its rebuild from
    the observed gradient order still pending, done at its next forward) builds the layout the
    peer rebuilds, not the peer's initial one (a torchrun check of replica groups of two ranks
    found this: a group joining a peer at step 1 crashed in gloo on buckets of other sizes)."""
    live = ft.DistributedDataParallel(LocalManager(), ft_worker.make_model(),
                                      process_group=own_group, first_bucket_mb=0.004,
                                      bucket_cap_mb=0.04)
    train_locally(live, 1)
    initial = live.bucket_parameter_names()
    joining = ft.DistributedDataParallel(LocalManager(), ft_worker.make_model(),
                                         process_group=own_group)
    ft.load_reducer_state(joining, ft.reducer_state(live))
    for model in (live, joining):
        train_locally(model, 1, first_step=1)
    assert live.bucket_parameter_names() != initial  # the live replica did rebuild
    assert joining.bucket_parameter_names() == live.bucket_parameter_names()
    for model in (live, joining):
        model.close()


class RankOneManager(LocalManager):
    """A quorum of two where this replica is quorum rank 1: the agreement's all-reduce brings
    rank 0's row, given by `rank0_row()` (this replica writes zeros); the buckets' all-reduces
    leave the tensor as it is."""

    def __init__(self, rank0_row):
        self.rank0_row = rank0_row

    def participating_rank(self):
        return 1

    def num_participants(self):
        return 2

    def allreduce(self, tensor, reduce_op=None):
        if tensor.dtype == torch.float64 and tensor.dim() == 1:  # the agreement's row (the
            # buckets are float32, the health exchange's rows a matrix)
            assert not tensor.any(), "quorum rank 1 must write zeros"
            tensor.add_(self.rank0_row())
        return _DummyWork(tensor)


def test_forward_agrees_limits_and_order_with_quorum_rank_0(own_group):
    """Each forward takes quorum rank 0's limits and order (Note [Layout agreed through the
    quorum]): the first step's rebuild uses rank 0's gradient-ready order though this replica
    observed another, a cap set on rank 0 alone reaches this replica at that step, a limit set
    on this replica alone is undone; the layouts are equal at every step."""
    kwargs = dict(process_group=own_group, first_bucket_mb=0.004, bucket_cap_mb=0.04)
    rank0 = ft.DistributedDataParallel(LocalManager(), ft_worker.make_model(), **kwargs)
    names = ft._param_names(rank0)
    order_of_rank0 = {}  # what rank 0 sends at step 1: its ready order, rotated by one

    def rank0_row():
        row = ft._agreement_row(rank0)
        if ft._reducer_of(rank0).stats()["step"] == 1:
            tail = len(row) - len(names)
            order = [int(i) for i in row[tail:].tolist()]
            order_of_rank0["order"] = order[1:] + order[:1]
            row[tail:] = torch.tensor(order_of_rank0["order"], dtype=row.dtype)
        return row

    rank1 = ft.DistributedDataParallel(RankOneManager(rank0_row), ft_worker.make_model(), **kwargs)
    for step in range(4):
        if step == 2:
            rank0.bucket_cap_bytes = 15_000  # on rank 0 only: every replica takes it
        if step == 3:
            rank1.first_bucket_bytes = 2_000  # on rank 1 only: undone
        train_locally(rank1, 1, first_step=step)  # its forward agrees with rank 0's row first
        if step == 1:
            # Rebuilt from rank 0's order, not from its own: as a fresh replica told that order.
            reference = ft.DistributedDataParallel(LocalManager(), ft_worker.make_model(),
                                                   **kwargs)
            ft._rebuild_as(reference, rank0.bucket_caps_bytes, rank0.last_bucket_bytes, None,
                           order_of_rank0["order"])
            train_locally(reference, 1)
            assert rank1.bucket_parameter_names() == reference.bucket_parameter_names()
            reference.close()
            # Rank 0 rebuilds from its own order here: told the rotated one as well.
            ft._reducer_of(rank0).request_rebuild_from_order(order_of_rank0["order"])
        train_locally(rank0, 1, first_step=step)
        assert rank1.bucket_caps_bytes == rank0.bucket_caps_bytes, step
        assert rank1.last_bucket_bytes == rank0.last_bucket_bytes
        assert rank1.bucket_parameter_names() == rank0.bucket_parameter_names(), step
    assert rank1.bucket_caps_bytes[-1] == 15_000
    assert rank1.first_bucket_bytes == rank0.first_bucket_bytes != 2_000
    assert ft._reducer_of(rank1).stats()["rebuilds"] == 3  # step 1, step 2, step 3 (undone)
    for model in (rank0, rank1):
        model.close()


def test_refused_under_a_changing_quorum(own_group):
    async_manager = LocalManager()
    async_manager._use_async_quorum = True
    with pytest.raises(FusedReducerError, match="use_async_quorum=False"):
        ft.DistributedDataParallel(async_manager, ft_worker.make_model(), process_group=own_group)
    with pytest.raises(FusedReducerError, match="autotune is refused"):
        ft.DistributedDataParallel(LocalManager(), ft_worker.make_model(),
                                   process_group=own_group, autotune=True)
    model = ft.DistributedDataParallel(LocalManager(), ft_worker.make_model(),
                                       process_group=own_group)
    with pytest.raises(FusedReducerError, match="another communication hook"):
        model.register_comm_hook(None, lambda state, bucket: None)
    from fused_reducer import ShardedOptimizer
    with pytest.raises(FusedReducerError, match="fused_reducer.torchft.Optimizer"):
        ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    state = ft.reducer_state(model)
    state["layout_order"] = state["layout_order"][:-1] + ["not.a.parameter"]
    with pytest.raises(FusedReducerError, match="other parameters"):
        ft.load_reducer_state(model, state)
    model.bucket_caps_bytes = [10_000] * (ft.MAX_BUCKET_LIMITS + 1)
    with pytest.raises(FusedReducerError, match="bucket_caps_bytes has 17 entries; at most 16"):
        model(ft_worker.batch(0, 0)[0])  # the forward's agreement refuses it, naming the limit
    model.bucket_caps_bytes = [10_000]
    count = len(list(model.parameters()))
    with pytest.raises(RuntimeError, match="out of range .* or repeated"):
        ft._reducer_of(model).request_rebuild_from_order([0] * count)
    with pytest.raises(RuntimeError, match=f"expected {count} parameter indices"):
        ft._reducer_of(model).request_rebuild_from_order([0])
    model.close()


def test_two_replicas_match_float64_and_overlap(tmp_path, lighthouse):
    """Two replicas, no failure: every step commits with both, the parameters equal the float64
    model trained on the global batch, the buckets go out during backward and the hook returns
    before its bucket is reduced: backward goes on meanwhile (the reducer waits once, at the end
    of backward)."""
    steps = 6
    procs = start_together(tmp_path, lighthouse,
                           {r: dict(steps=steps, final_participants=2) for r in range(2)})
    wait_all(procs, tmp_path, time.monotonic() + WAIT_S)
    recs = {r: records(tmp_path, r) for r in range(2)}
    reference, committed_steps, committed = replay(recs[0] + recs[1])
    # Both started together: every step both took part (none alone, none skipped).
    assert all(len(committed[s]) == 2 for s in committed_steps), committed
    assert all(rec["commit"] and rec["participants"] == 2 for r in recs for rec in recs[r])
    for r in range(2):
        final = torch.load(os.path.join(tmp_path, f"replica{r}.pt"))
        assert max_error(final, reference) < TOLERANCE
    # The layout: rebuilt after the first step (not the initial one), then by the limits of
    # step 2, the same on both replicas at every step.
    layouts = [[rec["layout"] for rec in recs[r]] for r in range(2)]
    assert layouts[0] == layouts[1]
    assert layouts[0][0] != layouts[0][1] and layouts[0][1] != layouts[0][2], layouts[0][:3]
    for r in range(2):
        for rec in recs[r]:
            assert rec["buckets"] == len(rec["layout"])
            # Every bucket but the one holding the last gradients went out before backward's
            # computation ended.
            assert rec["launched_before_end"] >= rec["buckets"] - 1, rec
    # Asynchronous: backward computed gradients while buckets were being reduced (never, if the
    # hook waited for its bucket: backward runs on the thread that calls the hook).
    # (Only one replica overlaps in a step, often: the later one finds its peer's data there.)
    overlapped = [[rec["overlapped"] for rec in recs[r]] for r in range(2)]
    assert sum(map(sum, overlapped)) >= steps // 2, overlapped


def test_limits_set_on_one_replica_are_agreed_through_the_quorum(tmp_path, lighthouse):
    """Limits changed on one replica only (replica 0's cap at step 2, replica 1's first bucket
    at step 4): the change of quorum rank 0 reaches both replicas at that step, the other's is
    undone; limits and layout equal on both at every step, parameters equal the float64 model."""
    own_limits = {0: {"2": {"bucket_cap_bytes": 15_000}}, 1: {"4": {"first_bucket_bytes": 2_000}}}
    procs = start_together(tmp_path, lighthouse, {
        r: dict(steps=6, final_participants=2, limits=own_limits[r]) for r in range(2)})
    wait_all(procs, tmp_path, time.monotonic() + WAIT_S)
    recs = {r: records(tmp_path, r) for r in range(2)}
    reference, committed_steps, committed = replay(recs[0] + recs[1])
    assert all(len(committed[s]) == 2 for s in committed_steps), committed
    for r in range(2):
        final = torch.load(os.path.join(tmp_path, f"replica{r}.pt"))
        assert max_error(final, reference) < TOLERANCE
    at = {r: {rec["step"]: rec for rec in recs[r]} for r in range(2)}
    assert at[0].keys() == at[1].keys()
    for step in at[0]:
        assert at[0][step]["caps"] == at[1][step]["caps"], step
        assert at[0][step]["layout"] == at[1][step]["layout"], step
    rank0 = at[0][2]["quorum_rank"]
    assert {at[0][2]["quorum_rank"], at[1][2]["quorum_rank"]} == {0, 1}
    initial = at[0][0]["caps"]
    if rank0 == 0:  # replica 0's cap taken at step 2 by both, replica 1's first bucket undone
        assert at[1][1]["caps"] == initial and at[1][2]["caps"][-1] == 15_000
        assert at[1][1]["layout"] != at[1][2]["layout"]
        assert at[1][5]["caps"][0] == initial[0]
    else:  # replica 0's cap undone, replica 1's first bucket taken at step 4 by both
        assert at[0][3]["caps"] == initial and at[0][4]["caps"][0] == 2_000
        assert at[0][3]["layout"] != at[0][4]["layout"]


@pytest.mark.parametrize("phase", ["forward", "backward", "after_backward", "step"])
def test_killed_replica_survivor_goes_on_and_restarted_replica_heals(tmp_path, lighthouse, phase):
    """Replica 1 is SIGKILLed (its own pid) at `phase` of step 3 (in its forward; in its
    backward with a bucket already sent to the Manager; after backward, before should_commit;
    in the optimizer step): replica 0 keeps training in the same process and never applies a
    partial average (killed before its gradients all went out: that step is not committed;
    after: committed with them or not at all), trains alone meanwhile; replica 1 restarted heals
    from replica 0's live state (model, optimizer, the bucket limits changed at step 2 and the
    rebuilt layout, step counter) and joins; both end equal to the float64 replay of the
    committed steps and to each other."""
    kill_step, steps = 3, 10
    procs = start_together(tmp_path, lighthouse, {
        0: dict(steps=steps, final_participants=2, pause_s=0.05),
        1: dict(steps=steps, final_participants=2, kill_step=kill_step, kill_in=phase,
                kill_after_buckets=1)})
    deadline = time.monotonic() + WAIT_S
    try:
        code = procs[1].wait(timeout=WAIT_S / 2)
    except subprocess.TimeoutExpired:
        code = None
    assert code == -signal.SIGKILL, f"replica 1 was to kill itself in {phase}, ended with {code}"
    killed = [rec for rec in records(tmp_path, 1) if "killed" in rec]
    assert killed and killed[0]["killed"] == kill_step and killed[0]["phase"] == phase, killed
    if phase == "backward":
        assert 1 <= killed[0]["launched"] < 3, killed  # buckets in flight, not all launched
    first_pid = procs[1].pid
    # Restart only once the survivor has committed a step alone: it goes on without restarting
    # while the peer is down (the Lighthouse drops the dead replica at its heartbeat timeout).
    while not any(rec.get("commit") and rec["participants"] == 1
                  for rec in records(tmp_path, 0)):
        if time.monotonic() > deadline - 60 or procs[0].poll() is not None:
            wait_all({0: procs[0]}, tmp_path, time.monotonic())
            raise AssertionError("the survivor did not commit a step alone")
        time.sleep(0.1)
    procs[1] = start(tmp_path, 1, lighthouse, steps=steps, final_participants=2, restarted=True,
                     pause_s=0.05)
    wait_all(procs, tmp_path, deadline)

    survivor = records(tmp_path, 0)
    assert len({rec["pid"] for rec in survivor}) == 1  # never restarted
    at_kill = [rec for rec in survivor if rec["step"] == kill_step][0]
    if phase in ("forward", "backward"):
        assert not at_kill["commit"] and at_kill["errored"], at_kill
    else:  # its gradients had all gone out: the step is committed with them, or skipped
        assert (at_kill["commit"] and at_kill["participants"] == 2) or \
            (not at_kill["commit"] and at_kill["errored"]), at_kill
    restarted = [rec for rec in records(tmp_path, 1) if "step" in rec and rec["pid"] != first_pid]
    joined = restarted[0]
    assert joined["healed_at"] >= kill_step and joined["step"] == joined["healed_at"]
    assert joined["participants"] == 2
    # Its first step, already with the survivor's layout and limits (set at step 2, before it
    # started): they came with the live state.
    same_step = [rec for rec in survivor if rec["step"] == joined["step"] and rec["commit"]]
    assert same_step and same_step[0]["participants"] == 2
    assert joined["layout"] == same_step[0]["layout"] and joined["caps"] == same_step[0]["caps"]
    assert joined["caps"][-1] == 15_000

    reference, _, _ = replay(survivor + records(tmp_path, 1))
    finals = [torch.load(os.path.join(tmp_path, f"replica{r}.pt")) for r in range(2)]
    for final in finals:
        assert max_error(final, reference) < TOLERANCE
    assert max_error(finals[1], {n: t.double() for n, t in finals[0].items()}) == 0.0


def test_stopped_replica_is_dropped_within_the_timeout(tmp_path, lighthouse):
    """Replica 1 stops answering (SIGSTOP, by pid, from here) while training: replica 0 never
    hangs: a step in flight fails at the Manager's timeout (not committed), the next quorum
    leaves replica 1 out, and replica 0 goes on alone in the same process."""
    timeout_s = 5
    procs = start_together(tmp_path, lighthouse, {
        r: dict(steps=10_000, final_participants=2, timeout_s=timeout_s)
        for r in range(2)})
    deadline = time.monotonic() + WAIT_S
    try:
        while len([rec for rec in records_or_none(tmp_path, 0) if rec["participants"] == 2]) < 3:
            assert time.monotonic() < deadline - 60, "the replicas did not train together"
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        while not any(rec["commit"] and rec["participants"] == 1
                      for rec in records_or_none(tmp_path, 0)):
            assert procs[0].poll() is None, "the survivor died"
            assert time.time() - stopped_at < 4 * timeout_s, "the survivor did not go on alone"
            time.sleep(0.05)
        alone_at = time.time()
        survivor = records(tmp_path, 0)
        assert len({rec["pid"] for rec in survivor}) == 1
        first_alone = next(i for i, rec in enumerate(survivor)
                           if rec["commit"] and rec["participants"] == 1)
        # Stopped between steps: the next quorum forms without it once the Lighthouse misses its
        # heartbeats; stopped in a step: that step fails (not committed) at the timeout first.
        failed = [rec for rec in survivor[:first_alone] if not rec["commit"]]
        assert all(rec["errored"] for rec in failed), survivor[first_alone - 2:]
        assert alone_at - stopped_at < 3 * timeout_s, alone_at - stopped_at
        print(f"stopped replica dropped: first commit alone {alone_at - stopped_at:.1f} s after "
              f"SIGSTOP, {len(failed)} step(s) failed meanwhile")
    finally:
        for proc in procs.values():  # only the processes this test started, by pid
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()



def test_train_ft_example_heals_and_ends_identical():
    """examples/train_ft.py end to end: replica 1 SIGKILLed in a backward, restarted, healed;
    both replicas end with identical parameters (the example exits 1 otherwise)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "examples", "train_ft.py"),
                           "--steps", "16", "--kill-step", "5", "--restart-delay-s", "1"],
                          capture_output=True, text=True, timeout=WAIT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "replica 1 (pid" in proc.stdout and "ended with -9" in proc.stdout, proc.stdout
    assert "replica 1 (restarted): healed to step" in proc.stdout, proc.stdout
    assert "identical parameters: True" in proc.stdout, proc.stdout
