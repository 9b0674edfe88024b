"""The configurations step_bench.py compares: DDP with the run's bucket limits (DDP's best
settings where this torch takes them), DDP as constructed by default, DDP with a compress hook
(--reduce-dtype), torch's FSDP2 replicate (DDP rebuilt on FSDP2), and FusedReducer; and how each
reports its bucket layout."""
import torch
import torch.distributed as dist
from torch import nn

import common
from models import fsdp2_blocks

MiB = 1024 * 1024


# -- wrappers -----------------------------------------------------------------------------------
def make_ddp(module, ctx, first_mb, cap_mb, grad_as_view):
    """DDP with its best settings for the run (common.ddp_best_kwargs): batched_grad_copy=True and
    FusedReducer's layout passed as arguments (bucket_cap_mb_list=[first, cap], or bucket_cap_mb
    when they are equal). A torch without bucket_cap_mb_list gets the limits through DDP's own
    defaults (_DEFAULT_FIRST_BUCKET_BYTES, _DEFAULT_BUCKET_CAP_MB, set just before it is built
    with bucket_cap_mb=None), as this benchmark did before."""
    import torch.nn.parallel.distributed as ddp_module
    kwargs, by_defaults = common.ddp_best_kwargs(first_mb, cap_mb)
    device_ids = [ctx.device.index] if ctx.is_cuda else None
    if not by_defaults:
        return nn.parallel.DistributedDataParallel(
            module, device_ids=device_ids, gradient_as_bucket_view=grad_as_view, **kwargs)
    saved_first = dist._DEFAULT_FIRST_BUCKET_BYTES
    saved_cap = ddp_module._DEFAULT_BUCKET_CAP_MB
    try:
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(first_mb * MiB)
        ddp_module._DEFAULT_BUCKET_CAP_MB = cap_mb
        return nn.parallel.DistributedDataParallel(
            module, device_ids=device_ids, bucket_cap_mb=None,
            gradient_as_bucket_view=grad_as_view, **kwargs)
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = saved_first
        ddp_module._DEFAULT_BUCKET_CAP_MB = saved_cap


def make_ddp_default(module, ctx, grad_as_view):
    """DDP as most users construct it: DDP(model) (gradient_as_bucket_view as the run asks):
    its own limits (first bucket 1 MiB, cap 25 MiB), one copy per parameter."""
    return nn.parallel.DistributedDataParallel(
        module, device_ids=[ctx.device.index] if ctx.is_cuda else None,
        gradient_as_bucket_view=grad_as_view)


def ddp_settings(first_mb, cap_mb):
    """How the run builds its DDP rows, for the JSON and the header."""
    kwargs, by_defaults = common.ddp_best_kwargs(first_mb, cap_mb)
    text = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    if by_defaults:
        text += (f"{', ' if text else ''}first {first_mb:g} / cap {cap_mb:g} MiB through DDP's "
                 f"module defaults ({by_defaults})")
    return {"ddp": f"DDP({text})", "ddp_default": "DDP(model)"}


def make_ddp_hook(module, ctx, first_mb, cap_mb, grad_as_view, reduce_dtype):
    """DDP as make_ddp plus its compress hook for `reduce_dtype` (bf16/fp16_compress_hook): the
    DDP way to all-reduce fp32 gradients in half precision."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    ddp = make_ddp(module, ctx, first_mb, cap_mb, grad_as_view)
    hook = dh.bf16_compress_hook if reduce_dtype == torch.bfloat16 else dh.fp16_compress_hook
    ddp.register_comm_hook(dist.group.WORLD, hook)
    return ddp


def make_fused(module, first_mb, cap_mb, grad_as_view, autotune=False, reduce_dtype=None,
               backend="auto"):
    """FusedReducer with DDP's limits. With a 2-byte reduce_dtype the limits count bytes of the
    reduce dtype (Note [Reduce dtype]), so they are halved: the same parameters per bucket as
    DDP's fp32 buckets."""
    from fused_reducer import FusedReducer
    factor = 0.5 if reduce_dtype in (torch.bfloat16, torch.float16) else 1.0
    return FusedReducer(module, bucket_cap_mb=cap_mb * factor, first_bucket_mb=first_mb * factor,
                        gradient_as_bucket_view=grad_as_view, autotune=autotune,
                        reduce_dtype=reduce_dtype, backend=backend)


def make_fsdp2_replicate(spec, ctx, reduce_dtype=None):
    """(model, group bytes): torch's replicate_with_fsdp.replicate applied torchtitan's way, to
    each block of the model (bench/models.py fsdp2_blocks) and then to the root, on a 1-D mesh
    of all ranks; with a reduce_dtype through MixedPrecisionPolicy(reduce_dtype=...). FSDP2 has
    no bucket limits: its groups are the blocks. Raises common.FSDP2Refused with torch's message
    where it rejects the model (channels_last parameters)."""
    module = spec.build(ctx.device)
    blocks = fsdp2_blocks(spec.name, module)
    groups = common.fsdp2_group_bytes(module, blocks)
    return common.fsdp2_wrap(module, "replicate", blocks, ctx.device.type, reduce_dtype), groups


def fused_bytes_as_fp32(fused, reduce_dtype):
    """FusedReducer's bucket sizes in bytes of fp32 gradients (comparable with DDP's): with a
    2-byte reduce dtype its buckets hold half the bytes."""
    factor = 2 if reduce_dtype in (torch.bfloat16, torch.float16) else 1
    return [b * factor for b in fused.bucket_sizes()]


def ddp_layout(ddp):
    data = ddp._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(s) for s in str(sizes).replace(" ", "").split(",") if s]


