"""The CUDA path's ordering, teardown and multi-rank behaviour on ONE GPU (bench/gpu_check.sh).

* Ordering without host waits: an all-reduce waits (on the GPU) for the stream that filled its
  bucket, and readers on another stream wait for the all-reduce. A producer stream that sleeps
  ~200 ms makes any missing wait visible as a wrong value, not as a timing guess.
* Teardown: close(), a peer that never joins, interpreter exit after an abort: each bounded.
* Two ranks on the one GPU through backend="process_group" over gloo with CUDA tensors: every
  kernel runs with a real scale of 1/2, against DDP on the same GPU.
* SyncBatchNorm and CUDA AMP (GradScaler) train as under DDP (world size 1 over NCCL).
* find_unused_parameters waits for the used map once, on an event; a backward under CUDA graph
  capture is refused with a clear error; a rebuild keeps buckets packed on a side stream until
  that stream is done with them; ShardedOptimizer over NCCL trains like the plain optimizer, and
  at two ranks over gloo with CUDA tensors like DDP + the same optimizer.
Skipped without a GPU or without a CUDA build.
"""
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_reducer
from fused_reducer import _C
from fused_reducer.testing.launch import reserved_port
from dist_utils import per_rank, run_checks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not fused_reducer.build_info()["cuda"], reason="needs a CUDA build"),
]

SLEEP_CYCLES = 400_000_000  # ~200 ms at ~2 GHz


@pytest.fixture(scope="module")
def nccl_world_of_one():
    torch.cuda.set_device(0)
    with reserved_port() as port:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_allreduce_waits_for_the_filling_stream_and_readers_wait_for_it(nccl_world_of_one):
    transport = fused_reducer.make_transport(dist.group.WORLD, "cuda:0", "nccl", 30.0)
    flat = torch.zeros(1 << 20, device="cuda")
    producer, reader = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(SLEEP_CYCLES)
        flat.fill_(2.0)
        pending = transport.allreduce_sum(flat)  # must wait for the fill (the "filled" event)
    started = time.monotonic()
    with torch.cuda.stream(reader):
        pending.wait(30.0)  # the reader stream waits for the all-reduce (the "done" event)
        seen = flat.clone()
    host_wait = time.monotonic() - started
    torch.cuda.synchronize()
    assert host_wait < 0.1, f"wait() blocked the host for {host_wait:.3f} s"
    assert torch.all(seen == 2.0), "a reader saw the bucket before the fill and all-reduce"
    transport.close(10.0)


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10)).cuda().to(dtype)


def test_backward_returns_before_the_gpu_drains(nccl_world_of_one):
    """No host stall at the end of backward: with the GPU kept busy ~200 ms, backward()
    returns long before, and the gradients are right once the stream is read."""
    ours = fused_reducer.FusedReducer(_model(), backend="nccl")
    ref = _model()
    x = torch.randn(32, 64, device="cuda")
    ours(x).sum().backward()  # first step (rebuild next)
    ours.zero_grad()
    loss = ours(x).sum()
    torch.cuda._sleep(SLEEP_CYCLES)
    started = time.monotonic()
    loss.backward()
    host = time.monotonic() - started
    ref(x).sum().backward()
    for a, b in zip(ours.module.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    assert host < 0.1, f"backward() held the host {host:.3f} s while the GPU was busy"


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward keeps its stream busy ~200 ms first."""
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(SLEEP_CYCLES)
        return grad


class _TwoStreams(nn.Module):
    """Branch `a` runs (forward, hence backward) on a side stream whose backward is slow; branch
    `b` on the current stream. Both branches' gradients share one bucket."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.side = torch.cuda.Stream()

    def forward(self, x):
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            ya = _SlowBackward.apply(self.a(x))
        torch.cuda.current_stream().wait_stream(self.side)
        return ya + self.b(x)


def test_gradients_from_several_streams_are_packed_after_their_stream(nccl_world_of_one):
    """A bucket packed on one stream waits for gradients produced on another (at world
    size 1 the unpack writes the packed copy back, so a pack that read early shows as wrong)."""
    ours = fused_reducer.FusedReducer(_TwoStreams().cuda(), backend="nccl")
    ref = _TwoStreams().cuda()
    for step in range(3):  # first step, rebuilt layout, steady state
        x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for model in (ours, ref):
            model.zero_grad()
            model(x).square().sum().backward()
        torch.cuda.synchronize()
        for a, b in zip(ours.module.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad)


def test_close_is_bounded_and_final(nccl_world_of_one):
    ours = fused_reducer.FusedReducer(_model(), backend="nccl")
    ours(torch.randn(8, 64, device="cuda")).sum().backward()
    started = time.monotonic()
    ours.close()
    assert time.monotonic() - started < 15
    with pytest.raises(RuntimeError, match="closed"):
        ours(torch.randn(8, 64, device="cuda"))


def test_a_peer_that_never_joins_times_out_and_exit_after_the_abort_is_bounded():
    code = textwrap.dedent("""
        import time, fused_reducer
        from fused_reducer import _C
        started = time.monotonic()
        try:
            _C.NcclTransport(_C.nccl_unique_id(), 0, 2, 0, 3.0)  # rank 1 never comes
        except RuntimeError as e:
            assert "timed out" in str(e), e
            print("timed out after", round(time.monotonic() - started, 1), "s")
        else:
            raise SystemExit("no timeout")
    """)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=90)
    assert result.returncode == 0, result.stderr[-2000:]
    assert time.monotonic() - started < 60


