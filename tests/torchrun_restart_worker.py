"""A worker for tests/test_torchrun_restart.py, launched by torchrun (2 ranks, CPU, gloo).

    python -m torch.distributed.run ... torchrun_restart_worker.py OUTDIR MODE

MODE 'fused' wraps the model in FusedReducer(backend='auto'), MODE 'ddp' in DDP (to check that
the launcher set-up itself restarts cleanly), MODE 'fused-sharded' in FusedReducer with a
ShardedOptimizer checkpointed through torch.distributed.checkpoint (sharded_job). Attempt 0 (TORCHELASTIC_RESTART_COUNT=0) trains,
rank 0 saves a checkpoint after CHECKPOINT_AFTER steps, and rank 1 SIGKILLs itself in the middle
of step KILL_AT (after its forward, before its backward), so rank 0 is left waiting in that
step's all-reduce. torchrun then restarts both ranks; attempt 1 loads the checkpoint and trains to
STEPS. Every attempt writes OUTDIR/attempt<a>_rank<r>.json when it starts training, after every
step, and at the end with the final parameters: what the test asserts on.

Before init_process_group, attempt 1 removes the keys torch itself left in torchrun's store in
attempt 0 (see forget_dead_attempts_torch_keys), not FusedReducer's; with
RESTART_WORKER_KEEP_TORCH_KEYS=1 it does not (the set-up a user has: scripts/restart_study.py
measures both).
"""
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

STEPS = 10
CHECKPOINT_AFTER = 4  # steps 0-3 done, then rank 0 saves {"next_step": 4, ...}
KILL_AT = 6  # attempt 0, rank 1: SIGKILL during step 6
IN_FEATURES, HIDDEN, OUT_FEATURES, BATCH = 16, 32, 4, 8
LR, MOMENTUM = 0.05, 0.9
WATCHDOG_S = 40  # per attempt; the test's own deadline is longer than two of these
AGREED_ATTEMPT = None  # the attempt, once the ranks agreed on it (main)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT_FEATURES))


