"""The shared-memory transport (Note [Shared-memory all-reduce]): sums against independent
references (float64, a plain gloo dist.all_reduce), chunking, identical replicas, the choice and
fallback of backend='auto', and faults (different buckets, a peer that closes or never comes,
a forked DataLoader worker) as clear errors, never hangs. Shared hosts, forked children,
timeouts and small containers: the forked child's exit status, cancellation of a timed-out wait, a
header rewritten by another process, attach checks, infinite timeouts, dropping a transport
holding the GIL, complex and overflowing integer sums, a malformed store value, close() from two
threads, /dev/shm sizing and dead segments, store keys per torchrun restart attempt."""
import gc
import math
import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fused_reducer
from fused_reducer.transports import transport as transport_module
from fused_reducer import FusedReducer
from dist_utils import SelectedChecks, results

checks = SelectedChecks()
uses = checks.uses

CHUNK = 4096  # bytes per slot: 1024 float32, so most sizes below span several chunks
SIZES = (1, 17, 1023, 1024, 1025, 5000)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64)


def rank_input(rank, numel, dtype):
    g = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, (numel,), generator=g)
    return (torch.randn(numel, generator=g, dtype=torch.float64) * (rank + 1)).to(dtype)


def check_sums(rank, world):
    """Every size and dtype, all started before the first wait (the worker runs them in order):
    the result vs the float64 sum of every rank's input, vs gloo's dist.all_reduce, and the
    replicas bit-identical."""
    transport, why_not = transport_module.shm_transport(dist.group.WORLD, 30.0, chunk_bytes=CHUNK)
    assert transport is not None, why_not
    cases = [(n, dtype) for dtype in DTYPES for n in SIZES]
    flats = [rank_input(rank, n, dtype) for n, dtype in cases]
    pending = [transport.allreduce_sum(flat) for flat in flats]
    for p in pending:
        p.wait(30.0)
    out = {"name": transport.name, "vs_float64": {}, "vs_gloo": {}, "replicas_differ": []}
    for (n, dtype), flat in zip(cases, flats):
        exact = sum(rank_input(r, n, dtype).double() for r in range(world))
        out["vs_float64"][(n, str(dtype))] = (flat.double() - exact).abs().max().item() / (
            exact.abs().max().item() or 1.0)
        gloo = rank_input(rank, n, dtype)
        dist.all_reduce(gloo)
        out["vs_gloo"][(n, str(dtype))] = (flat.double() - gloo.double()).abs().max().item() / (
            exact.abs().max().item() or 1.0)
        rank0 = flat.clone()
        dist.broadcast(rank0, 0)
        if not torch.equal(rank0, flat):
            out["replicas_differ"].append((n, str(dtype)))
    transport.close(5.0)
    return out


@uses(check_sums)
def test_sums_match_float64_and_gloo_across_chunks_and_replicas_are_identical(outcomes):
    world = len(outcomes)
    # float32/64: one rounding per add (exact for 2 ranks); half types: one rounding in all
    tolerance = {"torch.float32": 1e-6 * world, "torch.float64": 1e-15 * world,
                 "torch.bfloat16": 2 ** -8, "torch.float16": 2 ** -11, "torch.int64": 0.0}
    for r in results(outcomes, check_sums):
        assert r["name"] == "shm"
        assert r["replicas_differ"] == []
        for key, err in r["vs_float64"].items():
            assert err <= tolerance[key[1]], (key, err)
        for key, err in r["vs_gloo"].items():
            # two ranks: the very same additions as gloo's; half types round once (gloo per add)
            exact = world == 2 and key[1] not in ("torch.bfloat16", "torch.float16")
            assert err <= (0.0 if exact else 2 * tolerance[key[1]]), (key, err)


def check_segment_unlinked(rank, world):
    """Once constructed, the segment has no name left in /dev/shm (nothing leaks if a rank is
    killed later), and the model trains."""
    pid0 = [os.getpid()]
    dist.broadcast_object_list(pid0, 0)
    model = FusedReducer(nn.Linear(8, 8))
    model(torch.randn(2, 8)).sum().backward()
    left = [f for f in os.listdir("/dev/shm")
            if f.startswith(transport_module.shm_name_prefix(pid0[0]))]
    return {"backend": model.backend, "left": left}


