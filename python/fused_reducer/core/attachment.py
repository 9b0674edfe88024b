"""The attachment: a FusedReducer attached to its process group.

Attaching is the collective part of construction: check that every rank wraps the same model,
broadcast rank 0's parameters and buffers, join the transport, build the C++ reducer from the
model's ReducerConfig (its hooks are then installed). The wrapper owns the Attachment it gets,
replaces it when it attaches again (after unpickling) and closes it (FusedReducer.close(),
which also runs at garbage collection and at interpreter exit).

Join (core/join.py), the sharded optimizer (sharded/optimizer.py), the tuning layer (tuning/),
the pipelining stage (pipelining.py) and the integrations use a model's reducer, transport,
group and parameters through ``model.attachment``, by the public names below and nothing else;
what it holds for a step beyond that (the comm hook, the ShardedOptimizer, the autotuner) lives
and dies with it, as DDP's reducer owns its comm hook. Like DDP's ``reducer``, it is internal:
no promise to users.
"""
import weakref

import torch
import torch.distributed as dist

from .. import _C
from ..errors import FusedReducerError, raise_nonfinite
from ..transports.elastic import restart_failure
from ..transports.transport import (backend_of, check_one_rank_per_gpu, group_timeout,
                                    make_transport, resolve_backend, timeout_seconds)
from .module_states import synced_states
from .sharded_mode import released_gradients
from .tensor_parallel import TensorParallelParameters, local_of
from .validation import control_device, one_communicator_backend, verify_same_model

_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