def test_syncbatchnorm_and_cuda_amp_train_as_under_ddp(nccl_world_of_one):
    def net():
        torch.manual_seed(0)
        return nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
            nn.Linear(8 * 6 * 6, 10))).cuda()
    # One NCCL communicator (Note [One NCCL communicator]): "auto" reduces through the process
    # group that SyncBatchNorm uses too, as DDP does.
    ours = fused_reducer.FusedReducer(net())
    assert ours.backend == "process_group"
    ddp = DDP(net(), device_ids=[0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ddp)]
    scalers = [torch.amp.GradScaler("cuda") for _ in range(2)]
    for step in range(3):
        x = torch.randn(4, 3, 8, 8, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for model, opt, scaler in zip((ours, ddp), opts, scalers):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    for a, b in zip(ours.module.state_dict().values(), ddp.module.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


class _HalfUsed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.used(x)


def test_find_unused_waits_once_on_an_event_for_the_used_map(nccl_world_of_one):
    """Note [Used map on the GPU]: the map goes to the GPU from pinned memory without a host
    wait and comes back with one event wait, no stream synchronisation (a pageable copy, or
    .cpu(), synchronises the whole stream: cudaStreamSynchronize)."""
    ours = fused_reducer.FusedReducer(_HalfUsed().cuda(), backend="nccl",
                                      find_unused_parameters=True)
    ref = _HalfUsed().cuda()
    x = torch.randn(32, 64, device="cuda")
    for _ in range(2):  # the first step, and the one after the rebuild
        ours.zero_grad()
        ours(x).sum().backward()
    ours.zero_grad()
    loss = ours(x).sum()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function("backward under test"):
            loss.backward()
    # The profiler's own exit synchronises the device (cudaDeviceSynchronize, seen on the H100
    # with torch 2.11): only the host calls made inside backward() count.
    events = prof.events()
    region = next(e.time_range for e in events if e.name == "backward under test")
    names = [e.name for e in events
             if region.start <= e.time_range.start and e.time_range.end <= region.end]
    assert names.count("cudaStreamSynchronize") == 0, "a stream synchronisation in backward"
    assert "cudaDeviceSynchronize" not in names
    assert names.count("cudaEventSynchronize") == 1, names.count("cudaEventSynchronize")
    assert any("Pinned -> Device" in e.name for e in events), "the map is sent from pinned memory"
    ref(x).sum().backward()
    torch.testing.assert_close(ours.module.used.weight.grad, ref.used.weight.grad)
    assert ours.module.unused.weight.grad is None


def test_backward_under_cuda_graph_capture_is_refused_naming_the_fix(nccl_world_of_one):
    """Note [No NCCL collective under graph capture]: a clear error, not a capture broken by the
    watchdog's event queries and an aborted communicator.

    Constructed on the side stream, as PyTorch's CUDA-graph notes ask of DDP: the reducer holds
    every parameter's AccumulateGrad node, whose stream is the one current at construction; on
    the default stream, autograd itself breaks the capture (the legacy stream cannot join it)
    before any hook runs (seen on the H100 with torch 2.11)."""
    x = torch.randn(32, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ours = fused_reducer.FusedReducer(_model(), backend="nccl")
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph asks
        for _ in range(2):
            ours.zero_grad()
            ours(x).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError) as raised:
        with torch.cuda.graph(graph):
            ours(x).sum().backward()
    text = str(raised.value) + " | " + str(raised.value.__context__)
    assert "being captured into a CUDA graph" in text and "outside the graph" in text, text
    ours.close()


def test_a_rebuild_keeps_old_buckets_until_their_side_stream_copies_are_done(nccl_world_of_one):
    """Note [Releasing GPU buckets]: buckets packed on a side stream (forward and backward under
    torch.cuda.stream) are freed by a rebuild on the default stream; the caching allocator must
    hold their memory (active_pending_free) until the side stream passes that point, not hand
    it out at once (the NCCL stream alone, long done, would not hold it)."""
    ours = fused_reducer.FusedReducer(_model(), backend="nccl")
    side = torch.cuda.Stream()
    x = torch.randn(32, 64, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # the first step, and one on the rebuilt layout
            ours.zero_grad()
            ours(x).sum().backward()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # events recorded on `side` from now on are pending
    ours.first_bucket_bytes = 4096
    ours(x)  # the rebuild frees the old buckets here, on the default stream
    pending = [block for segment in torch.cuda.memory._snapshot()["segments"]
               for block in segment["blocks"] if block["state"] == "active_pending_free"]
    torch.cuda.synchronize()
    assert pending, "old buckets were free for reuse while their packing stream was still busy"
    ours.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_sharded_optimizer_over_nccl_trains_like_the_plain_optimizer(nccl_world_of_one, overlap):
    """ShardedOptimizer on the NCCL transport (ncclReduceScatter / ncclAllGather in place on the
    reducer's stream) at world size 1: the plain AdamW's parameters, through a layout change."""
    ours = fused_reducer.FusedReducer(_model(), backend="nccl", first_bucket_mb=0.01,
                                      bucket_cap_mb=0.02)
    opt = fused_reducer.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-3,
                                         overlap_param_gather=overlap)
    ref_model = _model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    for step in range(5):
        if step == 3:
            ours.first_bucket_bytes = 8192
        x = torch.randn(16, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for model, o in ((ours, opt), (ref_model, ref)):
            o.zero_grad()
            model(x).square().mean().backward()
            o.step()
    opt.finish_param_gather()
    for a, b in zip(ours.module.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ours.close()


# -- two ranks on the one GPU, gloo with CUDA tensors ------------------------------------------

def _train_both(rank, steps=4, dtype=torch.float32, side_stream=False, mid_rebuild=False,
                **options):
    torch.cuda.set_device(0)
    ours = fused_reducer.FusedReducer(_model(dtype), backend="process_group", first_bucket_mb=0.01,
                                      bucket_cap_mb=0.02, **options)
    ddp_options = {k: v for k, v in options.items() if k != "autotune"}
    ddp = DDP(_model(dtype), bucket_cap_mb=0.02, **ddp_options)
    stream = torch.cuda.Stream() if side_stream else None
    for step in range(steps):
        if mid_rebuild and step == 2:
            ours.first_bucket_bytes = 4096
        x = torch.randn(16, 64, device="cuda", dtype=dtype,
                        generator=torch.Generator("cuda").manual_seed(10 * rank + step))
        for model in (ours, ddp):
            model.zero_grad()
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    model(x).float().square().mean().backward()
                torch.cuda.current_stream().wait_stream(stream)
            else:
                model(x).float().square().mean().backward()
    torch.cuda.synchronize()
    return max((a.grad.float() - b.grad.float()).abs().max().item()
               for a, b in zip(ours.module.parameters(), ddp.module.parameters()))


def check_plain(rank, world):
    return _train_both(rank)


def check_bucket_view(rank, world):
    return _train_both(rank, gradient_as_bucket_view=True)


def check_find_unused(rank, world):
    return _train_both(rank, find_unused_parameters=True)


def check_fp16(rank, world):
    return _train_both(rank, dtype=torch.float16)


def check_bf16(rank, world):
    return _train_both(rank, dtype=torch.bfloat16)


def check_side_stream(rank, world):
    return _train_both(rank, side_stream=True)


def check_rebuild_mid_training(rank, world):
    return _train_both(rank, steps=5, mid_rebuild=True)


def check_autotune(rank, world):
    return _train_both(rank, steps=6, autotune=True)


def check_no_sync(rank, world):
    torch.cuda.set_device(0)
    ours = fused_reducer.FusedReducer(_model(), backend="process_group")
    ddp = DDP(_model())
    xs = [torch.randn(8, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(10 * rank + i))
          for i in range(3)]
    for model in (ours, ddp):
        with model.no_sync():
            for x in xs[:2]:
                model(x).sum().backward()
        model(xs[2]).sum().backward()
    return max((a.grad - b.grad).abs().max().item()
               for a, b in zip(ours.module.parameters(), ddp.module.parameters()))


def check_reduce_dtype_bf16_vs_ddp_compress_hook(rank, world):
    """reduce_dtype=bf16 (the fused cast copy on the GPU, one launch per bucket) against DDP +
    bf16_compress_hook with the same buckets (our limits count bf16 bytes: halved)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    torch.cuda.set_device(0)
    ours = fused_reducer.FusedReducer(_model(), backend="process_group", first_bucket_mb=0.005,
                                      bucket_cap_mb=0.01, reduce_dtype=torch.bfloat16)
    ddp = DDP(_model(), bucket_cap_mb=0.02)
    ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    for step in range(3):
        x = torch.randn(16, 64, device="cuda",
                        generator=torch.Generator("cuda").manual_seed(10 * rank + step))
        for model in (ours, ddp):
            model.zero_grad()
            model(x).square().mean().backward()
    torch.cuda.synchronize()
    return max((a.grad - b.grad).abs().max().item()
               for a, b in zip(ours.module.parameters(), ddp.module.parameters()))


def check_sharded_optimizer(rank, world):
    """ShardedOptimizer(AdamW) on the process-group transport (reduce-scatter and all-gather of
    CUDA buckets), overlapped all-gathers and a layout change, against DDP + AdamW on the same
    GPU: the largest parameter difference after 5 steps."""
    torch.cuda.set_device(0)
    ours = fused_reducer.FusedReducer(_model(), backend="process_group", first_bucket_mb=0.01,
                                      bucket_cap_mb=0.02)
    opt = fused_reducer.ShardedOptimizer(ours, torch.optim.AdamW, lr=1e-3,
                                         overlap_param_gather=True)
    ddp = DDP(_model(), bucket_cap_mb=0.02)
    ref = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    for step in range(5):
        if step == 3:
            ours.first_bucket_bytes = 8192
        x = torch.randn(16, 64, device="cuda",
                        generator=torch.Generator("cuda").manual_seed(10 * rank + step))
        for model, o in ((ours, opt), (ddp, ref)):
            o.zero_grad()
            model(x).square().mean().backward()
            o.step()
    opt.finish_param_gather()
    torch.cuda.synchronize()
    return max((a - b).abs().max().item()
               for a, b in zip(ours.module.parameters(), ddp.module.parameters()))


TWO_RANK_CHECKS = [check_plain, check_bucket_view, check_find_unused, check_fp16, check_bf16,
                   check_side_stream, check_rebuild_mid_training, check_autotune, check_no_sync,
                   check_reduce_dtype_bf16_vs_ddp_compress_hook, check_sharded_optimizer]
TOLERANCE = {"check_fp16": 1e-2, "check_bf16": 5e-2,
             "check_reduce_dtype_bf16_vs_ddp_compress_hook": 1e-2}


@pytest.fixture(scope="module")
def two_ranks_one_gpu():
    return run_checks(TWO_RANK_CHECKS, 2, timeout=280)


@pytest.mark.parametrize("check", [c.__name__ for c in TWO_RANK_CHECKS])
def test_two_ranks_on_one_gpu_over_gloo_match_ddp(two_ranks_one_gpu, check):
    for worst in per_rank(two_ranks_one_gpu, check):
        assert worst <= TOLERANCE.get(check, 1e-5), (check, worst)


def check_two_ranks_sharing_the_gpu_over_nccl(rank, world):
    """The README's "two ranks on one GPU" row through FusedReducer itself: an NCCL group whose
    ranks both sit on cuda:0 is refused at construction, on every rank, before NCCL runs."""
    torch.cuda.set_device(0)
    group = dist.new_group(backend="nccl")
    try:
        fused_reducer.FusedReducer(_model(), process_group=group)
    except RuntimeError as e:
        return str(e)
    return "constructed"


def test_fused_reducer_refuses_two_ranks_on_one_gpu_on_every_rank():
    outcomes = run_checks([check_two_ranks_sharing_the_gpu_over_nccl], 2, timeout=120)
    for message in per_rank(outcomes, "check_two_ranks_sharing_the_gpu_over_nccl"):
        assert "ranks 0 and 1 use the same GPU" in message, message
        assert "LOCAL_RANK" in message and "CUDA_VISIBLE_DEVICES" in message, message
