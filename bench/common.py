"""Shared pieces of the FusedReducer benchmarks.

* Launching: under torchrun (RANK, WORLD_SIZE and LOCAL_RANK set) every process joins the
  process group torchrun describes: NCCL on cuda:LOCAL_RANK when CUDA is available, else gloo.
  Run with plain ``python`` the benchmark spawns ``--nranks`` (default 2) gloo ranks itself on
  127.0.0.1, so it works on a CPU-only machine with no launcher.
* Machine description (``meta``) for JSON files and plot titles.
* Sizes with K/M/G suffixes (powers of 1024, like nccl-tests).
* JSON writing and rank-0-only printing.
"""
import argparse
import datetime
import faulthandler
import json
import os
import platform
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fused_reducer.testing.launch import (connect_store, rendezvous_store, start_ranks,
                                          wait_for_exit_codes)

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- sizes ----------------------------------------------------------------------------------------
_SUFFIXES = {"": 1, "B": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}


def parse_size(text):
    """'64K' -> 65536, '1M' -> 1048576, '2G', '512', '1.5M', '4MiB', '4MB' (all powers of 1024,
    as nccl-tests reads -b/-e). Raises argparse.ArgumentTypeError on anything else."""
    raw = str(text).strip()
    s = raw.upper()
    for tail in ("IB", "B"):
        if len(s) > len(tail) and s.endswith(tail) and s[-len(tail) - 1] in "KMGT":
            s = s[: -len(tail)]
            break
    unit = s[-1] if s and s[-1] in "KMGTB" else ""
    number = s[: -1] if unit else s
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {raw!r} (examples: 8, 64K, 1M, 2G)") from None
    size = int(value * _SUFFIXES[unit])
    if value < 0 or size < 0:
        raise argparse.ArgumentTypeError(f"size must not be negative: {raw!r}")
    return size


def format_size(nbytes):
    """65536 -> '64K', 1048576 -> '1M', 1000 -> '1000'."""
    for unit in ("G", "M", "K"):
        mult = _SUFFIXES[unit]
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{unit}"
    return str(nbytes)


