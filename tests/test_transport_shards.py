"""The sharded mode's transport collectives: Transport.reduce_scatter_sum and
Transport.all_gather, in place on a flat bucket of world_size equal shards, on the process-group
(gloo) and shared-memory transports, at 2, 3 and 4 ranks (Note [Process-group reduce-scatter and
all-gather], Note [Shared-memory reduce-scatter and all-gather]).

- reduce-scatter: this rank's shard is bit-identical to the same transport's all-reduce of the
  same inputs, and within rounding of a float64 sum; the shm transport's also to gloo's (two
  transports, one sum for two ranks; the shm sum in rank order otherwise);
- all-gather: every rank's shard arrives bit for bit (signed zeros, infinities and NaN included),
  whatever the other shards held before;
- sizes across the shm chunk edges (256 KiB chunks, buckets of up to three) and tiny ones (one
  element per rank), float32, float64, bfloat16, int32, int64;
- refusals: a number of elements that is not a multiple of the world size (naming both), a
  non-contiguous bucket, one on another device; ranks that start different collectives, or the
  same one on different buckets, raise on every rank (shm) promptly;
- the safety of the all-reduce holds for the new collectives: a timed-out shm reduce-scatter is
  cancelled on every rank and its bucket is never written afterwards, a peer that closes fails
  the others' all-gather at once, and a gloo reduce-scatter keeps wait()'s timeout (ProcessGroupGloo's
  own reduce_scatter_single would wait for the group's timeout instead).
One spawn per world size runs every check (a module fixture).
"""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fused_reducer.transports import transport as transport_module
from dist_utils import SelectedChecks, results

checks = SelectedChecks()
uses = checks.uses

CHUNK = 256 << 10  # the shm transport's slot size (transport.SHM_CHUNK_BYTES)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64)


def sizes(world, dtype):
    """Multiples of `world`: tiny ones, just under/at one shm chunk, just over it, three chunks
    (shard edges then fall inside chunks, and chunk edges inside shards)."""
    per_chunk = CHUNK // torch.empty((), dtype=dtype).element_size()

    def up(n):
        return (n + world - 1) // world * world

    return sorted({world, 7 * world, per_chunk // world * world, up(per_chunk + 1),
                   up(2 * per_chunk + 5)})


def rank_input(rank, numel, dtype):
    g = torch.Generator().manual_seed(7919 * rank + numel + 31 * DTYPES.index(dtype))
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int64).to(dtype)
    return (torch.randn(numel, generator=g, dtype=torch.float64) * (rank + 1)).to(dtype)


def gather_input(rank, numel, dtype, world):
    """Rank `rank`'s shard for the all-gather: its input, starting with +0.0, -0.0, inf, -inf
    and NaN where the dtype has them."""
    mine = shard(rank_input(rank, numel, dtype), rank, world).clone()
    if dtype.is_floating_point:
        special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")],
                               dtype=dtype)[:mine.numel()]
        mine[:special.numel()] = special
    return mine


