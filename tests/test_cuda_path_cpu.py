"""What a CPU can prove about the CUDA path on multi-GPU nodes.

* one rank per GPU: ranks sharing a GPU are refused on every rank, through the store (not NCCL),
  naming both ranks, the host and the device, with the fix;
* every collective the library issues itself stages its tensors on the rank's own device
  (recorded by stand-ins for torch.distributed, independent of the library's bookkeeping);
* bucket slots are 16-byte aligned and keep the parameter's strides (channels_last), checked on
  the gradients' own data pointers and strides, and the gradients still equal DDP's;
* close() is idempotent and final; no reference cycle keeps a reducer alive (no gc needed);
* one NCCL communicator: under backend="auto" a model with an NCCL SyncBatchNorm gets the
  process-group transport, an explicit backend="nccl" with one is refused naming the module and
  the fix, and a comm hook on the NCCL transport is refused naming the fix.
The GPU side of the same behaviour runs in tests/test_gpu.py (bench/gpu_check.sh).
"""
import gc
import types
import weakref
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_reducer
from fused_reducer.core import attachment as attachment_module
from fused_reducer.core import validation
from fused_reducer.core.config import ReducerConfig
from fused_reducer.transports import transport as transport_module
from fused_reducer.transports.transport import shared_gpus
from dist_utils import per_rank, run_checks


# -- one rank per GPU ----------------------------------------------------------------------------

def test_shared_gpus_groups_ranks_by_host_and_physical_gpu():
    identities = [("a", "cuda:0", "GPU-0"), ("a", "cuda:1", "GPU-1"), ("b", "cuda:0", "GPU-9"),
                  ("a", "cuda:0", "GPU-1"), ("b", "cuda:1", "GPU-8")]
    # rank 3 sees GPU-1 as its cuda:0 (other CUDA_VISIBLE_DEVICES): same physical GPU as rank 1
    assert shared_gpus(identities) == [("a", "cuda:1", [1, 3])]
    assert shared_gpus([("a", "cuda:0", "GPU-0"), ("b", "cuda:0", "GPU-0x")]) == []


def check_shared_gpu_refused(rank, world_size):
    from fused_reducer.transports.transport import check_one_rank_per_gpu
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
    assert validation.control_device(True, device) == device
    assert validation.control_device(False, device) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="NCCL"):
        validation.control_device(True, torch.device("cpu"))
    seen = {}

    def broadcast_object_list(objects, src=None, group=None, device=None):
        seen["unique_id_staging"] = device
        objects[0] = objects[0] or b"x" * 128

    saved = (dist.get_backend, dist.broadcast_object_list, transport_module._C)

    class FakeC:
        BUILD_INFO = {"cuda": True}
        TransportArgs = types.SimpleNamespace

        @staticmethod
        def make_registered_transport(name, args):
            assert name == "nccl", name
            seen["transport_device_index"] = args.device
            return object()

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


# -- one NCCL communicator ------------------------------------------------------------------------