@uses(check_segment_unlinked)
def test_segment_name_is_removed_once_every_rank_mapped_it(outcomes):
    for r in results(outcomes, check_segment_unlinked):
        assert r == {"backend": "shm", "left": []}


def check_different_buckets(rank, world):
    """Rank 0 reduces 100 elements, the others 200: every rank raises naming both sizes."""
    transport, _ = transport_module.shm_transport(dist.group.WORLD, 30.0)
    start = time.monotonic()
    try:
        transport.allreduce_sum(torch.ones(100 if rank == 0 else 200)).wait(30.0)
        return "no error"
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    finally:
        transport.close(1.0)


@uses(check_different_buckets)
def test_different_buckets_across_ranks_raise_on_every_rank_naming_the_sizes(outcomes):
    for r in results(outcomes, check_different_buckets):
        assert r != "no error"
        message, elapsed = r
        assert "different buckets" in message and "100 elements" in message, message
        assert "200 elements" in message and "differ across ranks" in message, message
        assert elapsed < 10, elapsed


def check_peer_closes(rank, world):
    """The last rank closes its transport without reducing; the others' bucket fails at once,
    naming it, instead of waiting for the timeout (60 s here)."""
    transport, _ = transport_module.shm_transport(dist.group.WORLD, 60.0)
    if rank == world - 1:
        transport.close(1.0)
        return "closed"
    start = time.monotonic()
    try:
        transport.allreduce_sum(torch.ones(10)).wait(60.0)
        return "no error"
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    finally:
        transport.close(1.0)


@uses(check_peer_closes)
def test_a_peer_that_closes_makes_the_waiting_ranks_raise_promptly_naming_it(outcomes):
    world = len(outcomes)
    answers = results(outcomes, check_peer_closes)
    assert answers[-1] == "closed"
    for r in answers[:-1]:
        assert r != "no error"
        message, elapsed = r
        assert f"rank {world - 1} stopped reducing" in message, message
        assert elapsed < 10, elapsed


def check_peer_never_comes(rank, world):
    """Rank 0 reduces with a 1 s timeout while the others never start: it raises naming the
    rank it waited for; the others, reducing later, learn that rank 0 gave up."""
    transport, _ = transport_module.shm_transport(dist.group.WORLD, 1.0)
    try:
        if rank != 0:
            time.sleep(3.0)
        start = time.monotonic()
        transport.allreduce_sum(torch.ones(10)).wait(30.0)
        return "no error"
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    finally:
        transport.close(1.0)


@uses(check_peer_never_comes)
def test_a_peer_that_never_comes_times_out_naming_it(outcomes):
    answers = results(outcomes, check_peer_never_comes)
    message, elapsed = answers[0]
    assert "timed out after 1000 ms waiting for rank 1" in message, message
    assert elapsed < 5, elapsed
    for r in answers[1:]:
        assert r != "no error" and "rank 0 stopped reducing" in r[0], r


def check_peer_never_joins(rank, world):
    """The last rank constructs no transport (dead, or another code path): the others raise
    within their 2 s timeout naming it, not after the store's own timeout."""
    group = dist.new_group()
    if rank == world - 1:
        time.sleep(6.0)  # gone for the others' whole timeout; then nothing is left to join
        return None
    start = time.monotonic()
    try:
        transport, _ = transport_module.shm_transport(group, 2.0)
        transport.close(0.0)
        return "no error", time.monotonic() - start
    except RuntimeError as e:
        return str(e), time.monotonic() - start


@uses(check_peer_never_joins)
def test_a_peer_that_never_joins_makes_the_others_raise_within_the_timeout_naming_it(outcomes):
    answers = results(outcomes, check_peer_never_joins)
    world = len(answers)
    for rank, (message, elapsed) in enumerate(answers[:-1]):
        assert f"rank(s) [{world - 1}]" in message and "'shm-host' exchange" in message, \
            (rank, message)
        assert elapsed < 5, (rank, elapsed)


