"""FusedReducer: the nn.Module users wrap their model with, DDP's face.

Python does the once-per-construction and once-per-forward work (checks, broadcasts, the safe
point for rebuilds); every per-gradient step runs in the C++ reducer (ext/reducer.cpp). What the
model is attached to (group, transport, C++ reducer, parameters) is its Attachment
(core/attachment.py), built from its ReducerConfig (core/config.py); the rest lives beside it:
which backward is reduced (core/backward_arming.py), norms (core/norms.py), the sharded mode
(core/sharded_mode.py), copies (core/copies.py), reports and exports (core/reports.py).
"""
import atexit
import warnings
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from .. import _C
from ..errors import FusedReducerError
from ..settings import as_byte_list, as_bytes, as_reduce_dtype
from ..transports.transport import resolve_backend
from .attachment import Attachment
from .backward_arming import BackwardArming
from .comm_hooks import bucket_launcher, check_hook, hook_name
from .config import ReducerConfig
from .copies import copied_state
from .debug_log import LayoutLog, debug_enabled, log
from .join import FusedReducerJoinHook, common_rank, sync_requested
from .module_states import reduced_parameters, synced_states, will_sync_buffers
from .norms import clip_targets, gradient_norm
from .plugins import tool
from .reports import Reports
from .sharded_mode import before_sharded_forward, finish_param_gather
from .tensor_parallel import group_named, refuse_unpicklable_hooks
from .validation import (buffer_sync_settings, check_bucket_view_dtypes, check_device_ids,
                         group_of, refuse_compiled_autograd, refuse_sparse_gradients,
                         refuse_sync_batch_norm_on_cpu, refuse_unsupported_ddp_arguments,
                         refuse_wrapped_twice, resolve_group, runs_nccl)