def bits(tensor):
    """The tensor's bytes as integers of its width (torch.equal takes -0.0 == 0.0, NaN != NaN)."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                        8: torch.int64}[tensor.element_size()])


def transports(world):
    """(name, transport) for the process group and the shm transport; the caller closes them."""
    shm, why_not = transport_module.shm_transport(dist.group.WORLD, 30.0, chunk_bytes=CHUNK)
    assert shm is not None, why_not
    pg = transport_module.make_transport(dist.group.WORLD, "cpu", backend="process_group")
    return [("process_group", pg), ("shm", shm)]


def shard(flat, rank, world):
    n = flat.numel() // world
    return flat[rank * n:(rank + 1) * n]


def check_reduce_scatter_and_all_gather(rank, world):
    """Per transport, dtype and size: all-reduce, reduce-scatter and all-gather of this rank's
    input; what each rank's shard holds, compared on the rank itself (nothing large is returned)."""
    out = {"not_bit_identical": [], "gather_wrong": [], "error_vs_float64": {}, "vs_gloo": []}
    gloo_sum = {}
    for name, transport in transports(world):
        for dtype in DTYPES:
            for n in sizes(world, dtype):
                x = rank_input(rank, n, dtype)
                summed = x.clone()
                transport.allreduce_sum(summed).wait(30.0)
                scattered = x.clone()
                pending = (transport.reduce_scatter_sum(scattered, f"bucket {n}") if n % 2
                           else transport.reduce_scatter_sum(scattered))  # the label's default
                pending.wait(30.0)
                mine = shard(scattered, rank, world)
                if not torch.equal(mine, shard(summed, rank, world)):
                    out["not_bit_identical"].append((name, str(dtype), n))
                # Within rounding of the float64 sum, relative to the sum of magnitudes.
                inputs = [shard(rank_input(r, n, dtype), rank, world).double() for r in range(world)]
                exact = sum(inputs)
                scale = sum(i.abs() for i in inputs).max().item() or 1.0
                error = (mine.double() - exact).abs().max().item() / scale
                key = (name, str(dtype))
                out["error_vs_float64"][key] = max(out["error_vs_float64"].get(key, 0.0), error)
                if name == "process_group":
                    gloo_sum[(dtype, n)] = mine.clone()
                elif not torch.equal(mine, gloo_sum[(dtype, n)]) and (
                        world == 2 or not dtype.is_floating_point):
                    out["vs_gloo"].append((str(dtype), n))  # one rounding: must agree
                # All-gather: this rank's shard in, everyone's out; the rest held garbage.
                # Compared bit for bit: signed zeros, infinities and NaN must arrive as sent.
                gathered = torch.full((n,), -7, dtype=dtype)
                shard(gathered, rank, world).copy_(gather_input(rank, n, dtype, world))
                transport.all_gather(gathered, f"bucket {n}").wait(30.0)
                expected = torch.cat([gather_input(r, n, dtype, world) for r in range(world)])
                if not torch.equal(bits(gathered), bits(expected)):
                    out["gather_wrong"].append((name, str(dtype), n))
        transport.close(5.0)
    return out


@uses(check_reduce_scatter_and_all_gather)
def test_reduce_scatter_equals_the_all_reduce_bit_for_bit_and_all_gather_is_exact(outcomes):
    world = len(outcomes)
    for r in results(outcomes, check_reduce_scatter_and_all_gather):
        assert r["not_bit_identical"] == [], r["not_bit_identical"]
        assert r["gather_wrong"] == [], r["gather_wrong"]
        assert r["vs_gloo"] == [], r["vs_gloo"]
        assert len(r["error_vs_float64"]) == 2 * len(DTYPES)
        for (name, dtype), error in r["error_vs_float64"].items():
            # world - 1 adds, each rounding by at most eps/2 of a partial sum's magnitude
            eps = torch.finfo(getattr(torch, dtype.split(".")[1])).eps if "int" not in dtype \
                else 0.0
            assert error <= world * eps, (name, dtype, error)


def check_refusals(rank, world):
    """Raised locally, before anything is started (no peer is left waiting)."""
    out = {}
    for name, transport in transports(world):
        bad = 5 * world + 1
        for op in ("reduce_scatter_sum", "all_gather"):
            try:
                getattr(transport, op)(torch.zeros(bad))
                out[(name, op, "numel")] = "no error"
            except RuntimeError as e:
                out[(name, op, "numel")] = str(e)
            try:
                getattr(transport, op)(torch.zeros(4 * world)[::2])
                out[(name, op, "strided")] = "no error"
            except RuntimeError as e:
                out[(name, op, "strided")] = str(e)
            if name == "shm":
                try:
                    getattr(transport, op)(torch.zeros(2 * world, device="meta"))
                    out[(name, op, "device")] = "no error"
                except RuntimeError as e:
                    out[(name, op, "device")] = str(e)
        # Still usable: nothing was started.
        flat = torch.ones(2 * world)
        transport.reduce_scatter_sum(flat).wait(30.0)
        out[(name, "after")] = shard(flat, rank, world).tolist()
        transport.close(5.0)
    return out