def check_fallback(rank, world):
    """Ranks that report different hosts: 'auto' falls back to the process group (and trains);
    'shm' raises on every rank naming the hosts and what to use instead."""
    real = transport_module.socket.gethostname
    transport_module.socket.gethostname = lambda: f"node{rank}"
    try:
        try:
            auto = FusedReducer(nn.Linear(4, 4))
            auto(torch.randn(2, 4)).sum().backward()
            out = {"auto": (auto.backend, auto.stats()["transport"])}
        except RuntimeError as e:
            out = {"auto": ("raised", str(e))}
        try:
            FusedReducer(nn.Linear(4, 4), backend="shm")
            out["shm"] = "accepted"
        except RuntimeError as e:
            out["shm"] = str(e)
        return out
    finally:
        transport_module.socket.gethostname = real


@uses(check_fallback)
def test_auto_falls_back_to_the_process_group_across_hosts_and_shm_raises(outcomes):
    for r in results(outcomes, check_fallback):
        assert r["auto"] == ("process_group", "process_group(gloo)"), r
        assert "backend='shm' cannot be used" in r["shm"], r["shm"]
        assert "several hosts (node0, node1" in r["shm"], r["shm"]
        assert "backend='process_group'" in r["shm"], r["shm"]


def wait_child(pid, seconds=20.0):
    """The child's exit status as ('exit', code) / ('signal', number), or ('hung', None) (then it
    is killed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                return ("signal", os.WTERMSIG(status))
            return ("exit", os.WEXITSTATUS(status))
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return ("hung", None)


def check_forked_worker(rank, world):
    """A DataLoader-style fork whose child drops the model and exits: the child exits cleanly
    (no SIGABRT from a joinable std::thread, no hang in ~condition_variable), and the parent's
    transport and its peers go on (the child must not stop the segment or join the parent's
    thread)."""
    torch.manual_seed(0)
    model = FusedReducer(nn.Linear(8, 8))
    x = torch.randn(2, 8)
    model(x).sum().backward()
    child = os.fork()
    if child == 0:
        try:
            del model
            gc.collect()
        finally:
            os._exit(0)
    status = wait_child(child)
    dist.barrier()
    model.zero_grad()
    model(x * (rank + 1)).sum().backward()
    # loss = sum of outputs: d/dW[i, j] = sum over the batch of x[:, j], averaged over ranks
    expected = sum((x * (r + 1)).sum(0) for r in range(world)) / world
    return status, (model.module.weight.grad - expected.expand(8, 8)).abs().max().item()


@uses(check_forked_worker)
def test_a_forked_child_dropping_the_model_exits_cleanly_and_does_not_disturb_training(outcomes):
    for status, err in results(outcomes, check_forked_worker):
        assert status == ("exit", 0), status
        assert err < 1e-6, err


def check_fork_during_an_all_reduce(rank, world):
    """Rank 0 forks while its bucket waits for the peers (the worker thread and the job's lock
    busy): in the child, waiting or all-reducing raises at once naming the fork, and dropping the
    transport exits cleanly; the parent's all-reduce then completes."""
    transport, why_not = transport_module.shm_transport(dist.group.WORLD, 30.0)
    assert transport is not None, why_not
    flat = torch.ones(1000)
    status, child_said = None, None
    if rank == 0:
        pending = transport.allreduce_sum(flat)
        time.sleep(0.2)  # the worker is inside the wait for the peers now
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            code = 1
            try:
                os.close(read)
                said = []
                for action in (lambda: pending.wait(5.0),
                               lambda: transport.allreduce_sum(torch.ones(3))):
                    try:
                        action()
                        said.append("no error")
                    except RuntimeError as e:
                        said.append(str(e))
                os.write(write, "\n".join(said).encode())
                del pending, transport
                gc.collect()
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        status = wait_child(child)
        with os.fdopen(read) as f:
            child_said = f.read().split("\n")
    dist.barrier()
    if rank != 0:
        pending = transport.allreduce_sum(flat)
    pending.wait(30.0)
    transport.close(5.0)
    return status, child_said, flat.tolist() == [float(world)] * 1000


@uses(check_fork_during_an_all_reduce)
def test_a_child_forked_during_an_all_reduce_raises_and_exits_cleanly(outcomes):
    answers = results(outcomes, check_fork_during_an_all_reduce)
    status, said, summed = answers[0]
    assert status == ("exit", 0), status
    assert len(said) == 2 and all("forked child" in text for text in said), said
    for _, _, summed in answers:
        assert summed


