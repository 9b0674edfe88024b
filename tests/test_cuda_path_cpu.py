"""What a CPU can prove about the multi-GPU CUDA path (issue: multi-GPU nodes).

* one rank per GPU: ranks sharing a GPU are refused on every rank, through the store (not NCCL),
  naming both ranks, the host and the device, with the fix;
* every collective the library issues itself stages its tensors on the rank's own device
  (recorded by stand-ins for torch.distributed, independent of the library's bookkeeping);
* bucket slots are 16-byte aligned and keep the parameter's strides (channels_last), checked on
  the gradients' own data pointers and strides, and the gradients still equal DDP's;
* close() is idempotent and final; no reference cycle keeps a reducer alive (no gc needed).
The GPU side of the same behaviour runs in tests/test_gpu.py (bench/gpu_check.sh).
"""
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_reducer
from fused_reducer import reducer as reducer_module
from fused_reducer import transport as transport_module
from fused_reducer.transport import shared_gpus
from dist_utils import per_rank, run_checks


# -- one rank per GPU ----------------------------------------------------------------------------

def test_shared_gpus_groups_ranks_by_host_and_physical_gpu():
    identities = [("a", "cuda:0", "GPU-0"), ("a", "cuda:1", "GPU-1"), ("b", "cuda:0", "GPU-9"),
                  ("a", "cuda:0", "GPU-1"), ("b", "cuda:1", "GPU-8")]
    # rank 3 sees GPU-1 as its cuda:0 (other CUDA_VISIBLE_DEVICES): same physical GPU as rank 1
    assert shared_gpus(identities) == [("a", "cuda:1", [1, 3])]
    assert shared_gpus([("a", "cuda:0", "GPU-0"), ("b", "cuda:0", "GPU-0x")]) == []


def check_shared_gpu_refused(rank, world_size):
    from fused_reducer.transport import check_one_rank_per_gpu
    try:
        check_one_rank_per_gpu(dist.group.WORLD, None, identity=("node7", "cuda:0", "GPU-abc"))
    except RuntimeError as e:
        shared = str(e)
    else:
        shared = None
    check_one_rank_per_gpu(dist.group.WORLD, None,
                           identity=("node7", f"cuda:{rank}", f"GPU-{rank}"))  # own GPUs: fine
    return shared


def check_collective_devices(rank, world_size):
    """Stand-ins for torch.distributed record the device of every tensor the library's own
    collectives move, with the group reported as NCCL and the model 'on' cuda:<rank + 2>."""
    device = torch.device("cuda", rank + 2)
    assert reducer_module._control_device(True, device) == device
    assert reducer_module._control_device(False, device) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="NCCL"):
        reducer_module._control_device(True, torch.device("cpu"))
    seen = {}

    def broadcast_object_list(objects, src=None, group=None, device=None):
        seen["unique_id_staging"] = device
        objects[0] = objects[0] or b"x" * 128

    class FakeTransport:
        def __init__(self, unique_id, rank, world, index, timeout):
            seen["transport_device_index"] = index

    saved = (dist.get_backend, dist.broadcast_object_list, transport_module._C)

    class FakeC:
        BUILD_INFO = {"cuda": True}
        NcclTransport = FakeTransport

        @staticmethod
        def nccl_unique_id():
            return b"u" * 128

    try:
        transport_module.dist.get_backend = lambda group=None: "nccl"
        transport_module.dist.broadcast_object_list = broadcast_object_list
        transport_module._C = FakeC
        transport_module.make_transport(dist.group.WORLD, device, "nccl", 5.0,
                                        check_devices=False)
    finally:
        dist.get_backend, dist.broadcast_object_list, transport_module._C = saved
    return {k: str(v) for k, v in seen.items()}


# -- slots: alignment and strides ---------------------------------------------------------------

