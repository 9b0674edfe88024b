"""FusedReducer: the nn.Module users wrap their model with.

Python does the once-per-construction and once-per-forward work (checks, broadcasts, the safe
point for rebuilds); every per-gradient step runs in the C++ reducer (ext/reducer.cpp).
"""
import atexit
import copy
import functools
import logging
import math
import os
import warnings
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.distributed.algorithms.join import Join, Joinable

from .. import _C
from ..errors import FusedReducerError, ShardedGradientError, raise_nonfinite
from ..settings import (bucket_limits, check_bucket_caps, check_bytes, check_reduce_dtype,
                        megabytes_to_bytes)
from ..transports.elastic import restart_failure
from ..transports.transport import (backend_of, check_one_rank_per_gpu, group_timeout,
                                    make_transport, resolve_backend, timeout_seconds)
from .attachment import Attachment
from .comm_hooks import GradBucket, check_hook, run_hook
from .join import FusedReducerJoinHook, common_rank, sync_requested
from .module_states import reduced_parameters, synced_states
from .plugins import tool
from .tensor_parallel import (TensorParallelParameters, group_named, local_of,
                              refuse_unpicklable_hooks)
from .validation import (_buffer_sync_settings, _check_bucket_view_dtypes, _check_device_ids,
                         _control_device, _group_of, _health_settings, _one_communicator_backend,
                         _reduce_dtype_of, _refuse_compiled_autograd, _refuse_sparse_gradients,
                         _refuse_sync_batch_norm_on_cpu, _refuse_unsupported_ddp_arguments,
                         _refuse_wrapped_twice,
                         _resolve_group, _runs_nccl, _verify_same_model)

_log = logging.getLogger("fused_reducer")

DEBUG_ENV = "FUSED_REDUCER_DEBUG"
_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


