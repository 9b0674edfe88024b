"""Run a function on N gloo ranks (spawned processes on 127.0.0.1) and collect the results.

How it avoids races, cascades and silent hangs:
- Rendezvous: the parent creates a TCPStore on port 0 before any rank starts and passes its port
  (fused_reducer.testing.launch, the launcher the benchmarks and scripts share); nothing picks a
  "free" port that another test could take in between, and gloo binds its own.
- Timeouts, innermost first (each layer reports before the next one fires):
    PG_TIMEOUT (60 s; pg_timeout= per spawn, e.g. for checks whose ranks compile at different
      speeds): a gloo collective raises instead of waiting torch's default 30 minutes, and a
      rank waits that + 15 s for its peers to finish a check;
    the spawn's `timeout`, cut to end HARNESS_MARGIN seconds before the running test's
      pytest-timeout (conftest.py tells the harness when that is);
    pytest-timeout (pyproject.toml), the last resort.
- Hangs: when the parent gives up on a rank it asks it (SIGUSR1, faulthandler) for every thread's
  stack and reports it with what the rank said it was doing ("in check X", ...); a rank that
  crashes leaves its stack too. Ranks orphaned by a killed parent exit on their own.
- run_checks: after each check the ranks meet through the store (not gloo, which may be the
  broken thing). A rank whose check raised first drops its gloo group, which wakes peers blocked
  in that check's collectives at once; after a failed check every rank starts a fresh group, so
  unmatched collectives cannot leak into the next check. A rank that stops answering fails its
  own check and the later ones; checks finished before keep their results.
"""
import faulthandler
import gc
import os
import pickle
import queue as queue_module
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from fused_reducer.testing.collectives import ALLREDUCE_EVENTS  # noqa: F401 - for the test files
from fused_reducer.testing.launch import connect_store, rendezvous_store, start_ranks, stop_ranks

PG_TIMEOUT = 60

# All-reduces as torch.profiler sees them: ALLREDUCE_EVENTS (fused_reducer/testing/collectives.py,
# shared with the demo and the benchmarks); the same with the input's shape and dtype: gloo's own
# 'gloo:all_reduce' inside c10d's op, and the shared-memory transport's one event.
SHAPED_ALLREDUCE_EVENTS = ("gloo:all_reduce", "shm:all_reduce")
HARNESS_MARGIN = 15
_test_deadline = None  # time.monotonic() at which pytest-timeout fails the running test


class RankFailed(Exception):
    pass


def set_test_deadline(deadline):
    """Called by conftest.py around each test (None: no pytest-timeout)."""
    global _test_deadline
    _test_deadline = deadline


# -- in each rank ----------------------------------------------------------------------------------

_store = None  # the parent's TCPStore, as seen from this rank
_rank_info = {}


def _status(text):
    """What this rank is doing now; the parent prints it if the rank never reports."""
    _store.set(f"status/{_rank_info['rank']}", text)


def _init_group(tag):
    dist.init_process_group("gloo", store=dist.PrefixStore(f"group/{tag}", _store),
                            rank=_rank_info["rank"], world_size=_rank_info["world_size"],
                            timeout=timedelta(seconds=_rank_info["pg_timeout"]))


def _drop_group():
    if dist.is_initialized():
        gc.collect()  # free what a failed check left holding the group, so its sockets close
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group is what we are discarding
            pass


def _entry(rank, world_size, port, fn, args, queue, workdir, pg_timeout, life):
    global _store
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)
    stacks = open(os.path.join(workdir, f"rank{rank}.stacks"), "w")
    faulthandler.enable(file=stacks, all_threads=True)  # a crash leaves its stack for the parent
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # the parent asks on a hang
    faulthandler.dump_traceback_later(life, exit=True, file=stacks)  # outlive no parent
    _rank_info.update(rank=rank, world_size=world_size, pg_timeout=pg_timeout)
    try:
        _store = connect_store(port, pg_timeout)
        _status("in init_process_group")
        _init_group("start")
        _status(f"in {fn.__name__}")
        result = fn(rank, world_size, *args)
        _status("reporting")
        queue.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the test
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        _drop_group()


# -- in the test process ---------------------------------------------------------------------------

def _read_status(store, rank):
    key = f"status/{rank}"
    return store.get(key).decode() if store.check([key]) else "not started"