class OddConvNet(nn.Module):
    """Odd-sized parameters (their bucket offsets would not be 16-byte multiples if packed
    element by element) and convolutions, used in channels_last."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 5, 3)
        self.conv2 = nn.Conv2d(5, 7, 3)
        self.odd = nn.Parameter(torch.randn(13))
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        y = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(y.mean(dim=(2, 3))) + self.odd[:3].sum()


def check_slots(rank, world_size):
    out = {}
    for channels_last in (False, True):
        for as_view in (False, True):
            fr_model = torch.manual_seed(0) and OddConvNet()
            ddp_model = torch.manual_seed(0) and OddConvNet()  # same initial weights
            if channels_last:
                fr_model, ddp_model = (m.to(memory_format=torch.channels_last)
                                       for m in (fr_model, ddp_model))
            fr = fused_reducer.FusedReducer(fr_model, gradient_as_bucket_view=as_view,
                                            first_bucket_mb=1e-4, bucket_cap_mb=2e-4)
            ddp = DDP(ddp_model, gradient_as_bucket_view=as_view)
            worst, aligned, strides_kept = 0.0, True, True
            for step in range(3):
                x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(10 * rank + step))
                if channels_last:
                    x = x.to(memory_format=torch.channels_last)
                for model in (fr, ddp):
                    model.zero_grad(set_to_none=False)
                    model(x).square().sum().backward()
                for p, q in zip(fr.module.parameters(), ddp.module.parameters()):
                    worst = max(worst, (p.grad - q.grad).abs().max().item())
                    strides_kept &= p.grad.stride() == p.stride()
                    if as_view:
                        aligned &= p.grad.data_ptr() % 16 == 0
            out[(channels_last, as_view)] = {"worst": worst, "aligned": aligned,
                                             "strides": strides_kept,
                                             "buckets": len(fr.bucket_sizes())}
    return out


# -- teardown -------------------------------------------------------------------------------------

def check_close_and_no_cycle(rank, world_size):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    out = {}
    gc.disable()
    try:
        model = fused_reducer.FusedReducer(nn.Linear(4, 4))
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        model(torch.randn(2, 4)).sum().backward()
        ref = weakref.ref(model)
        del model
        out["freed_without_gc"] = ref() is None
    finally:
        gc.enable()
    model = fused_reducer.FusedReducer(nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    model.close()
    model.close()  # idempotent
    try:
        model(torch.randn(2, 4))
        out["forward_after_close"] = None
    except RuntimeError as e:
        out["forward_after_close"] = str(e)
    return out


CHECKS = [check_shared_gpu_refused, check_collective_devices, check_slots,
          check_close_and_no_cycle]


@pytest.fixture(scope="module")
def outcomes():
    return run_checks(CHECKS, 2, timeout=240)


def test_ranks_sharing_a_gpu_are_refused_on_every_rank_naming_ranks_host_device_and_fix(outcomes):
    for message in per_rank(outcomes, "check_shared_gpu_refused"):
        assert message is not None
        for part in ("ranks 0 and 1", "node7", "cuda:0", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
            assert part in message, (part, message)


@pytest.mark.skipif(not fused_reducer.build_info()["cuda"], reason="NCCL transport not built")
def test_library_collectives_stage_on_the_ranks_own_gpu(outcomes):
    for rank, seen in enumerate(per_rank(outcomes, "check_collective_devices")):
        assert seen == {"unique_id_staging": f"cuda:{rank + 2}",
                        "transport_device_index": str(rank + 2)}, seen


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("as_view", [False, True])
def test_slots_are_16_byte_aligned_keep_strides_and_match_ddp(outcomes, channels_last, as_view):
    for results in per_rank(outcomes, "check_slots"):
        r = results[(channels_last, as_view)]
        assert r["buckets"] > 1, r  # several slots per bucket, several buckets
        assert r["worst"] <= 1e-5, r
        assert r["strides"], r
        if as_view:
            assert r["aligned"], r


def test_close_is_final_and_idempotent_and_no_cycle_keeps_a_reducer_alive(outcomes):
    for r in per_rank(outcomes, "check_close_and_no_cycle"):
        assert r["freed_without_gc"], r
        assert r["forward_after_close"] and "closed" in r["forward_after_close"], r


# -- layering -------------------------------------------------------------------------------------

def test_cuda_core_includes_neither_torch_nor_ext_headers():
    """cuda/ is the torch-free core; ext/ adapts it (the C++ test tests/cpp/test_cuda_core.cpp
    builds it without libtorch under ctest)."""
    import os
    import re
    root = os.path.join(os.path.dirname(__file__), "..")
    ext_headers = set(os.listdir(os.path.join(root, "ext")))
    for name in os.listdir(os.path.join(root, "cuda")):
        with open(os.path.join(root, "cuda", name)) as f:
            for line in f:
                match = re.match(r'\s*#\s*include\s*[<"]([^>"]+)[>"]', line)
                if match:
                    header = match.group(1)
                    assert not header.split("/")[0] in ("torch", "ATen", "c10", "pybind11"), \
                        (name, header)
                    assert os.path.basename(header) not in ext_headers, (name, header)
