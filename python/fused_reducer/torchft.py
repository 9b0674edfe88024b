"""FusedReducer as the reducer of torchft replica groups (fault-tolerant data parallelism).

    import torchft
    from fused_reducer.torchft import DistributedDataParallel, Optimizer, state_dict_fns

    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), min_replica_size=1,
                              use_async_quorum=False, load_state_dict=None, state_dict=None, ...)
    model = DistributedDataParallel(manager, module, first_bucket_mb=1)   # was torchft's DDP
    optimizer = Optimizer(manager, torch.optim.AdamW(model.parameters()))
    manager.register_state_dict_fn("fused_reducer", *state_dict_fns(model, optimizer))

``DistributedDataParallel(manager, module, **kwargs)`` mirrors ``torchft.DistributedDataParallel``
and takes FusedReducer's keywords. Each bucket goes through ``manager.allreduce`` (a SUM over
the quorum's replica groups divided by the number of participants; a healing replica contributes
zeros) as soon as it is complete, while backward goes on; the reducer waits for the buckets once,
at the end of backward (torchft's DDP waits inside the hook, bucket by bucket). An error in any
bucket is swallowed and recorded by the Manager: every later bucket of the step is left
unreduced, and ``should_commit()`` returns False, so the optimizer wrapper skips the step.

``Optimizer`` is torchft's own wrapper (``torchft.Optimizer``): it only calls
``manager.start_quorum()`` in ``zero_grad()`` and ``manager.should_commit()`` before ``step()``,
whatever the model is.

The bucket layout must be the same on every replica group at every step, rebuilds included:
each forward first agrees the limits (``bucket_caps_bytes``, ``last_bucket_bytes``,
``reduce_dtype``), the pending rebuild and the parameter order with quorum rank 0 through the
Manager, rank 0's winning (Note [Layout agreed through the quorum]).
``state_dict_fns(model, optimizer)`` gives the (load_state_dict, state_dict) pair for the
Manager; the state a healing replica receives carries the model, the optimizer, the reducer's
limits and the parameter order of its next layout, and loading it makes the next forward
rebuild exactly that layout (or, if the limits are changed after the heal and before that
forward, the layout of the new limits from that order, as on every replica).

A replica group of several ranks (``process_group``, by default the default group that torchrun
gives each replica group; every rank has its own Manager, ``Manager(rank=group rank,
world_size=group size)``): each bucket is reduced inside the group over its process group and
across groups by each rank's Manager, which joins the same group rank of every replica group
(``GroupReduction``, below). Synchronous quorum only (``use_async_quorum=False``: the heal is
applied before the forward, so the healing replica's first backward already has the others'
layout). See docs/FAULT_TOLERANCE.md.
"""
import collections
import functools
import inspect
import logging
import math
import statistics
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from .core.validation import health_option_names, health_settings
from .core.wrapper import FusedReducer
from .errors import FusedReducerError, NonFiniteGradientError
from .transports import elastic

log = logging.getLogger(__name__)

_EXTRA_HINT = ("pip install fused_reducer[ft] (or: pip install --no-build-isolation .[ft] from a "
               "checkout), which installs torchft==0.2.0")


def _import_torchft():
    try:
        import torchft
    except ImportError as e:
        raise ImportError(f"fused_reducer.torchft needs torchft: {_EXTRA_HINT}") from e
    return torchft


_torchft = _import_torchft()
from torchft.work import _DummyWork  # noqa: E402  (torchft's completed work after an error)
from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY  # noqa: E402

__all__ = ["DistributedDataParallel", "Optimizer", "OptimizerWrapper", "fault_tolerant_hook",
           "GroupReduction", "group_hook", "GROUP_REDUCTIONS", "DEFAULT_GROUP_REDUCTION",
           "state_dict_fns", "reducer_state", "load_reducer_state", "forget_dead_attempt_keys"]

Optimizer = _torchft.Optimizer  # torchft.optim.OptimizerWrapper: works with any module
OptimizerWrapper = Optimizer

# Keywords refused: each would let replicas change their layout or reduction on their own.
_REFUSED = {
    "autotune": "the autotuner changes the bucket limits from this replica's own timings, so "
                "replica groups would lay out their buckets differently; set the limits "
                "explicitly (first_bucket_mb, bucket_cap_mb, last_bucket_mb)",
    "skip_all_reduce_unused_params": "which parameters are skipped is decided from one "
                                     "replica's first step and is not carried to a healing one",
    "bucket_cap_mb_list": "not supported here yet: pass bucket_cap_mb / first_bucket_mb "
                          "(bucket_caps_bytes can be set after construction)",
}