def _spawn(fn, world_size, args, timeout, reporting, pg_timeout, keys=()):
    """Run the ranks. Returns (outcomes, lost, stored): outcomes {rank: (status, payload)},
    lost {rank: report} for ranks in `reporting` that never reported, stored {key: bytes} for
    those of `keys` the ranks set in the store."""
    if _test_deadline is not None:  # report before pytest-timeout cuts the test off
        timeout = max(10, min(timeout, _test_deadline - time.monotonic() - HARNESS_MARGIN))
    reporting = set(range(world_size) if reporting is None else reporting)
    queue = mp.get_context("spawn").Queue()
    store = rendezvous_store()
    outcomes, lost, stored = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="fused_reducer_ranks_") as workdir:
        procs = start_ranks(_entry, world_size, store,
                            (fn, args, queue, workdir, pg_timeout, timeout + 60))
        start = time.monotonic()
        died = {}  # rank -> when it was first seen dead without having reported
        first_report = None
        finished = False
        try:
            while reporting - set(outcomes):
                try:
                    rank, status, payload = queue.get(timeout=0.5)
                    outcomes[rank] = (status, payload)
                    first_report = first_report or time.monotonic()
                    continue
                except queue_module.Empty:
                    pass
                now = time.monotonic()
                pending = reporting - set(outcomes)
                for r in pending:
                    if not procs[r].is_alive():
                        died.setdefault(r, now)
                # Ranks that still run long after another reported are stuck: a peer waiting on
                # them fails its collective after pg_timeout; run_checks says so at once.
                grace = 5 if store.check(["abandoned"]) else pg_timeout + 10
                # Give up: deadline; every waited-for rank dead (2 s to drain its last message);
                # a rank dead for 10 s (the others wait on it); the rest stuck (above).
                if (now > start + timeout
                        or all(now > died.get(r, now + 1) + 2 for r in pending)
                        or any(now > died[r] + 10 for r in pending if r in died)
                        or (first_report and now > first_report + grace)):
                    break
            for r in sorted(reporting - set(outcomes)):
                if procs[r].is_alive():
                    os.kill(procs[r].pid, signal.SIGUSR1)
            if reporting - set(outcomes):
                time.sleep(1)  # let faulthandler write
            for r in sorted(reporting - set(outcomes)):
                if procs[r].is_alive():
                    what = f"did not report within {time.monotonic() - start:.0f}s (hang?)"
                else:
                    what = f"exited with code {procs[r].exitcode} without reporting"
                path = os.path.join(workdir, f"rank{r}.stacks")
                stacks = open(path).read().strip() if os.path.exists(path) else ""
                lost[r] = (f"rank {r} {what}; it was {_read_status(store, r)}; its stacks:\n"
                           f"{stacks or '(none written)'}")
            for key in keys:
                if store.check([key]):
                    stored[key] = store.get(key)
            finished = not lost
        finally:
            stop_ranks(procs, 10 if finished else 0)  # ranks that reported tear down their groups
            queue.close()
            del store
    return outcomes, lost, stored


def spawn_ranks(fn, world_size, *args, timeout=120, reporting=None, pg_timeout=PG_TIMEOUT):
    """fn(rank, world_size, *args) on each rank. Returns {rank: ("ok", result) | ("error", text)}.

    reporting: the ranks expected to report (default all; a rank that kills itself won't).
    A rank of `reporting` that hangs or dies raises RankFailed with its stack."""
    outcomes, lost, _ = _spawn(fn, world_size, args, timeout, reporting, pg_timeout)
    if lost:
        raise RankFailed("\n\n".join(lost[r] for r in sorted(lost)))
    return outcomes


