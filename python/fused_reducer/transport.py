"""Choosing how buckets move: NCCL directly (CUDA builds, CUDA parameters) or any process group."""
import socket

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


def make_transport(group, device, backend="auto", timeout_s=600.0, check_devices=True):
    """The transport a FusedReducer (or the bandwidth benchmark) reduces buckets with.

    For NCCL, rank 0 of `group` makes the communicator id and shares it with a broadcast over
    `group` (staged on `device` when the group is an NCCL group, so no rank touches another
    GPU); every rank then joins on `device` (raises after `timeout_s` if a rank never joins).
    """
    device = torch.device(device)
    backend = resolve_backend(backend, device)
    if backend == "process_group":
        return _C.ProcessGroupTransport(group)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if check_devices:
        check_one_rank_per_gpu(group, device)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    box = [_C.nccl_unique_id() if rank == 0 else None]
    staging = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group,
                               device=staging)
    return _C.NcclTransport(box[0], rank, world, device.index, timeout_s)


def control_allreduce(values, op, group, device):
    """All-reduce a few numbers (float64) across `group` with `op`, staged on `device` (the
    model's control device: the rank's GPU for an NCCL group, which has no CPU backend, else
    the CPU); returns them as a list. The library's own small agreements go through here."""
    agreed = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=op, group=group)
    return agreed.tolist()


# -- one rank per GPU -------------------------------------------------------------------------
_exchange_rounds = {}  # per group: how many identity exchanges so far (same sequence on all ranks)


def gpu_identity(device):
    """(host, device, physical id) of a CUDA device: the UUID tells two ranks apart that see
    the same physical GPU under different CUDA_VISIBLE_DEVICES indices."""
    device = torch.device(device)
    try:
        physical = str(torch.cuda.get_device_properties(device).uuid)
    except (AttributeError, RuntimeError, AssertionError):
        physical = f"index {device.index}"
    return socket.gethostname(), str(device), physical


def shared_gpus(identities):
    """[(host, device, [ranks])] for every physical GPU that more than one rank uses."""
    users = {}
    for rank, (host, device, physical) in enumerate(identities):
        users.setdefault((host, physical), (device, []))[1].append(rank)
    return [(host, device, ranks) for (host, _), (device, ranks) in users.items() if len(ranks) > 1]


def check_one_rank_per_gpu(group, device, identity=None):
    """Refuse, on every rank and before NCCL does ("Duplicate GPU detected"), ranks that share a
    GPU. The identities travel through the group's store, not through NCCL."""
    identity = identity or gpu_identity(device)
    store = _group_store(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    key = dist.distributed_c10d._get_process_group_name(group) if hasattr(
        dist.distributed_c10d, "_get_process_group_name") else str(id(group))
    round_ = _exchange_rounds.get(key, 0)
    _exchange_rounds[key] = round_ + 1
    prefix = f"fused_reducer/gpu_identity/{key}/{round_}/"
    store.set(prefix + str(rank), "\t".join(identity))
    identities = [tuple(store.get(prefix + str(r)).decode().split("\t")) for r in range(world)]
    clashes = shared_gpus(identities)
    if clashes:
        host, shared, ranks = clashes[0]
        listed = ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"
        raise RuntimeError(
            f"FusedReducer: ranks {listed} use the same GPU ({shared}) of host {host}; NCCL "
            "needs one GPU per rank. In each process call "
            "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) and move the model to "
            "f\"cuda:{local_rank}\" before wrapping it (torchrun sets LOCAL_RANK), or give each "
            "rank its own GPU with CUDA_VISIBLE_DEVICES.")


def _group_store(group):
    try:
        return dist.distributed_c10d._world.pg_map[group][1]
    except (AttributeError, KeyError):
        return dist.distributed_c10d._get_default_store()