def _torchft_async_quorum(manager):
    """Whether `manager` runs its quorum asynchronously (torchft keeps the flag private)."""
    return bool(getattr(manager, "_use_async_quorum", True))


def _reducer_of(model):
    """The C++ reducer of `model`, through its attachment."""
    attachment = model.attachment
    if attachment is None:
        raise FusedReducerError("fused_reducer.torchft: the model's reducer is closed")
    return attachment.reducer


def _replica_group(process_group):
    """The replica group's own process group: the one given, the default one (what torchrun
    starts for a replica group), or, with neither, a world of one (nothing to rendezvous with)."""
    if process_group is not None:
        return process_group
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def _collective_of(work):
    """The process group's work inside a Manager work (torchft keeps it as ``_work``)."""
    inner = getattr(work, "_work", None)
    if inner is None:
        raise FusedReducerError(
            "fused_reducer.torchft: torchft's managed work does not hold its process group's "
            f"work (this module reads torchft 0.2.0; installed: {_torchft_version()})")
    return inner


def _torchft_version():
    try:
        from importlib.metadata import version
        return version("torchft")
    except Exception:  # noqa: BLE001 - only for a message
        return "unknown"


def _managed_future(manager, work, tensor, participants):
    """A torch Future of the averaged `tensor` for a Manager work, without waiting.

    torchft 0.2.0's ``_ManagedWork`` builds its future chain (the division by the number of
    participants, ``manager.wrap_future``'s timeout and error capture) only in ``wait()`` or
    ``synchronize()``, and that chain assumes the collective has already completed: its
    continuation reads a loop variable that has moved on by the time an incomplete collective
    completes (the tail's callback is None: AssertionError in torchft/manager.py). So the
    same chain is built here on the process group's work: SUM, divide by the step's number of
    participants, then ``manager.wrap_future`` (public): a failure or a timeout is recorded
    by the Manager (``should_commit()`` then returns False) and the future completes with the
    unreduced buffer. After an error the Manager returns a ``_DummyWork``, already complete."""
    if isinstance(work, _DummyWork):
        return work.get_future()

    def average(fut):
        fut.value()  # raises the collective's error, for wrap_future to record
        tensor.div_(participants)
        return tensor

    return manager.wrap_future(_collective_of(work).get_future().then(average), tensor)


def fault_tolerant_hook(manager, bucket):
    """The communication hook: the bucket through ``manager.allreduce`` (average over the step's
    participants; zeros from a replica that is not participating), its future returned at once
    so that the next buckets go out while backward continues."""
    tensor = bucket.buffer()
    work = manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM)
    return _managed_future(manager, work, tensor, manager.num_participants())


# -- replica groups of several ranks -----------------------------------------------------------
# How a bucket is reduced in a replica group of several ranks:
#   "all_reduce":     all-reduce inside the group, the fault-tolerant all-reduce of the whole
#                     bucket across groups;
#   "reduce_scatter": reduce-scatter inside the group, the fault-tolerant all-reduce of this
#                     rank's 1/N shard across groups, all-gather inside the group (1/N of the
#                     bytes across groups, where the links are usually the slowest).
# The default is the faster one measured (bench/ft_groups_bench.py, docs/FAULT_TOLERANCE.md):
# on gloo a reduce-scatter plus an all-gather cost about twice an all-reduce, more than the
# shard saves across groups.
GROUP_REDUCTIONS = ("all_reduce", "reduce_scatter")
DEFAULT_GROUP_REDUCTION = "all_reduce"


def _check_group_reduction(method):
    if method not in GROUP_REDUCTIONS:
        raise FusedReducerError(
            f"fused_reducer.torchft: group_reduction must be one of {GROUP_REDUCTIONS}, "
            f"got {method!r}")


