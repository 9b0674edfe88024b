"""The checks FusedReducer's constructor and attach run on their arguments and on the model:
DDP arguments refused or translated (with DDP's warnings), the process group and the device, the
one-NCCL-communicator rule, and the collective check that every rank wraps the same model. Each
raises a FusedReducerError saying what was wrong and what to do."""
import warnings
import zlib

import torch
import torch.distributed as dist
from torch import nn

from .. import _C
from ..errors import FusedReducerError
from ..transports.transport import resolve_backend

_MAX_DIMS = 8  # shape entries compared across ranks; the rest is folded into numel


def health_option_names():
    """The health checks' options, as C++ binds them on HealthOptions (for_each_health_option in
    ext/health_checks.h): an option added there is taken, checked and passed on by name."""
    return sorted(name for name in dir(_C.HealthOptions) if not name.startswith("_"))


def health_settings(given):
    """The C++ reducer's health options from FusedReducer's keyword arguments of the same names:
    each one's type checked here against its C++ field's (a bool; an int number of steps; a
    float, None meaning automatic, which C++ spells 0, so an explicit value must be positive,
    in milliseconds for a name ending in _ms), the ranges by C++'s check_health_options, before
    any collective. Returns {name: value} as C++ takes it."""
    defaults = _C.HealthOptions()
    settings = {}
    for name in health_option_names():
        value, default = given[name], getattr(defaults, name)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise FusedReducerError(f"FusedReducer: {name} must be True or False, got "
                                        f"{value!r}")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 2**62:
                raise FusedReducerError(f"FusedReducer: {name} must be an int number of steps "
                                        f"(below 2**62), got {value!r}")
        elif value is None:
            value = 0.0
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0:
            unit = " of milliseconds" if name.endswith("_ms") else ""
            raise FusedReducerError(f"FusedReducer: {name} must be a positive number{unit}, or "
                                    f"None (automatic), got {value!r}")
        settings[name] = float(value) if isinstance(default, float) else value
    unknown = set(given) - set(settings)
    if unknown:  # a keyword the C++ options no longer have: a wrapper out of step with C++
        raise AssertionError(f"health options C++ does not bind: {sorted(unknown)}")
    options = _C.HealthOptions()
    for name, value in settings.items():
        setattr(options, name, value)
    _C.check_health_options(options)
    return settings


def check_bucket_view_dtypes(gradient_as_bucket_view, reduce_dtype, named):
    """gradient_as_bucket_view with a reduce dtype other than a floating gradient's: refused
    before any collective, by the C++ check the reduce_dtype setter runs too (Note [Reduce
    dtype] in ext/bucket_layout.cpp)."""
    _C.check_bucket_view_dtypes(gradient_as_bucket_view, reduce_dtype,
                                [p.dtype for _, p in named], [name for name, _ in named])


def refuse_compiled_autograd():
    """FusedReducer's gradient hooks are C++ post-hooks on the gradient accumulators, which
    compiled autograd does not run: refuse at once rather than skip the reduction."""
    try:
        from torch._dynamo import compiled_autograd
    except ImportError:  # pragma: no cover - older torch
        return
    enabled = (getattr(compiled_autograd, "compiled_autograd_enabled", False)
               or getattr(torch._dynamo.config, "compiled_autograd", False))
    if enabled:
        raise FusedReducerError(
            "FusedReducer: compiled autograd (torch._dynamo.config.compiled_autograd or "
            "torch._dynamo.compiled_autograd.enable) is not supported: FusedReducer reduces "
            "gradients from C++ hooks on the parameters' gradient accumulators, which compiled "
            "autograd does not call. Keep compiled autograd off; torch.compile of the model or of "
            "FusedReducer itself is supported.")