def check_timed_out_wait_cancels(rank, world):
    """Rank 0's wait gives up after 0.5 s while the peers are late: nothing is written into its
    bucket afterwards, and the late peers' all-reduce fails naming rank 0 instead of succeeding
    with a sum rank 0 never received."""
    transport, why_not = transport_module.shm_transport(dist.group.WORLD, 30.0)
    assert transport is not None, why_not
    flat = torch.ones(5000)
    try:
        if rank == 0:
            pending = transport.allreduce_sum(flat)
            try:
                pending.wait(0.5)
                waited = "no error"
            except RuntimeError as e:
                waited = str(e)
            dist.barrier()
            time.sleep(1.5)  # the peers have long arrived
            try:
                transport.check()
                later = "no error"
            except RuntimeError as e:
                later = str(e)
            # The expected message is reported as a verdict, not as text: scripts/mutants.py
            # would read "timed out after" in a failure report as a hang.
            expected = ("timed out after 500 ms waiting for rank 1" in waited
                        and "cancelled" in waited)
            return expected or waited, flat.tolist() == [1.0] * 5000, later
        dist.barrier()
        time.sleep(0.3)
        try:
            transport.allreduce_sum(flat).wait(10.0)
            return "no error"
        except RuntimeError as e:
            return str(e)
    finally:
        transport.close(1.0)


@uses(check_timed_out_wait_cancels)
def test_a_timed_out_wait_cancels_its_all_reduce_on_every_rank(outcomes):
    answers = results(outcomes, check_timed_out_wait_cancels)
    waited, untouched, later = answers[0]
    assert untouched, "the sum was written into the bucket after its wait had failed"
    for message in answers[1:]:
        assert "rank 0 stopped reducing" in message, message
    assert waited is True, waited  # "timed out after 500 ms waiting for rank 1; ...cancelled"
    assert "rank 0" in later and "cancelled" in later, later


REWRITE = """
import mmap, os, struct, sys
fd = os.open("/dev/shm" + sys.argv[1], os.O_RDWR)
with mmap.mmap(fd, 4096) as m:
    struct.pack_into("<i", m, 8, 64)            # world (ext/shm_segment.h: static_asserts)
    struct.pack_into("<q", m, 16, 1 << 40)      # chunk_bytes
"""


def check_header_rewritten(rank, world):
    """Once every rank has mapped the segment, another process rewrites its header (world size
    64, chunk size 1 TiB): the offsets come from each rank's own values, so every sum stays
    right (it read and wrote out of bounds, and crashed). A segment whose mode another process
    widened to 0644 is refused on attach, naming the rank and the mode."""
    name = [f"/{transport_module.shm_name_prefix()}{os.urandom(6).hex()}" if rank == 0 else None]
    dist.broadcast_object_list(name, 0)
    made = transport_module._C.ShmTransport(name[0], True, 0, world, CHUNK, 30.0) if rank == 0 \
        else None
    dist.barrier()
    transport = made or transport_module._C.ShmTransport(name[0], False, rank, world, CHUNK, 30.0)
    dist.barrier()
    if rank == 0:
        subprocess.run([sys.executable, "-c", REWRITE, name[0]], check=True)
        transport.unlink()
    dist.barrier()
    transport.start_peer_checks()
    wrong = []
    for n in (1, 1025, 5000, 20000):
        flat = rank_input(rank, n, torch.float64)
        transport.allreduce_sum(flat).wait(30.0)
        exact = sum(rank_input(r, n, torch.float64) for r in range(world))
        if (flat - exact).abs().max().item() > 1e-12:
            wrong.append(n)
    transport.close(5.0)

    name = [f"/{transport_module.shm_name_prefix()}{os.urandom(6).hex()}" if rank == 0 else None]
    dist.broadcast_object_list(name, 0)
    if rank == 0:
        made = transport_module._C.ShmTransport(name[0], True, 0, world, CHUNK, 30.0)
        os.chmod("/dev/shm" + name[0], 0o644)
    dist.barrier()
    refused = None
    if rank != 0:
        try:
            transport_module._C.ShmTransport(name[0], False, rank, world, CHUNK, 30.0)
            refused = "accepted"
        except RuntimeError as e:
            refused = str(e)
    dist.barrier()
    if rank == 0:
        made.unlink()
        made.close(0.0)
    return wrong, refused