class FusedReducer(nn.Module, Joinable, Reports):
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


    # Why a ShardedOptimizer cannot be used with this class (a subclass that reduces across
    # replicas that come and go says so here), or None.
    sharded_optimizer_refusal = None

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
        # Every check before the first collective, so that every rank refuses alike.
        refuse_unsupported_ddp_arguments(static_graph, delay_all_reduce_named_params,
                                         param_to_hook_all_reduce)
        if check_reduction:
            warnings.warn("check_reduction is deprecated in DDP and has no effect in "
                          "FusedReducer either (every step reduces every bucket)", FutureWarning,
                          stacklevel=2)
        config = ReducerConfig.from_arguments(
            bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb,
            bucket_cap_mb_list=bucket_cap_mb_list, last_bucket_mb=last_bucket_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            reduce_dtype=reduce_dtype, mixed_precision=mixed_precision, backend=backend,
            timeout=timeout,
            health=dict(check_finite=check_finite, straggler_interval=straggler_interval,
                        straggler_window=straggler_window,
                        straggler_threshold_ms=straggler_threshold_ms,
                        straggler_warn_steps=straggler_warn_steps))
        named = reduced_parameters(module)
        if not named:
            raise FusedReducerError("FusedReducer: the module has no trainable parameters "
                                    "(none with requires_grad=True); there is nothing to reduce")
        refuse_sparse_gradients(module)
        refuse_wrapped_twice(module, FusedReducer)
        check_bucket_view_dtypes(config.gradient_as_bucket_view, config.reduce_dtype, named)
        # Every parameter DDP broadcasts (frozen ones too, not the ignored ones), as DDP checks.
        devices = {p.device for p in synced_states(module, buffers=False)}
        if len(devices) != 1:
            raise FusedReducerError(
                f"FusedReducer: parameters are spread over devices {sorted(map(str, devices))}; "
                "like DDP, each process must hold its replica on one device")
        device = devices.pop()
        check_device_ids(device_ids, output_device, device)
        refuse_sync_batch_norm_on_cpu(module, device)
        forward_sync, init_sync_buffers = buffer_sync_settings(broadcast_buffers,
                                                               forward_sync_buffers)

        # The state of the wrapper, all of it. DDP's attributes first, as DDP sets them (code
        # written for DDP reads them).
        self.module = module
        self.process_group = resolve_group(group_of(process_group, device_mesh))
        self.device_mesh = device_mesh
        self.device = device
        gpu_ids = device_ids is not None and device.type == "cuda"
        self.device_ids = [device.index] if gpu_ids else None
        self.output_device = device.index if gpu_ids else None
        self.dim = dim  # as in DDP with one device per process: kept, not used
        self.batched_grad_copy = batched_grad_copy  # FusedReducer always copies a bucket at once
        self.mixed_precision = mixed_precision
        self.init_sync = init_sync
        self.static_graph = False  # static_graph=True is refused above
        self.forward_sync_buffers = forward_sync
        self.gradient_as_bucket_view = config.gradient_as_bucket_view
        self.find_unused_parameters = config.find_unused_parameters
        self.skip_all_reduce_unused_params = config.skip_all_reduce_unused_params
        self.check_finite = dict(config.health)["check_finite"]
        self.backend = resolve_backend(backend, device)  # the attachment's, once attached
        # FusedReducer's own.
        self._config = config  # the limits in force replace its own when the model is copied
        self._init_sync_buffers = init_sync_buffers
        self._syncing = True  # require_backward_grad_sync
        self._require_forward_param_sync = True  # DDP: buffers sync unless the last forward didn't
        self._divide_by_initial_world_size = True  # join(divide_by_initial_world_size=...)
        self._divide_factor = 0  # what the C++ reducer divides by under join; 0: world size
        self._comm_hook = None  # (state, hook), registered once, kept across attaches
        self._attach_sharded = False  # a copy of a sharded model attaches in sharded mode
        self._trace_steps = 100  # the C++ reducer's default ring size
        self._dp_group_name = None  # a copy with DTensor parameters attaches to this group
        self._norm_source = None  # how the last grad_norm() was computed: "copy" or "torch"
        self._closed = False
        self._layout_log = LayoutLog() if debug_enabled() else None
        self._arming = BackwardArming(self)
        self._attachment = None
        self._attach(named)
        if autotune:
            self.autotune()

    def _attach(self, named):
        """The collective part of construction: see core/attachment.py."""
        self._attachment = Attachment(
            self.module, self._config, self.process_group, self.device, named,
            init_sync=self.init_sync, init_sync_buffers=self._init_sync_buffers,
            hook_registered=self._comm_hook is not None, sharded=self._attach_sharded,
            sharding_refused=self.sharded_optimizer_refusal,
            trace_steps=self._trace_steps)
        if self._comm_hook is not None:
            self._attachment.set_comm_hook(bucket_launcher(*self._comm_hook,
                                                           self._attachment.params))
        self.backend = self._attachment.backend
        self._has_tp = bool(self._attachment.tensor_parallel)  # a plain bool, read by forward
        _live_models.add(self)
        if self._layout_log is not None:
            self._layout_log.attached(self)

    def _reattach(self):
        """After unpickling: attach to the default process group again (collective). A model
        with DTensor parameters attaches to the data-parallel group it had, found by its name
        as DeviceMesh finds its groups after unpickling: the default group holds its
        tensor-parallel ranks too (Note [Copies of DTensor models])."""
        self.process_group = resolve_group(group_named(self._dp_group_name))
        self._attach(reduced_parameters(self.module))

    @property
    def attachment(self):
        """What this model is attached to (core/attachment.py), for the library's own layers;
        None when closed, or unpickled and not yet attached again."""
        return self._attachment

    # -- teardown ------------------------------------------------------------------------------
    def close(self):
        """Remove the gradient hooks and release the communicator: collectives still in flight
        get until ``timeout`` (at most 10 s), then the communicator is aborted, so a dead peer
        never makes exit hang. Not collective; idempotent. Runs at interpreter exit and when the
        model is garbage collected if not called. Raises afterwards if a collective had failed
        in the background. The model cannot be trained after close()."""
        self._closed = True
        attachment, self._attachment = self._attachment, None
        if attachment is not None:
            attachment.close()

    def __del__(self):
        try:
            if self.__dict__.get("_attachment") is not None:
                self.close()
        except Exception:  # noqa: BLE001 - never raise from the garbage collector
            pass

    # -- copies: like DDP, the process group and the reducer are not part of the pickle ---------
    def __getstate__(self):
        if self._has_tp:
            refuse_unpicklable_hooks(self.module)  # See Note [Copies of DTensor models]
        return copied_state(self.__dict__, self._attachment)

    # copy.copy and copy.deepcopy as the default protocol does them (copy._reconstruct), with the
    # state of copied_state: they copy hooks by reference, so a model with torch's TP hooks,
    # which pickle refuses, copies.
    def __copy__(self):
        copied = type(self).__new__(type(self))
        copied.__setstate__(copied_state(self.__dict__, self._attachment))
        return copied

    def __deepcopy__(self, memo):
        import copy
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(copied_state(self.__dict__, self._attachment), memo))
        return copied

    def __setstate__(self, state):
        super().__setstate__(state)
        # Attached again (collectively) at the first forward, in the then default group (with
        # DTensor parameters: the data-parallel group it had, see _reattach).
        self._arming = BackwardArming(self)

    # -- the step ------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._pre_forward()
        attachment = self._attachment
        if attachment.sharded:  # a plain bool: no graph break under torch.compile otherwise
            before_sharded_forward(attachment, torch.compiler.is_compiling())
        if self._has_tp and torch.is_grad_enabled():
            with attachment.tensor_parallel.swapped_in():  # See Note [DTensor parameters]
                output = self.module(*args, **kwargs)
        else:
            output = self.module(*args, **kwargs)
        if attachment.sharded:
            finish_param_gather(attachment)  # before backward refills the buckets
        if self._require_forward_param_sync or (self._has_tp and torch.is_grad_enabled()):
            # See Note [Several forwards before their backwards] in core/backward_arming.py.
            self._arming.hook_outputs(
                output, synced=self._require_forward_param_sync,
                find_unused=self.find_unused_parameters and self._require_forward_param_sync,
                tensor_parallel=self._has_tp, joining=self._join_config.enable)
        return output

    @torch.compiler.disable
    def _pre_forward(self):
        """Once per forward, outside any torch.compile graph: the safe point for rebuilds, the
        join protocol and the buffer broadcast, in DDP's order."""
        if self._attachment is None:
            if self._closed:
                raise RuntimeError("FusedReducer: this model was closed (close()); wrap the module "
                                   "in a new FusedReducer to train it again")
            self._reattach()
        attachment = self._attachment
        reducer = attachment.reducer
        attachment.transport.check()  # a collective that failed in the background raises here
        refuse_compiled_autograd()
        grad_sync = torch.is_grad_enabled() and self._syncing
        if self._join_config.enable:
            with self._waiting_in_forward():
                join_work = Join.notify_join_context(self)
        else:
            join_work = Join.notify_join_context(self)  # no join context: no collective
        self._set_divide_factor(join_work)
        if torch.is_grad_enabled():
            if self._has_tp:
                self._arming.forward_started()
                attachment.tensor_parallel.adopt_gradients()  # See Note [DTensor parameters]
            if attachment.tuner is not None and self._syncing:
                attachment.tuner.on_forward()  # once per step: may set the limits for this step
            reducer.prepare_forward(will_sync=True)
            self._arming.note(reducer, self._syncing)
            if self._layout_log is not None:
                self._layout_log.after_prepare(self)
        if will_sync_buffers(self):
            with self._waiting_in_forward():  # under join: from the highest rank training
                attachment.sync_buffers(common_rank(attachment, True)
                                        if self._join_config.enable else 0)
        warning = reducer.take_straggler_warning()
        if warning:
            log.warning(warning)
        if self._join_config.enable:
            with self._waiting_in_forward():
                # Tells joined ranks whether to shadow backward.
                sync_requested(attachment, self._syncing, joined=False)
        self._require_forward_param_sync = grad_sync

    @contextmanager
    def _waiting_in_forward(self):
        """Around one collective of a forward with grad enabled: a rank late before its forward
        is waited for there, so that wait counts into its straggler slack
        (Reducer::begin_forward_sync). Not ended if the collective raises."""
        timed = torch.is_grad_enabled()
        if timed:
            self._attachment.reducer.begin_forward_sync()
        yield
        if timed:
            self._attachment.reducer.end_forward_sync()

    def _live_reducer(self):
        return self._attachment_or_raise().reducer

    def _checked_reducer(self):
        return self._checked_attachment().reducer

    def state_dict(self, *args, **kwargs):
        finish_param_gather(self._attachment)
        return super().state_dict(*args, **kwargs)

    # -- uneven inputs (DDP's join) --------------------------------------------------------------
    def join(self, divide_by_initial_world_size=True, enable=True,
             throw_on_early_termination=False):
        """Context manager for uneven inputs, as ``DistributedDataParallel.join``: ranks that run
        out of batches shadow the others' collectives until every rank is done. Composes with
        other Joinables (e.g. ZeroRedundancyOptimizer) through
        ``torch.distributed.algorithms.Join([model, optimizer])``."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        attachment = self._attachment_or_raise()
        if attachment.sharded:
            raise FusedReducerError(
                "FusedReducer.join: uneven inputs are not supported with a ShardedOptimizer yet "
                "(a joined rank would have to shadow reduce-scatters and all-gathers); give every "
                "rank the same number of batches, or use a plain optimizer")
        if attachment.tuner is not None and attachment.tuner.state != "done":
            raise FusedReducerError(
                "FusedReducer.join: autotune is still measuring; its per-step collectives cannot "
                "be shadowed by joined ranks. Let it finish (autotune_report()['done']) or "
                "construct without autotune for uneven inputs.")
        self._divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return FusedReducerJoinHook(self, attachment)

    @property
    def join_device(self):
        return self._attachment_or_raise().control_device

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
            self._attachment.reducer.set_divide_factor(factor)
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
        attachment = self._attachment_or_raise()
        if attachment.sharded:
            raise FusedReducerError(
                f"FusedReducer: cannot register communication hook {hook_name(hook)}: a "
                "ShardedOptimizer reduce-scatters this model's buckets, and a hook replaces the "
                "all-reduce; use one or the other")
        if self._comm_hook is not None:
            raise FusedReducerError(
                "FusedReducer: register_comm_hook can only be called once (as in DDP); "
                f"a hook ({hook_name(self._comm_hook[1])}) is already registered")
        if self.backend == "nccl" and runs_nccl(self.process_group):
            chosen = (" (chosen by backend='auto')"
                      if self._config.backend == "auto" else "")
            raise FusedReducerError(
                f"FusedReducer: cannot register communication hook {hook_name(hook)}: this model "
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
        attachment.set_comm_hook(bucket_launcher(state, hook, attachment.params))

    def prepare_for_backward(self):
        """Arm the reduction for one more backward of the same forward's graph (DDP's
        ``reducer.prepare_for_backward``): manual optimization with several backward passes per
        training step, e.g. Lightning's ``manual_backward``. Collective like forward."""
        if torch.is_grad_enabled() and self._syncing:
            attachment = self._attachment_or_raise()
            if attachment.tuner is not None and not self._require_forward_param_sync:
                # Pipeline schedules run every forward inside no_sync(): the step's reduction is
                # decided here, so the tuner's step starts here.
                attachment.tuner.on_forward()
            attachment.reducer.prepare_forward(will_sync=True)
            self._arming.note(attachment.reducer, True)

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
        if self._attachment is not None:
            self._attachment.reducer.set_sync_enabled(self._syncing)

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
        self._checked_reducer().bucket_caps_bytes = as_byte_list(caps)

    @property
    def first_bucket_bytes(self):
        """Size limit of the first bucket to launch. Setting it rebuilds the layout at the next
        forward from the last observed gradient order; the value persists across rebuilds."""
        return self._live_reducer().first_bucket_bytes

    @first_bucket_bytes.setter
    def first_bucket_bytes(self, nbytes):
        self._checked_reducer().first_bucket_bytes = as_bytes("first_bucket_bytes", nbytes)

    @property
    def bucket_cap_bytes(self):
        """Size limit of every bucket after the first; same rules as first_bucket_bytes."""
        return self._live_reducer().bucket_cap_bytes

    @bucket_cap_bytes.setter
    def bucket_cap_bytes(self, nbytes):
        self._checked_reducer().bucket_cap_bytes = as_bytes("bucket_cap_bytes", nbytes)

    @property
    def last_bucket_bytes(self):
        """Size of a separate last bucket (0 = none): the last gradients of backward, at least
        this many bytes, reduced on their own so the reduction left after backward is short.
        Same rules as first_bucket_bytes; 0 or None turns it off."""
        return self._live_reducer().last_bucket_bytes

    @last_bucket_bytes.setter
    def last_bucket_bytes(self, nbytes):
        self._checked_reducer().last_bucket_bytes = 0 if nbytes is None else as_bytes(
            "last_bucket_bytes", nbytes)

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
        self._checked_reducer().reduce_dtype = as_reduce_dtype(dtype)

    def rebuild_buckets(self):
        """Rebuild the layout at the next forward from the last observed gradient-ready order."""
        self._live_reducer().request_rebuild()

    # -- autotune ------------------------------------------------------------------------------
    def autotune(self, **options):
        """Start tuning first_bucket_bytes, bucket_cap_bytes and last_bucket_bytes from measured
        steps while training goes on (collective: call on every rank). Gradients stay exact: a
        new layout only takes effect at a forward. When done, the choice is the value of the
        properties. Options: see fused_reducer.tuning.autotune.Autotuner."""
        start_autotune = tool("autotuner", "FusedReducer.autotune")
        self._checked_reducer()
        tuner = start_autotune(self, **options)
        attachment = self._attachment
        if attachment.tuner is not None:
            attachment.tuner.abandon()  # a restart starts from the user's limits, not a trial's
        attachment.tuner = tuner

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
        attachment = self._attachment_or_raise()
        if attachment.sharded:
            return self._sharded_optimizer_for("grad_norm").grad_norm(norm_type)
        total, source = gradient_norm(attachment, self.module, norm_type)
        if source is not None:
            self._norm_source = source
        return total

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """torch.nn.utils.clip_grad_norm_(model.parameters(), ...) with the norm from
        grad_norm() (no pass over the gradients to measure them; one to scale them, torch's
        clip_grads_with_norm_, as torch does). Returns the total norm. With a
        ShardedOptimizer: its clip_grad_norm_ (collective)."""
        if self._attachment_or_raise().sharded:
            return self._sharded_optimizer_for("clip_grad_norm_").clip_grad_norm_(
                max_norm, norm_type, error_if_nonfinite)
        total = self.grad_norm(norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"FusedReducer.clip_grad_norm_: the total norm of order {float(norm_type)} of the "
                "gradients is non-finite, so it cannot be clipped. To disable this error and "
                "scale the gradients by the non-finite norm anyway, set error_if_nonfinite=False")
        grads = clip_targets(self._attachment, self.module)
        if grads:
            torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total, foreach)
        return total

    def _sharded_optimizer_for(self, what):
        optimizer = self._attachment.sharded_optimizer
        if optimizer is None:
            raise FusedReducerError(
                f"FusedReducer.{what}: this model is in sharded mode but its ShardedOptimizer "
                "is gone; the averaged gradients exist only as its shards")
        return optimizer


_live_models = weakref.WeakSet()

# Seconds the exit handler waits for the backend threads to let go of the reducer's collectives.
EXIT_SETTLE_S = 2.0


@atexit.register
def _close_live_models():
    """At interpreter exit, before Python finalises: close every model still attached (bounded:
    see close()), then wait for the process group's threads to let go of the collectives the
    reducer launched, so that none of them is destroyed on such a thread while Python shuts down
    (an abort at exit; Note [Releasing process-group work], Note [Process life] in
    ext/transport.h)."""
    for model in list(_live_models):
        try:
            model.close()
        except Exception:  # noqa: BLE001 - exit must go on
            pass
    _C.settle_released_works(EXIT_SETTLE_S)
