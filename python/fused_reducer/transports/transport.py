"""Choosing how buckets move: NCCL directly (CUDA builds, CUDA parameters), shared memory (CPU
parameters, every rank on one host and in one PID namespace), or any process group."""
import math
import os
import re
import socket
import uuid
from datetime import timedelta
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from .. import _C

BACKENDS = ("auto", "nccl", "shm", "process_group")
# Per slot; a bucket is summed in chunks of this size (Note [Shared-memory all-reduce]). The segment
# is 2 x (world + 1) slots, mapped by every rank and resident in each rank's RSS once a bucket has
# run through it: 256 KiB keeps it at 1.5 MiB for 2 ranks (4 MiB chunks made it 24 MiB, and
# FusedReducer's resident memory 1.07-1.12x DDP's on a 96 MiB-gradient model; issue 22). It is
# also among the fastest sizes on a 2-core EPYC VM (a chunk's slots stay in L2): 64 MiB summed in
# 15-20 ms, 17-18 with 512 KiB, 23 with 1 MiB, 39 with 4 MiB (docs/archive/PERFORMANCE_LOG.md).
SHM_CHUNK_BYTES = 256 << 10
_SHM_MIN_CHUNK_BYTES = 256 << 10
# The longest timeout: longer ones (inf, timedelta.max) mean "no timeout" and become this (the
# same as kLongestTimeout in ext/shm_segment.h, where every conversion to milliseconds clamps).
MAX_TIMEOUT_S = 365 * 24 * 3600.0


def timeout_seconds(timeout):
    """A user's timeout (timedelta or seconds) as float seconds for every transport: inf,
    timedelta.max and anything over a year mean "no timeout" and become MAX_TIMEOUT_S (a wait
    turns it into a finite deadline; converted as given, they overflowed and every all-reduce
    failed at once). NaN, zero and negative values raise ValueError."""
    try:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    except (TypeError, ValueError):
        raise ValueError(f"timeout must be a timedelta or a number of seconds, got "
                         f"{timeout!r}") from None
    if math.isnan(seconds) or not seconds > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return min(seconds, MAX_TIMEOUT_S)


def group_timeout(group, device):
    """The timeout `group` was made with (init_process_group(timeout=...), new_group, the
    Trainer's ddp_timeout): how long DDP's collectives wait. Torch's default for the group's
    backend where the group does not say."""
    try:
        backend = group._get_backend(torch.device(device))
        backend = getattr(backend, "wrapped_pg", backend)  # TORCH_DISTRIBUTED_DEBUG=DETAIL
        timeout = backend.options._timeout
        if timeout.total_seconds() > 0:
            return timeout
    except (AttributeError, RuntimeError):
        pass
    return dist.distributed_c10d._get_default_timeout(dist.get_backend(group))


def nccl_built():
    return bool(_C.BUILD_INFO["cuda"])


# -- the transports, in the order backend='auto' considers them ----------------------------------
class Backend(NamedTuple):
    """One transport as `backend=` names it. `picks(device)`: whether backend='auto' takes it
    for parameters on `device` (the first in TRANSPORTS that does). `refuse(device)`: for an
    explicit choice, the error to raise, or None when it may be used. `make(group, device,
    timeout_s, check_devices)`: (transport, None), or (None, why) when it cannot be used here
    (then 'auto' takes the next one that picks the device; the explicit choice raises). The C++
    side registers itself by the same name (ext/transport_registry.h); docs/DESIGN.md,
    "Extension points", is the recipe for adding one."""
    picks: Callable[[torch.device], bool]
    refuse: Callable[[torch.device], Optional[Exception]]
    make: Callable


def _refuse_nccl(device):
    if not nccl_built():
        return RuntimeError(
            "backend='nccl' needs a CUDA build of fused_reducer, but this one was built "
            "without CUDA (fused_reducer.build_info()['cuda'] is False); rebuild with a CUDA "
            "toolkit and a CUDA build of torch, or use backend='process_group'")
    if device.type != "cuda":
        return ValueError(
            f"backend='nccl' needs parameters on a CUDA device, but they are on {device}; "
            "move the model to CUDA first, or use backend='process_group'")
    return None


def _refuse_shm(device):
    if device.type != "cpu":
        return ValueError(
            f"backend='shm' sums CPU buckets through shared memory, but the parameters are on "
            f"{device}; use backend='auto' (NCCL for CUDA) or backend='process_group'")
    return None


