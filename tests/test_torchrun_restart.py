"""A real torchrun restart resumes from the checkpoint on the shared-memory transport, end to end
(2 CPU ranks, gloo).

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        --monitor-interval 0.5 tests/torchrun_restart_worker.py OUTDIR fused

Attempt 0 trains with FusedReducer(backend='auto'), rank 0 checkpoints after 4 steps, and rank 1
SIGKILLs itself in the middle of step 6; torchrun restarts both ranks. Attempt 1 loads the
checkpoint and trains to step 10. torchrun's agent store (the c10d rendezvous shares it with the
workers) outlives attempt 0, with attempt 0's FusedReducer keys in it: before the fix (store keys
per TORCHELASTIC_RESTART_COUNT, python/fused_reducer/transports/transport.py) attempt 1 read attempt 0's
answers (its unlinked segment's name, its ranks' "ok") and backend='auto' silently fell back to
the process group on both ranks, or on one of them, leaving the other waiting in shared memory
for a peer that never came. Asserted: the launcher exits 0; every attempt uses backend 'shm' on
every rank; attempt 1 resumed at the checkpoint and trained to the end; its final parameters are
bit-identical across ranks and equal (1e-6) a float64 reference of the same training without a
restart; attempt 0's keys really were in attempt 1's store. Bounded: each attempt's workers end
themselves after 40 s, the launcher is stopped after LAUNCH_TIMEOUT_S (a run takes ~20 s).

torch itself does not restart cleanly on that shared store (pytorch/pytorch#135712: gloo reads
the dead attempt's address of its peer, "connectFullMesh failed ... Connection refused", in 4 of
5 plain-DDP restarts tried here). The worker removes torch's own keys of the dead attempt before
init_process_group and leaves FusedReducer's keys alone; test_ddp_restarts_... checks that plain
DDP then restarts under exactly this set-up, to the same parameters.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchrun_restart_worker as worker

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "torchrun_restart_worker.py")
WORLD = 2
LAUNCH_TIMEOUT_S = 120  # a run takes ~20 s; each attempt's workers give up after 40 s
TOLERANCE = 1e-6  # float32 training vs the float64 reference: ~5e-8 here; a lost step: ~2e-2
# Set by an outer launcher (e.g. this suite run under torchrun): not for the workers we launch.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "ROLE_RANK", "ROLE_NAME", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT")


def require_torchrun():
    if importlib.util.find_spec("torch.distributed.run") is None:
        pytest.skip("torch.distributed.run (torchrun) is not available in this torch")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")


def worker_environment():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHELASTIC_") and k not in LAUNCHER_VARIABLES}
    # The workers import the fused_reducer this test process imports (a dev tree or the installed
    # build), and the worker module from tests/.
    import fused_reducer
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(fused_reducer.__file__)))
    paths = [package_root, HERE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["OMP_NUM_THREADS"] = "1"
    return env


def end_stray_workers(outdir):
    """Workers run in their own sessions (torchrun's subprocess handler): after a launcher that
    had to be stopped, end any of ours still running, by the pids they wrote."""
    for name in os.listdir(outdir):
        if not name.startswith("pid_"):
            continue
        try:
            pid = int(open(os.path.join(outdir, name)).read())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except (OSError, ValueError):
            continue
        if WORKER in cmdline and str(outdir) in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def launch(outdir, mode):
    """torchrun with one restart allowed; (exit code, output, {(attempt, rank): report}, s)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(WORLD), "--max-restarts", "1", "--monitor-interval", "0.5",
           WORKER, str(outdir), mode]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=worker_environment(), cwd=outdir, start_new_session=True)
    try:
        try:
            output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # torchrun stops its workers on SIGTERM
            try:
                output, _ = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
            pytest.fail(f"torchrun did not finish within {LAUNCH_TIMEOUT_S} s (a hang); its "
                        f"output:\n{output[-6000:]}\nreports: {summary(read_reports(outdir))}")
    finally:
        end_stray_workers(outdir)
    return proc.returncode, output, read_reports(outdir), time.monotonic() - start