class GroupReduction:
    """The reduction of one rank of a replica group of several ranks, as the comm hook's state.

    Every bucket's chain (inside, across, inside) runs on one worker thread, bucket after bucket
    in launch order: every rank then issues its group's collectives and its Manager's in the
    same order (gloo matches collectives by their order), and backward goes on while the worker
    reduces; the reducer waits for the buckets once, at the end of backward.

    The average is over the step's global batch: the sum over the participating groups' ranks
    divided by ``num_participants() * group size`` (a healing group contributes zeros: its
    Manager zeroes its tensor). Every tensor that crosses groups carries one more element, the
    group's size, so a quorum of groups of different sizes (whose average would be wrong) is
    caught at every step: the sum of sizes must be ``num_participants() * group size``."""

    def __init__(self, manager, group, method=DEFAULT_GROUP_REDUCTION):
        _check_group_reduction(method)
        self.manager = manager
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.method = method
        self._worker = ThreadPoolExecutor(max_workers=1,
                                          thread_name_prefix="fused_reducer_ft_group")

    def launch(self, flat):
        """A Future of the averaged `flat` (a bucket), reduced on the worker thread."""
        result = torch.futures.Future()
        self._worker.submit(self._reduce, flat, result)
        return result

    def close(self):
        self._worker.shutdown(wait=False)

    def _reduce(self, flat, result):
        try:
            if self.method == "reduce_scatter":
                result.set_result(self._reduce_scatter_chain(flat))
            else:
                result.set_result(self._all_reduce_chain(flat))
        except BaseException as e:  # noqa: BLE001 - raised by the reducer at the end of backward
            result.set_exception(e)

    def _all_reduce_chain(self, flat):
        wire = flat.new_empty(flat.numel() + 1)
        wire[:-1].copy_(flat)
        wire[-1] = 1  # every rank counts itself: the group's sum is its size
        self._inside(dist.all_reduce, wire)
        self._across(wire)
        return wire[:-1]

    def _reduce_scatter_chain(self, flat):
        numel, size = flat.numel(), self.group_size
        shard_numel = math.ceil(numel / size)
        if shard_numel * size == numel:
            whole = flat  # no copy: reduce-scattered from, and all-gathered into, the bucket
        else:
            whole = flat.new_zeros(shard_numel * size)
            whole[:numel].copy_(flat)
        wire = flat.new_empty(shard_numel + 1)
        self._inside(dist.reduce_scatter_single, wire[:-1], whole)
        wire[-1] = size
        self._across(wire)
        self._inside(dist.all_gather_single, whole, wire[:-1])
        return whole[:numel]

    def _inside(self, collective, *tensors):
        try:
            collective(*tensors, group=self.group)
        except Exception as e:
            error = FusedReducerError(
                "fused_reducer.torchft: a collective inside this replica group failed (a rank of "
                f"the group died or stopped answering: {e}); the group cannot go on with that "
                "process group: restart the whole replica group (torchrun does), it then heals "
                "from a live group")
            self.manager.report_error(error)
            raise error from e

    def _across(self, wire):
        """The fault-tolerant all-reduce (SUM, then divided by the global number of ranks) of
        `wire` across the groups, waited for; then the group-size check."""
        manager = self.manager
        work = manager.allreduce(wire, reduce_op=dist.ReduceOp.SUM)
        participants = manager.num_participants()
        _managed_future(manager, work, wire, participants * self.group_size).wait()
        if manager.errored() is not None:
            return  # the step will not be committed; the buffer is unreduced
        ranks = wire[-1].item() * participants * self.group_size
        if round(ranks) != participants * self.group_size:
            error = FusedReducerError(
                f"fused_reducer.torchft: the {participants} participating replica groups have "
                f"{ranks:g} ranks in all, but this group has {self.group_size}: every replica "
                "group must have the same number of ranks (the same --nproc-per-node for every "
                "torchrun), or the average would be wrong")
            manager.report_error(error)
            raise error


def group_hook(reduction, bucket):
    """The communication hook of a replica group of several ranks (state: its
    GroupReduction)."""
    return reduction.launch(bucket.buffer())