def _make_nccl(group, device, timeout_s, check_devices):
    return nccl_transport(group, device, timeout_s, check_devices), None


def _make_shm(group, device, timeout_s, check_devices):
    return shm_transport(group, timeout_s)


def _make_process_group(group, device, timeout_s, check_devices):
    return process_group_transport(group, timeout_s), None


TRANSPORTS = {
    "nccl": Backend(picks=lambda device: device.type == "cuda" and nccl_built(),
                    refuse=_refuse_nccl, make=_make_nccl),
    "shm": Backend(picks=lambda device: device.type == "cpu", refuse=_refuse_shm, make=_make_shm),
    "process_group": Backend(picks=lambda device: True, refuse=lambda device: None,
                             make=_make_process_group),
}
BACKENDS = ("auto",) + tuple(TRANSPORTS)


def registered_transport(name, **fields):
    """The C++ transport registered as `name` (ext/transport_registry.h), made from `fields`
    (group, id, create, rank, world_size, device, chunk_bytes, timeout_seconds: each transport
    reads those it needs)."""
    args = _C.TransportArgs()
    for field, value in fields.items():
        setattr(args, field, value)
    return _C.make_registered_transport(name, args)


def _auto_choices(device, start=None):
    """The transports 'auto' tries for `device`, in order (from `start` on, when given)."""
    names = [name for name, backend in TRANSPORTS.items() if backend.picks(device)]
    return names[names.index(start):] if start in names else names


def resolve_backend(backend, device):
    """The transport to try: 'auto' -> 'nccl' for CUDA parameters in a CUDA build, 'shm' for CPU
    parameters (make_transport falls back to 'process_group' when the ranks do not share a
    host), else 'process_group'. An explicit choice is checked against the device."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return _auto_choices(device)[0]
    refused = TRANSPORTS[backend].refuse(device)
    if refused is not None:
        raise refused
    return backend


def make_transport(group, device, backend="auto", timeout_s=600.0, check_devices=True):
    """The transport a FusedReducer (or the bandwidth benchmark) reduces buckets with.

    For NCCL, rank 0 of `group` makes the communicator id and shares it with a broadcast over
    `group` (staged on `device` when the group is an NCCL group, so no rank touches another
    GPU); every rank then joins on `device` (raises after `timeout_s` if a rank never joins).
    For shm, the ranks agree through the group's store; with backend='auto' a group whose ranks
    cannot share memory (several hosts, no room in /dev/shm) or watch each other's processes
    (several PID namespaces, no /proc) gets the process group instead, with backend='shm' it
    raises.
    """
    device = torch.device(device)
    requested = backend
    backend = resolve_backend(backend, device)
    # An explicit choice is tried alone; 'auto' goes down its list (every rank alike: a make
    # returns the same kind of answer on every rank).
    for name in ([backend] if requested != "auto" else _auto_choices(device, backend)):
        transport, why_not = TRANSPORTS[name].make(group, device, timeout_s, check_devices)
        if transport is not None:
            return transport
        if requested == name:
            raise RuntimeError(f"FusedReducer: backend='{name}' cannot be used: {why_not}; use "
                               "backend='process_group' (or 'auto', which falls back to it)")
    raise AssertionError("unreachable: the process group picks every device")


def nccl_transport(group, device, timeout_s, check_devices=True):
    """The NCCL transport on `device`: rank 0's unique id broadcast over `group`, every rank
    joining (raises after `timeout_s` if one never does)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if check_devices:
        check_one_rank_per_gpu(group, device)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    box = [_C.nccl_unique_id() if rank == 0 else None]
    staging = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group,
                               device=staging)
    return registered_transport("nccl", id=box[0], rank=rank, world_size=world,
                                device=device.index, timeout_seconds=timeout_s)


def process_group_transport(group, timeout_s):
    """A transport over `group` itself. Collective (over the store): the ranks of this host tell
    each other their pids, so that an error names a peer whose process has exited (gloo names
    only its address; Note [Naming a dead peer over a process group])."""
    transport = registered_transport("process_group", group=group)
    if dist.get_world_size(group) > 1:
        rank, host = dist.get_rank(group), process_host()
        peers = [text.rsplit("\t", 1)
                 for text in exchange(group, "pg-peers", f"{host}\t{os.getpid()}", timeout_s)]
        transport.set_peer_processes([(r, int(pid)) for r, (h, pid) in enumerate(peers)
                                      if h == host and r != rank])
    return transport