def read_reports(outdir):
    reports = {}
    for attempt in range(2):
        for rank in range(WORLD):
            path = os.path.join(outdir, f"attempt{attempt}_rank{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    reports[attempt, rank] = json.load(f)
    return reports


def summary(reports):
    """The reports without their parameters, for failure messages."""
    return {key: {k: v for k, v in report.items() if k != "final"}
            for key, report in reports.items()}


def reference_parameters():
    """The same training without a restart, in float64: every step, the gradient is the mean of
    the ranks' gradients (what DDP computes), then SGD with momentum."""
    with torch.random.fork_rng():
        model = worker.make_model().double()
    optimizer = worker.make_optimizer(model.parameters())
    loss_fn = nn.MSELoss()
    for step in range(worker.STEPS):
        total = None
        for rank in range(WORLD):
            model.zero_grad()
            x, y = worker.batch(step, rank, torch.float64)
            loss_fn(model(x), y).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        for p, g in zip(model.parameters(), total):
            p.grad = g / WORLD
        optimizer.step()
    return [p.detach().flatten() for p in model.parameters()]


def check_restarted_run(rc, output, reports, mode):
    """What must hold for either wrapper: launcher exit 0, attempt 0 killed where planned,
    attempt 1 resumed from the checkpoint and trained to the end, identical replicas equal to
    the reference."""
    assert rc == 0, (f"torchrun exited with {rc}; reports: {summary(reports)}; its output:\n"
                     f"{output[-6000:]}")
    missing = [key for key in [(a, r) for a in range(2) for r in range(WORLD)]
               if key not in reports]
    assert not missing, (f"no report from (attempt, rank) {missing}: {summary(reports)}\n"
                         f"{output[-4000:]}")
    killed = reports[0, 1]
    assert killed.get("killed_at") == worker.KILL_AT, summary(reports)
    assert killed["steps_done"] == list(range(worker.KILL_AT)), summary(reports)
    for rank in range(WORLD):
        report = reports[1, rank]
        assert report["start_step"] == worker.CHECKPOINT_AFTER, (
            f"rank {rank} did not resume from the checkpoint: {summary(reports)}")
        assert report["steps_done"] == list(range(worker.CHECKPOINT_AFTER, worker.STEPS)), (
            summary(reports))
        assert report["final"] is not None, summary(reports)
    finals = [reports[1, rank]["final"] for rank in range(WORLD)]
    assert finals[1:] == finals[:-1], "the replicas differ after the restart"
    reference = reference_parameters()
    got = [torch.tensor(values, dtype=torch.float64) for values in finals[0]]
    assert [g.numel() for g in got] == [r.numel() for r in reference]
    worst = max((g - r).abs().max().item() for g, r in zip(got, reference))
    assert worst <= TOLERANCE, (f"{mode}: final parameters differ from the reference (no restart)"
                                f" by up to {worst:.3g}")


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_fused_reducer_resumes_on_shared_memory_after_a_torchrun_restart(tmp_path):
    require_torchrun()
    rc, output, reports, elapsed = launch(tmp_path, "fused")
    for (attempt, rank), report in sorted(reports.items()):
        assert report["backend"] == "shm", (
            f"attempt {attempt}, rank {rank}: FusedReducer(backend='auto') chose "
            f"{report['backend']!r}, not 'shm' (a fallback through keys of the dead attempt?); "
            f"reports: {summary(reports)}\n{output[-4000:]}")
    check_restarted_run(rc, output, reports, "FusedReducer")
    restarted = reports[1, 0]
    stale = restarted.get("stale_fused_reducer_keys", [])
    if not stale:
        pytest.skip(f"passed in {elapsed:.0f} s, but torchrun gave attempt 1 a store without "
                    "attempt 0's FusedReducer keys (a fresh store per attempt: "
                    f"agent_store={restarted.get('agent_store')}), so key reuse was not exercised")
    # The point of the scenario: attempt 0's exchanges were there for attempt 1 to misread.
    assert any("/shm-create/" in key for key in stale), stale


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_ddp_restarts_under_the_same_launcher_set_up(tmp_path):
    """The set-up itself (torchrun --standalone, a restart, the worker's removal of torch's own
    stale keys) restarts plain DDP, to the same parameters."""
    require_torchrun()
    rc, output, reports, _ = launch(tmp_path, "ddp")
    check_restarted_run(rc, output, reports, "DDP")
    assert reports[1, 0].get("removed_torch_keys"), summary(reports)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_a_sharded_optimizer_resumes_from_its_dcp_checkpoint_after_a_torchrun_restart(tmp_path):
    """The same restart with a ShardedOptimizer whose checkpoint every rank writes its
    part of (dcp.save of sharded_state_dict()); attempt 1 loads it the documented way and ends
    where a run without a restart ends (the float64 reference)."""
    require_torchrun()
    rc, output, reports, _ = launch(tmp_path, "fused-sharded")
    check_restarted_run(rc, output, reports, "FusedReducer + ShardedOptimizer")
    files = sorted(os.listdir(tmp_path / "checkpoint.dcp"))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files