class DistributedDataParallel(FusedReducer):
    """``torchft.DistributedDataParallel(manager, module)`` with FusedReducer as the reducer:
    every keyword is FusedReducer's (``first_bucket_mb``, ``bucket_cap_mb``, ``last_bucket_mb``,
    ``reduce_dtype``, ...). ``process_group``: the replica group's own (default: the default
    group, what torchrun starts for the group); with more than one rank, ``group_reduction``
    (one of GROUP_REDUCTIONS) says how a bucket is reduced inside and across groups. See the
    module's docstring."""

    sharded_optimizer_refusal = (
        "ShardedOptimizer cannot be used with fused_reducer.torchft.DistributedDataParallel: "
        "its shards would span torchft replica groups, whose membership changes at every "
        "quorum (a dead group takes its shard of the optimizer state with it, and a healing "
        "group receives whole-model state); sharding within a replica group of several ranks "
        "is not supported yet either. Use a plain optimizer wrapped in "
        "fused_reducer.torchft.Optimizer(manager, optimizer): every rank keeps the whole "
        "optimizer state, and healing copies it.")

    def __init__(self, manager, module, process_group=None,
                 group_reduction=DEFAULT_GROUP_REDUCTION, replica_id=None, **kwargs):
        _check_group_reduction(group_reduction)  # also where a one-rank group does not use it
        for name, why in _REFUSED.items():
            if kwargs.get(name):
                raise FusedReducerError(
                    f"fused_reducer.torchft.DistributedDataParallel: {name} is refused under a "
                    f"changing quorum: {why}")
        if _torchft_async_quorum(manager):
            raise FusedReducerError(
                "fused_reducer.torchft.DistributedDataParallel needs Manager(..., "
                "use_async_quorum=False): with an asynchronous quorum a healing replica loads "
                "the live state only in should_commit(), after a backward whose buckets were "
                "laid out before the heal, so its collectives would not match the others'")
        # Every replica initialises its own parameters; the Manager heals the differences
        # (torchft's DDP too skips DDP's initial broadcast). Inside a replica group of several
        # ranks, DDP's initial broadcast would be the group's own: the Manager's heal covers it.
        kwargs.setdefault("init_sync", False)
        if any(p.is_cuda for p in module.parameters()):
            # Every bucket goes through the Manager's process group (torchft's NCCL one), so the
            # reducer's own transport never reduces: the plain process group's, not a second
            # NCCL communicator on the device beside torchft's.
            kwargs.setdefault("backend", "process_group")
        health = take_health_settings(kwargs)  # Note [Health across replica groups]
        group = _replica_group(process_group)
        if dist.get_world_size(group) > 1 and kwargs.get("find_unused_parameters"):
            raise FusedReducerError(
                "fused_reducer.torchft.DistributedDataParallel: find_unused_parameters=True is "
                "not supported with a replica group of several ranks yet: the reducer's "
                "all-reduce of the used parameters would run on the group's process group "
                "beside the buckets' reductions (issued from another thread), in an order that "
                "can differ between ranks")
        super().__init__(module, process_group=group, **kwargs)
        self.manager = manager
        self.check_finite = health["check_finite"]  # what runs, across replica groups
        self.replica_health = ReplicaHealth(self, manager, replica_id, health)
        # After a heal: the received limits and the sender's bucket_parameter_names, checked by
        # the next forward.
        self.expected_layout = None
        if dist.get_world_size(group) == 1:
            self.group_reduction = None
            self.register_comm_hook(manager, fault_tolerant_hook)
        else:
            self.group_reduction = GroupReduction(manager, group, group_reduction)
            self.register_comm_hook(self.group_reduction, group_hook)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():  # where the reducer applies a pending rebuild
            agree_layout(self)  # Note [Layout agreed through the quorum]
        out = super().forward(*args, **kwargs)  # applies a received or agreed layout (a rebuild)
        if self.expected_layout is not None:
            (limits, expected), self.expected_layout = self.expected_layout, None
            got = [list(b) for b in self.bucket_parameter_names()]
            # Limits changed since the heal (every replica changes them at the same step, after
            # the quorum): every replica rebuilds from the same order with the new limits, so
            # the sender's layout from before the change is not the one to expect.
            if expected is not None and _limits(self) == limits and got != expected:
                raise FusedReducerError(
                    "fused_reducer.torchft: after healing, this replica's buckets differ from "
                    f"the live replica's: {got} != {expected}")
        return out

    def straggler_report(self):
        """Which replica groups are late: lateness_ms per replica (by the replica_id given, or
        its quorum rank), slowest, stragglers, threshold_ms, ... of the last exchange (every
        straggler_interval steps) through the Manager (Note [Health across replica groups])."""
        return self.replica_health.report()

    def register_comm_hook(self, state, hook):
        if self.__dict__.get("_ft_hook_registered") or hook not in (fault_tolerant_hook,
                                                                     group_hook):
            raise FusedReducerError(
                "fused_reducer.torchft.DistributedDataParallel reduces every bucket through the "
                "Manager's fault-tolerant all-reduce; another communication hook cannot be "
                "registered")
        super().register_comm_hook(state, self.replica_health.observed(hook))
        self._ft_hook_registered = True

    def close(self):
        super().close()
        reduction = self.__dict__.get("group_reduction")
        if reduction is not None:
            reduction.close()


# -- the state a healing replica receives ----------------------------------------------------------
def reducer_state(model):
    """What a replica joining at this step needs to lay out its buckets as `model` does at its
    next forward: the limits and the parameter order (by name) of the layout it will have, and
    the bucket parameter names it must produce (None where they are only known after that
    forward)."""
    reducer = _reducer_of(model)
    order = _next_layout_order(reducer)
    expected = (None if reducer.rebuild_pending()
                else [list(b) for b in model.bucket_parameter_names()])
    names = _param_names(model)
    dtype = model.reduce_dtype
    return {
        "bucket_caps_bytes": list(model.bucket_caps_bytes),
        "last_bucket_bytes": int(model.last_bucket_bytes),
        "reduce_dtype": None if dtype is None else str(dtype).replace("torch.", ""),
        "layout_order": [names[i] for i in order],
        "bucket_parameter_names": expected,
    }


