"""The CUDA path on one GPU (world size 1: NCCL refuses two ranks on one GPU).

Skipped cleanly without a GPU or without a CUDA build. Run by bench/gpu_check.sh on a GPU machine.
"""
import re
import statistics
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_reducer
from fused_reducer import _C
from fused_reducer.testing.launch import reserved_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not fused_reducer.build_info()["cuda"], reason="needs a CUDA build"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_fused_copy_matches_torch_on_odd_sizes_and_misaligned_offsets(dtype, scale):
    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [1, 3, 7, 8, 31, 1000, 4097, 65537, 1 << 20]
    # Sources at odd offsets into one storage: most are not 16-byte aligned.
    storage = torch.randn(sum(sizes) + 64, device="cuda", generator=g).to(dtype)
    srcs, offset = [], 1
    for n in sizes:
        srcs.append(storage[offset:offset + n])
        offset += n + 1 if n % 2 else n
    flat = torch.full((sum(sizes) + 3,), float("nan"), device="cuda", dtype=dtype)  # poisoned
    dsts, offset = [], 3  # destinations start misaligned too
    for n in sizes:
        dsts.append(flat[offset:offset + n])
        offset += n
    launches = _C.scaled_copy(srcs, dsts, scale)
    torch.cuda.synchronize()
    assert launches == 1, "one fused launch for the whole set"
    for s, d in zip(srcs, dsts):
        expected = (s.float() * scale).to(dtype) if dtype != torch.float64 else s * scale
        torch.testing.assert_close(d, expected, rtol=0, atol=0)
    assert torch.isnan(flat[:3]).all(), "bytes outside the destinations stay untouched"


def test_fused_copy_handles_more_tensors_than_one_launch_holds():
    srcs = [torch.randn(5, device="cuda") for _ in range(2000)]
    dsts = [torch.empty(5, device="cuda") for _ in range(2000)]
    launches = _C.scaled_copy(srcs, dsts, 2.0)
    assert launches == 3  # 800 segments per launch
    for s, d in zip(srcs, dsts):
        torch.testing.assert_close(d, s * 2.0, rtol=0, atol=0)


def test_nccl_transport_times_out_when_a_peer_never_joins():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        _C.NcclTransport(_C.nccl_unique_id(), 0, 2, 0, 5.0)  # rank 1 never comes
    assert time.monotonic() - started < 60


@pytest.fixture(scope="module")
def nccl_world_of_one():
    torch.cuda.set_device(0)
    with reserved_port() as port:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10)).cuda()


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("as_view", [False, True])
def test_fused_reducer_on_nccl_matches_ddp(nccl_world_of_one, as_view):
    ours = fused_reducer.FusedReducer(_model(), backend="nccl", bucket_cap_mb=0.01,
                                      first_bucket_mb=0.005, gradient_as_bucket_view=as_view)
    ddp = DDP(_model(), device_ids=[0], bucket_cap_mb=0.01, gradient_as_bucket_view=as_view)
    assert ours.stats()["transport"] == "nccl"
    for step in range(3):
        x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for model in (ours, ddp):
            model.zero_grad()
            model(x).square().mean().backward()
        for a, b in zip(_grads(ours.module), _grads(ddp.module)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    stats = ours.stats()
    assert stats["allreduces"] == stats["buckets"] > 1
    # One fused copy per bucket in, one out (none out when grads are bucket views).
    assert stats["copy_launches"] <= (1 if as_view else 2) * stats["buckets"]
    if not as_view:  # every bucket is packed by the fused kernel (a per-parameter fallback: 0)
        assert stats["copy_launches"] >= stats["buckets"]


def test_check_finite_and_the_norm_from_the_copy_on_nccl(nccl_world_of_one):
    """The CUDA kernel's statistics (Note [Statistics from the copy]): NaN counted in the pack,
    norms accumulated in the unpack, against torch on the same gradients."""
    ours = fused_reducer.FusedReducer(_model(), backend="nccl", bucket_cap_mb=0.01,
                                      check_finite=True)
    ours.grad_norm()  # asked once: from now on it can come from the copy
    x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    ours(x).square().mean().backward()
    for norm_type in (1.0, 2.0, float("inf")):
        mine = float(ours.grad_norm(norm_type))
        assert ours._norm_source == "copy"
        theirs = float(torch.nn.utils.get_total_norm(
            [p.grad.double() for p in ours.parameters()], norm_type))
        assert abs(mine - theirs) <= 1e-6 * theirs, (norm_type, mine, theirs)
    ours.zero_grad()
    x[3, 5] = float("nan")
    with pytest.raises(fused_reducer.NonFiniteGradientError, match=r"rank 0: \d+ elements"):
        ours(x).square().mean().backward()
    ours.zero_grad()
    x[3, 5] = 0.0
    ours(x).square().mean().backward()  # the next step trains normally
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters())
    ours.close()
    # Finite local gradients beyond float16's range: the float16 bucket overflows, the unpack
    # kernel's sum |x| sees it (Note [Averages that overflow]).
    ours = fused_reducer.FusedReducer(_model(), backend="nccl", bucket_cap_mb=0.01,
                                      check_finite=True, reduce_dtype=torch.float16)
    with pytest.raises(fused_reducer.NonFiniteGradientError, match="local gradients were finite"):
        (ours(x).square().mean() * 1e9).backward()
    ours.close()