class _ReleasedGradient(torch.Tensor):
    """param.grad after a synchronised backward in sharded mode: the parameter's metadata and no
    storage; every operation on it raises ShardedGradientError naming the parameter (Note
    [Released gradients] in ext/reducer.cpp)."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, param, name):
        self = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, strides=param.stride(), storage_offset=param.storage_offset(),
            dtype=param.dtype, device=param.device, requires_grad=False)
        self.parameter_name = name
        return self

    def __repr__(self):
        return (f"<released gradient of '{self.parameter_name}': averaged only as shards of a "
                "ShardedOptimizer>")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        names = [a.parameter_name for a in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(a, cls)]
        raise ShardedGradientError(
            f"param.grad of '{names[0]}' was used ({func}) after a synchronised backward with a "
            "ShardedOptimizer: the averaged gradients exist only as shards across the ranks, and "
            "this rank's local gradient was released. Clip with opt.clip_grad_norm_(max_norm) "
            "(the global norm, as torch.nn.utils.clip_grad_norm_ under DDP) instead of a torch "
            "utility over model.parameters(); call opt.step() and opt.zero_grad() before the "
            "next backward; accumulate micro-batches under model.no_sync().")


def _norm_dtype(grads):
    """torch's norm has the gradients' widest real dtype (a complex gradient's norm is real)."""
    return functools.reduce(torch.promote_types, (g.dtype.to_real() for g in grads))


class FusedReducer(nn.Module, Joinable):
    """Data-parallel wrapper: after ``loss.backward()`` every ``param.grad`` holds the average over
    the ranks of ``process_group``. Buckets follow DDP's rules (see README), but the first bucket
    and the cap stay tunable while training: set ``first_bucket_bytes`` / ``bucket_cap_bytes`` and
    the next forward rebuilds the layout, and every later rebuild keeps the value.

    Like every torch.distributed API, construction, the setters and ``rebuild_buckets()`` are
    collective: call them on every rank (rank 0's values win if they differ). ``backend`` picks
    how buckets move: "auto" (NCCL for CUDA parameters, but the process group for a model with
    SyncBatchNorm on an NCCL group, see Note [One NCCL communicator]; for CPU parameters shared
    memory when every rank is on one host and in one PID namespace, else the process group), "nccl", "shm",
    "process_group"; the ``backend`` attribute then names the one in use. ``timeout`` bounds
    every wait on a collective, after which the step raises naming the bucket (None: the process
    group's timeout, as DDP's collectives).

    ``last_bucket_mb`` (None = off) splits the last gradients of backward into a small bucket of
    their own (see ``last_bucket_bytes``). ``autotune=True`` starts ``autotune()`` at once: the
    limits are then measured and chosen while training goes on (docs/TUNING.md).
    ``reduce_dtype`` (None = each gradient's own dtype; torch.bfloat16, torch.float16 or
    torch.float32): the dtype the buckets of floating-point gradients are reduced in; settable
    later as ``model.reduce_dtype`` (docs/REDUCE_DTYPE.md).
    ``FUSED_REDUCER_DEBUG=1`` logs layout changes, rebuilds and tuning decisions to the
    ``fused_reducer`` logger.

    As a drop-in for DDP: ``state_dict()`` keys carry DDP's ``module.`` prefix, ``no_sync()``,
    ``join()`` (uneven inputs) and ``register_comm_hook()`` (DDP's hooks) behave as DDP's, and
    the bookkeeping in ``forward`` stays out of ``torch.compile``'s graph. Pickling drops the
    process group and the reducer; the first forward after unpickling attaches them again
    (collective). See docs/DDP_MIGRATION.md.
    """

    def __init__(self, module, process_group=None, bucket_cap_mb=None, first_bucket_mb=None,
                 gradient_as_bucket_view=False, find_unused_parameters=False,
                 broadcast_buffers=None, backend="auto", timeout=None,
                 last_bucket_mb=None, autotune=False, static_graph=False, reduce_dtype=None,
                 device_ids=None, output_device=None, bucket_cap_mb_list=None,
                 forward_sync_buffers=None, init_sync=True, batched_grad_copy=False,
                 mixed_precision=None, device_mesh=None, dim=0, check_reduction=False,
                 skip_all_reduce_unused_params=False, delay_all_reduce_named_params=None,
                 param_to_hook_all_reduce=None, check_finite=False, straggler_interval=10,
                 straggler_window=10, straggler_threshold_ms=None, straggler_warn_steps=20):
        super().__init__()
        Joinable.__init__(self)
        _refuse_unsupported_ddp_arguments(static_graph, delay_all_reduce_named_params,
                                          param_to_hook_all_reduce)
        if check_reduction:
            warnings.warn("check_reduction is deprecated in DDP and has no effect in "
                          "FusedReducer either (every step reduces every bucket)", FutureWarning,
                          stacklevel=2)
        caps = bucket_limits(bucket_cap_mb, first_bucket_mb, bucket_cap_mb_list)
        last_bytes = (0 if last_bucket_mb is None or (not isinstance(last_bucket_mb, bool)
                                                      and last_bucket_mb == 0)
                      else megabytes_to_bytes("last_bucket_mb", last_bucket_mb))
        reduce_dtype = check_reduce_dtype(_reduce_dtype_of(mixed_precision, reduce_dtype))
        self.module = module
        self.process_group = _resolve_group(_group_of(process_group, device_mesh))
        self.device_mesh = device_mesh
        self.dim = dim  # as in DDP with one device per process: kept, not used
        self.batched_grad_copy = batched_grad_copy  # FusedReducer always copies a bucket at once
        self.mixed_precision = mixed_precision
        self.init_sync = init_sync
        self.forward_sync_buffers, self._init_sync_buffers = _buffer_sync_settings(
            broadcast_buffers, forward_sync_buffers)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        # Needs find_unused_parameters, as in DDP; see Note [Skipping unused parameters].
        self.skip_all_reduce_unused_params = bool(skip_all_reduce_unused_params)
        self._health = _health_settings(check_finite, straggler_interval, straggler_window,
                                        straggler_threshold_ms, straggler_warn_steps)
        self.check_finite = self._health["check_finite"]

        named = reduced_parameters(module)
        if not named:
            raise FusedReducerError("FusedReducer: the module has no trainable parameters "
                             "(none with requires_grad=True); there is nothing to reduce")
        _refuse_sparse_gradients(module)
        _refuse_wrapped_twice(module, FusedReducer)
        self._param_names = [n for n, _ in named]
        # DTensor parameters reduce through plain leaves: see Note [DTensor parameters].
        self._tp = TensorParallelParameters(module, named, self.process_group)
        self._has_tp = bool(self._tp)
        params = self._tp.reduced(named)
        _check_bucket_view_dtypes(gradient_as_bucket_view, reduce_dtype, named)
        # Every parameter DDP broadcasts (frozen ones too, not the ignored ones), as DDP checks.
        devices = {p.device for p in synced_states(module, buffers=False)}
        if len(devices) != 1:
            raise FusedReducerError(f"FusedReducer: parameters are spread over devices {sorted(map(str, devices))}; "
                             "like DDP, each process must hold its replica on one device")
        self.device = devices.pop()
        _check_device_ids(device_ids, output_device, self.device)
        _refuse_sync_batch_norm_on_cpu(module, self.device)
        # DDP's attributes, as DDP sets them (code written for DDP reads them).
        gpu_ids = device_ids is not None and self.device.type == "cuda"
        self.device_ids = [self.device.index] if gpu_ids else None
        self.output_device = self.device.index if gpu_ids else None
        self.static_graph = False  # static_graph=True is refused above
        self._backend_request = backend
        self.backend = resolve_backend(backend, self.device)  # what _attach tries first
        # None: the process group's own timeout, read when attaching to a group (_attach).
        self._timeout_request = timeout
        if timeout is not None:
            timeout_seconds(timeout)  # refuse a bad value before any collective
        self._limits = (caps, last_bytes)  # kept for re-attaching after pickling
        # DDP's first layout for a bucket_cap_mb_list (see Note [Bucket assignment]).
        self._ddp_first_layout = bool(bucket_cap_mb_list)
        self._reduce_dtype = reduce_dtype  # likewise
        self._syncing = True
        self._require_forward_param_sync = True  # DDP: buffers sync unless the last forward didn't
        self._divide_by_initial_world_size = True
        self._divide_factor = 0
        self._comm_hook = None  # (state, hook)
        self._trace_steps = 100  # the C++ reducer's default ring size
        self._tuner = None  # the forward observer autotune() starts (see core/plugins.py)
        self._debug = _debug_enabled()
        self._rebuilds_seen = 0
        self._sharded = False  # a ShardedOptimizer uses this model: _use_sharded_optimizer
        self._attach(params)
        if autotune:
            self.autotune()

    def _attach(self, params):
        """The collective part of construction: check the model across ranks, broadcast rank 0's
        parameters and buffers, join the transport, build the C++ reducer (hooks installed)."""
        # Before any collective, so every rank refuses alike: see Note [One NCCL communicator].
        request = _one_communicator_backend(getattr(self, "_backend_request", self.backend),
                                            self.device, self.module, self.process_group,
                                            self._comm_hook is not None)
        self.backend = resolve_backend(request, self.device)
        # None: the process group's own timeout, which DDP's collectives wait (the Trainer's
        # ddp_timeout); inf / timedelta.max: a year, see timeout_seconds. Unpickled from before
        # the request was kept: the timeout it had.
        request_timeout = self.__dict__.get("_timeout_request", self.__dict__.get("_timeout_s"))
        self._timeout_s = timeout_seconds(group_timeout(self.process_group, self.device)
                                          if request_timeout is None else request_timeout)
        nccl_group = dist.get_backend(self.process_group) == "nccl"
        if self.device.type == "cuda" and (nccl_group or self.backend == "nccl"):
            check_one_rank_per_gpu(self.process_group, self.device)  # before NCCL refuses
        self._control_device = _control_device(nccl_group, self.device)
        # Kept with init_sync=False too (DDP skips it): ranks must agree on the bucket layout.
        try:
            _verify_same_model(self.process_group, self._param_names, params,
                               self._control_device)
        except FusedReducerError:
            raise
        except RuntimeError as e:  # the group's first collective: say whose failure it is
            message = restart_failure(e)
            if message is None:
                raise
            try:
                explained = type(e)(message)  # the same class (DistError callers keep working)
            except Exception:  # noqa: BLE001 - a class that takes other arguments
                explained = RuntimeError(message)
            raise explained from e
        if getattr(self, "init_sync", True):
            # As DDP: broadcast_buffers=False also leaves the buffers alone at construction
            # (rank-local buffers stay rank-local); forward_sync_buffers does not.
            self._broadcast(synced_states(self.module, self._init_sync_buffers), 0)
        # The autotuner's probe times this same transport; join shadows buckets through it.
        self._transport = make_transport(self.process_group, self.device, request,
                                         self._timeout_s, check_devices=False)
        self.backend = backend_of(self._transport)  # 'auto' on CPU may have fallen back
        caps, last_bytes = self._limits
        options = _C.ReducerOptions()  # ext/reducer_options.h
        options.bucket_caps_bytes = caps
        options.last_bucket_bytes = last_bytes
        options.ddp_first_layout = getattr(self, "_ddp_first_layout", False)
        options.gradient_as_bucket_view = self.gradient_as_bucket_view
        options.find_unused_parameters = self.find_unused_parameters
        options.skip_all_reduce_unused_params = getattr(self, "skip_all_reduce_unused_params", False)
        options.timeout_seconds = self._timeout_s
        options.reduce_dtype = getattr(self, "_reduce_dtype", None)
        for name, value in getattr(self, "_health", {}).items():
            setattr(options.health, name, value)
        self._reducer = _C.Reducer(params, self._param_names, self.process_group,
                                   str(self._control_device), self._transport, options)
        self._reducer.set_nonfinite_handler(raise_nonfinite)
        self._norm_source = None  # how the last grad_norm() was computed: "copy" or "torch"
        self._params = params  # the reducer's parameter indices
        self._reducer.set_trace_capacity(self._trace_steps)
        self._sharded = getattr(self, "_sharded", False)  # unpickled from before it existed
        if self._sharded:
            self._enter_sharded_mode()
        if self._comm_hook is not None:
            self._reducer.set_comm_hook(_comm_hook_launcher(self))
        _live_reducers.add(self)
        if self._debug:
            self._log_layout("initial layout")

    # -- teardown ------------------------------------------------------------------------------
    def close(self):
        """Remove the gradient hooks and release the communicator: collectives still in flight
        get until ``timeout`` (at most 10 s), then the communicator is aborted, so a dead peer
        never makes exit hang. Not collective; idempotent. Runs at interpreter exit and when the
        model is garbage collected if not called. Raises afterwards if a collective had failed
        in the background. The model cannot be trained after close()."""
        self._closed = True
        reducer, transport = self.__dict__.get("_reducer"), self.__dict__.get("_transport")
        self._reducer = self._transport = self._tuner = None
        failure = None
        if transport is not None:
            try:
                transport.check()
            except RuntimeError as e:
                failure = e
        del reducer  # hooks removed, launched collectives waited for (bounded by the timeout)
        if transport is not None:
            transport.close(min(self._timeout_s, 10.0))
        if failure is not None:
            raise failure

    def __del__(self):
        try:
            if self.__dict__.get("_reducer") is not None:
                self.close()
        except Exception:  # noqa: BLE001 - never raise from the garbage collector
            pass

    # -- pickling: like DDP, the process group and the reducer are not part of the pickle ------
    def _copied_state(self):
        """What a copy keeps (pickle, torch.save, copy.copy, copy.deepcopy): the settings in force;
        not the group, the reducer and what depends on them (attached again at the first forward).
        With DTensor parameters, the data-parallel group by name: see _reattach."""
        state = dict(self.__dict__)
        if state.get("_reducer") is not None:
            state["_limits"] = (self.bucket_caps_bytes, self.last_bucket_bytes)
            state["_reduce_dtype"] = self.reduce_dtype
            if self._has_tp:
                state["_dp_group_name"] = self.process_group.group_name
        for transient in ("process_group", "_reducer", "_transport", "_tuner", "_control_device",
                          "_sharded_optimizer", "_arm", "_tp",
                          "_closed"):
            state[transient] = None
        return state

    def __getstate__(self):
        if self.__dict__.get("_has_tp"):
            refuse_unpicklable_hooks(self.module)  # See Note [Copies of DTensor models]
        return self._copied_state()

    # copy.copy and copy.deepcopy as the default protocol does them (copy._reconstruct), with the
    # state of _copied_state: they copy hooks by reference, so a model with torch's TP hooks,
    # which pickle refuses, copies.
    def __copy__(self):
        copied = type(self).__new__(type(self))
        copied.__setstate__(self._copied_state())
        return copied

    def __deepcopy__(self, memo):
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self._copied_state(), memo))
        return copied

    def __setstate__(self, state):
        super().__setstate__(state)
        # Attached again (collectively) at the first forward, in the then default group (with
        # DTensor parameters: the data-parallel group it had, see _reattach).

    # -- the step ------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._pre_forward()
        if self._sharded:  # a plain bool: no graph break under torch.compile otherwise
            self._before_sharded_forward(torch.compiler.is_compiling())
        if self._has_tp and torch.is_grad_enabled():
            with self._tp.swapped_in():  # See Note [DTensor parameters]
                output = self.module(*args, **kwargs)
        else:
            output = self.module(*args, **kwargs)
        if self._sharded:  # a plain bool: no graph break under torch.compile otherwise
            self._finish_param_gather()  # before backward refills the buckets
        if self._require_forward_param_sync or (self._has_tp and torch.is_grad_enabled()):
            self._hook_outputs(output)
        return output

    # Note [Several forwards before their backwards]
    # Pipeline schedules run several forwards before their backwards: GPipe F1 F2 B1 B2, 1F1B
    # F1 F2 B1 F3 B2 ..., a reversed order F1 F2 B2 B1. The C++ reducer is armed by a forward for
    # the next backward, and the end of that backward disarms it: B1 took the arm that F2 had set,
    # and B2 then stayed local, so param.grad ended as avg(g1) + g2 (DDP does exactly the same,
    # silently). Here every backward of a synchronised forward is reduced: the forward's outputs
    # are hooked, and when a backward first reaches them while the reducer's arm was used up by an
    # earlier backward (its step completed) or cancelled (a later forward inside no_sync), the arm
    # is renewed there, before any of that backward's gradients is ready
    # (_arm_for_backward_of_forward). The backward then reduces the whole param.grad, the earlier
    # averages included, so param.grad = avg(g1) + avg(g2) + ... = the average of the summed
    # gradients, in any order of forwards and backwards: exact. Each such backward is a step of
    # its own (one reduction of each bucket per backward); for one reduction per training step,
    # run the forwards and all but the last backward inside no_sync() and call
    # prepare_for_backward() before the last backward, as torch's PipelineStage drives DDP and
    # fused_reducer.pipelining.PipelineStage drives FusedReducer.
    # Why not defer the reduction to the last backward instead: whether more backwards will come is
    # unknowable at a backward's end, because a forward whose output is dropped (a GAN's extra
    # generator pass, a metric computed with grad enabled) never gets one; deferring would then
    # never average, while renewing the arm stays exact. A second backward through the same graph
    # (one forward, backward(retain_graph=True) twice, or one backward per output) is reduced the
    # same way: DDP leaves it local and the ranks' gradients silently differ. It is reduced if it
    # runs while the model syncs (inside no_sync() it stays local, as the user asked). A
    # ShardedOptimizer refuses a renewed arm: its averages exist only as shards, and the next
    # backward would have to accumulate into released gradients.
    @torch.compiler.disable
    def _hook_outputs(self, output):
        """Hooks on a synchronised forward's outputs: the first backward reaching them is reduced
        (Note [Several forwards before their backwards]); with find_unused_parameters, that
        backward is also the one whose end decides which parameters were unused, not a nested
        backward that reentrant checkpointing runs inside it (see Note [End of backward] in
        ext/reducer.cpp)."""
        leaves = [leaf for leaf in tree_leaves(output)
                  if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if not leaves:
            if self._has_tp:
                raise FusedReducerError(
                    "FusedReducer: with DTensor parameters the wrapped module's forward must "
                    "return its outputs as tensors (or lists, tuples, dicts of them) that require "
                    "grad: the end of their backward publishes param.grad as DTensors (Note "
                    "[DTensor parameters]). Return the tensors, or run this forward under "
                    "torch.no_grad().")
            return
        model = weakref.ref(self)
        synced = self._require_forward_param_sync
        find_unused = self.find_unused_parameters and synced
        tp = self._has_tp
        first = [True]  # the first backward through these outputs

        def reached(grad):
            wrapper = model()
            if wrapper is None or wrapper.__dict__.get("_reducer") is None:
                return
            # The forward decided whether its first backward syncs (as DDP); a later backward
            # through the same graph syncs unless it runs inside no_sync().
            if synced and (first[0] or wrapper._syncing):
                wrapper._arm_for_backward_of_forward()
            first[0] = False
            if tp:
                wrapper._publish_at_end_of_backward()
            if find_unused:
                wrapper._reducer.on_outputs_reached()

        for leaf in leaves:
            leaf.register_hook(reached)

    def _publish_at_end_of_backward(self):
        """With DTensor parameters: param.grad published as DTensors once this backward, and the
        reducer's end of it (queued later, by the first gradient hook), are done."""
        if self.__dict__.get("_publish_queued"):
            return
        self._publish_queued = True
        engine = torch.autograd.Variable._execution_engine
        model = weakref.ref(self)

        def publish():
            wrapper = model()
            if wrapper is not None:
                wrapper._publish_queued = False
                wrapper._tp.publish_gradients()

        # Callbacks run in the order queued, and one queued by a callback runs after the others:
        # publish after Reducer::finalize_backward, which may assign param.grad.
        engine.queue_callback(lambda: engine.queue_callback(publish))

    def _armed(self):
        """Whether the C++ reducer is armed for a backward that has not yet completed a step."""
        arm = self.__dict__.get("_arm")
        return arm is not None and arm == self._reducer.completed_steps()

    def _note_arm(self, armed):
        self._arm = self._reducer.completed_steps() if armed else None

    def _arm_for_backward_of_forward(self):
        """A backward reached the outputs of a synchronised forward: reduce it, renewing the arm
        if an earlier backward used it up. See Note [Several forwards before their backwards]."""
        if self._armed():
            return
        if self._sharded:
            raise FusedReducerError(
                "FusedReducer: a second backward of this step reached the outputs of a forward run "
                "outside no_sync(), but with a ShardedOptimizer the previous backward already "
                "reduced and released the gradients (they exist only as shards), so this "
                "backward's gradients cannot be added to them. Run the forwards and all but the "
                "last backward of the step under model.no_sync() and call "
                "model.prepare_for_backward() before the last backward (one reduction per step), "
                "or drive the stage with fused_reducer.pipelining.PipelineStage, which does that "
                "for pipeline schedules.")
        if self._join_config.enable:
            raise FusedReducerError(
                "FusedReducer: several forwards before their backwards are not supported inside "
                "join() (the joined ranks shadow one reduction per forward). Run the forwards and "
                "all but the last backward under model.no_sync() and call "
                "model.prepare_for_backward() before the last backward, or drive the stage with "
                "fused_reducer.pipelining.PipelineStage.")
        syncing = self._syncing
        if not syncing:  # no_sync() entered after this forward: its backward still syncs (DDP)
            self._reducer.set_sync_enabled(True)
        try:
            self._reducer.prepare_forward(will_sync=True)
        finally:
            if not syncing:
                self._reducer.set_sync_enabled(False)
        self._note_arm(True)

    @torch.compiler.disable
    def _pre_forward(self):
        """Once per forward, outside any torch.compile graph: the safe point for rebuilds, the
        join protocol and the buffer broadcast, in DDP's order."""
        if self._reducer is None:
            if self.__dict__.get("_closed"):
                raise RuntimeError("FusedReducer: this model was closed (close()); wrap the module "
                                   "in a new FusedReducer to train it again")
            self._reattach()
        self._transport.check()  # a collective that failed in the background raises here
        _refuse_compiled_autograd()
        grad_sync = torch.is_grad_enabled() and self._syncing
        if self._join_config.enable:
            with self._waiting_in_forward():
                join_work = Join.notify_join_context(self)
        else:
            join_work = Join.notify_join_context(self)  # no join context: no collective
        self._set_divide_factor(join_work)
        if torch.is_grad_enabled():
            if self._has_tp:
                self._publish_queued = False  # a backward that raised left it set
                self._tp.adopt_gradients()  # See Note [DTensor parameters]
            if self._tuner is not None and self._syncing:
                self._tuner.on_forward()  # once per step: may set the limits for this step
            self._reducer.prepare_forward(will_sync=True)
            self._note_arm(self._syncing)
            if self._debug:
                self._log_rebuild()
        if self._will_sync_buffers():
            with self._waiting_in_forward():
                self._sync_buffers(joined=False)
        warning = self._reducer.take_straggler_warning()
        if warning:
            _log.warning(warning)
        if self._join_config.enable:
            with self._waiting_in_forward():
                sync_requested(self, joined=False)  # tells joined ranks whether to shadow backward
        self._require_forward_param_sync = grad_sync

    @contextmanager
    def _waiting_in_forward(self):
        """Around one collective of a forward with grad enabled: a rank late before its forward
        is waited for there, so that wait counts into its straggler slack
        (Reducer::begin_forward_sync). Not ended if the collective raises."""
        timed = torch.is_grad_enabled()
        if timed:
            self._reducer.begin_forward_sync()
        yield
        if timed:
            self._reducer.end_forward_sync()

    def _will_sync_buffers(self):
        # DDP's rule: not after a forward that did not synchronise (no_sync, no_grad).
        # A cheap early exit per forward; _sync_buffers leaves out the ignored ones.
        return self.forward_sync_buffers and self._require_forward_param_sync and any(
            True for _ in self.module.buffers())

    def _sync_buffers(self, joined):
        """Broadcast the buffers (re-read: one may have been reassigned) from rank 0, or under
        join from the highest rank still training, without bumping their version counters (a
        second forward before backward must not invalidate what autograd saved)."""
        source = common_rank(self, not joined) if self._join_config.enable else 0
        buffers = synced_states(self.module, buffers=True, parameters=False)
        with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            self._broadcast(buffers, source)

    def _broadcast(self, tensors, source):
        tensors = [local_of(t) for t in tensors]  # a DTensor's shard, over the DP group only
        if tensors and dist.get_world_size(self.process_group) > 1:
            with torch.no_grad():
                dist._broadcast_coalesced(self.process_group, tensors, _BROADCAST_BUCKET_BYTES,
                                          source)

    def _checked_reducer(self):
        """The C++ reducer, once a collective that failed in the background (NCCL watchdog) has
        raised: setters report it like forward does."""
        reducer = self._live_reducer()
        self._transport.check()
        return reducer

    def _live_reducer(self):
        """The C++ reducer; a closed or unpickled model has none until attached again."""
        if self._reducer is None:
            raise RuntimeError("FusedReducer: this model was closed or unpickled; run a forward "
                               "(after unpickling) or wrap the module again (after close())")
        return self._reducer

    def _reattach(self):
        """After unpickling: attach to the default process group again (collective). A model
        with DTensor parameters attaches to the data-parallel group it had, found by its name
        as DeviceMesh finds its groups after unpickling: the default group holds its
        tensor-parallel ranks too (Note [Copies of DTensor models])."""
        self.process_group = _resolve_group(group_named(self.__dict__.get("_dp_group_name")))
        named = reduced_parameters(self.module)
        self._tp = TensorParallelParameters(self.module, named, self.process_group)
        self._has_tp = bool(self._tp)
        self._attach(self._tp.reduced(named))

    # -- uneven inputs (DDP's join) --------------------------------------------------------------
    def join(self, divide_by_initial_world_size=True, enable=True,
             throw_on_early_termination=False):
        """Context manager for uneven inputs, as ``DistributedDataParallel.join``: ranks that run
        out of batches shadow the others' collectives until every rank is done. Composes with
        other Joinables (e.g. ZeroRedundancyOptimizer) through
        ``torch.distributed.algorithms.Join([model, optimizer])``."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def _reducer_params(self):
        """The trainable parameters, in the reducer's index order."""
        return self._params

    def _module_params(self):
        """The module's parameters in the reducer's index order (DTensors where the reducer holds
        their leaves)."""
        return self._tp.module_params(self._params)

    @property
    def _attachment(self):
        """What join, the sharded optimizer and the tuning layer use of this model: the group,
        transport, C++ reducer and parameters, and the few step decisions they share (see
        core/attachment.py). They reach nothing else of the wrapper."""
        return Attachment(self)

    @torch.compiler.disable
    def _finish_param_gather(self):
        """A ShardedOptimizer's parameter all-gathers left in flight by step()
        (overlap_param_gather): finished. See Note [Overlapped parameter all-gather]."""
        optimizer = self._live_sharded_optimizer()
        if optimizer is not None and optimizer._gathers:
            optimizer.finish_param_gather()

    def _live_sharded_optimizer(self):
        """The ShardedOptimizer of this model, None if there is none (or it was dropped)."""
        ref = self.__dict__.get("_sharded_optimizer")
        return ref() if ref is not None else None

    @torch.compiler.disable
    def _before_sharded_forward(self, traced):
        """Before a sharded forward's module runs: when this forward records a graph, the
        released-gradient placeholders are cleared, so that neither the forward nor autograd's
        accumulation ever sees one (Note [Released gradients] in ext/reducer.cpp); `traced`:
        this forward is being compiled (Note [Overlapped parameter all-gather])."""
        if torch.is_grad_enabled():
            self._reducer.clear_released_gradients()
        optimizer = self._live_sharded_optimizer()
        if optimizer is not None:
            optimizer.finish_before_forward(traced)

    def state_dict(self, *args, **kwargs):
        self._finish_param_gather()
        return super().state_dict(*args, **kwargs)

    def _use_sharded_optimizer(self, optimizer):
        """A ShardedOptimizer was constructed for this model: reduce-scatter from the next forward
        on (Note [Sharded mode] in ext/reducer.cpp). Collective in effect: every rank constructs
        it."""
        if self._tuner is not None and self._tuner.state != "done":
            raise FusedReducerError(
                "ShardedOptimizer: autotune is still measuring with all-reduce; construct the "
                "ShardedOptimizer before starting it (FusedReducer(..., autotune=False), then "
                "model.autotune() after the ShardedOptimizer), or let it finish "
                "(autotune_report()['done'])")
        self._enter_sharded_mode()
        self._sharded = True
        self._sharded_optimizer = weakref.ref(optimizer)

    def _enter_sharded_mode(self):
        self._reducer.set_sharded(True)  # raises naming what it cannot combine with
        self._reducer.set_released_gradients(
            [_ReleasedGradient(p, name) for p, name in zip(self._params, self._param_names)])

    def join_hook(self, **kwargs):
        if getattr(self, "_sharded", False):
            raise FusedReducerError(
                "FusedReducer.join: uneven inputs are not supported with a ShardedOptimizer yet "
                "(a joined rank would have to shadow reduce-scatters and all-gathers); give every "
                "rank the same number of batches, or use a plain optimizer")
        if self._tuner is not None and self._tuner.state != "done":
            raise FusedReducerError(
                "FusedReducer.join: autotune is still measuring; its per-step collectives cannot "
                "be shadowed by joined ranks. Let it finish (autotune_report()['done']) or "
                "construct without autotune for uneven inputs.")
        return FusedReducerJoinHook(
            self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self):
        return self._control_device

    @property
    def join_process_group(self):
        return self.process_group

    def _set_divide_factor(self, join_work):
        """Under join gradients are divided by an explicit count: the world size, or the ranks
        still training (divide_by_initial_world_size=False), read from the join notification."""
        if join_work is None:
            factor = 0
        elif self._divide_by_initial_world_size:
            factor = dist.get_world_size(self.process_group)
        else:
            factor = int(join_work.get_future().wait()[0].item())
        if factor != self._divide_factor:
            self._reducer.set_divide_factor(factor)
            self._divide_factor = factor

    # -- DDP communication hooks -----------------------------------------------------------------
    def register_comm_hook(self, state, hook):
        """Reduce every bucket with a DDP communication hook ``hook(state, bucket) -> Future``
        (e.g. from torch.distributed.algorithms.ddp_comm_hooks) instead of the built-in
        all-reduce. As in DDP it can be registered once, on every rank; the bucket a hook sees is
        a GradBucket (index(), buffer(), gradients(), parameters(), is_last(), set_buffer()).
        With a reduce_dtype the bucket (buffer and gradients) holds that dtype; the hook's result
        is cast back into param.grad in the gradient's dtype.

        Over an NCCL process group the model must reduce through that group
        (``backend="process_group"``, DDP's arrangement: one communicator): with FusedReducer's
        own NCCL communicator in use (``backend="nccl"``, which "auto" picks on CUDA) this raises
        FusedReducerError naming the fix. See Note [One NCCL communicator]."""
        check_hook(hook)
        if getattr(self, "_sharded", False):
            raise FusedReducerError(
                f"FusedReducer: cannot register communication hook {_name_of(hook)}: a "
                "ShardedOptimizer reduce-scatters this model's buckets, and a hook replaces the "
                "all-reduce; use one or the other")
        if self._comm_hook is not None:
            raise FusedReducerError(
                "FusedReducer: register_comm_hook can only be called once (as in DDP); "
                f"a hook ({_name_of(self._comm_hook[1])}) is already registered")
        if self.backend == "nccl" and _runs_nccl(self.process_group):
            chosen = (" (chosen by backend='auto')"
                      if getattr(self, "_backend_request", "nccl") == "auto" else "")
            raise FusedReducerError(
                f"FusedReducer: cannot register communication hook {_name_of(hook)}: this model "
                f"reduces its buckets over FusedReducer's own NCCL communicator "
                f"(backend='nccl'{chosen}), while the hook's collectives run on the process "
                "group's NCCL communicator, and the reducer's communicator still runs "
                "collectives of its own (the used-parameter map of find_unused_parameters, "
                "join, autotune's probe). NCCL collectives on two communicators of one device "
                "can deadlock; DDP runs its hooks on its one communicator. Fix: construct the "
                "model with backend='process_group' (FusedReducer(module, "
                "backend='process_group', ...), or FusedReducerStrategy(backend="
                "'process_group') under Lightning), then register the hook: everything then "
                "runs on the process group's communicator, as under DDP.")
        self._comm_hook = (state, hook)
        self._reducer.set_comm_hook(_comm_hook_launcher(self))

    def _run_comm_hook(self, index, is_last, flat, views, params):
        state, hook = self._comm_hook
        # The reducer's parameters: a DTensor parameter's local leaf, shaped like its gradient.
        bucket = GradBucket(index, is_last, flat, views, [self._params[i] for i in params])
        return run_hook(state, hook, bucket)

    def prepare_for_backward(self):
        """Arm the reduction for one more backward of the same forward's graph (DDP's
        ``reducer.prepare_for_backward``): manual optimization with several backward passes per
        training step, e.g. Lightning's ``manual_backward``. Collective like forward."""
        if torch.is_grad_enabled() and self._syncing:
            if self._tuner is not None and not self._require_forward_param_sync:
                # Pipeline schedules run every forward inside no_sync(): the step's reduction is
                # decided here, so the tuner's step starts here (issue 40, 3-D).
                self._tuner.on_forward()
            self._reducer.prepare_forward(will_sync=True)
            self._note_arm(True)

    @contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside accumulate into param.grad without
        communication; the next synchronised backward reduces the accumulated sum. Nests like
        DDP's: on exit (also when the body raises) the previous setting is restored."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @property
    def require_backward_grad_sync(self):
        """DDP's flag, which no_sync() sets: False keeps the backward passes of forwards run
        meanwhile local (accumulated into param.grad); loops and libraries that accumulate
        gradients set it directly, as on DDP."""
        return self._syncing

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value):
        self._syncing = bool(value)
        if self.__dict__.get("_reducer") is not None:
            self._reducer.set_sync_enabled(self._syncing)

    @property
    def require_forward_param_sync(self):
        """DDP's flag: whether the last forward synchronised (buffers are broadcast before the
        next forward only then)."""
        return self._require_forward_param_sync

    @require_forward_param_sync.setter
    def require_forward_param_sync(self, value):
        self._require_forward_param_sync = bool(value)

    @property
    def bucket_bytes_cap(self):
        """DDP's name of bucket_cap_bytes (here settable while training: a rebuild applies it)."""
        return self.bucket_cap_bytes

    @bucket_bytes_cap.setter
    def bucket_bytes_cap(self, nbytes):
        self.bucket_cap_bytes = nbytes

    # -- knobs ---------------------------------------------------------------------------------
    @property
    def broadcast_buffers(self):
        """DDP's deprecated name of forward_sync_buffers (as DDP, reading and setting it)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value):
        self.forward_sync_buffers = value

    @property
    def bucket_caps_bytes(self):
        """Size limits of each (dtype, device) group's buckets in launch order, the last one
        repeating for every later bucket: DDP's ``bucket_cap_mb_list``, in bytes, changeable
        while training. ``first_bucket_bytes`` is its first entry, ``bucket_cap_bytes`` its
        last. Setting it (a non-empty list of ints > 0) rebuilds at the next forward, and
        every later rebuild keeps it, like the other limits."""
        return list(self._live_reducer().bucket_caps_bytes)

    @bucket_caps_bytes.setter
    def bucket_caps_bytes(self, caps):
        self._checked_reducer().bucket_caps_bytes = check_bucket_caps(caps)

    @property
    def first_bucket_bytes(self):
        """Size limit of the first bucket to launch. Setting it rebuilds the layout at the next
        forward from the last observed gradient order; the value persists across rebuilds."""
        return self._live_reducer().first_bucket_bytes

    @first_bucket_bytes.setter
    def first_bucket_bytes(self, nbytes):
        self._checked_reducer().first_bucket_bytes = check_bytes("first_bucket_bytes", nbytes)

    @property
    def bucket_cap_bytes(self):
        """Size limit of every bucket after the first; same rules as first_bucket_bytes."""
        return self._live_reducer().bucket_cap_bytes

    @bucket_cap_bytes.setter
    def bucket_cap_bytes(self, nbytes):
        self._checked_reducer().bucket_cap_bytes = check_bytes("bucket_cap_bytes", nbytes)

    @property
    def last_bucket_bytes(self):
        """Size of a separate last bucket (0 = none): the last gradients of backward, at least
        this many bytes, reduced on their own so the reduction left after backward is short.
        Same rules as first_bucket_bytes; 0 or None turns it off."""
        return self._live_reducer().last_bucket_bytes

    @last_bucket_bytes.setter
    def last_bucket_bytes(self, nbytes):
        if nbytes is None or (isinstance(nbytes, int) and not isinstance(nbytes, bool)
                              and nbytes == 0):
            nbytes = 0
        elif isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes < 0:
            raise ValueError(f"last_bucket_bytes must be 0 or None (off) or a positive number of "
                             f"bytes, got {nbytes}")
        else:
            nbytes = check_bytes("last_bucket_bytes", nbytes)
        self._checked_reducer().last_bucket_bytes = nbytes

    @property
    def reduce_dtype(self):
        """dtype of the buckets of floating-point gradients (None: each gradient's own). Setting
        it (torch.bfloat16, torch.float16, torch.float32 or None) follows first_bucket_bytes'
        rules: collective, applied by a rebuild at the next forward, kept by later rebuilds,
        rank 0's value wins. Gradients are scaled, cast into the bucket, reduced, and cast back
        into param.grad in their own dtype; bucket limits count bytes of this dtype.
        See docs/REDUCE_DTYPE.md."""
        return self._live_reducer().reduce_dtype

    @reduce_dtype.setter
    def reduce_dtype(self, dtype):
        dtype = check_reduce_dtype(dtype)
        _check_bucket_view_dtypes(
            self.gradient_as_bucket_view, dtype,
            reduced_parameters(self.module))
        self._checked_reducer().reduce_dtype = dtype
        self._reduce_dtype = dtype

    def rebuild_buckets(self):
        """Rebuild the layout at the next forward from the last observed gradient-ready order."""
        self._live_reducer().request_rebuild()

    # -- autotune ------------------------------------------------------------------------------
    def autotune(self, **options):
        """Start tuning first_bucket_bytes, bucket_cap_bytes and last_bucket_bytes from measured
        steps while training goes on (collective: call on every rank). Gradients stay exact: a
        new layout only takes effect at a forward. When done, the choice is the value of the
        properties. Options: see fused_reducer.tuning.autotune.Autotuner."""
        from ..transports.transport import control_allreduce
        autotuner = tool("autotuner", "FusedReducer.autotune")
        self._checked_reducer()
        try:
            tuner, refused = autotuner(self, **options), None
        except (ValueError, TypeError, OSError) as e:
            tuner, refused = None, e
        # Every rank agrees before any goes on: a planner_hint file missing on some rank only
        # must not leave the others tuning alone (their collectives would wait for it).
        ok, = control_allreduce([0.0 if refused else 1.0], dist.ReduceOp.MIN,
                                self.process_group, self._control_device)
        if refused is not None:
            raise refused
        if not ok:
            raise FusedReducerError("FusedReducer.autotune: another rank refused these options "
                                    "(its error says why, e.g. a planner_hint file it cannot "
                                    "read); tuning was not started on any rank")
        if self._tuner is not None:
            self._tuner.abandon()  # a restart starts from the user's limits, not a trial's
        self._tuner = tuner

    def autotune_report(self):
        """{done, trials: [{first_bucket_bytes, bucket_cap_bytes, last_bucket_bytes, step_ms,
        ...}], choice: {...} or None, ...}; see docs/TUNING.md."""
        if self._tuner is None:
            return {"done": False, "state": "not started", "trials": [], "choice": None}
        return self._tuner.report()

    # -- training health -------------------------------------------------------------------------
    def straggler_report(self):
        """Which ranks are late, from each rank's slack: how long it waited for the others in
        the step's collectives, its last bucket's and its forward's (Note [Lateness from slack]
        in ext/training_health.cpp), exchanged every `straggler_interval` steps (every step
        with check_finite): lateness_ms (per rank: how long after the earliest rank it reached
        them, median of its last `straggler_window` steps; None: not measured), slack_ms (per
        rank: that wait, the same median),
        slowest, stragglers (late beyond threshold_ms in the last exchange), late_steps (per
        rank, steps late in a row; the warning comes at straggler_warn_steps), threshold_ms
        (straggler_threshold_ms, or automatic: 15 % of median_step_ms, and at least jitter_ms,
        the ranks' median step-to-step scatter of their slack, and 1 ms: Note [A straggler is
        late relative to the step] in ext/training_health.cpp), median_step_ms, jitter_ms,
        step (of the last exchange, 0: none yet), interval, window, measured (whether any
        rank's lateness is known yet).
        On CPU the slack is read off the host clock; on GPU buckets off CUDA timing events on
        the compute stream, once the device has finished them (Note [Lateness from slack on
        the GPU] in ext/reducer.cpp). The same on every rank; local, no collective."""
        report = dict(self._checked_reducer().straggler_report())
        for key in ("lateness_ms", "slack_ms"):
            report[key] = [None if math.isnan(v) else v for v in report[key]]
        report["measured"] = any(v is not None for v in report["lateness_ms"])
        return report

    def grad_norm(self, norm_type=2.0):
        """The global norm of the averaged gradients: what
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type) computes, read
        for norm_type 1, 2 and inf from what the unpack into param.grad accumulated (Note
        [Statistics from the copy] in ext/bucket_copy.h): no pass over the gradients. If
        param.grad changed since that backward wrote it (clipped, unscaled, accumulated, or set
        by hand), or for another norm_type, it is computed by torch from param.grad; so is it
        before the first backward after the model's first grad_norm() call (from then on each
        backward keeps three elements of each gradient to see changes the version counter
        misses). With a ShardedOptimizer: its norm over the shards (collective: call on every
        rank)."""
        norm_type = float(norm_type)
        if self._sharded:
            return self._sharded_optimizer_for("grad_norm").grad_norm(norm_type)
        # Asked first, even with no gradients yet: from then on each backward keeps the probes
        # that tell an unchanged param.grad (Reducer::copy_norms), so that call itself is
        # torch's computation.
        from_copy = self._norm_from_copy(norm_type)
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        if self._has_tp:
            return self._tensor_parallel_norm(grads, norm_type, from_copy is not None)
        # The copy saw only the reduced parameters' gradients: a frozen or ignored parameter
        # that holds a .grad counts in torch's norm over model.parameters() too.
        total = from_copy if len(grads) == self._reduced_grads() else None
        self._norm_source = "copy" if total is not None else "torch"
        if total is None:
            return torch.nn.utils.get_total_norm(grads, norm_type)
        return total.to(device=grads[0].device, dtype=_norm_dtype(grads))

    def _tensor_parallel_norm(self, grads, norm_type, copy_usable):
        """grad_norm() with DTensor parameters: torch's norm over DTensor gradients (shards
        summed over their tensor-parallel groups, replicated ones counted once), from the copy's
        statistics where they cover every gradient (collective over the tensor-parallel
        groups). A frozen or ignored parameter's gradient counts as replicated."""
        reduced = [p.grad for p in self._params]
        extra = len(grads) - self._reduced_grads()
        copied = None
        if copy_usable and extra == 0:
            copied = tuple(self._reducer.copy_norms().tolist())
        self._norm_source = "copy" if copied is not None else "torch"
        others = []
        if extra:
            mine = {id(e.param) for e in self._tp.entries.values()} | {id(p) for p in self._params}
            others = [local_of(p.grad) for p in self.module.parameters()
                      if p.grad is not None and id(p) not in mine]
        total = self._tp.global_norm(reduced, norm_type, self._control_device, copied, others)
        return total.to(device=local_of(grads[0]).device, dtype=_norm_dtype(grads))

    def _reduced_grads(self):
        return sum(p.grad is not None for p in self._params)

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """torch.nn.utils.clip_grad_norm_(model.parameters(), ...) with the norm from
        grad_norm() (no pass over the gradients to measure them; one to scale them, torch's
        clip_grads_with_norm_, as torch does). Returns the total norm. With a
        ShardedOptimizer: its clip_grad_norm_ (collective)."""
        if self._sharded:
            return self._sharded_optimizer_for("clip_grad_norm_").clip_grad_norm_(
                max_norm, norm_type, error_if_nonfinite)
        total = self.grad_norm(norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"FusedReducer.clip_grad_norm_: the total norm of order {float(norm_type)} of the "
                "gradients is non-finite, so it cannot be clipped. To disable this error and "
                "scale the gradients by the non-finite norm anyway, set error_if_nonfinite=False")
        grads = [p for p in self.module.parameters() if p.grad is not None]
        if self._has_tp:  # scale the plain leaves, whose storage the DTensor gradients view
            grads = self._tp.clip_targets(grads)
        if grads:
            torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total, foreach)
        return total

    def _norm_from_copy(self, norm_type):
        norms = None if self._reducer is None else self._reducer.copy_norms()
        if norms is None or norm_type not in (1.0, 2.0, math.inf):
            return None
        sum_sq, sum_abs, max_abs = norms.tolist()
        if not math.isfinite(sum_abs):
            return None  # a NaN/Inf (or a CUDA float sum past its range): torch's norm says which
        if norm_type == 2.0:
            return torch.tensor(math.sqrt(sum_sq), dtype=torch.float64)
        if norm_type == 1.0:
            return torch.tensor(sum_abs, dtype=torch.float64)
        return torch.tensor(max_abs, dtype=torch.float64)

    def _sharded_optimizer_for(self, what):
        optimizer = self._live_sharded_optimizer()
        if optimizer is None:
            raise FusedReducerError(
                f"FusedReducer.{what}: this model is in sharded mode but its ShardedOptimizer "
                "is gone; the averaged gradients exist only as its shards")
        return optimizer

    # -- introspection -------------------------------------------------------------------------
    def bucket_sizes(self):
        """Bytes per bucket of the layout in force, in launch order."""
        return list(self._live_reducer().bucket_sizes())

    def bucket_parameter_names(self):
        """Parameter names per bucket of the layout in force, in launch order."""
        return [[self._param_names[i] for i in bucket] for bucket in self._live_reducer().bucket_params()]

    def stats(self):
        """step; allreduces and allreduce_bytes: the gradients' collectives of the last
        completed step (one per bucket, plus the used map's with find_unused_parameters, as
        DDP); health_exchanges and health_exchange_bytes: that step's check_finite / straggler
        exchange, counted apart (every step with check_finite, else every straggler_interval
        steps); rebuilds, limits, reduce_dtype (of the layout in force: str(torch.dtype) or None);
        telemetry of the last step: buckets_detail (per bucket: bytes, params, ready_first_us,
        ready_last_us, launch_us, pack_us, complete_us, wait_us; microseconds after the step's
        first gradient), overlap, exposed_wait_us, backward_end_us."""
        return dict(self._live_reducer().stats())

    def step_history(self):
        """Telemetry of the last steps kept (at most trace_steps), oldest first: one dict per
        step like stats()'s telemetry, with the limits in force and per-bucket records."""
        return list(self._live_reducer().history())

    @property
    def trace_steps(self):
        """How many steps of telemetry are kept for step_history() and export_trace()."""
        return self._trace_steps

    @trace_steps.setter
    def trace_steps(self, steps):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
            raise ValueError(f"trace_steps must be a positive int, got {steps!r}")
        self._trace_steps = steps
        if self._reducer is not None:
            self._reducer.set_trace_capacity(steps)

    def export_trace(self, path, steps=None):
        """Write the telemetry of the last `steps` steps (default all kept) as a Chrome trace
        (JSON, opens in Perfetto / chrome://tracing): a row for the step, one for backward and
        the end-of-backward wait, one per bucket (fill, copy, all-reduce, exposed wait). `path`
        may contain "{rank}". Returns the path written."""
        write_chrome_trace = tool("write_chrome_trace", "FusedReducer.export_trace")
        history = self.step_history()
        if steps is not None:
            history = history[-int(steps):] if int(steps) > 0 else []
        rank = dist.get_rank(self.process_group)
        path = str(path).format(rank=rank)
        write_chrome_trace(path, history, rank=rank,
                           meta={"transport": self._reducer.stats()["transport"],
                                 "world_size": dist.get_world_size(self.process_group)})
        return path

    def export_profile(self, path):
        """Write this run's profile (JSON, versioned) for `python -m fused_reducer.plan`:
        per-parameter bytes and median ready times, step phases, limits, probed transport,
        machine (docs/PLANNING.md). Collective: call on every rank after >= 2 steps; rank 0
        writes `path` (every rank with "{rank}" in it). Returns the path written or None."""
        export_profile = tool("export_profile", "FusedReducer.export_profile")
        self._checked_reducer()
        return export_profile(self, path)

    # -- debug logging (FUSED_REDUCER_DEBUG=1) ---------------------------------------------------
    def _log_layout(self, what):
        sizes = self.bucket_sizes()
        _log.debug("rank %d: %s: first_bucket_bytes=%d bucket_cap_bytes=%d last_bucket_bytes=%d; "
                   "%d buckets (MiB, launch order) %s", dist.get_rank(self.process_group), what,
                   self.first_bucket_bytes, self.bucket_cap_bytes, self.last_bucket_bytes,
                   len(sizes), [round(b / 2**20, 3) for b in sizes])

    def _log_rebuild(self):
        rebuilds = self._reducer.stats()["rebuilds"]
        if rebuilds != self._rebuilds_seen:
            self._rebuilds_seen = rebuilds
            self._log_layout(f"layout rebuilt (rebuild {rebuilds})")