def _next_layout_order(reducer):
    """The parameter indices, in order, that the layout of the next forward is built from."""
    if reducer.rebuild_pending():
        # That forward rebuilds (after the first backward, or for a limit just set) from the
        # gradient-ready order last observed, as DDP does, not from the layout in force (found by
        # a replica group joining a peer that had trained one step alone).
        return list(reducer.last_ready_order())
    return [i for bucket in reducer.bucket_params() for i in bucket]


def _param_names(model):
    """The reducer's parameter names in its index order (bucket_parameter_names' vocabulary)."""
    _reducer_of(model)  # raises if closed
    return model.attachment.param_names


def load_reducer_state(model, state):
    """Apply `reducer_state` of a live replica: its limits and its layout take effect at the
    next forward (one rebuild), so the next backward's buckets are the sender's."""
    names = _param_names(model)
    index = {name: i for i, name in enumerate(names)}
    order = state["layout_order"]
    if sorted(order) != sorted(names):
        raise FusedReducerError(
            "fused_reducer.torchft: the received layout names other parameters than this "
            "model's; replica groups must train the same model")
    dtype = state["reduce_dtype"]
    _rebuild_as(model, state["bucket_caps_bytes"], state["last_bucket_bytes"],
                None if dtype is None else getattr(torch, dtype), [index[n] for n in order])
    expected = state["bucket_parameter_names"]
    model.expected_layout = (_limits(model),
                             None if expected is None else [list(b) for b in expected])


def _rebuild_as(model, caps, last_bucket_bytes, reduce_dtype, order):
    """Set the limits and make the next forward rebuild from `order` (parameter indices)."""
    model.bucket_caps_bytes = list(caps)
    model.last_bucket_bytes = int(last_bucket_bytes)
    model.reduce_dtype = reduce_dtype
    _reducer_of(model).request_rebuild_from_order(list(order))


def _limits(model):
    """What a layout is built from, besides the parameter order."""
    return list(model.bucket_caps_bytes), int(model.last_bucket_bytes), model.reduce_dtype


# -- the layout agreed through the quorum -----------------------------------------------------
# Note [Layout agreed through the quorum]
# Every replica group must lay its buckets out alike at every step, or the Manager's all-reduces
# would pair buckets of different sizes (a size error in the process group) or, worse, buckets of
# one size holding different parameters. Inside a group the reducer's rebuild already takes group
# rank 0's limits and order (Note [Persistent limits]). Across groups, each training forward
# first agrees on what its layout is built from, as the participant of quorum rank 0 has it
# (its value wins, as rank 0's does inside a group): the limits (bucket_caps_bytes,
# last_bucket_bytes, reduce_dtype), whether it rebuilds at this forward, and the parameter order
# the layout is built from (reducer_state's). One small all-reduce through the Manager carries
# it: rank 0 writes its row, every other participant zeros (a healing or spare replica's row is
# zeroed by the Manager anyway). If rank 0 rebuilds, every replica rebuilds from rank 0's order
# and limits; a replica whose limits or pending rebuild differ from rank 0's rebuilds to rank 0's
# layout. So a limit changed at any step on rank 0 only reaches every replica at that step, one
# changed on another replica only is undone there (as inside a group), and the first step's
# rebuild uses rank 0's gradient-ready order on every replica. If the all-reduce fails the step
# is not committed and nothing is applied. The heal carries the same state (reducer_state), for
# the forward before which the healing replica takes part in this agreement. Every replica must
# therefore run the same grad-enabled forwards between quorums (as each DDP rank runs the same
# forwards): evaluate under torch.no_grad(), where no rebuild happens and nothing is agreed.
MAX_BUCKET_LIMITS = 16  # entries of bucket_caps_bytes carried by the agreement
_DTYPE_CODES = (None, torch.bfloat16, torch.float16, torch.float32)


def _agreement_row(model):
    """This replica's row of the agreement: [1, rebuilds, number of limits, the limits padded to
    MAX_BUCKET_LIMITS, last_bucket_bytes, reduce_dtype's code, the order (parameter indices)]."""
    reducer = _reducer_of(model)
    caps = list(model.bucket_caps_bytes)
    if len(caps) > MAX_BUCKET_LIMITS:
        raise FusedReducerError(
            f"fused_reducer.torchft: bucket_caps_bytes has {len(caps)} entries; at most "
            f"{MAX_BUCKET_LIMITS} are agreed across replica groups: pass fewer limits (the "
            "last one repeats for every later bucket)")
    row = [1, int(reducer.rebuild_pending()), len(caps)]
    row += caps + [0] * (MAX_BUCKET_LIMITS - len(caps))
    row += [model.last_bucket_bytes, _DTYPE_CODES.index(model.reduce_dtype)]
    row += _next_layout_order(reducer)
    # float64: every byte count and index below 2**53 is exact; on the parameters' device, where
    # the Manager's process group reduces (NCCL: the GPU).
    return torch.tensor(row, dtype=torch.float64, device=model.attachment.params[0].device)