@uses(check_header_rewritten)
def test_a_header_rewritten_by_another_process_moves_no_slot_and_a_wide_mode_is_refused(outcomes):
    answers = results(outcomes, check_header_rewritten)
    for rank, (wrong, refused) in enumerate(answers):
        assert wrong == [], wrong
        if rank:
            assert f"rank {rank}" in refused and "mode is 0644, not 0600" in refused, refused


def check_infinite_timeouts(rank, world):
    """timeout=inf and timedelta.max mean no timeout (clamped to a year), on shared memory and on
    the process group: training works (every all-reduce failed at once, 'timed out after
    -9223372036854775808 ms'). NaN and non-positive timeouts raise at construction."""
    out = {}
    for backend in ("shm", "process_group"):
        for timeout in (float("inf"), timedelta.max):
            torch.manual_seed(0)
            model = FusedReducer(nn.Linear(4, 4), backend=backend, timeout=timeout)
            x = torch.randn(2, 4) * (rank + 1)
            model(x).sum().backward()
            expected = sum((x / (rank + 1) * (r + 1)).sum(0) for r in range(world)) / world
            out[(backend, str(timeout))] = (
                model.backend, model.attachment.timeout_s,
                (model.module.weight.grad - expected.expand(4, 4)).abs().max().item())
            model.close()
    for bad in (float("nan"), 0, -1.0, timedelta(0)):
        try:
            FusedReducer(nn.Linear(4, 4), timeout=bad)
            out[repr(bad)] = "accepted"
        except ValueError as e:
            out[repr(bad)] = str(e)
    return out


@uses(check_infinite_timeouts)
def test_infinite_timeouts_mean_no_timeout_and_nan_is_refused(outcomes):
    for r in results(outcomes, check_infinite_timeouts):
        for key, value in r.items():
            if isinstance(key, tuple):
                backend, timeout_s, err = value
                assert backend == key[0], (key, value)
                assert timeout_s == transport_module.MAX_TIMEOUT_S, (key, value)
                assert err < 1e-6, (key, value)
            else:
                assert "timeout must be positive" in value, (key, value)


def check_drop_without_close(rank, world):
    """A transport dropped without close() while its bucket is still in flight, by Python (which
    holds the GIL): the destructor lets the bucket finish and returns (the worker released the
    bucket's tensor, which needed the GIL: a deadlock)."""
    import faulthandler
    faulthandler.dump_traceback_later(60, exit=True)  # a deadlock holds the GIL: end the rank
    try:
        transport, why_not = transport_module.shm_transport(dist.group.WORLD, 30.0)
        assert transport is not None, why_not
        flat = torch.ones(100)
        flat.tag = "a Python attribute: torch keeps the PyObject alive for C++ owners"
        if rank != 0:
            time.sleep(1.0)
        pending = transport.allreduce_sum(flat)
        del flat
        start = time.monotonic()
        del transport  # no close(): the destructor runs now, holding the GIL
        elapsed = time.monotonic() - start
        pending.wait(10.0)
        del pending
        gc.collect()
        return elapsed
    finally:
        faulthandler.cancel_dump_traceback_later()


@uses(check_drop_without_close)
def test_dropping_a_transport_without_close_holding_the_gil_returns(outcomes):
    for elapsed in results(outcomes, check_drop_without_close):
        assert elapsed < 10, elapsed