def refuse_unsupported_ddp_arguments(static_graph, delay_all_reduce_named_params,
                                      param_to_hook_all_reduce):
    """DDP constructor arguments FusedReducer does not implement: a FusedReducerError naming
    the argument and what to use instead (never silently ignored)."""
    if static_graph:
        raise FusedReducerError(
            "FusedReducer: static_graph=True is not supported. It is not needed for "
            "reentrant activation checkpointing, which FusedReducer handles without it; for "
            "parameters unused in forward, pass find_unused_parameters=True instead.")
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        raise FusedReducerError(
            "FusedReducer: delay_all_reduce_named_params / param_to_hook_all_reduce are not "
            "supported. To reduce some gradients late in one collective, give them a bucket of "
            "their own: last_bucket_mb=... (the last gradients of backward) or "
            "bucket_cap_mb_list=[...].")


def reduce_dtype_of(mixed_precision, reduce_dtype):
    """DDP's mixed_precision=_MixedPrecision(reduce_dtype=...) is FusedReducer's reduce_dtype;
    its param_dtype and buffer_dtype are refused (use torch.autocast)."""
    if mixed_precision is None:
        return reduce_dtype
    for field in ("param_dtype", "buffer_dtype"):
        if getattr(mixed_precision, field, None) is not None:
            raise FusedReducerError(
                f"FusedReducer: mixed_precision.{field}={getattr(mixed_precision, field)} is not "
                "supported (FusedReducer does not keep low-precision copies of the parameters or "
                "buffers). Compute in low precision with torch.autocast; "
                "mixed_precision=_MixedPrecision(reduce_dtype=...) or reduce_dtype=... sets the "
                "dtype gradients are reduced in.")
    wanted = getattr(mixed_precision, "reduce_dtype", None)
    if reduce_dtype is not None and wanted is not None and reduce_dtype != wanted:
        raise FusedReducerError(
            f"FusedReducer: reduce_dtype={reduce_dtype} and mixed_precision.reduce_dtype="
            f"{wanted} disagree; pass one of them")
    return wanted if wanted is not None else reduce_dtype