def _row_fields(row):
    values = [int(v) for v in row.tolist()]
    count = values[2]
    tail = 3 + MAX_BUCKET_LIMITS
    return {"rebuilds": bool(values[1]),
            "limits": (values[3:3 + count], values[tail], _DTYPE_CODES[values[tail + 1]]),
            "order": values[tail + 2:]}


def agree_layout(model):
    """Agree this forward's layout with quorum rank 0 (Note [Layout agreed through the
    quorum]); returns True if this replica rebuilds to rank 0's."""
    manager = model.manager
    if manager.num_participants() == 0:
        return False  # no quorum yet (a forward before the first zero_grad): nothing to agree
    own = _agreement_row(model)
    wire = own.clone() if manager.participating_rank() == 0 else torch.zeros_like(own)
    # Waited for at once (torchft's own wait: an error is recorded by the Manager, not raised).
    manager.allreduce(wire, reduce_op=dist.ReduceOp.SUM).wait()
    if manager.errored() is not None or wire[0].item() != 1:
        return False  # the step will not be committed (or no participant of rank 0 wrote)
    agreed, mine = _row_fields(wire), _row_fields(own)
    if not agreed["rebuilds"] and (mine["rebuilds"], mine["limits"]) == (False, agreed["limits"]):
        return False
    caps, last_bucket_bytes, reduce_dtype = agreed["limits"]
    _rebuild_as(model, caps, last_bucket_bytes, reduce_dtype, agreed["order"])
    return True


def state_dict_fns(model, optimizer=None):
    """For a fused_reducer.torchft.DistributedDataParallel `model`:
    (load_state_dict, state_dict) for ``Manager(load_state_dict=..., state_dict=...)`` or
    ``manager.register_state_dict_fn(key, ...)``: the model's parameters and buffers, the
    optimizer's state and the reducer's limits and layout."""

    def state_dict():
        state = {"model": model.module.state_dict(), "reducer": reducer_state(model)}
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        return state

    def load_state_dict(state):
        with torch.no_grad():
            model.module.load_state_dict(state["model"])
        if optimizer is not None and "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
        load_reducer_state(model, state["reducer"])

    return load_state_dict, state_dict


# -- torchrun restarts ----------------------------------------------------------------------------
def forget_dead_attempt_keys(timeout=timedelta(seconds=60)):
    """fused_reducer.transports.elastic.forget_dead_attempt_keys, and the keys torchft's Manager
    left in torchrun's store in the dead attempt (group rank 0's Manager server address and the
    replica id): in a restarted replica group, a rank other than 0 would otherwise read the dead
    server's address before rank 0 writes the new one, and wait for it until connect_timeout
    (found with scripts/ft_groups_torchrun.py). Call on every rank before
    ``dist.init_process_group()`` and the Manager."""
    return elastic.forget_dead_attempt_keys(timeout, also=(MANAGER_ADDR_KEY, REPLICA_ID_KEY))


# -- training health across replica groups ---------------------------------------------------------
# Note [Health across replica groups]
# FusedReducer's own check_finite and straggler report (ext/health_exchange.cpp) exchange their
# rows over the reducer's process group, which here is the replica's own group of one rank: they
# would see this replica alone, and a NaN from another replica would reach this one's gradients
# through the Manager unnamed. So under torchft the same keywords run here instead (the C++ ones
# are turned off): with check_finite each replica counts the non-finite elements of its local
# gradients (a pre-hook of each parameter's gradient accumulator, as they enter the buckets: a
# Python call per parameter and step, paid only with check_finite), and it notes when its last
# bucket was complete (in the comm hook, once per bucket); at the end of backward one small
# float64 all-reduce through the Manager carries a row per participant (its slot:
# manager.participating_rank()), the same
# on every replica afterwards, so every replica reaches the same verdict (every replica must be
# given the same health keywords, as every other keyword). A non-finite gradient anywhere: every
# replica reports the error to the Manager (should_commit() is then False on every replica, the
# step is skipped) and raises NonFiniteGradientError naming the replica and the parameters.
# Lateness is read from slack, as in C++ (Note [Lateness from slack]): the time from a replica's
# last gradient to the end of its backward is mostly its wait for the others in the buckets'
# all-reduces, so the replica that waited least is the latest; lateness = the largest slack
# minus its own (no clock agreement across hosts). A replica slow before the quorum (its
# optimizer.zero_grad()) makes the others wait in the quorum instead, which is not seen here.
_NAMED_PARAMS = 3  # parameters named per replica in the error
_ID_CHARS = 64  # characters of a replica id carried in its row
# The row of one replica: its non-finite elements, the parameters with any, (index, count) of
# the first _NAMED_PARAMS of them, its slack and step time (ms), its id's length and characters.
_ELEMENTS, _PARAMS, _FIRST = 0, 1, 2
_SLACK = _FIRST + 2 * _NAMED_PARAMS
_STEP_MS = _SLACK + 1
_ID_LENGTH = _STEP_MS + 1
_ID = _ID_LENGTH + 1
_ROW = _ID + _ID_CHARS


