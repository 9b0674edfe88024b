"""Training health across torchft replica groups (issue 47, point 4): check_finite and the
straggler report of fused_reducer.torchft go through the Manager, so they name the replica
(the replica_id given to fused_reducer.torchft.DistributedDataParallel) and the parameter, and a
non-finite gradient on one replica makes every replica skip the step (never a wrong step).

Replicas are processes (tests/ft_worker.py) around a Lighthouse in this process, as in
tests/test_fault_tolerance.py; bounded the same way (ft_common)."""
import time

import pytest

pytest.importorskip("torchft", reason="torchft is not installed (pip install .[ft])")

import torch  # noqa: E402

from ft_common import (TOLERANCE, WAIT_S, final_parameters, max_error, records,  # noqa: E402
                       replay, start_lighthouse, start_together, wait_all)


@pytest.fixture
def lighthouse():
    server = start_lighthouse()
    yield server.address()
    server.shutdown()


def test_nonfinite_gradient_on_one_replica_names_it_and_no_replica_commits(tmp_path, lighthouse):
    """Replica 1's local gradient of c.weight holds one NaN in step 2: both replicas raise
    NonFiniteGradientError with the same message naming replica_1 and 'c.weight', neither
    commits that step (the Manager's should_commit() is False), the retried step 2 and the rest
    commit, and both end equal to the float64 replay of the committed steps."""
    health = {"check_finite": True}
    procs = start_together(tmp_path, lighthouse, {
        0: dict(steps=5, final_participants=2, health=health),
        1: dict(steps=5, final_participants=2, health=health, nan_step=2, nan_param="c.weight")})
    wait_all(procs, tmp_path, time.monotonic() + WAIT_S)
    recs = {r: [rec for rec in records(tmp_path, r) if "step" in rec] for r in range(2)}
    messages = set()
    for r in range(2):
        poisoned = [rec for rec in recs[r] if rec["nonfinite"]]
        assert len(poisoned) == 1, [(rec["step"], rec["nonfinite"]) for rec in recs[r]]
        assert poisoned[0]["step"] == 2 and not poisoned[0]["commit"], poisoned[0]
        messages.add(poisoned[0]["nonfinite"])
        # Every other step committed with both, step 2 among them (retried).
        assert all(rec["commit"] and rec["participants"] == 2
                   for rec in recs[r] if not rec["nonfinite"])
        assert [rec["step"] for rec in recs[r] if rec["commit"]][:3] == [0, 1, 2]
    assert len(messages) == 1, messages  # the same verdict on every replica
    message = messages.pop()
    assert "replica replica_1: 1 element in 1 parameter, first 'c.weight' (1)" in message, message
    assert "replica_0" not in message, message
    reference, _, _ = replay(recs[0] + recs[1])
    for r in range(2):
        final = final_parameters(tmp_path, r)
        assert all(torch.isfinite(t).all() for t in final.values())
        assert max_error(final, reference) < TOLERANCE


def test_slow_replica_is_named_in_the_straggler_report(tmp_path, lighthouse):
    """Replica 1 sleeps 150 ms in every forward (after the quorum; well above this shared
    host's scheduling noise): from the exchange through the Manager every step
    (straggler_interval=1), both replicas' straggler_report() names replica_1, and only it,
    over the last steps (a window of 4 steps, filled by then), and never names replica_0."""
    health = {"straggler_interval": 1, "straggler_window": 4}
    procs = start_together(tmp_path, lighthouse, {
        0: dict(steps=10, final_participants=2, health=health),
        1: dict(steps=10, final_participants=2, health=health, sleep_ms=150)})
    wait_all(procs, tmp_path, time.monotonic() + WAIT_S)
    for r in range(2):
        recs = [rec for rec in records(tmp_path, r) if "step" in rec]
        assert len(recs) >= 10 and all(rec["participants"] == 2 for rec in recs), recs
        named = [rec["stragglers"] for rec in recs]
        assert named[-4:] == [["replica_1"]] * 4, named
        assert not any("replica_0" in n for n in named), named