def buffer_sync_settings(broadcast_buffers, forward_sync_buffers):
    """(sync buffers before forwards, sync buffers at construction), combined as DDP combines
    its deprecated broadcast_buffers with forward_sync_buffers, with DDP's warnings."""
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            warnings.warn("Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                          "`broadcast_buffers` is deprecated and its value is ignored when "
                          "`forward_sync_buffers` is provided.", FutureWarning, stacklevel=3)
        else:
            warnings.warn("`broadcast_buffers` is deprecated (as in DDP). Use "
                          "`forward_sync_buffers` instead; unlike `broadcast_buffers=False`, "
                          "`forward_sync_buffers=False` still broadcasts the buffers at "
                          "construction.", FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    effective = True if broadcast_buffers is None else bool(broadcast_buffers)
    return effective, effective


def group_of(process_group, device_mesh):
    """The process group of a 1-D device_mesh (as DDP), or process_group."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise FusedReducerError("FusedReducer: pass process_group or device_mesh, not both")
    if device_mesh.ndim != 1:
        raise FusedReducerError(
            f"FusedReducer: only a 1-D device_mesh is supported (as DDP), got one with "
            f"{device_mesh.ndim} dimensions; pass the data-parallel dimension, e.g. "
            f"mesh['dp']")
    return device_mesh.get_group(mesh_dim=0)


def resolve_group(process_group):
    if process_group is not None:
        return process_group
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "FusedReducer needs an initialised process group: call "
            "torch.distributed.init_process_group(backend=...) first (torchrun provides the "
            "rendezvous environment), or pass process_group=")
    return dist.group.WORLD


# Note [One NCCL communicator]
# NCCL documents that collectives running concurrently on two communicators of the same devices
# can deadlock (each may grab the GPU's resources the other needs). FusedReducer's own NCCL
# communicator (backend="nccl") is therefore only used where nothing else of the step issues
# collectives on another NCCL communicator of this device while backward runs:
# * SyncBatchNorm all-reduces its statistics during forward and backward on its process group,
#   concurrently with the bucket all-reduces. Under backend="auto" a model containing a
#   torch.nn.SyncBatchNorm whose group runs NCCL reduces buckets through the process group
#   instead (DDP's arrangement: one communicator; model.backend says "process_group"); an
#   explicit backend="nccl" raises at construction naming the module and the fix.
# * A communication hook issues its collectives on the process group, while the reducer's own
#   communicator still runs collectives (find_unused_parameters's used map, join, autotune's
#   probe). Hooks are registered after construction, when the transport is already chosen, so
#   with the NCCL transport over an NCCL group register_comm_hook raises naming the fix
#   (backend="process_group"). After unpickling, a model with a hook re-attaches to the
#   process group transport under "auto" like a SyncBatchNorm model.
# The library's own control collectives on the process group (layout and buffer broadcasts, the
# checks) never overlap the buckets: see "Two communicators" in ext/nccl_transport.h.


def runs_nccl(group):
    """Whether `group` (None: the default group) moves CUDA tensors with NCCL."""
    try:
        return "nccl" in str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError, AttributeError):  # not initialised, or a stand-in group
        return False


def sync_batchnorms_on_nccl(module):
    """Qualified names of the torch.nn.SyncBatchNorm modules whose process group (their own, or
    the default one) runs NCCL: each all-reduces on that group's communicator in backward."""
    return [name or "(the wrapped module itself)" for name, m in module.named_modules()
            if isinstance(m, nn.SyncBatchNorm) and runs_nccl(m.process_group)]


def one_communicator_backend(request, device, module, group, has_hook=False):
    """The backend to construct the transport with, given the user's `request`: never the
    reducer's own NCCL communicator next to another NCCL communicator (Note [One NCCL
    communicator]). 'auto' becomes 'process_group' then; an explicit 'nccl' raises."""
    if resolve_backend(request, device) != "nccl":
        return request
    sync_bns = sync_batchnorms_on_nccl(module)
    hook = has_hook and runs_nccl(group)
    if not sync_bns and not hook:
        return request
    if request == "auto":
        return "process_group"
    if sync_bns:
        more = f" (and {len(sync_bns) - 1} more)" if len(sync_bns) > 1 else ""
        raise FusedReducerError(
            f"FusedReducer: backend='nccl' cannot be used with torch.nn.SyncBatchNorm "
            f"'{sync_bns[0]}'{more}: SyncBatchNorm all-reduces its statistics in backward on "
            "the process group's NCCL communicator while the buckets would go over "
            "FusedReducer's own NCCL communicator, and NCCL collectives on two communicators of "
            "one device can deadlock (DDP uses one communicator). Use backend='process_group' "
            "or backend='auto' (which picks the process group for a model with SyncBatchNorm).")
    raise FusedReducerError(
        "FusedReducer: backend='nccl' cannot be used with a registered communication hook: the "
        "hook's collectives run on the process group's NCCL communicator, and NCCL collectives "
        "on two communicators of one device can deadlock (DDP uses one communicator). Use "
        "backend='process_group' or backend='auto'.")


def control_device(nccl_group, device):
    """Where the library's own small control tensors live: the parameters' GPU for an NCCL
    group (it only moves CUDA tensors, and never another rank's GPU), else the CPU."""
    if not nccl_group:
        return torch.device("cpu")
    if device.type != "cuda":
        raise FusedReducerError(
            f"FusedReducer: the process group uses NCCL but the parameters are on {device}; move "
            "the model to this rank's GPU first (torch.cuda.set_device(local_rank); "
            "model.to(f'cuda:{local_rank}')), or use a gloo process group for CPU training")
    return device


def check_device_ids(device_ids, output_device, device):
    """DDP's `device_ids` / `output_device`, accepted so that switching is a one-line change.
    The device is always the parameters'; these may only confirm it (as in DDP: None for a CPU
    module, [the module's GPU] for a single-GPU one). Outputs stay where the module puts them."""
    def as_device(value):
        return torch.device(device.type, value) if isinstance(value, int) else torch.device(value)

    if device_ids is not None:
        ids = list(device_ids) if isinstance(device_ids, (list, tuple)) else [device_ids]
        if device.type == "cpu" or len(ids) != 1 or as_device(ids[0]) != device:
            raise FusedReducerError(
                f"FusedReducer: device_ids={device_ids!r} does not match the module, whose "
                f"parameters are on {device}. Like DDP, pass device_ids=None for a CPU module and "
                f"[{device.index if device.index is not None else 'local_rank'}] for a module on "
                "one GPU, or leave it out: FusedReducer uses the parameters' device.")
    if output_device is not None and as_device(output_device) != device:
        raise FusedReducerError(
            f"FusedReducer: output_device={output_device!r} differs from the parameters' device "
            f"{device}; FusedReducer leaves outputs where the module puts them. Leave it out.")


def refuse_sync_batch_norm_on_cpu(module, device):
    if device.type == "cpu" and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        raise ValueError("FusedReducer: SyncBatchNorm layers only work with GPU modules (as in "
                         "DDP); use torch.nn.BatchNorm for a CPU model, or move it to a GPU")


def refuse_sparse_gradients(module):
    for name, sub in module.named_modules():
        if getattr(sub, "sparse", False) is True:
            raise FusedReducerError(
                f"FusedReducer: module '{name}' ({type(sub).__name__}) has sparse=True and would "
                "produce sparse gradients, which FusedReducer does not reduce; construct it with "
                "sparse=False (dense gradients) or keep it outside FusedReducer")


def refuse_wrapped_twice(module, wrapper_class):
    """A model already wrapped (FusedReducer or DDP, at its root or in a submodule) would have
    every gradient reduced by each wrapper: twice the traffic per step, silently. Refused on
    every rank alike, before any collective."""
    for name, sub in module.named_modules():
        if isinstance(sub, (wrapper_class, nn.parallel.DistributedDataParallel)):
            kind = type(sub).__name__
            if name == "":
                where, fix = "the module to wrap", (
                    f"wrap the plain model once: FusedReducer(inner.module), where inner is the "
                    f"{kind}, or keep the {kind} alone")
            else:
                where, fix = f"submodule '{name}' of the module to wrap", (
                    f"put the plain module back in its place (the {kind}'s .module) and wrap "
                    "the whole model once")
            raise FusedReducerError(
                f"FusedReducer: {where} is already a {kind}, which averages its gradients "
                f"itself: wrapped twice, each gradient would be reduced twice (twice the traffic "
                f"per step). To fix it, {fix}.")


def _shape_signature(params):
    """One int64 row per parameter: dtype, ndim, numel, first _MAX_DIMS sizes (padded with -1)."""
    rows = []
    for p in params:
        dims = list(p.shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(p.dim(), _MAX_DIMS))
        rows.append([_dtype_code(p.dtype), p.dim(), p.numel()] + dims)
    return torch.tensor(rows, dtype=torch.int64)


def _dtype_code(dtype):
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF  # same on every rank, unlike hash()


_DTYPE_NAMES = {_dtype_code(d): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _describe(row):
    dims = [int(d) for d in row[3:3 + min(int(row[1]), _MAX_DIMS)]]
    dtype = _DTYPE_NAMES.get(int(row[0]), "unknown dtype")
    return f"shape {tuple(dims)} {dtype}"


def verify_same_model(group, names, params, device):
    """Every rank must wrap the same parameters; otherwise raise, on every rank, naming the first
    mismatching parameter. DDP over gloo crashes or hangs here instead."""
    world = dist.get_world_size(group)
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([len(params)], dtype=torch.int64, device=device), group=group)
    counts = [int(c.item()) for c in counts]
    if len(set(counts)) != 1:
        raise FusedReducerError(
            "FusedReducer: ranks wrap different models: trainable parameter counts per rank are "
            f"{counts}. Build the same model on every rank.")
    mine = _shape_signature(params).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    reference = gathered[0].cpu()
    for rank, theirs in enumerate(gathered[1:], start=1):
        theirs = theirs.cpu()
        for index in range(len(params)):
            if not torch.equal(reference[index], theirs[index]):
                kind = "dtype" if reference[index][0] != theirs[index][0] else "shape"
                raise FusedReducerError(
                    f"FusedReducer: parameter '{names[index]}' (index {index}) differs across "
                    f"ranks ({kind}): rank 0 has {_describe(reference[index])}, rank {rank} has "
                    f"{_describe(theirs[index])}. Build the same model on every rank.")