def check_comm_hook_refused_on_the_nccl_transport(rank, world_size):
    """A model whose transport is reported as NCCL, over a group reported as NCCL: a comm hook
    would run on a second NCCL communicator, so registering it raises naming the fix; with the
    process-group transport (the fix) the same hook registers and trains."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model = fused_reducer.FusedReducer(nn.Linear(4, 4), backend="process_group")
    model.backend = "nccl"  # the transport reported as NCCL ...
    saved = dist.get_backend
    try:
        dist.get_backend = lambda group=None: "nccl"  # ... over an NCCL process group
        try:
            model.register_comm_hook(None, default_hooks.allreduce_hook)
            refused = None
        except fused_reducer.FusedReducerError as e:
            refused = str(e)
    finally:
        dist.get_backend = saved
    out = {"refused": refused, "hook_kept": model._comm_hook is not None}
    model.backend = "process_group"
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    model(torch.randn(2, 4)).sum().backward()
    out["trained"] = all(p.grad is not None for p in model.parameters())
    return out


CHECKS = [check_shared_gpu_refused, check_collective_devices, check_slots,
          check_close_and_no_cycle, check_comm_hook_refused_on_the_nccl_transport]


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


# -- one NCCL communicator: see Note [One NCCL communicator] in core/validation.py

@contextmanager
def nccl_stand_ins(gloo_groups=()):
    """A CUDA build (for resolve_backend) and every process group reported as NCCL, except the
    stand-in groups in `gloo_groups`."""
    saved = (dist.get_backend, transport_module._C)

    class FakeC:
        BUILD_INFO = {"cuda": True}

    try:
        dist.get_backend = lambda group=None: "gloo" if any(
            group is g for g in gloo_groups) else "nccl"
        transport_module._C = FakeC
        yield
    finally:
        dist.get_backend, transport_module._C = saved


def sync_bn_net(process_group=None):
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(
        nn.Linear(4, 4), nn.SyncBatchNorm(4, process_group=process_group)))


CUDA2 = torch.device("cuda", 2)


def test_auto_on_cuda_picks_the_process_group_for_a_model_with_syncbatchnorm_on_nccl():
    choose = validation.one_communicator_backend
    gloo_group = object()
    with nccl_stand_ins(gloo_groups=[gloo_group]):
        assert choose("auto", CUDA2, sync_bn_net(), None) == "process_group"
        # a SyncBatchNorm that is the wrapped module itself
        assert choose("auto", CUDA2, nn.SyncBatchNorm(4), None) == "process_group"
        # without SyncBatchNorm, or with one whose group is not NCCL: the NCCL transport
        plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        assert choose("auto", CUDA2, plain, None) == "auto"
        assert transport_module.resolve_backend("auto", CUDA2) == "nccl"
        assert choose("auto", CUDA2, sync_bn_net(gloo_group), None) == "auto"
        assert choose("nccl", CUDA2, sync_bn_net(gloo_group), None) == "nccl"
        # the process-group transport is already one communicator: unchanged
        assert choose("process_group", CUDA2, sync_bn_net(), None) == "process_group"
        # a model with a hook re-attaching (after unpickling) over an NCCL group
        assert choose("auto", CUDA2, plain, None, has_hook=True) == "process_group"
        with pytest.raises(fused_reducer.FusedReducerError, match="communication hook"):
            choose("nccl", CUDA2, plain, None, has_hook=True)


def test_explicit_nccl_with_syncbatchnorm_raises_naming_module_reason_and_fix():
    with nccl_stand_ins():
        with pytest.raises(fused_reducer.FusedReducerError) as refused:
            validation.one_communicator_backend("nccl", CUDA2, sync_bn_net(), None)
    message = str(refused.value)
    for part in ("backend='nccl'", "SyncBatchNorm '1.1'", "two communicators", "deadlock",
                 "backend='process_group'", "backend='auto'"):
        assert part in message, (part, message)
    assert isinstance(refused.value, RuntimeError)


class _Reached(Exception):
    pass


def _attach_until_the_gpu_check(module, backend):
    """An Attachment as construction builds it, for a model 'on' cuda:2 over a group reported
    as NCCL, stopped at the one-rank-per-GPU check (its first collective): returns the backend
    it is about to build the transport for."""
    config = ReducerConfig(bucket_caps_bytes=(1 << 20, 25 << 20), backend=backend)
    saved = attachment_module.check_one_rank_per_gpu
    chosen = []
    real_resolve = attachment_module.resolve_backend

    def resolve(request, device):
        chosen.append(real_resolve(request, device))
        return chosen[-1]

    def reached(group, device):
        raise _Reached(chosen[-1])

    try:
        attachment_module.check_one_rank_per_gpu = reached
        attachment_module.resolve_backend = resolve
        with nccl_stand_ins():
            attachment_module.Attachment(module, config, None, CUDA2, [], init_sync=True,
                                         init_sync_buffers=True)
    except _Reached as e:
        return e.args[0]
    finally:
        attachment_module.check_one_rank_per_gpu = saved
        attachment_module.resolve_backend = real_resolve
    raise AssertionError("the attachment did not reach the GPU check")


def test_construction_applies_the_rule_before_any_collective():
    assert _attach_until_the_gpu_check(sync_bn_net(), "auto") == "process_group"
    assert _attach_until_the_gpu_check(nn.Linear(4, 4), "auto") == "nccl"
    with pytest.raises(fused_reducer.FusedReducerError, match="SyncBatchNorm '1.1'"):
        _attach_until_the_gpu_check(sync_bn_net(), "nccl")


def test_comm_hook_on_the_nccl_transport_over_nccl_is_refused_naming_the_fix(outcomes):
    for r in per_rank(outcomes, "check_comm_hook_refused_on_the_nccl_transport"):
        message = r["refused"]
        assert message is not None, r
        for part in ("allreduce_hook", "own NCCL communicator", "deadlock",
                     "backend='process_group'"):
            assert part in message, (part, message)
        assert not r["hook_kept"], r
        assert r["trained"], r


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