def take_health_settings(kwargs):
    """Pop FusedReducer's health keywords from `kwargs` (FusedReducer's defaults, validated as
    FusedReducer validates them) and turn the C++ checks off: across replica groups they run in
    ReplicaHealth."""
    defaults = inspect.signature(FusedReducer.__init__).parameters
    given = {name: kwargs.pop(name, defaults[name].default) for name in health_option_names()}
    health_settings(given)
    kwargs["check_finite"] = False
    kwargs["straggler_interval"] = 0
    return given


class ReplicaHealth:
    """check_finite and the straggler report across the replica groups of each quorum
    (Note [Health across replica groups]). `replica_id`: how this replica is named in messages
    (the id given to its Manager; default: its rank in the step's quorum)."""

    def __init__(self, model, manager, replica_id, settings):
        self.manager = manager
        self.replica_id = replica_id
        self.check_finite = settings["check_finite"]
        self.interval = settings["straggler_interval"]
        self.window = settings["straggler_window"]
        self.threshold_ms = settings["straggler_threshold_ms"]
        self.warn_steps = settings["straggler_warn_steps"]
        named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.counts = torch.zeros(len(named), dtype=torch.int64, device=model.device)
        self.armed = False  # this backward exchanges
        self.queued = False
        self.forward_began = self.last_gradient = 0.0
        self.lateness = collections.defaultdict(lambda: collections.deque(maxlen=self.window))
        self.step_ms = collections.deque(maxlen=self.window)
        self.late_steps = collections.defaultdict(int)
        self.last = None  # (step, names of the participants) of the last exchange
        model_ref = weakref.ref(model)  # the model holds this object: no cycle through it
        self.sync = lambda: model_ref().require_backward_grad_sync
        self.accumulators = []  # kept alive: a parameter holds its accumulator weakly
        if self.check_finite or self.interval > 0:
            model.register_forward_pre_hook(lambda module, args: self.forward_started())
        if self.check_finite:  # a Python hook per parameter and step: only when asked for
            for index, (_, p) in enumerate(named):
                # A pre-hook of the gradient accumulator sees the gradient after every tensor
                # hook on the parameter, also those registered later: what enters the buckets.
                accumulator = p.view_as(p).grad_fn.next_functions[0][0]
                accumulator.register_prehook(
                    lambda grads, index=index: self.gradient(index, grads[0]))
                self.accumulators.append(accumulator)

    def due(self, step):
        return self.check_finite or (self.interval > 0 and step % self.interval == 0)

    def forward_started(self):
        # Every replica is at the same step (synchronous quorum), so all decide alike.
        self.armed = (torch.is_grad_enabled() and self.sync()
                      and self.due(self.manager.current_step()))
        if self.armed:
            self.counts.zero_()
            self.queued = False
            self.forward_began = time.perf_counter()

    def observed(self, hook):
        """`hook` (the comm hook), with each bucket's launch noted first."""
        @functools.wraps(hook)
        def launch(state, bucket):
            self.bucket_ready()
            return hook(state, bucket)
        return launch

    def bucket_ready(self):
        """A bucket is complete: this replica's gradients are ready up to now (its last one: the
        slack's start), and the exchange is queued after the reducer's end of backward."""
        if not self.armed:
            return
        if not self.queued:
            self.queued = True
            engine = torch.autograd.Variable._execution_engine
            # A callback queued by a callback runs after the others: after the reducer's end of
            # backward (queued by its first gradient hook), which waits for the buckets.
            engine.queue_callback(lambda: engine.queue_callback(self.exchange))
        self.last_gradient = time.perf_counter()

    def gradient(self, index, grad):
        if self.armed:
            self.counts[index] += grad.isfinite().logical_not().sum()

    def own_row(self, ended, rank):
        row = torch.zeros(_ROW, dtype=torch.float64)
        counts = self.counts.cpu()  # the one host sync of the check, at the end of backward
        found = counts.nonzero().flatten().tolist()
        row[_ELEMENTS], row[_PARAMS] = float(counts.sum()), len(found)
        for k, index in enumerate(found[:_NAMED_PARAMS]):
            row[_FIRST + 2 * k], row[_FIRST + 2 * k + 1] = index, float(counts[index])
        row[_SLACK] = 1000 * (ended - self.last_gradient)
        row[_STEP_MS] = 1000 * (ended - self.forward_began)
        name = (self.replica_id or f"quorum rank {rank}").encode()[:_ID_CHARS]
        row[_ID_LENGTH] = len(name)
        row[_ID:_ID + len(name)] = torch.tensor(list(name), dtype=torch.float64)
        return row

    def exchange(self):
        """At the end of a synchronising backward: every participant's row through the
        Manager, then the verdicts (the same on every replica)."""
        self.armed = False
        ended = time.perf_counter()
        manager = self.manager
        rank = manager.participating_rank()
        if rank is None or manager.errored() is not None:
            return  # this step is not committed anyway
        rows = torch.zeros(manager.num_participants(), _ROW, dtype=torch.float64)
        rows[rank] = self.own_row(ended, rank)
        rows = rows.to(self.counts.device)
        manager.allreduce(rows, reduce_op=dist.ReduceOp.SUM).wait()
        if manager.errored() is not None:
            return  # a peer failed during the exchange: the step is not committed
        rows = rows.cpu()
        names = [bytes(int(c) for c in row[_ID:_ID + int(row[_ID_LENGTH])]).decode(
            errors="replace") for row in rows]
        step = manager.current_step()
        if self.interval > 0 and step % self.interval == 0:
            self.update_stragglers(rows, names, step)
        if rows[:, _ELEMENTS].sum() > 0:
            error = NonFiniteGradientError(self.nonfinite_message(rows, names, step))
            manager.report_error(error)  # should_commit() is False: the step is skipped
            raise error

    def nonfinite_message(self, rows, names, step):
        parts = []
        for row, name in zip(rows, names):
            elements, params = int(row[_ELEMENTS]), int(row[_PARAMS])
            if elements == 0:
                continue
            first = ", ".join(
                f"'{self.names[int(row[_FIRST + 2 * k])]}' ({int(row[_FIRST + 2 * k + 1])})"
                for k in range(min(params, _NAMED_PARAMS)))
            more = f" and {params - _NAMED_PARAMS} more" if params > _NAMED_PARAMS else ""
            parts.append(f"replica {name}: {elements} element{'s' if elements != 1 else ''} "
                         f"in {params} parameter{'s' if params != 1 else ''}, first {first}{more}")
        return (f"fused_reducer.torchft: non-finite gradients (NaN or Inf) in step {step} "
                f"(check_finite=True), in the local gradients of {'; '.join(parts)}. They were "
                "averaged into every replica's gradients, so every replica raises this and the "
                "Manager does not commit the step (should_commit() is False on every replica): "
                "call optimizer.step() as usual (torchft's wrapper skips it) or "
                "optimizer.zero_grad(), and go on with the next batch. To find the cause, look "
                "at the named replica's batch, loss scale and learning rate.")

    def update_stragglers(self, rows, names, step):
        slack = rows[:, _SLACK]
        for name, own in zip(names, slack.tolist()):
            self.lateness[name].append(float(slack.max()) - own)
        self.step_ms.append(float(rows[:, _STEP_MS].median()))
        self.last = (step, names)
        report = self.report()
        for name in names:
            if name not in report["stragglers"]:
                self.late_steps[name] = 0
                continue
            self.late_steps[name] += self.interval
            if self.late_steps[name] - self.interval < self.warn_steps <= self.late_steps[name]:
                log.warning("fused_reducer.torchft: replica %s has been late for %d steps "
                            "(%.1f ms after the earliest replica, threshold %.1f ms): it slows "
                            "every replica group", name, self.late_steps[name],
                            report["lateness_ms"][name], report["threshold_ms"])

    def report(self):
        """Which replicas of the last exchange's quorum are late (see straggler_report)."""
        if self.last is None:
            return {"step": 0, "replicas": [], "lateness_ms": {}, "slowest": None,
                    "stragglers": [], "threshold_ms": self.threshold_ms, "median_step_ms": None,
                    "late_steps": {}, "interval": self.interval, "window": self.window,
                    "measured": False}
        step, names = self.last
        lateness = {name: statistics.median(self.lateness[name]) for name in names}
        median_step = statistics.median(self.step_ms)
        threshold = self.threshold_ms or max(1.0, 0.15 * median_step)
        return {"step": step, "replicas": list(names), "lateness_ms": lateness,
                "slowest": max(lateness, key=lateness.get),
                "stragglers": [n for n in names if lateness[n] > threshold],
                "threshold_ms": threshold, "median_step_ms": median_step,
                "late_steps": {n: self.late_steps[n] for n in names},
                "interval": self.interval, "window": self.window, "measured": True}