def parse_float_list(text):
    """'1,4,16' -> [1.0, 4.0, 16.0] (MiB lists of the step benchmark)."""
    try:
        values = [float(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"need positive numbers, got {text!r}")
    return values


# -- DDP's best settings ---------------------------------------------------------------------------
def ddp_best_kwargs(first_mb, cap_mb, ddp_class=None):
    """The keyword arguments that give the installed torch's DDP its best settings for the
    bucket limits (first, cap) in MiB, each only where DDP's signature has it:
    batched_grad_copy=True (one _foreach_copy_ + one div_ per bucket instead of a copy per
    parameter), and FusedReducer's layout: bucket_cap_mb when first == cap (an explicit cap makes
    DDP's first bucket the cap too), else bucket_cap_mb_list=[first, cap] (per-bucket limits, the
    last one for every later bucket; used for the first layout and for the rebuild). Returns
    (kwargs, None), or (kwargs, why) when this DDP cannot take the limits as arguments (torch
    without bucket_cap_mb_list and first != cap): then the caller sets them through DDP's module
    defaults (make_ddp in step_bench.py)."""
    import inspect
    if ddp_class is None:
        ddp_class = torch.nn.parallel.DistributedDataParallel
    params = inspect.signature(ddp_class.__init__).parameters
    kwargs = {}
    if "batched_grad_copy" in params:
        kwargs["batched_grad_copy"] = True
    if first_mb == cap_mb:
        kwargs["bucket_cap_mb"] = cap_mb
    elif "bucket_cap_mb_list" in params:
        kwargs["bucket_cap_mb_list"] = [first_mb, cap_mb]
    else:
        return kwargs, "this torch's DDP has no bucket_cap_mb_list"
    return kwargs, None


# -- FSDP2 (torch's successor of DDP) -------------------------------------------------------------
class FSDP2Refused(RuntimeError):
    """torch's FSDP2 would not take the model (e.g. channels_last parameters); the message is
    torch's own error, for the bench to print in place of the row."""


def fsdp2_wrap(module, way, blocks, device_type="cpu", reduce_dtype=None):
    """The module under torch's FSDP2, applied the way torchtitan does: to each of `blocks` (the
    model's repeated blocks, bench/models.py fsdp2_blocks) and then to the root, so each block's
    gradients are reduced as soon as its backward is done (the overlap DDP's buckets give).

    way: 'replicate' = torch.distributed._composable.replicate_with_fsdp.replicate (DDP rebuilt
    on FSDP2: parameters are DTensors placed Replicate() on a 1-D mesh, one all-reduce per block);
    'zero2' = torch.distributed.fsdp.fully_shard(reshard_after_forward=False) on a 1-D data-
    parallel mesh (parameters Shard(0), gradients reduce-scattered, parameters all-gathered in
    forward and kept unsharded until the next step: ZeRO-2). reduce_dtype goes into
    MixedPrecisionPolicy(reduce_dtype=...). Raises FSDP2Refused with torch's message where FSDP2
    rejects the model (NotImplementedError in torch 2.14: non-contiguous, e.g. channels_last,
    parameters). Returns the module itself (FSDP2 changes its class in place)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed._composable.replicate_with_fsdp import replicate
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    if way == "replicate":
        apply = lambda m: replicate(m, mesh=mesh, mp_policy=policy)  # noqa: E731
    elif way == "zero2":
        apply = lambda m: fully_shard(m, mesh=mesh, mp_policy=policy,  # noqa: E731
                                      reshard_after_forward=False)
    else:
        raise ValueError(f"fsdp2_wrap: way must be 'replicate' or 'zero2', got {way!r}")
    try:
        for block in blocks:
            apply(block)
        apply(module)
    except NotImplementedError as e:
        raise FSDP2Refused(f"{type(e).__name__}: {e}") from None
    return module


def fsdp2_group_bytes(module, blocks):
    """Bytes of the parameters each FSDP2 group reduces, in backward order as far as blocks go:
    the blocks (last first), then the root's own (the rest)."""
    in_blocks = set()
    sizes = []
    for block in reversed(blocks):
        params = list(block.parameters())
        in_blocks.update(id(p) for p in params)
        sizes.append(sum(p.numel() * p.element_size() for p in params))
    rest = sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in in_blocks)
    return sizes + ([rest] if rest else [])


def full_tensor(t):
    """A DTensor (FSDP2's parameters and gradients) as the whole tensor; a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# -- launching ------------------------------------------------------------------------------------
@dataclass
class Context:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    launcher: str  # "torchrun" or "spawn"

    @property
    def is_cuda(self):
        return self.device.type == "cuda"

    def sync(self):
        """Wait for queued device work (no-op on CPU)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def launched_by_torchrun():
    return all(k in os.environ for k in TORCHRUN_ENV)


def add_launch_args(parser):
    group = parser.add_argument_group("launching")
    group.add_argument("--nranks", type=int, default=2,
                       help="ranks to spawn when not started by torchrun (gloo on 127.0.0.1); "
                            "ignored under torchrun, which sets the world size (default 2)")
    group.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                       help="process-group backend; auto = nccl on cuda:LOCAL_RANK under torchrun "
                            "when CUDA is available, gloo otherwise (default auto)")
    group.add_argument("--threads", type=int, default=None,
                       help="torch intra-op threads per rank on CPU (default: usable cores / "
                            "local ranks, at least 1)")
    group.add_argument("--timeout", type=float, default=600.0,
                       help="seconds before a stuck collective fails the run (default 600)")
    return group