def _gpu_sleep_ms(ms):
    """Cycles of torch.cuda._sleep that keep the GPU busy about `ms` (calibrated here)."""
    cycles = 1 << 22
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # warm up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return max(1, int(cycles * ms / start.elapsed_time(end)))


def test_straggler_slack_is_read_off_the_gpu_clock(nccl_world_of_one):
    """Note [Lateness from slack on the GPU]: on NCCL buckets the slack (last bucket ready ->
    its collective complete) comes from CUDA timing events, one step late, with no host wait
    in backward; at world size 1 nobody is late."""
    ours = fused_reducer.FusedReducer(_model(), backend="nccl", bucket_cap_mb=0.01,
                                      straggler_interval=2, straggler_window=4)
    x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    for _ in range(6):
        ours.zero_grad()
        ours(x).square().mean().backward()
    report = ours.straggler_report()
    assert report["measured"] and report["step"] == 6, report
    assert report["lateness_ms"] == [0.0] and report["stragglers"] == [], report
    assert 0 <= report["slack_ms"][0] < report["median_step_ms"] + 1.0, report
    ours.close()


def _report_after_six_steps(ours):
    x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    for _ in range(6):
        ours.zero_grad()
        ours(x).square().mean().backward()
    torch.cuda.synchronize()
    return ours.straggler_report()


def test_straggler_slack_counts_device_time_the_host_never_waited_for(nccl_world_of_one):
    """A bucket whose collective the GPU finishes 30 ms after its gradients are ready (a comm
    hook that sleeps on a side stream before its all-reduce; the host returns at once): the
    slack is those 30 ms, which a host clock would not see."""
    sleep_cycles = _gpu_sleep_ms(30)
    side = torch.cuda.Stream()

    def slow_allreduce(state, bucket):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(sleep_cycles)
            future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return future.then(lambda f: f.value()[0])

    ours = fused_reducer.FusedReducer(_model(), backend="process_group", bucket_cap_mb=100,
                                      straggler_interval=2, straggler_window=4)
    ours.register_comm_hook(None, slow_allreduce)
    report = _report_after_six_steps(ours)
    assert report["measured"] and 25.0 <= report["slack_ms"][0] <= 60.0, report
    assert report["lateness_ms"] == [0.0], report
    ours.close()


def test_straggler_slack_counts_device_time_in_the_forwards_collectives(nccl_world_of_one):
    """The forward's collectives (buffer broadcast, join) are where the others wait for a rank
    slow before forward: their device time counts into the slack, from timing events around
    them on the compute stream. Here the broadcast is made to take 30 ms of GPU time."""
    sleep_cycles = _gpu_sleep_ms(30)
    ours = fused_reducer.FusedReducer(nn.Sequential(nn.BatchNorm1d(64), _model()).cuda(),
                                      backend="nccl", straggler_interval=2, straggler_window=4)

    def slow_broadcast(joined):
        torch.cuda._sleep(sleep_cycles)  # on the current stream, as a waiting collective

    ours._sync_buffers = slow_broadcast
    report = _report_after_six_steps(ours)
    assert report["measured"] and 25.0 <= report["slack_ms"][0] <= 60.0, report
    ours.close()