@uses(check_refusals)
def test_a_bucket_that_cannot_be_sharded_is_refused_naming_the_sizes_and_the_rule(outcomes):
    world = len(outcomes)
    bad = 5 * world + 1
    for r in results(outcomes, check_refusals):
        for name in ("process_group", "shm"):
            for op in ("reduce_scatter_sum", "all_gather"):
                message = r[(name, op, "numel")]
                assert f"got {bad} elements ({bad} % {world} = 1)" in message, message
                assert "multiple of the world size" in message, message
                assert f"each of the {world} ranks owns an equal shard" in message, message
                assert "contiguous" in r[(name, op, "strided")], r[(name, op, "strided")]
            assert r[(name, "after")] == [float(world), float(world)]
        for op in ("reduce_scatter_sum", "all_gather"):
            assert "contiguous CPU tensors; got meta" in r[("shm", op, "device")]


def _shm_outcome(rank, world, start):
    """Runs start(transport) -> pending on a fresh shm transport: the error (and how long it
    took) or "no error"."""
    transport, why_not = transport_module.shm_transport(dist.group.WORLD, 30.0, chunk_bytes=CHUNK)
    assert transport is not None, why_not
    began = time.monotonic()
    try:
        start(transport).wait(30.0)
        return "no error"
    except RuntimeError as e:
        return str(e), time.monotonic() - began
    finally:
        transport.close(1.0)


def check_mismatched_collectives(rank, world):
    """Rank 0 starts one collective, the others another, on buckets of one size; then one
    collective on buckets of different sizes."""
    n = 3 * world
    out = {}
    out["rs_vs_ar"] = _shm_outcome(rank, world, lambda t: t.reduce_scatter_sum(torch.ones(n))
                                   if rank == 0 else t.allreduce_sum(torch.ones(n)))
    out["ag_vs_rs"] = _shm_outcome(rank, world, lambda t: t.all_gather(torch.ones(n))
                                   if rank == 0 else t.reduce_scatter_sum(torch.ones(n)))
    out["ar_vs_ag"] = _shm_outcome(rank, world, lambda t: t.allreduce_sum(torch.ones(n))
                                   if rank == 0 else t.all_gather(torch.ones(n)))
    out["rs_sizes"] = _shm_outcome(rank, world, lambda t: t.reduce_scatter_sum(
        torch.ones(n if rank == 0 else 2 * n)))
    out["ag_sizes"] = _shm_outcome(rank, world, lambda t: t.all_gather(
        torch.ones(n if rank == 0 else 2 * n)))
    return out


@uses(check_mismatched_collectives)
def test_ranks_starting_different_collectives_or_buckets_raise_on_every_rank(outcomes):
    world = len(outcomes)
    n = 3 * world
    kinds = {"rs_vs_ar": ("a reduce-scatter", "an all-reduce"),
             "ag_vs_rs": ("an all-gather", "a reduce-scatter"),
             "ar_vs_ag": ("an all-reduce", "an all-gather")}
    for rank, r in enumerate(results(outcomes, check_mismatched_collectives)):
        for case, (first, others) in kinds.items():
            assert r[case] != "no error", (rank, case)
            message, elapsed = r[case]
            assert "ranks run different collectives" in message, message
            assert f"{first} of {n} elements" in message and f"{others} of {n} elements" in message, message
            assert elapsed < 10, elapsed
        for case, verb in (("rs_sizes", "reduce-scatter"), ("ag_sizes", "all-gather")):
            assert r[case] != "no error", (rank, case)
            message, elapsed = r[case]
            assert f"ranks {verb} different buckets" in message, message
            assert f"{n} elements" in message and f"{2 * n} elements" in message, message
            assert elapsed < 10, elapsed


