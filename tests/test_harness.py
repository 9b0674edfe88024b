"""The multi-rank harness itself (tests/dist_utils.py): failures stay in their own check, hangs
and crashes are reported naming the rank and where it was, concurrent spawns do not collide."""
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import RankFailed, per_rank, run_checks, run_ranks, spawn_ranks

_started = {}  # per rank process: when a check began


def fails_on_rank0_before_its_all_reduce(rank, world_size):
    _started["fail"] = time.monotonic()
    if rank == 0:
        raise ValueError("planted failure")
    dist.all_reduce(torch.ones(4))  # rank 0 never comes: must fail fast, not after PG_TIMEOUT
    return "rank 1 was not blocked"


def all_reduce_after_a_failure(rank, world_size):
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    return t.tolist(), time.monotonic() - _started["fail"]


def leaves_an_unmatched_all_reduce_on_rank0(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.full((3,), 100.0), async_op=True)  # rank 1 never matches it
        raise RuntimeError("planted failure with a collective in flight")
    return "ok"


def all_reduce_after_an_unmatched_one(rank, world_size):
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)  # would pair with rank 0's stale all-reduce if the group were reused
    return t.tolist()


def sleeps_forever_on_rank1(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return "rank 0 done"


def after_the_hang(rank, world_size):
    return "ran"


CHECKS = [fails_on_rank0_before_its_all_reduce, all_reduce_after_a_failure,
          leaves_an_unmatched_all_reduce_on_rank0, all_reduce_after_an_unmatched_one,
          sleeps_forever_on_rank1, after_the_hang]


@pytest.fixture(scope="module")
def outcomes():
    started = time.monotonic()
    # pg_timeout=10: the hang is given up on after ~10 s + grace, well within `timeout`.
    results = run_checks(CHECKS, 2, timeout=120, pg_timeout=10)
    return results, time.monotonic() - started


def test_a_failing_check_fails_alone_and_promptly(outcomes):
    results, _ = outcomes
    status, payload = results[0]["fails_on_rank0_before_its_all_reduce"]
    assert status == "error" and "planted failure" in payload, payload
    # rank 1's all-reduce with the failed rank 0 raised instead of waiting for the gloo timeout
    assert results[1]["fails_on_rank0_before_its_all_reduce"][0] == "error"
    for values, since_failure in per_rank(results, "all_reduce_after_a_failure"):
        assert values == [3.0, 3.0, 3.0]
        assert since_failure < 8, since_failure  # PG_TIMEOUT is 10 here


def test_an_unmatched_collective_does_not_leak_into_the_next_check(outcomes):
    results, _ = outcomes
    assert results[0]["leaves_an_unmatched_all_reduce_on_rank0"][0] == "error"
    assert results[1]["leaves_an_unmatched_all_reduce_on_rank0"] == ("ok", "ok")
    assert per_rank(results, "all_reduce_after_an_unmatched_one") == [[3.0] * 3, [3.0] * 3]


def test_a_hanging_rank_is_reported_with_its_check_and_stack(outcomes):
    results, elapsed = outcomes
    assert results[0]["sleeps_forever_on_rank1"] == ("ok", "rank 0 done")
    status, report = results[1]["sleeps_forever_on_rank1"]
    assert status == "error"
    assert "rank 1 did not report" in report, report
    assert "in check sleeps_forever_on_rank1" in report, report
    assert "sleeps_forever_on_rank1" in report.split("its stacks:", 1)[1], report  # its stack
    # later checks fail naming the hang instead of running against a missing peer
    assert all(r["after_the_hang"][0] == "error" for r in results)
    assert elapsed < 100, elapsed


def crashes_on_rank1(rank, world_size):
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    return "rank 0 done"


def test_a_crashing_rank_is_reported_with_its_exit_code_and_stack():
    started = time.monotonic()
    with pytest.raises(RankFailed) as info:
        spawn_ranks(crashes_on_rank1, 2, timeout=120, pg_timeout=10)
    report = str(info.value)
    assert f"rank 1 exited with code {-signal.SIGSEGV} without reporting" in report, report
    assert "crashes_on_rank1" in report, report  # faulthandler's stack of the crash
    assert time.monotonic() - started < 100


def sum_of_ranks_plus(rank, world_size, offset):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return t.item()


def test_concurrent_spawns_rendezvous_separately():
    results = {}

    def spawn(offset):
        results[offset] = run_ranks(sum_of_ranks_plus, 2, offset, timeout=120)

    threads = [threading.Thread(target=spawn, args=(offset,)) for offset in (10, 1000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {10: [21.0, 21.0], 1000: [2001.0, 2001.0]}


def rank1_sleeps_forever(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return "rank 0 done"


@pytest.mark.timeout(60)
def test_the_harness_reports_a_hang_before_pytest_timeout_fires():
    # timeout=600 asks for more than pytest-timeout allows: the harness gives up 15 s before it.
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 did not report .* in rank1_sleeps_forever"):
        spawn_ranks(rank1_sleeps_forever, 2, timeout=600)
    assert time.monotonic() - started < 50