def test_no_sync_on_gpu_accumulates_then_reduces(nccl_world_of_one):
    ours = fused_reducer.FusedReducer(_model(), backend="nccl")
    ref = _model()
    xs = [torch.randn(8, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
          for i in range(3)]
    with ours.no_sync():
        for x in xs[:2]:
            ours(x).sum().backward()
    ours(xs[2]).sum().backward()
    for x in xs:
        ref(x).sum().backward()
    for a, b in zip(_grads(ours.module), _grads(ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# -- widening copies take the vector path ----------------------------------------------------------

def _slot_offsets(numels, dtype):
    """Slot offsets and the flat buffer's length, as the reducer lays out a bucket (Note [Slot
    layout] in ext/reducer.cpp: every slot starts at a multiple of 16 bytes)."""
    align = max(1, 16 // torch.empty((), dtype=dtype).element_size())
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += -(-n // align) * align
    return offsets, total


# Sizes around the kernel's block range (8192 elements for a 2-byte/4-byte pair), so block ranges
# start at every kind of offset inside a slot.
SLOT_SIZES = [1, 3, 7, 8, 9, 31, 1000, 4097, 8191, 8193, 20000, 65537, 1 << 20]


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("direction", ["unpack", "pack"])
@pytest.mark.parametrize("scale", [1.0, 1 / 3])
def test_widening_and_narrowing_copies_on_the_reducers_slot_layout_are_exact(narrow, direction,
                                                                            scale):
    """A bf16/fp16 bucket unpacked into fp32 gradients (widening), and fp32 gradients packed into
    it (narrowing), through the reducer's real 16-byte slots: every block range vectorises (see
    Note [Copy alignment]; tests/cpp/test_cuda_core.cpp checks the split itself) and the result is
    bit-exact, with nothing written outside the slots."""
    g = torch.Generator(device="cuda").manual_seed(1)
    grads = [torch.randn(n, device="cuda", generator=g) for n in SLOT_SIZES]
    offsets, total = _slot_offsets(SLOT_SIZES, narrow)
    flat = torch.full((total,), float("nan"), device="cuda", dtype=narrow)  # padding stays NaN
    slots = [flat.narrow(0, offset, n) for offset, n in zip(offsets, SLOT_SIZES)]
    assert all(s.data_ptr() % 16 == 0 for s in slots)
    if direction == "unpack":
        for s in slots:
            s.copy_(torch.randn(s.numel(), device="cuda", generator=g))
        srcs, dsts = slots, [torch.full_like(x, float("nan")) for x in grads]
    else:
        srcs, dsts = grads, slots
    launches = _C.scaled_copy(srcs, dsts, scale)
    torch.cuda.synchronize()
    assert launches == 1
    for s, d in zip(srcs, dsts):
        torch.testing.assert_close(d, (s.float() * scale).to(d.dtype), rtol=0, atol=0)
    if direction == "pack":
        written = torch.zeros(total, dtype=torch.bool, device="cuda")
        for s in slots:
            written[s.storage_offset():s.storage_offset() + s.numel()] = True
        assert torch.isnan(flat[~written].float()).all(), "padding between slots untouched"


def _median_copy_ms(srcs, dsts, iters=20):
    for _ in range(3):
        _C.scaled_copy(srcs, dsts, 1.0)
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            _C.scaled_copy(srcs, dsts, 1.0)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def test_widening_copy_whose_narrow_side_starts_half_a_vector_off_still_vectorises():
    """bf16 -> fp32 with the bf16 source 8 bytes (4 elements) past a 16-byte boundary and the
    fp32 destination aligned: aligning on the narrower side, 4 scalar elements put both sides on
    16 bytes, so it runs as fast as the fully aligned copy. (Aligning on the destination, the old
    rule, ran all of it scalar, as slow as a source one element off, which has no common
    alignment and is scalar by design; printed for comparison.) The deterministic check of the
    split is the C++ test; this is its timing on the GPU."""
    n = 1 << 26
    storage = torch.randn(n + 8, device="cuda").to(torch.bfloat16)
    dst = torch.empty(n, device="cuda")
    ms = {offset: _median_copy_ms([storage[offset:offset + n]], [dst]) for offset in (0, 4, 1)}
    for offset in (0, 4, 1):  # and exact, whichever path
        _C.scaled_copy([storage[offset:offset + n]], [dst], 1.0)
        torch.testing.assert_close(dst, storage[offset:offset + n].float(), rtol=0, atol=0)
    print(f"bf16 -> fp32, 64 Mi elements: aligned {ms[0]:.3f} ms, 8 bytes off {ms[4]:.3f} ms, "
          f"2 bytes off (scalar) {ms[1]:.3f} ms")
    assert ms[4] <= 1.2 * ms[0], ms


# -- the watchdog's error names the bucket ---------------------------------------------------------

def _keep_gpu_busy(seconds):
    """Queue a kernel on the current stream that spins for about `seconds`.

    Calibrated after a warm-up spin: the first launch loads the kernel (the GPU waits between the
    events) and an idle GPU runs at a fraction of its clock, and either makes the calibrated spin
    far shorter than asked: the likely reason why, on the H100 with torch 2.11, a step queued
    behind a "6 s" spin raised no timeout of 3 s."""
    cycles = 50_000_000
    torch.cuda._sleep(4 * cycles)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    per_ms = cycles / max(start.elapsed_time(end), 1e-3)
    torch.cuda._sleep(int(per_ms * seconds * 1000))


def test_nccl_watchdog_timeout_aborts_and_names_the_bucket(nccl_world_of_one):
    """A bucket whose all-reduce cannot finish within `timeout` (its stream waits behind a kernel
    that spins past the deadline): the watchdog aborts the communicator (under its lock, while
    the hook thread goes on) and the error raised by the next call names that bucket, as
    "all-reduce of bucket 0 of N (k parameters, x MiB, first '<name>')", not "all-reduce #N"."""
    timeout = 3.0
    model = fused_reducer.FusedReducer(_model(), backend="nccl", timeout=timeout,
                                       bucket_cap_mb=0.01, first_bucket_mb=0.005)
    names = [n for n, _ in model.module.named_parameters()]
    x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    model(x).sum().backward()  # a normal step first
    torch.cuda.synchronize()
    started = time.monotonic()
    _keep_gpu_busy(3 * timeout)  # every bucket of the next step waits behind it
    with pytest.raises(RuntimeError) as failure:
        for _ in range(3):  # the watchdog's error surfaces at the next call into the transport
            model.zero_grad()
            model(x).sum().backward()
            time.sleep(timeout + 1)
    message = str(failure.value)
    assert time.monotonic() - started < 4 * (timeout + 1)
    assert "did not complete within its timeout" in message, message
    found = re.search(r"all-reduce of bucket 0 of (\d+) \((\d+) parameters?, [\d.e+-]+ MiB, "
                      r"first '([^']+)'\) on cuda:0", message)
    assert found and int(found.group(1)) > 1 and found.group(3) in names, message
    assert "all-reduce #" not in message, message
    assert "was aborted" in message, message
    with pytest.raises(RuntimeError, match="bucket 0 of"):
        model.close()  # the background failure is raised again, the communicator released
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + 30
    while not done.query() and time.monotonic() < deadline:  # the spinning kernel ends
        time.sleep(0.1)
    assert done.query(), "the GPU drains after the abort"


# -- one NCCL communicator ------------------------------------------------------------------------

def _sync_bn_model():
    torch.manual_seed(0)
    return nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
        nn.Linear(8 * 6 * 6, 10))).cuda()


def test_syncbatchnorm_under_auto_uses_the_process_group_and_explicit_nccl_raises(
        nccl_world_of_one):
    """SyncBatchNorm all-reduces on the process group's NCCL communicator: under backend='auto'
    the buckets go through that group too (one communicator, as DDP) and train like DDP; an
    explicit backend='nccl' raises at construction naming the module and the fix. A model
    without SyncBatchNorm still gets the NCCL transport. See Note [One NCCL communicator]."""
    ours = fused_reducer.FusedReducer(_sync_bn_model())
    assert ours.backend == "process_group"
    assert ours.stats()["transport"].startswith("process_group"), ours.stats()["transport"]
    ddp = DDP(_sync_bn_model(), device_ids=[0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ddp)]
    for step in range(3):
        x = torch.randn(4, 3, 8, 8, device="cuda",
                        generator=torch.Generator("cuda").manual_seed(step))
        for model, opt in zip((ours, ddp), opts):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for a, b in zip(ours.module.state_dict().values(), ddp.module.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(fused_reducer.FusedReducerError,
                       match=r"backend='nccl'.*SyncBatchNorm '1'.*deadlock.*"
                             r"backend='process_group'"):
        fused_reducer.FusedReducer(_sync_bn_model(), backend="nccl")
    plain = fused_reducer.FusedReducer(_model())
    assert plain.backend == "nccl"
    for model in (ours, plain):
        model.close()


def test_comm_hook_needs_the_process_group_transport_on_nccl(nccl_world_of_one):
    """A comm hook runs on the process group's communicator: refused on the NCCL transport
    (which 'auto' picks) naming backend='process_group'; with that backend it matches DDP."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    on_nccl = fused_reducer.FusedReducer(_model())
    assert on_nccl.backend == "nccl"
    with pytest.raises(fused_reducer.FusedReducerError,
                       match=r"allreduce_hook.*deadlock.*backend='process_group'"):
        on_nccl.register_comm_hook(None, default_hooks.allreduce_hook)
    on_nccl.close()
    ours = fused_reducer.FusedReducer(_model(), backend="process_group")
    ours.register_comm_hook(None, default_hooks.allreduce_hook)
    ddp = DDP(_model(), device_ids=[0])
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    for step in range(2):
        x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for model in (ours, ddp):
            model.zero_grad()
            model(x).square().mean().backward()
        for a, b in zip(_grads(ours.module), _grads(ddp.module)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    ours.close()


# -- no host stall per bucket; autotune times CUDA trials on the GPU -------------------------------

class _GpuBound(nn.Module):
    """_model() behind a kernel that spins `cycles`: a step of GPU time the host enqueues at once."""

    def __init__(self, cycles):
        super().__init__()
        self.net = _model()
        self.cycles = cycles

    def forward(self, x):
        torch.cuda._sleep(self.cycles)
        return self.net(x)


@pytest.mark.parametrize("backend", ["nccl", "process_group"])
def test_autotune_times_cuda_trials_with_events_on_the_gpu(nccl_world_of_one, backend):
    """Each step spins the GPU for ~30 ms while the host enqueues it in a few ms and runs ahead
    (no host stall per bucket, over the process group too: Note [Process-group work without host
    stalls]). Host gaps between forwards would then read a few ms; the trial times must read the
    GPU's step, as the CUDA events do: about 30 ms each."""
    gpu_ms = 30.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles = int(10_000_000 * gpu_ms / max(start.elapsed_time(end), 1e-3))
    model = fused_reducer.FusedReducer(_GpuBound(cycles), backend=backend, bucket_cap_mb=0.01,
                                       first_bucket_mb=0.005)
    x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def step():
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    for _ in range(3):  # communicators, kernels, allocator
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(5):
        step()
    host_ms = (time.perf_counter() - started) * 1e3 / 5
    torch.cuda.synchronize()
    assert host_ms < gpu_ms / 2, (
        f"the host waited for the GPU within a step over {backend} ({host_ms:.1f} ms per step "
        f"for {gpu_ms} ms of GPU work)")
    model.autotune(max_candidates=2, round_steps=(3,), min_steps=1)
    for _ in range(40):
        step()
        if model.autotune_report()["done"]:
            break
    torch.cuda.synchronize()
    report = model.autotune_report()
    assert report["done"], report
    samples = [s for trial in report["trials"] for s in trial["samples_ms"]]
    assert samples, report
    assert all(0.8 * gpu_ms <= s <= 2 * gpu_ms for s in samples), (
        f"trial step times {samples} ms should read the GPU's ~{gpu_ms} ms step "
        f"(host gaps: {host_ms:.1f} ms)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_world_of_one_reduce_scatter_and_all_gather_are_the_identity_on_nccl(nccl_world_of_one,
                                                                             dtype):
    """Sharded mode: at world size 1 the in-place reduce-scatter and all-gather leave
    the bucket as it was, through ncclReduceScatter/ncclAllGather directly (NcclTransport) and
    through ProcessGroupNCCL's reduce_scatter_single/all_gather_single (in place on a view of the
    bucket); buckets it cannot take are refused naming why."""
    g = torch.Generator(device="cuda").manual_seed(0)
    transports = [_C.NcclTransport(_C.nccl_unique_id(), 0, 1, 0, 30.0),
                  _C.ProcessGroupTransport(nccl_world_of_one)]
    for transport in transports:
        for n in (1, 1000, (1 << 20) + 3):
            if dtype.is_floating_point:
                x = (torch.randn(n, device="cuda", generator=g) * 100).to(dtype)
            else:
                x = torch.randint(-1000, 1000, (n,), device="cuda", generator=g, dtype=dtype)
            flat = x.clone()
            transport.reduce_scatter_sum(flat, "bucket 0").wait(30.0)
            transport.all_gather(flat).wait(30.0)
            torch.cuda.synchronize()
            assert torch.equal(flat, x), (transport.name, n)
        with pytest.raises(RuntimeError, match="contiguous"):
            transport.reduce_scatter_sum(torch.zeros(8, device="cuda", dtype=dtype)[::2])
    with pytest.raises(RuntimeError, match="cuda:0, got cpu"):
        transports[0].all_gather(torch.zeros(8, dtype=dtype))
    transports[0].close(10.0)


def test_tensor_parallel_split_backward_pipeline_on_the_gpu(nccl_world_of_one):
    from test_pipeline_parallel import tp_and_split_pipeline_world_of_one
    out = tp_and_split_pipeline_world_of_one("cuda")
    assert out["params"] < 1e-5, out
    assert out["reductions"] == [[1, 1]] * 2 and out["placements"], out
