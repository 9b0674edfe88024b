"""Choosing how buckets move: NCCL directly (CUDA builds, CUDA parameters) or any process group."""
import torch
import torch.distributed as dist

from . import _C

BACKENDS = ("auto", "nccl", "process_group")


def nccl_built():
    return bool(_C.BUILD_INFO["cuda"])


def resolve_backend(backend, device):
    """'auto' -> 'nccl' for CUDA parameters in a CUDA build, else 'process_group'."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "nccl" if device.type == "cuda" and nccl_built() else "process_group"
    if backend == "nccl":
        if not nccl_built():
            raise RuntimeError(
                "backend='nccl' needs a CUDA build of fused_reducer, but this one was built "
                "without CUDA (fused_reducer.build_info()['cuda'] is False); rebuild with a CUDA "
                "toolkit and a CUDA build of torch, or use backend='process_group'")
        if device.type != "cuda":
            raise ValueError(
                f"backend='nccl' needs parameters on a CUDA device, but they are on {device}; "
                "move the model to CUDA first, or use backend='process_group'")
    return backend


def make_transport(group, device, backend="auto", timeout_s=600.0):
    """The transport a FusedReducer (or the bandwidth benchmark) reduces buckets with.

    For NCCL, rank 0 of `group` makes the communicator id and shares it with a broadcast over
    `group`; every rank then joins on `device` (raises after `timeout_s` if a rank never joins).
    """
    backend = resolve_backend(backend, torch.device(device))
    if backend == "process_group":
        return _C.ProcessGroupTransport(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    box = [_C.nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    index = torch.device(device).index
    return _C.NcclTransport(box[0], rank, world, torch.cuda.current_device() if index is None else index,
                            timeout_s)
