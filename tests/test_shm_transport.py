"""The shared-memory transport (Note [Shared-memory all-reduce]): sums against independent
references (float64, a plain gloo dist.all_reduce), chunking, identical replicas, the choice and
fallback of backend='auto', and faults (different buckets, a peer that closes or never comes,
a forked DataLoader worker) as clear errors, never hangs."""
import gc
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fused_reducer
from fused_reducer import transport as transport_module
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
    left = [f for f in os.listdir("/dev/shm") if f.startswith(f"fused_reducer_{pid0[0]}_")]
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


def check_forked_worker(rank, world):
    """A DataLoader-style fork whose child drops the model and exits: the parent's transport and
    its peers go on (the child must not stop the segment or join the parent's thread)."""
    torch.manual_seed(0)
    model = FusedReducer(nn.Linear(8, 8))
    x = torch.randn(2, 8)
    model(x).sum().backward()
    child = os.fork()
    if child == 0:
        del model
        gc.collect()
        os._exit(0)
    os.waitpid(child, 0)
    dist.barrier()
    model.zero_grad()
    model(x * (rank + 1)).sum().backward()
    # loss = sum of outputs: d/dW[i, j] = sum over the batch of x[:, j], averaged over ranks
    expected = sum((x * (r + 1)).sum(0) for r in range(world)) / world
    return (model.module.weight.grad - expected.expand(8, 8)).abs().max().item()


@uses(check_forked_worker)
def test_a_forked_child_dropping_the_model_does_not_disturb_training(outcomes):
    for err in results(outcomes, check_forked_worker):
        assert err < 1e-6, err


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def outcomes(request):
    return checks.run(request, world_size=request.param)