def process_host():
    """Where this process's pids mean something: the host and its PID namespace (0: unknown,
    no /proc). Ranks in containers on one host (sharing /dev/shm, e.g. docker --ipc=host) see
    each other's pids only within one namespace, and a peer whose pid cannot be seen cannot be
    watched."""
    return f"{socket.gethostname()}\t{_pid_namespace()}"


def backend_of(transport):
    """'nccl', 'shm' or 'process_group': which kind of transport this is."""
    name = transport.name
    return "process_group" if name.startswith("process_group") else name.split("(")[0]


def shm_transport(group, timeout_s, chunk_bytes=SHM_CHUNK_BYTES):
    """(ShmTransport, None) when every rank of `group` maps one shared segment, else (None, why).
    Collective over the group's store; every rank returns the same kind of answer, whatever
    fails on whichever rank (nothing may leave a peer waiting for an exchange)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    hosts = [text.split("\t") for text in exchange(group, "shm-host", process_host(), timeout_s)]
    if len({host for host, _ in hosts}) > 1:
        return None, f"the ranks are on several hosts ({', '.join(sorted({h for h, _ in hosts}))})"
    # A peer whose process a rank cannot see die (killed, os._exit) would go unnoticed until
    # the timeout.
    namespaces = {namespace for _, namespace in hosts}
    if len(namespaces) > 1:
        return None, ("the ranks of this host are in different PID namespaces (containers "
                      "sharing /dev/shm), so a rank could not see a peer's process die")
    if "0" in namespaces:
        return None, ("the PID namespace cannot be read (no /proc/self/ns/pid), so a rank "
                      "could not see a peer's process die")
    created, transport = "", None
    if rank == 0:
        try:
            sweep_dead_segments()
            chunk, why_not = _shm_chunk_bytes(world, chunk_bytes)
            if chunk is None:
                raise RuntimeError(why_not)
            name = f"/{shm_name_prefix()}{uuid.uuid4().hex[:12]}"
            transport = registered_transport("shm", id=name, create=True, rank=0,
                                             world_size=world, chunk_bytes=chunk,
                                             timeout_seconds=timeout_s)
            created = f"{name}\t{chunk}"
        except Exception as e:  # noqa: BLE001 - every rank must get an answer
            created = f"!rank 0: {e}"
    outcomes = None
    try:
        created = exchange(group, "shm-create", created, timeout_s)[0]
        if created.startswith("!"):
            return None, created[1:]
        outcome = "ok"
        if rank != 0:
            try:
                name, chunk = _parse_created(created)
                transport = registered_transport("shm", id=name, rank=rank, world_size=world,
                                                 chunk_bytes=chunk, timeout_seconds=timeout_s)
            except Exception as e:  # noqa: BLE001 - every rank must get an answer
                transport, outcome = None, f"rank {rank}: {e}"
        outcomes = exchange(group, "shm-attach", outcome, timeout_s)
    finally:
        if rank == 0 and transport is not None:
            transport.unlink()  # every rank has mapped it or given up (or the store failed)
    failures = [o for o in outcomes if o != "ok"]
    if failures:
        if transport is not None:
            transport.close(0.0)
        return None, failures[0]
    transport.start_peer_checks()
    return transport, None


def _parse_created(text):
    """(name, chunk_bytes) from rank 0's 'name<TAB>chunk'; ValueError naming the value if it is
    not one (another writer of the store's key, or another version of fused_reducer)."""
    parts = text.split("\t")
    if (len(parts) != 2 or not parts[0].startswith("/fused_reducer_") or "/" in parts[0][1:]
            or not parts[1].isdigit()):
        raise ValueError(f"rank 0's shared-memory segment arrived malformed through the store: "
                         f"{text[:80]!r}")
    return parts[0], int(parts[1])


# -- sizing and cleaning /dev/shm -------------------------------------------------------------
# A run reserves at most this share of /dev/shm's size, and of its free space: a container's
# default 64 MiB is shared with the DataLoader workers (their batches travel through it) and with
# other jobs on the host.
SHM_SHARE_OF_SIZE = 1 / 8
SHM_SHARE_OF_FREE = 1 / 4
_SHM_DIR = "/dev/shm"
_SHM_NAME = re.compile(r"fused_reducer_(\d+)_(\d+)_[0-9a-f]{12}$")


def shm_chunk_for(world, preferred, size, free):
    """(chunk, None): the largest chunk up to `preferred` (halving, down to 256 KiB or
    `preferred` if smaller) whose two sets of world + 1 slots fit in SHM_SHARE_OF_SIZE of /dev/shm's
    `size` and SHM_SHARE_OF_FREE of its `free` bytes; else (None, why)."""
    budget = min(int(size * SHM_SHARE_OF_SIZE), int(free * SHM_SHARE_OF_FREE))
    chunk, floor = preferred, min(preferred, _SHM_MIN_CHUNK_BYTES)
    while chunk > floor and 2 * (world + 1) * chunk > budget:
        chunk //= 2
    if 2 * (world + 1) * chunk <= budget:
        return chunk, None
    needs = 2 * (world + 1) * floor
    return None, (f"/dev/shm is too small for {world} ranks: the segment needs {needs >> 10} KiB, "
                  f"and a run takes at most 1/{round(1 / SHM_SHARE_OF_SIZE)} of its size "
                  f"({size >> 20} MiB) and 1/{round(1 / SHM_SHARE_OF_FREE)} of its free space "
                  f"({free >> 20} MiB), leaving the rest to DataLoader workers and other jobs; "
                  "give the container more shared memory (e.g. docker run --shm-size=1g)")


def _shm_chunk_bytes(world, preferred):
    """shm_chunk_for() with /dev/shm's own size and free space."""
    try:
        stat = os.statvfs(_SHM_DIR)
    except OSError as e:
        return None, f"cannot read the size of {_SHM_DIR} (statvfs failed: {e})"
    return shm_chunk_for(world, preferred, stat.f_blocks * stat.f_frsize,
                         stat.f_bavail * stat.f_frsize)


def _pid_namespace():
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def shm_name_prefix(pid=None):
    """Segment names are fused_reducer_<pid namespace>_<creator pid>_<random>: a later run can
    tell which ones a dead process of its own left behind (sweep_dead_segments)."""
    return f"fused_reducer_{_pid_namespace()}_{os.getpid() if pid is None else pid}_"


def _process_exited(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


def sweep_dead_segments(directory=_SHM_DIR):
    """Remove the segments that this user's dead processes left: a rank 0 killed (SIGKILL, or
    torchrun stopping the job) after creating a segment and before every rank mapped it (then
    its name is removed) leaves it in /dev/shm. Only names of this pid namespace, owned by this
    user, whose creating process has exited. Returns the names removed."""
    namespace = _pid_namespace()
    try:
        names = os.listdir(directory) if namespace else []
    except OSError:
        return []
    removed = []
    for name in names:
        match = _SHM_NAME.match(name)
        if match is None or int(match.group(1)) != namespace:
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid != os.geteuid() or not _process_exited(int(match.group(2))):
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
    return removed


def control_allreduce(values, op, group, device):
    """All-reduce a few numbers (float64) across `group` with `op`, staged on `device` (the
    model's control device: the rank's GPU for an NCCL group, which has no CPU backend, else
    the CPU); returns them as a list. The library's own small agreements go through here."""
    agreed = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=op, group=group)
    return agreed.tolist()


# -- one rank per GPU -------------------------------------------------------------------------


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
    identities = [tuple(text.split("\t"))
                  for text in exchange(group, "gpu_identity", "\t".join(identity))]
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


# -- agreeing through the store -----------------------------------------------------------------
_exchange_rounds = {}  # per (group, topic): exchanges so far (the same sequence on every rank)


def exchange(group, topic, text, timeout_s=None):
    """Every rank's `text`, in rank order, through the group's store: works for any backend and
    on any device, before a communicator exists. Collective over `group`. With `timeout_s`, a
    rank that does not arrive within it (dead, or not constructing FusedReducer) makes the others
    raise naming it, instead of waiting for the store's own timeout."""
    store = _group_store(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    key = dist.distributed_c10d._get_process_group_name(group) if hasattr(
        dist.distributed_c10d, "_get_process_group_name") else str(id(group))
    token = attempt_token(group, key, store, topic, timeout_s)
    round_ = _exchange_rounds.get((key, token, topic), 0)
    _exchange_rounds[(key, token, topic)] = round_ + 1
    prefix = f"fused_reducer/{token}/{topic}/{key}/{round_}/"
    store.set(prefix + str(rank), text)
    keys = [prefix + str(r) for r in range(world)]
    if timeout_s is not None:
        try:
            store.wait(keys, timedelta(seconds=min(timeout_s, MAX_TIMEOUT_S)))
        except Exception as e:  # noqa: BLE001 - the store's timeout, or a store gone with its host
            raise _absent(store, keys, topic, timeout_s, e) from None
    return [store.get(key).decode() for key in keys]


def _absent(store, keys, topic, timeout_s, error):
    """The error naming the ranks whose key in `keys` is missing after a timeout."""
    missing = [r for r, key in enumerate(keys) if not _stored(store, key)]
    return RuntimeError(
        f"FusedReducer: rank(s) {missing or '?'} of the group did not reach the {topic!r} "
        f"exchange within {timeout_s:.0f} s (timeout=): a peer may have died, or not every rank "
        f"constructs FusedReducer ({type(error).__name__}: {error})")


_attempt_tokens = {}  # per group name: (the group, this attempt's namespace, agreed by its ranks)


def attempt_token(group, key, store, topic, timeout_s):
    """The namespace of this attempt's keys in the group's store. torchrun's store outlives the
    workers it restarts, so an attempt's keys must differ from a dead attempt's (whose values
    would be read as this one's: a segment name of a dead attempt made backend='auto' fall back,
    or a rank wait forever). torchrun's restart count alone is not enough: it is each agent's
    own, and an agent that restarts for another node's failure (a membership change) keeps its
    count, so two nodes can disagree (seen with two agents: scripts/restart_study.py). So under
    torchrun's agent store, where the group moves CPU tensors (gloo), once per group and process: every rank announces itself
    in the store (an absent rank is named within `timeout_s`, like the exchange, and no
    collective is left waiting for it), then rank 0's draw is summed over the group (a sum
    completes on no rank unless all took part). A group of NCCL alone (whose first collective
    would create the communicator that check_one_rank_per_gpu must come before) keeps the
    restart count."""
    cached = _attempt_tokens.get(key)
    if cached is not None and cached[0] is group:  # group names repeat after a re-init
        return cached[1]
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    config = (dist.get_backend_config(group) if hasattr(dist, "get_backend_config")
              else dist.get_backend(group))
    # Only torchrun's agent store outlives an attempt; elsewhere there is nothing to tell apart,
    # and no collective is added to construction.
    if "gloo" not in str(config) or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        _attempt_tokens[key] = (group, restart)
        return restart
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # Deleted once the sum is done, so a later attempt finds none of them (a key of a process
    # that died inside these few lines can remain: the sum's own timeout then bounds the wait).
    present = [f"fused_reducer/present/{key}/{r}" for r in range(world)]
    store.set(present[rank], str(os.getpid()))
    wait = timedelta(seconds=min(timeout_s, MAX_TIMEOUT_S)) if timeout_s is not None else None
    try:
        store.wait(present, wait) if wait is not None else store.wait(present)
    except Exception as e:  # noqa: BLE001 - the store's timeout, or a store gone with its host
        raise _absent(store, present, topic, timeout_s or 0, e) from None
    drawn = torch.tensor([int.from_bytes(os.urandom(7), "little") if rank == 0 else 0
                          for _ in range(2)], dtype=torch.int64)
    work = dist.all_reduce(drawn, group=group, async_op=True)
    try:
        work.wait(wait) if wait is not None else work.wait()
    except Exception as e:  # noqa: BLE001 - gloo's timeout, or a peer gone
        raise RuntimeError(
            f"FusedReducer: the ranks of the group did not agree on a namespace for the "
            f"{topic!r} exchange ({type(e).__name__}: {e}): a peer may have died") from None
    try:
        store.delete_key(present[rank])
    except Exception:  # noqa: BLE001 - a store without delete_key: the key only names a rank
        pass
    token = f"{int(drawn[0]):x}{int(drawn[1]):x}"  # rank 0's draw: the same on every rank
    _attempt_tokens[key] = (group, token)
    return token


def _stored(store, key):
    try:
        return store.check([key])
    except Exception:  # noqa: BLE001 - the store itself is gone: nothing can be known
        return True


def _group_store(group):
    try:
        return dist.distributed_c10d._world.pg_map[group][1]
    except (AttributeError, KeyError):
        return dist.distributed_c10d._get_default_store()