def _usable_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _setup_rank(args, rank, world_size, local_rank, local_world, launcher, store=None):
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if launcher == "torchrun" and torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise SystemExit("--backend nccl needs CUDA, and none is available")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    threads = args.threads or max(1, _usable_cpus() // max(1, local_world))
    torch.set_num_threads(threads)
    kwargs = dict(backend=backend, rank=rank, world_size=world_size,
                  timeout=datetime.timedelta(seconds=args.timeout))
    if store is not None:
        kwargs["store"] = store
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    return Context(rank, world_size, local_rank, backend, device, launcher)


def _spawned_entry(rank, world_size, store_port, worker, args):
    faulthandler.enable()  # a rank killed by a signal (SIGSEGV, SIGBUS) prints where it was
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads or max(1, _usable_cpus() // world_size)))
    code = 1
    try:
        ctx = _setup_rank(args, rank, world_size, rank, world_size, "spawn",
                          store=connect_store(store_port, args.timeout))
        code = int(worker(ctx, args) or 0)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(f"[rank {rank}] {e.code}", file=sys.stderr, flush=True)
            code = 1
    except BaseException:  # noqa: BLE001 - reported, then a non-zero exit
        print(f"[rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code = 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown of gloo/cuda threads


def launch(worker, args):
    """Run ``worker(ctx, args)`` on every rank; return the process exit code (0 = success).

    Under torchrun this process is one rank. Otherwise ``args.nranks`` processes are spawned
    (worker must be a module-level function); if one fails, the others are given a few seconds
    and then killed, so a broken run never hangs.
    """
    if launched_by_torchrun():
        ctx = _setup_rank(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                          int(os.environ["LOCAL_RANK"]),
                          int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
                          "torchrun")
        try:
            return int(worker(ctx, args) or 0)
        finally:
            dist.destroy_process_group()

    if args.nranks < 1:
        raise SystemExit("--nranks must be at least 1")
    store = rendezvous_store()  # the ranks meet on it: no port picked and released (launch.py)
    procs = start_ranks(_spawned_entry, args.nranks, store, (worker, args))
    code = wait_for_exit_codes(procs, grace_s=10)
    del store
    return code


# -- output ---------------------------------------------------------------------------------------
def print0(ctx, *parts, file=None, **kwargs):
    """print on rank 0 only, flushed."""
    if ctx.rank == 0:
        print(*parts, file=file or sys.stdout, flush=True, **kwargs)


class Progress:
    """Rank-0 progress lines on stderr, at most one every `every` seconds (plus forced ones)."""

    def __init__(self, ctx, enabled=True, every=2.0):
        self.enabled = enabled and ctx.rank == 0
        self.every = every
        self.start = time.monotonic()
        self.last = -1e9

    def __call__(self, message, force=False):
        if not self.enabled:
            return
        now = time.monotonic()
        if force or now - self.last >= self.every:
            self.last = now
            print(f"[{now - self.start:7.1f}s] {message}", file=sys.stderr, flush=True)


def write_json(path, obj):
    """Write `obj` as indented JSON, atomically (temp file + rename); creates parent folders."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def ensure_parent(path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


# -- machine description --------------------------------------------------------------------------
def _git_commit():
    try:
        out = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def collect_meta(ctx, argv=None, extra=None):
    """Machine and run description; a collective (all ranks must call it)."""
    mine = {"hostname": socket.gethostname(), "pid": os.getpid(), "rank": ctx.rank,
            "device": str(ctx.device),
            "gpu": torch.cuda.get_device_name(ctx.device) if ctx.is_cuda else None}
    ranks = [None] * ctx.world_size
    dist.all_gather_object(ranks, mine)
    try:
        import fused_reducer
        build = fused_reducer.build_info()
    except Exception as e:  # noqa: BLE001
        build = {"error": f"{type(e).__name__}: {e}"}
    hosts = sorted({r["hostname"] for r in ranks})
    gpus = sorted({r["gpu"] for r in ranks if r["gpu"]})
    meta = {
        "hostname": hosts[0] if len(hosts) == 1 else ",".join(hosts),
        "hosts": hosts,
        "cpu_count": os.cpu_count(),
        "usable_cpus": _usable_cpus(),
        "cpu_model": _cpu_model(),
        "threads_per_rank": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "gpu": gpus[0] if len(gpus) == 1 else (", ".join(gpus) or None),
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "launcher": ctx.launcher,
        "device_type": ctx.device.type,
        "ranks": ranks,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "fused_reducer_build": build,
        "git_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + list(argv if argv is not None else sys.argv)),
    }
    if extra:
        meta.update(extra)
    return meta


def meta_label(meta):
    """One line for plot titles: machine, world size, backend, date."""
    where = meta.get("gpu") or meta.get("cpu_model") or "cpu"
    return (f"{meta['hostname']} ({where}, {meta['usable_cpus']} cores) - world {meta['world_size']} "
            f"{meta['backend']} - torch {meta['torch_version']} - {meta['date'][:10]}")