def check_peer_closes_during_all_gather(rank, world):
    """The last rank closes its shm transport instead of gathering: the others fail promptly
    (the timeout is 30 s), naming it."""
    transport, why_not = transport_module.shm_transport(dist.group.WORLD, 30.0, chunk_bytes=CHUNK)
    assert transport is not None, why_not
    if rank == world - 1:
        time.sleep(0.3)
        transport.close(1.0)
        return "closed"
    began = time.monotonic()
    try:
        transport.all_gather(torch.ones(CHUNK // 4 * world)).wait(30.0)
        return "no error"
    except RuntimeError as e:
        return str(e), time.monotonic() - began
    finally:
        transport.close(1.0)


@uses(check_peer_closes_during_all_gather)
def test_a_peer_that_closes_fails_the_others_all_gather_promptly_naming_it(outcomes):
    world = len(outcomes)
    answers = results(outcomes, check_peer_closes_during_all_gather)
    assert answers[-1] == "closed"
    for answer in answers[:-1]:
        assert answer != "no error"
        message, elapsed = answer
        assert f"rank {world - 1} stopped reducing" in message, message
        assert elapsed < 10, elapsed


def check_timed_out_reduce_scatter_cancels(rank, world):
    """Rank 0's reduce-scatter wait gives up after 0.5 s while the peers are late: nothing is
    written into its bucket afterwards, and the peers' reduce-scatter fails naming rank 0."""
    if world != 2:
        return "skipped"  # one world size is enough (it sleeps)
    transport, why_not = transport_module.shm_transport(dist.group.WORLD, 30.0, chunk_bytes=CHUNK)
    assert transport is not None, why_not
    flat = torch.ones(3 * CHUNK // 4)  # three chunks
    try:
        if rank == 0:
            pending = transport.reduce_scatter_sum(flat, "bucket 0")
            try:
                pending.wait(0.5)
                waited = "no error"
            except RuntimeError as e:
                waited = str(e)
            dist.barrier()
            time.sleep(1.0)  # the peers have long arrived
            return waited, bool((flat == 1).all())
        dist.barrier()
        time.sleep(0.3)
        try:
            transport.reduce_scatter_sum(flat).wait(10.0)
            return "no error"
        except RuntimeError as e:
            return str(e)
    finally:
        transport.close(1.0)


@uses(check_timed_out_reduce_scatter_cancels)
def test_a_timed_out_reduce_scatter_is_cancelled_on_every_rank(outcomes):
    answers = results(outcomes, check_timed_out_reduce_scatter_cancels)
    if answers[0] == "skipped":
        return
    waited, untouched = answers[0]
    assert untouched, "the sum was written into the bucket after its wait had failed"
    assert "waiting for rank 1" in waited and "the reduce-scatter was cancelled" in waited, waited
    for message in answers[1:]:
        assert "rank 0 stopped reducing" in message, message


def check_gloo_reduce_scatter_keeps_the_timeout(rank, world):
    """On a fresh gloo group (4 s timeout) that only rank 0 uses: its reduce-scatter's wait(0.5 s)
    raises after about 0.5 s, not after the group's 4 s."""
    if world != 2:
        return "skipped"  # one world size is enough (the group's work runs out its timeout)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=4))
    if rank != 0:
        return "idle"
    transport = transport_module._C.ProcessGroupTransport(group)
    began = time.monotonic()
    try:
        transport.reduce_scatter_sum(torch.ones(4 * world), "bucket 0").wait(0.5)
        return "no error"
    except RuntimeError as e:
        return str(e), time.monotonic() - began


@uses(check_gloo_reduce_scatter_keeps_the_timeout)
def test_a_gloo_reduce_scatter_keeps_the_wait_timeout(outcomes):
    answers = results(outcomes, check_gloo_reduce_scatter_keeps_the_timeout)
    if answers[0] == "skipped":
        return
    assert answers[0] != "no error"
    message, elapsed = answers[0]
    assert "timed out" in message.lower(), message
    assert elapsed < 2.5, elapsed


@pytest.fixture(scope="module", params=[2, 3, 4], ids=["world2", "world3", "world4"])
def outcomes(request):
    return checks.run(request, world_size=request.param)