def _debug_enabled():
    """FUSED_REDUCER_DEBUG=1: debug records of the 'fused_reducer' logger are shown on stderr
    (a handler is added unless the application configured one)."""
    if os.environ.get(DEBUG_ENV, "").strip() in ("", "0"):
        return False
    if _log.level == logging.NOTSET or _log.level > logging.DEBUG:
        _log.setLevel(logging.DEBUG)
    if not _log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[fused_reducer %(levelname)s] %(message)s"))
        _log.addHandler(handler)
    return True


_live_reducers = weakref.WeakSet()


# Seconds the exit handler waits for the backend threads to let go of the reducer's collectives.
EXIT_SETTLE_S = 2.0


@atexit.register
def _close_live_reducers():
    """At interpreter exit, before Python finalises: release every communicator still open
    (bounded: see close()), then wait for the process group's threads to let go of the
    collectives the reducer launched, so that none of them is destroyed on such a thread while
    Python shuts down (an abort at exit; Note [Releasing process-group work], Note [Process
    life] in ext/transport.h)."""
    for model in list(_live_reducers):
        try:
            model.close()
        except Exception:  # noqa: BLE001 - exit must go on
            pass
    _C.settle_released_works(EXIT_SETTLE_S)


def _comm_hook_launcher(model):
    """What the C++ reducer calls when a bucket is complete and a hook is registered. It holds
    the model weakly: the reducer (owned by the model) must not keep the model alive."""
    ref = weakref.ref(model)

    def launch(index, is_last, flat, views, params):
        return ref()._run_comm_hook(index, is_last, flat, views, params)

    return launch


def _name_of(hook):
    return getattr(hook, "__qualname__", None) or repr(hook)