def run_ranks(fn, world_size, *args, timeout=120, pg_timeout=PG_TIMEOUT):
    """fn on every rank; the results by rank, or RankFailed with every rank's error."""
    outcomes = spawn_ranks(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout)
    errors = {r: payload for r, (status, payload) in outcomes.items() if status == "error"}
    if errors:
        raise RankFailed("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [outcomes[r][1] for r in range(world_size)]


def _run_checks(rank, world_size, checks):
    abandoned = None  # why the remaining checks cannot run here
    for i, fn in enumerate(checks):
        name = fn.__name__
        if abandoned:
            outcome = ("error", abandoned)
        else:
            _status(f"in check {name}")
            try:
                outcome = ("ok", fn(rank, world_size))
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - pytest.fail, SystemExit too: to its test
                outcome = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            if outcome[0] == "error":
                _drop_group()  # peers blocked on this rank in the check's collectives fail now
        try:
            data = pickle.dumps(outcome)
        except Exception as e:  # noqa: BLE001 - fail this check, not the spawn
            data = pickle.dumps(("error", f"the check's result cannot be pickled: {e!r}"))
        _store.set(f"result/{name}/{rank}", data)
        _store.set(f"done/{i}/{rank}", outcome[0])
        if abandoned:
            continue
        _status(f"waiting for the other ranks to finish check {name}")
        done = [f"done/{i}/{r}" for r in range(world_size)]
        try:
            # Longer than a collective's timeout: a peer stuck in one fails it and arrives.
            _store.wait(done, timedelta(seconds=_rank_info["pg_timeout"] + 15))
        except Exception:  # noqa: BLE001 - a peer stopped answering: nothing later can run
            late = [r for r in range(world_size) if not _store.check([done[r]])]
            abandoned = f"not run: rank(s) {late} did not finish check {name}"
            _store.set("abandoned", str(rank))  # the parent need not wait for the late ones
            continue
        if any(_store.get(key) == b"error" for key in done):
            # A failed check may leave unmatched collectives behind: start from a fresh group.
            _drop_group()
            try:
                _init_group(f"after-check-{i}")
            except Exception as e:  # noqa: BLE001 - e.g. a peer died meanwhile
                abandoned = f"not run: no fresh group after check {name}: {type(e).__name__}: {e}"
                _store.set("abandoned", str(rank))
    _status("reporting")


def run_checks(checks, world_size=2, timeout=180, pg_timeout=PG_TIMEOUT):
    """Several checks fn(rank, world_size) in one spawn (spawning costs seconds). Returns, per
    rank, {check name: ("ok", result) | ("error", text)}: a check that raises, hangs or loses a
    peer fails its own test (and, for a hang, the later checks), not the whole spawn."""
    names = [fn.__name__ for fn in checks]
    keys = [f"result/{n}/{r}" for n in names for r in range(world_size)]
    outcomes, lost, stored = _spawn(_run_checks, world_size, (checks,), timeout, None, pg_timeout,
                                    keys)
    errors = {r: payload for r, (status, payload) in outcomes.items() if status == "error"}
    if errors:  # the harness itself failed on a rank (e.g. init_process_group)
        raise RankFailed("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    lost_report = "\n\n".join(lost[r] for r in sorted(lost))
    return [{n: pickle.loads(stored[f"result/{n}/{r}"]) if f"result/{n}/{r}" in stored
             else ("error", lost_report) for n in names}
            for r in range(world_size)]


class SelectedChecks:
    """A test module's checks, each used by one or more tests (`@checks.uses(check)`), run in ONE
    spawn by the module fixture (`checks.run(request)`): only the checks of the tests pytest
    selected, so `-k one_test` spawns for that check alone."""

    def __init__(self):
        self.check_of = {}

    def uses(self, check):
        def mark(test):
            self.check_of[test.__name__] = check
            return test
        return mark

    def run(self, request, world_size=2, timeout=180):
        selected = [item.name.split("[")[0] for item in request.session.items
                    if item.module is request.module]
        checks = []
        for name in selected:
            check = self.check_of.get(name)
            if check is not None and check not in checks:
                checks.append(check)
        return run_checks(checks, world_size, timeout=timeout)

    def fixture(self, world_size=2, timeout=180):
        """The module fixture `outcomes` (assign it to that name): run(request, ...) once per
        module."""
        import pytest

        @pytest.fixture(scope="module", name="outcomes")
        def outcomes(request):
            return self.run(request, world_size, timeout)
        return outcomes


def train_squares(model, steps, rank, width):
    """`steps` backward passes of mean(model(x)^2) on a 4 x `width` batch seeded by step and rank
    (different data on every rank, the same on every run)."""
    import torch
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        model.zero_grad(set_to_none=True)
        model(torch.randn(4, width, generator=g)).pow(2).mean().backward()


def assert_small(values, what, tol=1e-6):
    """Every value a float no larger than tol (and at least one)."""
    assert values, f"{what}: nothing compared"
    for i, d in enumerate(values):
        assert isinstance(d, float) and d <= tol, f"{what} [{i}]: {d}"


def observe_ready_order(module):
    """Gradient-ready order (parameter indices) as plain PyTorch hooks see it: (order, handles);
    remove the handles when done."""
    order = []
    handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: order.append(i))
               for i, p in enumerate(module.parameters())]
    return order, handles


def results(outcomes, check):
    """per_rank for a check given as the function."""
    return per_rank(outcomes, check.__name__)


def per_rank(outcomes, check):
    """The results of `check` on every rank; fails the test with that rank's error otherwise."""
    out = []
    for rank, results in enumerate(outcomes):
        status, payload = results[check]
        assert status == "ok", f"rank {rank}: {payload}"
        out.append(payload)
    return out