def make_optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def batch(step, rank, dtype=torch.float32):
    """Rank `rank`'s batch of step `step`: the same in every attempt and in the test's reference."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, IN_FEATURES, generator=g, dtype=torch.float64).float()
    y = torch.randn(BATCH, OUT_FEATURES, generator=g, dtype=torch.float64).float()
    return x.to(dtype), y.to(dtype)


def write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def main(outdir, mode):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # A hang anywhere (a stale store key, a peer that never arrives) ends this rank with every
    # thread's stack on stderr and in OUTDIR/hang_attempt<a>_rank<r>.txt, well before the test's
    # own deadline; an exception's traceback goes to OUTDIR/error_attempt<a>_rank<r>.txt
    # (scripts/restart_study.py reads both to tell whose failure a failed restart was).
    # Named by the pid until the attempt is agreed (this agent's restart count can differ from
    # the other node's: see below).
    hang_path = os.path.join(outdir, f"hang_pid{os.getpid()}.txt")
    hang_file = open(hang_path, "w")
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True, file=hang_file)
    with open(os.path.join(outdir, f"pid_{os.getpid()}"), "w") as f:
        f.write(str(os.getpid()))  # the test ends a stray worker by this pid
    torch.set_num_threads(1)
    store_state = forget_dead_attempts_torch_keys(attempt, rank)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    # The attempt, agreed: on two nodes an agent that restarts for the other node's failure keeps
    # its restart count (a membership change), so the counts can differ across ranks.
    agreed = torch.tensor([attempt])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    attempt = int(agreed)
    global AGREED_ATTEMPT
    AGREED_ATTEMPT = attempt
    os.rename(hang_path, os.path.join(outdir, f"hang_attempt{attempt}_rank{rank}.txt"))
    checkpoint = os.path.join(outdir, "checkpoint.pt")
    model = make_model()
    start = 0
    if mode == "fused-sharded":
        wrapped, optimizer, start = sharded_job(model, outdir, attempt)
        backend = wrapped.backend
    else:
        optimizer = make_optimizer(model.parameters())
    if attempt > 0 and mode != "fused-sharded":
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["next_step"]
    if mode == "fused":
        from fused_reducer import FusedReducer
        wrapped = FusedReducer(model, backend="auto", timeout=timedelta(seconds=20))
        backend = wrapped.backend
    elif mode == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
        backend = dist.get_backend()
    report = {"attempt": attempt, "rank": rank, "world": world, "mode": mode, "backend": backend,
              "start_step": start, "steps_done": [], "final": None,
              "store": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
              "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"), **store_state}
    path = os.path.join(outdir, f"attempt{attempt}_rank{rank}.json")
    write_json(path, report)
    loss_fn = nn.MSELoss()
    for step in range(start, STEPS):
        if step == CHECKPOINT_AFTER and attempt == 0 and mode == "fused-sharded":
            write_sharded_checkpoint(outdir, model, optimizer, step)  # every rank writes its part
        elif step == CHECKPOINT_AFTER and rank == 0 and attempt == 0:
            # Before step 4's all-reduce: once rank 1 has finished step 4, the checkpoint exists.
            write_checkpoint(checkpoint, model, optimizer, step)
        x, y = batch(step, rank)
        optimizer.zero_grad()
        loss = loss_fn(wrapped(x), y)
        if attempt == 0 and rank == 1 and step == KILL_AT:
            report["killed_at"] = step
            write_json(path, report)
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        optimizer.step()
        report["steps_done"].append(step)
        write_json(path, report)
    report["final"] = [p.detach().double().flatten().tolist() for p in model.parameters()]
    write_json(path, report)
    if mode.startswith("fused"):
        wrapped.close()
    dist.barrier()
    dist.destroy_process_group()


def forget_dead_attempts_torch_keys(attempt, rank):
    """Make torch's own restart work with
    fused_reducer.transports.elastic.forget_dead_attempt_keys() (it removes the
    keys torch's default group left in torchrun's store in the dead attempt; pytorch#135712),
    unless RESTART_WORKER_KEEP_TORCH_KEYS=1. FusedReducer's keys ('/fused_reducer/' in the name)
    are left as they are: the store stays, for FusedReducer, exactly the one a restarted attempt
    really meets; rank 0 lists them first, as the test's evidence that they were there."""
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    state = {}
    if rank == 0:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=timedelta(seconds=30))
        try:
            keys = store.list_keys()
        except (AttributeError, RuntimeError) as e:  # an older torch: nothing to go by
            keys = []
            print(f"torchrun_restart_worker: cannot list the store's keys: {e}", file=sys.stderr)
        state["stale_fused_reducer_keys"] = sorted(k for k in keys if "/fused_reducer/" in k)
    if os.environ.get("RESTART_WORKER_KEEP_TORCH_KEYS") == "1" or \
            int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:  # one agent only (its docstring)
        return {**state, "removed_torch_keys": None}
    from fused_reducer.transports.elastic import forget_dead_attempt_keys
    return {**state, "removed_torch_keys": forget_dead_attempt_keys()["removed"]}


def sharded_job(model, outdir, attempt):
    """MODE 'fused-sharded': FusedReducer + ShardedOptimizer(SGD), checkpointed with
    torch.distributed.checkpoint (each rank writes its fragments); a restarted attempt resumes
    from it the documented way. Returns (wrapped, optimizer, the step to start at)."""
    import torch.distributed.checkpoint as dcp
    from fused_reducer import FusedReducer, ShardedOptimizer
    wrapped = FusedReducer(model, backend="auto", timeout=timedelta(seconds=20))
    optimizer = ShardedOptimizer(wrapped, torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    if attempt == 0:
        return wrapped, optimizer, 0
    sd = {"model": model.state_dict(), "optim": optimizer.sharded_state_dict(), "next_step": 0}
    dcp.load(sd, checkpoint_id=os.path.join(outdir, "checkpoint.dcp"))
    model.load_state_dict(sd["model"])
    optimizer.load_sharded_state_dict(sd["optim"])
    return wrapped, optimizer, sd["next_step"]


def write_sharded_checkpoint(outdir, model, optimizer, next_step):
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": model.state_dict(), "optim": optimizer.sharded_state_dict(),
              "next_step": next_step}, checkpoint_id=os.path.join(outdir, "checkpoint.dcp"))


def write_checkpoint(path, model, optimizer, next_step):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "next_step": next_step, "saved_at": time.time()}, tmp)
    os.replace(tmp, path)


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    except BaseException:
        attempt = AGREED_ATTEMPT
        if attempt is None:  # before init_process_group: this agent's count, its highest guess
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        with open(os.path.join(sys.argv[1], f"error_attempt{attempt}_rank{os.environ['RANK']}.txt"),
                  "w") as f:
            f.write(traceback.format_exc())
        raise