class Attachment:
    """What one attach made, by public name: ``module``, ``config`` (the ReducerConfig it was
    built from), ``group``, ``device``, ``control_device`` (where the library's own small
    collectives on the group stage their tensors), ``timeout_s`` (the resolved ``timeout``),
    ``transport``, ``backend`` (its kind), ``reducer`` (the C++ reducer; None once closed),
    ``params`` and ``param_names`` (the trainable parameters in the reducer's index order, a
    DTensor parameter's plain leaf in its place: Note [DTensor parameters]), ``tensor_parallel``
    (the DTensor parameters' bookkeeping, false for a model without them)."""

    def __init__(self, module, config, group, device, named, *, init_sync, init_sync_buffers,
                 hook_registered=False, sharded=False, trace_steps=100, sharding_refused=None):
        # hook_registered: a comm hook will be set (set_comm_hook), which picks the transport.
        self.module = module
        self.config = config
        self.group = group
        self.device = device
        self.param_names = [name for name, _ in named]
        self.tensor_parallel = TensorParallelParameters(
            module, named, group, grads_are_bucket_views=config.gradient_as_bucket_view)
        self.params = self.tensor_parallel.reduced(named)
        self.reducer = self.transport = None
        self._launch_hook = None  # the registered comm hook's bucket launcher
        self.sharded = False  # a ShardedOptimizer reduce-scatters the buckets (Note [Sharded mode])
        self.tuner = None  # the forward observer autotune() starts (see core/plugins.py)
        self._sharded_optimizer = None  # weakly: the optimizer holds the model, not the reverse
        self._sharding_refused = sharding_refused  # why no ShardedOptimizer may shard it, or None

        # Before any collective, so every rank refuses alike: see Note [One NCCL communicator].
        request = one_communicator_backend(config.backend, device, module, group,
                                           hook_registered)
        # None: the process group's own timeout, which DDP's collectives wait (the Trainer's
        # ddp_timeout); inf / timedelta.max: a year, see timeout_seconds.
        self.timeout_s = timeout_seconds(group_timeout(group, device) if config.timeout is None
                                         else config.timeout)
        nccl_group = dist.get_backend(group) == "nccl"
        planned = resolve_backend(request, device)  # what make_transport tries first
        if device.type == "cuda" and (nccl_group or planned == "nccl"):
            check_one_rank_per_gpu(group, device)  # before NCCL refuses
        self.control_device = control_device(nccl_group, device)
        # Kept with init_sync=False too (DDP skips it): ranks must agree on the bucket layout.
        _verify_with_restart_hint(group, self.param_names, self.params, self.control_device)
        if init_sync:
            # As DDP: broadcast_buffers=False also leaves the buffers alone at construction
            # (rank-local buffers stay rank-local); forward_sync_buffers does not.
            self.broadcast(synced_states(module, init_sync_buffers), 0)
        # The autotuner's probe times this same transport; join shadows buckets through it.
        self.transport = make_transport(group, device, request, self.timeout_s,
                                        check_devices=False)
        self.backend = backend_of(self.transport)  # 'auto' on CPU may have fallen back
        self.reducer = _C.Reducer(self.params, self.param_names, group, str(self.control_device),
                                  self.transport, config.options(self.timeout_s))
        self.reducer.set_nonfinite_handler(raise_nonfinite)
        self.reducer.set_trace_capacity(trace_steps)
        if sharded:
            self.enter_sharded_mode()

    # -- the parameters ----------------------------------------------------------------------
    @property
    def module_params(self):
        """The module's own parameter objects, in the reducer's order: a DTensor parameter where
        the reducer holds its plain leaf (Note [DTensor parameters]), else ``params``'s."""
        return self.tensor_parallel.module_params(self.params)

    @property
    def autograd_leaves(self):
        """The tensors backward accumulates the module's gradients into, in the reducer's order
        and then the trainable parameters the reducer leaves out (DDP-ignored ones): a DTensor
        parameter's plain leaf (Note [DTensor parameters]), else the parameter itself."""
        reduced = {id(p) for p in self.module_params}
        return list(self.params) + [p for p in self.module.parameters()
                                    if p.requires_grad and id(p) not in reduced]

    def publish_gradients(self):
        """After a backward that did not pass through the module's outputs (a pipeline stage's
        weight half): each DTensor parameter's ``.grad`` made to view its leaf's again (Note
        [DTensor parameters]); nothing for a model without DTensor parameters."""
        if self.tensor_parallel:
            self.tensor_parallel.publish_gradients()

    def tensor_parallel_norm(self, indexed_grads, norm_type):
        """The global norm of averaged gradient pieces [(reducer index, tensor)] spread over
        the DP ranks (each rank passes its own), with DTensor parameters' shards summed over
        their tensor-parallel groups (torch's norm for DTensor gradients); None for a model
        without DTensor parameters. Collective over the DP and TP groups."""
        if not self.tensor_parallel:
            return None
        return self.tensor_parallel.norm_of_pieces(indexed_grads, norm_type, self.group,
                                                   self.control_device)

    # -- collectives of the library's own ----------------------------------------------------
    def broadcast(self, tensors, source):
        """Broadcast `tensors` from `source` on the process group (coalesced)."""
        tensors = [local_of(t) for t in tensors]  # a DTensor's shard, over the DP group only
        if tensors and dist.get_world_size(self.group) > 1:
            with torch.no_grad():
                dist._broadcast_coalesced(self.group, tensors, _BROADCAST_BUCKET_BYTES, source)

    def sync_buffers(self, source):
        """Broadcast the module's buffers (re-read: one may have been reassigned) from `source`,
        without bumping their version counters (a second forward before backward must not
        invalidate what autograd saved)."""
        buffers = synced_states(self.module, buffers=True, parameters=False)
        with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            self.broadcast(buffers, source)

    # -- the communication hook (DDP's register_comm_hook) -----------------------------------
    @property
    def has_comm_hook(self):
        return self._launch_hook is not None

    def set_comm_hook(self, launch):
        """`launch(index, is_last, flat, views, indices)` (comm_hooks.bucket_launcher) runs the
        registered hook on each bucket from now on."""
        self._launch_hook = launch
        self.reducer.set_comm_hook(_comm_hook_launcher(self))

    def run_comm_hook(self, index, is_last, flat, views, params):
        """The registered communication hook on one bucket: run_hook's ``finish``."""
        return self._launch_hook(index, is_last, flat, views, params)

    # -- the sharded optimizer ---------------------------------------------------------------
    @property
    def sharded_optimizer(self):
        """The model's live ShardedOptimizer, or None (none, or it was dropped): with one, the
        averaged gradients exist only as its shards."""
        return self._sharded_optimizer() if self._sharded_optimizer is not None else None

    def use_sharded_optimizer(self, optimizer):
        """A ShardedOptimizer was constructed for this model: reduce-scatter from the next
        forward on (Note [Sharded mode] in ext/reducer.cpp). Collective in effect: every rank
        constructs it."""
        if self._sharding_refused is not None:
            raise FusedReducerError(self._sharding_refused)
        if self.tuner is not None and self.tuner.state != "done":
            raise FusedReducerError(
                "ShardedOptimizer: autotune is still measuring with all-reduce; construct the "
                "ShardedOptimizer before starting it (FusedReducer(..., autotune=False), then "
                "model.autotune() after the ShardedOptimizer), or let it finish "
                "(autotune_report()['done'])")
        self.enter_sharded_mode()
        self._sharded_optimizer = weakref.ref(optimizer)

    def enter_sharded_mode(self):
        self.reducer.set_sharded(True)  # raises naming what it cannot combine with
        self.reducer.set_released_gradients(released_gradients(self.params, self.param_names))
        self.sharded = True

    # -- the end -----------------------------------------------------------------------------
    def close(self):
        """Remove the gradient hooks and release the communicator (see FusedReducer.close);
        raises afterwards if a collective had failed in the background. Idempotent."""
        reducer, transport = self.reducer, self.transport
        self.reducer = self.transport = self.tuner = None
        failure = None
        if transport is not None:
            try:
                transport.check()
            except RuntimeError as e:
                failure = e
        del reducer  # hooks removed, launched collectives waited for (bounded by the timeout)
        if transport is not None:
            transport.close(min(self.timeout_s, 10.0))
        if failure is not None:
            raise failure


def _verify_with_restart_hint(group, names, params, device):
    """verify_same_model, the group's first collective: a failure there says whose it is (a
    peer that restarted: transports/elastic.py)."""
    try:
        verify_same_model(group, names, params, device)
    except FusedReducerError:
        raise
    except RuntimeError as e:
        message = restart_failure(e)
        if message is None:
            raise
        try:
            explained = type(e)(message)  # the same class (DistError callers keep working)
        except Exception:  # noqa: BLE001 - a class that takes other arguments
            explained = RuntimeError(message)
        raise explained from e


def _comm_hook_launcher(attachment):
    """What the C++ reducer calls when a bucket is complete and a hook is registered. It holds
    the attachment weakly: the reducer (owned by the attachment) must not keep it alive."""
    ref = weakref.ref(attachment)

    def launch(index, is_last, flat, views, params):
        return ref().run_comm_hook(index, is_last, flat, views, params)

    return launch
