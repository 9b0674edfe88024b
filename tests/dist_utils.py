"""Run a function on N gloo ranks (spawned processes on 127.0.0.1) and collect the results.

A worker's exception comes back to the test as a RankFailed naming the rank; a rank that hangs
is killed after `timeout` seconds, so a broken test fails instead of hanging the suite.
"""
import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(Exception):
    pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the test
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def spawn_ranks(fn, world_size, *args, timeout=120, reporting=None):
    """fn(rank, world_size, *args) on each rank. Returns {rank: ("ok", result) | ("error", text)}.

    reporting: the ranks expected to report (default all; a rank that kills itself won't)."""
    import queue as queue_module
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    reporting = set(range(world_size) if reporting is None else reporting)
    outcomes = {}
    try:
        while not reporting <= set(outcomes):
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except queue_module.Empty:
                raise RankFailed(f"ranks {sorted(reporting - set(outcomes))} did not finish "
                                 f"within {timeout}s (hang?)") from None
            outcomes[rank] = (status, payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return outcomes


def run_ranks(fn, world_size, *args, timeout=120):
    """fn on every rank; the results by rank, or RankFailed with every rank's error."""
    outcomes = spawn_ranks(fn, world_size, *args, timeout=timeout)
    errors = {r: payload for r, (status, payload) in outcomes.items() if status == "error"}
    if errors:
        raise RankFailed("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [outcomes[r][1] for r in range(world_size)]


def _run_checks(rank, world_size, checks):
    import traceback as tb
    results = {}
    for fn in checks:
        try:
            results[fn.__name__] = ("ok", fn(rank, world_size))
        except Exception as e:  # noqa: BLE001 - each check's error goes back to its test
            results[fn.__name__] = ("error", f"{type(e).__name__}: {e}\n{tb.format_exc()}")
        dist.barrier()
    return results


def run_checks(checks, world_size=2, timeout=180):
    """Several checks fn(rank, world_size) in one spawn (spawning costs seconds): a check that
    raises is recorded, not fatal, so each test can assert on its own check's outcome."""
    return run_ranks(_run_checks, world_size, checks, timeout=timeout)


def per_rank(outcomes, check):
    """The results of `check` on every rank; fails the test with that rank's error otherwise."""
    out = []
    for rank, results in enumerate(outcomes):
        status, payload = results[check]
        assert status == "ok", f"rank {rank}: {payload}"
        out.append(payload)
    return out
