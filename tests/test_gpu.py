"""The CUDA path on one GPU (world size 1: NCCL refuses two ranks on one GPU).

Skipped cleanly without a GPU or without a CUDA build. Run by bench/gpu_check.sh on a GPU machine.
"""
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_reducer
from fused_reducer import _C
from dist_utils import free_port

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
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
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
