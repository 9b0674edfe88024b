"""Process endings, run by the lifecycle stress harness (scripts/lifecycle_stress.py): no run of
an ending aborts, hangs or leaves a segment, and the peer names the failed rank.

CI's bounded subset: one run of every ending, the two CPU transports in turn (about 1.5 minutes
on 2 cores; the harness stops starting runs after LIFECYCLE_BUDGET_S, and a run is killed after
RUN_TIMEOUT_S, so the whole stays under 3 minutes). The many-run target (>= 300 runs, 0
bad) is the same script with --rounds (docs/TESTING.md, "Process life"). The verdict itself is
checked on recorded outcomes, so the harness cannot pass a run that aborted, hung, left a segment
or whose peer did not name the failed rank.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(os.path.dirname(HERE), "scripts")
sys.path.insert(0, SCRIPTS)
import lifecycle_stress as stress  # noqa: E402

LIFECYCLE_BUDGET_S = 130
RUN_TIMEOUT_S = 45  # FusedReducer's timeout in these runs is 20 s; a peer names the dead rank sooner


def write_run(tmp_path, logs, records):
    for name, text in logs.items():
        (tmp_path / name).write_text(text)
    for rank, record in records.items():
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(record))
    return str(tmp_path)


def test_verdict_flags_an_abort_a_hang_a_silent_peer_and_a_leftover_segment(tmp_path):
    trained = {0: {"pid": 1, "trained": True}, 1: {"pid": 2, "trained": True}}
    (tmp_path / "good").mkdir()
    good = write_run(tmp_path / "good", {"rank0.log": "rank 0: trained\n"}, trained)
    assert stress.verdict("plain-exit", 2, good, {"rank 0": 0, "rank 1": 0}, [], 30) == []

    (tmp_path / "abort").mkdir()
    aborted = write_run(tmp_path / "abort", {
        "rank1.log": "terminate called without an active exception\nFatal Python error: Aborted"},
        trained)
    problems = stress.verdict("plain-exit", 2, aborted,
                              {"rank 0": 0, "rank 1": -signal.SIGABRT}, [], 30)
    assert any("terminate called" in p for p in problems)
    assert any("rank 1 exited -6" in p for p in problems)

    assert stress.verdict("no-destroy", 2, good, {"rank 0": 0, "rank 1": -9}, ["rank 1"], 30)

    (tmp_path / "silent").mkdir()
    victim = {0: {"pid": 1, "raised": "RuntimeError: Connection closed by peer [127.0.0.1]:5",
                  "raised_after_s": 1.0}, 1: {"pid": 2}}
    silent = write_run(tmp_path / "silent", {}, victim)
    problems = stress.verdict("raise-mid-step", 2, silent, {"rank 0": 1, "rank 1": 1}, [], 30)
    assert any("without naming rank [1]" in p for p in problems)
    victim[0]["raised"] = "RuntimeError: ... rank 1 stopped reducing"
    named = write_run(tmp_path / "silent", {}, victim)
    assert stress.verdict("raise-mid-step", 2, named, {"rank 0": 1, "rank 1": 1}, [], 30) == []
    victim[0]["raised_after_s"] = 60.0
    late = write_run(tmp_path / "silent", {}, victim)
    assert any("only after" in p for p in
               stress.verdict("raise-mid-step", 2, late, {"rank 0": 1, "rank 1": 1}, [], 30))

    (tmp_path / "segment").mkdir()
    pid = os.getpid()
    path = f"/dev/shm/fused_reducer_{stress.pid_namespace()}_{pid}_0123456789ab"
    open(path, "w").close()
    try:
        left = write_run(tmp_path / "segment", {}, {0: {"pid": pid, "trained": True},
                                                    1: {"pid": 2, "trained": True}})
        problems = stress.verdict("close", 2, left, {"rank 0": 0, "rank 1": 0}, [], 30)
        assert any("leftover segment" in p for p in problems)
    finally:
        os.unlink(path)


@pytest.mark.timeout(LIFECYCLE_BUDGET_S + RUN_TIMEOUT_S + 60)
def test_every_ending_on_both_transports_ends_cleanly():
    """One run of each ending, shm and process_group in turn: plain exit, no
    destroy_process_group, close, gc, two torchrun agents as two nodes (a plain exit, and one
    agent SIGTERMed mid-backward), a rank raising mid-step, sys.exit with buckets in flight,
    SIGTERM mid-backward, KeyboardInterrupt on one and on every rank, and a ShardedOptimizer with
    all-gathers in flight (at exit, and with a raise, a SIGTERM or a KeyboardInterrupt in
    backward): 0 bad runs, every ending run, within 3 minutes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "lifecycle_stress.py"), "--rounds", "1",
         "--alternate-backends", "--timeout-s", "20", "--run-timeout-s", str(RUN_TIMEOUT_S),
         "--budget-s", str(LIFECYCLE_BUDGET_S)],
        capture_output=True, text=True, env=env, timeout=LIFECYCLE_BUDGET_S + RUN_TIMEOUT_S + 30)
    took = time.monotonic() - started
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("lifecycle: ") and ", 0 bad," in summary, proc.stdout[-6000:]
    ran = {line.split()[2] for line in proc.stdout.splitlines() if line.startswith("run ")}
    assert ran == set(stress.ALL_ENDINGS), (
        f"endings not run within the budget: {sorted(set(stress.ALL_ENDINGS) - ran)}; {summary}")
    assert took <= 180, f"the CI subset took {took:.0f} s (bound 180 s): {summary}"
    assert proc.returncode == 0


PIDNS_WORKER = r'''
import os, signal, sys, time, torch, torch.distributed as dist
from torch import nn
import fused_reducer
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = fused_reducer.FusedReducer(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)),
                                   timeout=120.0)
print(f"rank{rank} backend={model.backend}", flush=True)
for step in range(6):
    if step == 3:
        start = time.monotonic()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    try:
        model(torch.randn(8, 64)).sum().backward()
    except Exception as e:
        print(f"rank{rank} raised after {time.monotonic() - start:.1f} s: {e}", flush=True)
        sys.exit(1)
print(f"rank{rank} trained 6 steps", flush=True)
'''


def test_ranks_in_two_pid_namespaces_of_one_host_see_a_killed_peer(tmp_path):
    """Two containers on one host sharing /dev/shm (docker --ipc=host, one host name): their
    ranks cannot see each other's pids, so the shared-memory transport could not tell a killed
    peer from a slow one (it waited out the whole timeout). backend='auto' takes the process
    group there, which sees the peer's connection close."""
    if subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"],
                      capture_output=True).returncode != 0:
        pytest.skip("unshare cannot make a PID namespace here (needs root or user namespaces)")
    worker = tmp_path / "worker.py"
    worker.write_text(PIDNS_WORKER)
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1",
               MASTER_PORT=str(20000 + os.getpid() % 20000))
    command = f"{sys.executable} {worker}; exit $?"  # not pid 1 of its namespace: killable
    procs = [subprocess.Popen(prefix + ["sh", "-c", command], env=dict(env, RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank, prefix in ((0, []), (1, ["unshare", "-p", "-f", "--mount-proc"]))]
    try:
        outputs = [proc.communicate(timeout=90)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert "rank0 backend=process_group" in outputs[0], outputs
    assert "rank1 backend=process_group" in outputs[1], outputs
    raised = [line for line in outputs[0].splitlines() if line.startswith("rank0 raised after")]
    assert raised and float(raised[0].split()[3]) < 30, outputs  # not the 120 s timeout