def check_complex_and_integer_overflow(rank, world):
    """Complex buckets are summed as (re, im) pairs; a complex model under backend='auto' uses
    shared memory and trains like the process group; integer sums wrap around like torch's."""
    transport, why_not = transport_module.shm_transport(dist.group.WORLD, 30.0, chunk_bytes=CHUNK)
    assert transport is not None, why_not
    out = {}
    cases = [(torch.complex64, 1500), (torch.complex128, 700), (torch.int8, 3000),
             (torch.int16, 100), (torch.int32, 100), (torch.int64, 1500)]
    def made_by(r, dtype, n):
        if dtype.is_complex:
            return torch.randn(n, dtype=dtype, generator=torch.Generator().manual_seed(r))
        info = torch.iinfo(dtype)
        flat = torch.full((n,), info.max - r, dtype=dtype)  # overflows from 2 ranks on
        flat[::2] = info.min + r
        return flat

    for dtype, n in cases:
        flat = made_by(rank, dtype, n)
        transport.allreduce_sum(flat).wait(30.0)
        expected = made_by(0, dtype, n)
        for r in range(1, world):
            expected = expected + made_by(r, dtype, n)  # torch's integer adds wrap around
        out[str(dtype)] = ((flat - expected).abs().max().item() / expected.abs().max().item()
                           if dtype.is_complex else torch.equal(flat, expected))
    transport.close(5.0)

    torch.manual_seed(0)
    model = FusedReducer(nn.Linear(4, 4, dtype=torch.complex64))
    reference = nn.Linear(4, 4, dtype=torch.complex64)
    reference.load_state_dict(model.module.state_dict())
    x = torch.randn(2, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(rank))
    model(x).abs().sum().backward()
    reference(x).abs().sum().backward()
    expected = reference.weight.grad.clone()
    dist.all_reduce(expected)
    expected /= world
    out["model"] = (model.backend, (model.module.weight.grad - expected).abs().max().item())
    model.close()
    return out


@uses(check_complex_and_integer_overflow)
def test_complex_sums_as_real_pairs_and_integer_sums_wrap_like_torch(outcomes):
    for r in results(outcomes, check_complex_and_integer_overflow):
        backend, err = r.pop("model")
        assert backend == "shm" and err < 1e-5, (backend, err)
        for dtype, value in r.items():
            if "complex" in dtype:
                assert value < 1e-6, (dtype, value)
            else:
                assert value is True, dtype


def check_malformed_store_value(rank, world):
    """Rank 1 reads a malformed segment name from the store: every rank still gets an answer
    (no shared memory, naming rank 1 and the value), none waits for another."""
    real = transport_module.exchange

    def tampered(group, topic, text, timeout_s=None):
        answers = real(group, topic, text, timeout_s)
        return ["garbage-without-a-tab"] * len(answers) if topic == "shm-create" else answers

    if rank == 1:
        transport_module.exchange = tampered
    start = time.monotonic()
    try:
        transport, why_not = transport_module.shm_transport(dist.group.WORLD, 30.0)
    finally:
        transport_module.exchange = real
    if transport is not None:
        transport.close(0.0)
    return transport is None, why_not, time.monotonic() - start


@uses(check_malformed_store_value)
def test_a_malformed_store_value_on_rank_1_gives_every_rank_an_answer(outcomes):
    for none, why_not, elapsed in results(outcomes, check_malformed_store_value):
        assert none, why_not
        assert "rank 1" in why_not and "malformed" in why_not, why_not
        assert elapsed < 10, elapsed


