"""Internal (tests/, bench/, scripts/; no compatibility promise): the one way this repository
starts ranks on 127.0.0.1 and picks the ports they meet on.

Ports, without the race. Asking the kernel for a free port, closing the socket and handing the
number on leaves a window in which any other process (a concurrent test's gloo pairs, another
benchmark) can take that port. Two ways close it, and this module uses each where it fits:
- Ranks this module spawns (start_ranks): the parent creates the rendezvous TCPStore itself, on
  port 0, before any rank starts (rendezvous_store), and the ranks connect to it as clients. No
  number ever leaves a socket that is not listening.
- An external program that must host the store itself (torchrun's --master-port or
  --rdzv-endpoint, accelerate's --main_process_port, env:// ranks whose rank 0 binds
  MASTER_PORT): reserved_port() keeps its socket bound, not listening, with SO_REUSEADDR, for as
  long as the caller holds it. The kernel then gives that port to no other bind(0) or outgoing
  connection, while the program's own TCPStore server (c10d sets SO_REUSEADDR too) can still
  bind and listen on it. A parent-held listening store would not do here: it would make the
  program a client of the parent and change who hosts the store (torchrun's agent hosts it, and a
  restart or a SIGTERMed agent must behave as it does for users).

Processes: start_ranks() spawns `target(rank, world_size, store_port, *args)` per rank;
stop_ranks() ends what is still running; wait_for_exit_codes() is the benchmarks' policy (give
the other ranks 10 s after one fails, then kill); wait_all() waits on subprocesses (external
programs) until a deadline and kills the sessions that still run. The test harness
(tests/dist_utils.py) adds its own reporting (results, stacks, timeouts) on top of start_ranks.
"""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

HOST = "127.0.0.1"


@contextlib.contextmanager
def reserved_port():
    """A port on 127.0.0.1 that stays reserved (bound, not listening) while the block runs: start
    the program that binds it inside the block, and leave the block once it has bound it (or has
    ended). See the module's docstring for why this and not a port number from a closed socket."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((HOST, 0))
        yield s.getsockname()[1]


def rendezvous_store(timeout_s=10):
    """The parent's TCPStore, listening on a port the kernel chose, for ranks that connect as
    clients (connect_store in each rank)."""
    import torch.distributed as dist
    return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def connect_store(port, timeout_s):
    """In a rank: the parent's rendezvous store."""
    import torch.distributed as dist
    return dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def start_ranks(target, world_size, store, args=()):
    """Spawn (multiprocessing 'spawn') world_size processes running
    target(rank, world_size, store.port, *args); target must be a module-level function."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world_size, store.port, *args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    return procs


def stop_ranks(procs, grace_s):
    """Join each process for up to grace_s seconds, then kill it if it still runs."""
    for p in procs:
        p.join(timeout=grace_s)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def wait_for_exit_codes(procs, grace_s=10):
    """Wait for every rank; once one has failed, give the others grace_s seconds, then kill them.
    Returns the run's exit code: 0, else the largest positive exit code, else 1 (a rank killed by
    a signal it was not sent here is reported on stderr)."""
    failed_at = None
    try:
        while any(p.is_alive() for p in procs):
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    killed = set()
    for rank, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            killed.add(rank)
        p.join()
    codes = [p.exitcode for p in procs]
    bad = [c for c in codes if c != 0]
    if not bad:
        return 0
    for rank, code in enumerate(codes):
        if code is not None and code < 0 and rank not in killed:
            print(f"[rank {rank}] died by signal {-code}", file=sys.stderr, flush=True)
    positive = [c for c in bad if c is not None and c > 0]
    return max(positive) if positive else 1


def wait_all(procs, deadline):
    """procs: [(name, subprocess.Popen started with start_new_session=True)]. Wait for each until
    time.monotonic() reaches `deadline`; kill the whole session of any still running. Returns the
    names of those that had to be killed."""
    hung = []
    for name, proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(name)
    for name, proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return hung