def check_close_from_two_threads(rank, world):
    """On rank 0, two threads close the transport at once while a bucket waits for peers that
    have not started (the first close joins the worker until its 1 s deadline): both return,
    neither raises nor blocks. The peers close afterwards."""
    transport, why_not = transport_module.shm_transport(dist.group.WORLD, 30.0)
    assert transport is not None, why_not
    if rank != 0:
        dist.barrier()
        transport.close(1.0)
        return None
    pending = transport.allreduce_sum(torch.ones(10))
    time.sleep(0.2)
    answers = []

    def close():
        try:
            transport.close(1.0)
            answers.append("ok")
        except Exception as e:  # noqa: BLE001 - reported
            answers.append(repr(e))

    start = time.monotonic()
    threads = [threading.Thread(target=close) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    elapsed = time.monotonic() - start
    hung = any(t.is_alive() for t in threads)
    try:
        pending.wait(5.0)
    except RuntimeError:
        pass
    dist.barrier()
    return answers, hung, elapsed


@uses(check_close_from_two_threads)
def test_close_from_two_threads_at_once_returns_in_both(outcomes):
    answers, hung, elapsed = results(outcomes, check_close_from_two_threads)[0]
    assert not hung and answers == ["ok", "ok"], answers
    assert elapsed < 10, elapsed


def check_restart_attempt_keys(rank, world):
    """torchrun's store outlives a restarted attempt: the keys of attempt 1 differ from attempt
    0's, so an exchange of the new attempt (its own round 0 again) reads the new values, not the
    dead attempt's; so does the shared-memory rendezvous."""
    saved_rounds = dict(transport_module._exchange_rounds)
    saved_tokens = dict(transport_module._attempt_tokens)
    saved_env = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    try:
        # Attempts 10 and 11: keys no earlier check of these ranks used (rounds restart at 0).
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "10"
        transport_module._exchange_rounds.clear()
        transport_module._attempt_tokens.clear()
        first = transport_module.exchange(dist.group.WORLD, "restart-probe", f"attempt0-{rank}")
        shm0, _ = transport_module.shm_transport(dist.group.WORLD, 30.0)
        shm0.close(1.0)  # rank 0's segment is gone: reading its name again would fail to attach
        dist.barrier()
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "11"
        transport_module._exchange_rounds.clear()  # a new process: rounds start again,
        transport_module._attempt_tokens.clear()  # and it has no token yet
        second = transport_module.exchange(dist.group.WORLD, "restart-probe", f"attempt1-{rank}")
        shm1, why_not = transport_module.shm_transport(dist.group.WORLD, 30.0)
        if shm1 is not None:
            flat = torch.ones(10)
            shm1.allreduce_sum(flat).wait(10.0)
            shm1.close(1.0)
            why_not = flat.tolist() == [float(world)] * 10
        dist.barrier()
        # Two torchrun agents can disagree on the count (one restarted for the other's failure
        # keeps its count): the ranks still agree on one namespace, through the group.
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(20 + rank)
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the store that outlives attempts
        transport_module._exchange_rounds.clear()
        transport_module._attempt_tokens.clear()
        split = transport_module.exchange(dist.group.WORLD, "restart-probe", f"split-{rank}", 30.0)
        return first, second, why_not, split
    finally:
        transport_module._exchange_rounds.clear()
        transport_module._exchange_rounds.update(saved_rounds)
        transport_module._attempt_tokens.clear()
        transport_module._attempt_tokens.update(saved_tokens)
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        if saved_env is None:
            os.environ.pop("TORCHELASTIC_RESTART_COUNT", None)
        else:
            os.environ["TORCHELASTIC_RESTART_COUNT"] = saved_env


@uses(check_restart_attempt_keys)
def test_store_keys_of_a_restarted_attempt_do_not_collide_with_the_last_ones(outcomes):
    world = len(outcomes)
    for first, second, shm, split in results(outcomes, check_restart_attempt_keys):
        assert first == [f"attempt0-{r}" for r in range(world)]
        assert second == [f"attempt1-{r}" for r in range(world)], second
        assert shm is True, shm
        assert split == [f"split-{r}" for r in range(world)], split


# -- /dev/shm sizing and dead segments (one process) -------------------------------------------

MiB = 1 << 20
GiB = 1 << 30


def test_a_64_mib_dev_shm_gets_a_small_share_and_a_too_small_one_is_refused():
    """A container's default 64 MiB /dev/shm: the segment takes at most an eighth of it (it took
    up to half, starving the DataLoader's shared memory), however many ranks; smaller shares
    refuse with what to do. Through the size chooser's inputs: this machine's /dev/shm is large."""
    for world in (2, 3, 4, 8):
        chunk, why_not = transport_module.shm_chunk_for(world, 4 * MiB, 64 * MiB, 64 * MiB)
        assert chunk is not None, why_not
        assert 2 * (world + 1) * chunk <= 8 * MiB, (world, chunk)
        assert chunk >= 256 << 10 and chunk % 4096 == 0
    # Mostly used by other jobs: at most a quarter of what is free.
    chunk, _ = transport_module.shm_chunk_for(2, 4 * MiB, 64 * GiB, 16 * MiB)
    assert 2 * 3 * chunk <= 4 * MiB, chunk
    # A big host: the full preferred chunk.
    assert transport_module.shm_chunk_for(8, 4 * MiB, 64 * GiB, 60 * GiB) == (4 * MiB, None)
    chunk, why_not = transport_module.shm_chunk_for(8, 4 * MiB, 16 * MiB, 16 * MiB)
    assert chunk is None and "/dev/shm is too small for 8 ranks" in why_not, why_not
    assert "--shm-size" in why_not, why_not



def test_a_failing_statvfs_is_reported_as_such(monkeypatch):
    def broken(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(transport_module.os, "statvfs", broken)
    chunk, why_not = transport_module._shm_chunk_bytes(2, 4 * MiB)
    assert chunk is None
    assert "cannot read the size of /dev/shm" in why_not and "Input/output error" in why_not
    assert "too small" not in why_not


KILLED_CREATOR = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from fused_reducer import _C
from fused_reducer.transports import transport
name = "/" + transport.shm_name_prefix() + os.urandom(6).hex()
t = _C.ShmTransport(name, True, 0, 2, 4096, 1.0)
print(name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # as torchrun kills a rank in the rendezvous window
"""


def test_segments_of_dead_processes_of_this_user_are_swept_and_live_ones_kept():
    """A rank 0 SIGKILLed between creating its segment and every rank mapping it leaves the
    segment in /dev/shm; the next rendezvous on the host (sweep_dead_segments) removes it. A
    live process's segment, and names of another pid namespace, are kept."""
    package = os.path.dirname(os.path.dirname(fused_reducer.__file__))
    creator = subprocess.run([sys.executable, "-c", KILLED_CREATOR, package],
                             capture_output=True, text=True, timeout=120)
    assert creator.returncode == -signal.SIGKILL, creator
    dead_name = creator.stdout.strip()
    live_name = f"/{transport_module.shm_name_prefix()}{os.urandom(6).hex()}"
    other_ns = f"/fused_reducer_1_{dead_name.split('_')[3]}_{os.urandom(6).hex()}"
    for name in (live_name, other_ns):
        with open("/dev/shm" + name, "wb"):
            pass
    try:
        assert os.path.exists("/dev/shm" + dead_name)  # what a killed rank leaves
        removed = transport_module.sweep_dead_segments()
        assert dead_name[1:] in removed and not os.path.exists("/dev/shm" + dead_name)
        assert os.path.exists("/dev/shm" + live_name) and os.path.exists("/dev/shm" + other_ns)
    finally:
        for name in (dead_name, live_name, other_ns):
            if os.path.exists("/dev/shm" + name):
                os.unlink("/dev/shm" + name)


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def outcomes(request):
    return checks.run(request, world_size=request.param)


# -- ranks as threads of one process: 4 and 8 ranks, every dtype the transport takes ------------

ALL_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
              torch.complex128, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def thread_input(rank, n, dtype):
    g = torch.Generator().manual_seed(7919 * rank + n)
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(n, dtype=torch.complex128 if dtype.is_complex else torch.float64,
                            generator=g) * (rank + 1)).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)


def expected_sum(world, n, dtype):
    """In rank order, as the transport sums: half types in float32, rounded once."""
    inputs = [thread_input(r, n, dtype) for r in range(world)]
    if dtype in (torch.float16, torch.bfloat16):
        total = inputs[0].float()
        for x in inputs[1:]:
            total = total + x.float()
        return total.to(dtype)
    total = inputs[0].clone()
    for x in inputs[1:]:
        total = total + x  # integers wrap around
    return total


@pytest.mark.parametrize("world", [4, 8])
def test_ranks_as_threads_sum_every_dtype_across_chunk_edges_bit_identically(world):
    """Ranks as threads of one process (each its own mapping of one segment), 4 and 8 ranks:
    every dtype the transport takes, sizes across chunk edges, each result bit-identical to the
    sum in rank order and on every rank."""
    name = f"/{transport_module.shm_name_prefix()}{os.urandom(6).hex()}"
    ranks = [transport_module._C.ShmTransport(name, True, 0, world, CHUNK, 30.0)]
    try:
        ranks += [transport_module._C.ShmTransport(name, False, r, world, CHUNK, 30.0)
                  for r in range(1, world)]
    finally:
        ranks[0].unlink()
    cases = [(n, dtype) for dtype in ALL_DTYPES for n in (1, 17, 255, 256, 257, 1025, 5000)]
    outputs = [[thread_input(r, n, dtype) for n, dtype in cases] for r in range(world)]
    errors = []

    def run(rank):
        try:
            pending = [ranks[rank].allreduce_sum(flat) for flat in outputs[rank]]
            for p in pending:
                p.wait(60.0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"rank {rank}: {e}")

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for transport in ranks:
        transport.close(1.0)
    assert not errors, errors
    for i, (n, dtype) in enumerate(cases):
        expected = expected_sum(world, n, dtype)
        for r in range(world):
            assert torch.equal(outputs[r][i], expected), (world, n, dtype, r)
