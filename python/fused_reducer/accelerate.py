"""Hugging Face accelerate on FusedReducer: accelerate's ``Accelerator``, with the model wrapped in
``FusedReducer`` wherever accelerate would wrap it in ``DistributedDataParallel``.

    from fused_reducer.accelerate import Accelerator  # was: from accelerate import Accelerator
    accelerator = Accelerator(fused_reducer_kwargs={"first_bucket_mb": 16})
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

Everything else is accelerate's: the launch (``accelerate launch``, torchrun), device placement,
mixed precision (autocast), data loaders, ``accumulate()`` / ``no_sync`` (FusedReducer.no_sync),
``backward``, ``gather``, ``save_state`` / ``load_state`` (the unwrapped model's weights, as with
DDP). What the user gave accelerate for DDP (``DistributedDataParallelKwargs``: bucket_cap_mb,
find_unused_parameters, gradient_as_bucket_view, broadcast_buffers, comm_hook, ...) is passed to
FusedReducer, whose own ``fused_reducer_kwargs`` win where both name an argument; a DDP argument
FusedReducer refuses (``static_graph=True``) raises at ``prepare()`` naming it and what to use.
Distributed set-ups that do not use DDP (DeepSpeed, FSDP, Megatron-LM, XLA, tensor parallelism)
are refused at construction: nothing runs without FusedReducer silently.

What this class changes in accelerate, and why (checked against accelerate 1.16):
- ``prepare_model``: accelerate's own, with ``evaluation_mode=True`` (device placement, autocast,
  torch.compile; no DDP), then ``FusedReducer`` around the result and accelerate's comm hook
  registration (``DistributedDataParallelKwargs.register_comm_hook``).
- ``unwrap_model`` (and so ``get_state_dict``, ``save_model`` and transformers' Trainer):
  accelerate's ``extract_model_from_parallel`` unwraps DDP, DataParallel, DeepSpeed and FSDP
  only; the FusedReducer is peeled first, so saved weights carry no ``module.`` prefix.
- ``trigger_sync_in_backward``: accelerate's checks ``isinstance(model, DistributedDataParallel)``;
  for a FusedReducer it arms the next backward (``FusedReducer.prepare_for_backward``).
- ``clip_grad_norm_``: for the parameters of a model whose optimizer is a ShardedOptimizer the
  gradients exist only as shards, so the norm is the optimizer's (over all shards, collective).
"""
import inspect
import weakref
from contextlib import contextmanager

import accelerate
from accelerate.utils import DistributedDataParallelKwargs, DistributedType

from .core.wrapper import FusedReducer
from .sharded.optimizer import ShardedOptimizer

TESTED_ACCELERATE = "1.16.0"

# FusedReducer's constructor arguments (the module aside), which fused_reducer_kwargs may name.
REDUCER_ARGUMENTS = tuple(name for name in inspect.signature(FusedReducer.__init__).parameters
                          if name not in ("self", "module"))

# Distributed types under which accelerate does not wrap in DDP: there is nothing to replace.
_NOT_DDP = {
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.FSDP: "FSDP",
    DistributedType.MEGATRON_LM: "Megatron-LM",
    DistributedType.XLA: "XLA",
}

__all__ = ["Accelerator", "REDUCER_ARGUMENTS", "TESTED_ACCELERATE", "check_reducer_kwargs"]


def check_reducer_kwargs(kwargs, where):
    """A copy of `kwargs` (None: empty) if every name is FusedReducer's, else TypeError."""
    kwargs = dict(kwargs or {})
    unknown = sorted(set(kwargs) - set(REDUCER_ARGUMENTS))
    if unknown:
        raise TypeError(
            f"{where}: fused_reducer_kwargs has {', '.join(map(repr, unknown))}, which "
            f"fused_reducer.FusedReducer does not take; it takes: {', '.join(REDUCER_ARGUMENTS)}")
    if "module" in kwargs:
        raise TypeError(f"{where}: fused_reducer_kwargs must not name the module; prepare() "
                        "wraps the model it is given")
    return kwargs


def _version_error(what):
    return RuntimeError(
        f"fused_reducer.accelerate relies on {what}, which the installed accelerate "
        f"{accelerate.__version__} does not have (tested with accelerate {TESTED_ACCELERATE}); "
        f"install that version (pip install accelerate=={TESTED_ACCELERATE}) or use "
        "accelerate.Accelerator (DDP) instead. Nothing was wrapped in FusedReducer.")


def _check_accelerate_api():
    """What this module uses of accelerate beyond its documented API, checked once per
    construction so that a changed accelerate fails here, not by silently skipping FusedReducer."""
    if "evaluation_mode" not in inspect.signature(accelerate.Accelerator.prepare_model).parameters:
        raise _version_error("Accelerator.prepare_model(..., evaluation_mode=True)")
    for name in ("to_kwargs", "register_comm_hook"):
        if not callable(getattr(DistributedDataParallelKwargs, name, None)):
            raise _version_error(f"DistributedDataParallelKwargs.{name}()")
    if not isinstance(getattr(accelerate.Accelerator, "multi_device", None), property):
        raise _version_error("the Accelerator.multi_device property")


class Accelerator(accelerate.Accelerator):
    """accelerate's Accelerator, wrapping models in ``fused_reducer.FusedReducer`` where
    accelerate would wrap them in DDP. ``fused_reducer_kwargs``: FusedReducer's constructor
    arguments (``first_bucket_mb``, ``bucket_cap_mb``, ``backend``, ``autotune``, ...); they win
    over the same names in a ``DistributedDataParallelKwargs`` handler. Every other argument is
    accelerate's."""

    def __init__(self, *args, fused_reducer_kwargs=None, **kwargs):
        self.fused_reducer_kwargs = check_reducer_kwargs(fused_reducer_kwargs,
                                                         "fused_reducer.accelerate.Accelerator")
        _check_accelerate_api()
        super().__init__(*args, **kwargs)
        if not hasattr(self, "ddp_handler"):
            raise _version_error("the Accelerator.ddp_handler attribute")
        # The FusedReducers prepared here, not kept alive by it (a Trainer that re-creates its
        # accelerator, auto_find_batch_size, drops the old model and its hooks with it).
        self._reducers = weakref.WeakSet()
        self._to_shard = {}  # id(plain optimizer) -> ShardedOptimizer kwargs: shard_when_prepared
        self._refuse_non_ddp_setups()

    def _refuse_non_ddp_setups(self):
        name = _NOT_DDP.get(self.distributed_type)
        config = getattr(self, "parallelism_config", None)
        if name is None and config is not None and (getattr(config, "tp_enabled", False)
                                                    or getattr(config, "cp_enabled", False)):
            name = "tensor/context parallelism (parallelism_config)"
        if name is not None:
            raise ValueError(
                f"fused_reducer.accelerate.Accelerator replaces DistributedDataParallel, which "
                f"accelerate does not use under {name}; use accelerate.Accelerator for {name}, "
                "or launch plain data-parallel training (accelerate launch / torchrun without "
                "that plugin) to train with FusedReducer")

    def _wraps_in_ddp(self, model):
        """Whether accelerate's prepare_model would wrap `model` in DDP (its rule in 1.16)."""
        if self.multi_device:
            return any(p.requires_grad for p in model.parameters())
        return self.distributed_type == DistributedType.MULTI_CPU

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if (evaluation_mode or getattr(model, "_is_accelerate_prepared", False)
                or not self._wraps_in_ddp(model)):
            return super().prepare_model(model, device_placement, evaluation_mode)
        # accelerate's preparation without its DDP: placement, autocast, torch.compile.
        model = super().prepare_model(model, device_placement, evaluation_mode=True)
        if isinstance(model, FusedReducer):  # wrapped by the user: kept, not wrapped twice
            self._reducers.add(model)
            return model
        from_ddp = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        arguments = {**from_ddp, **self.fused_reducer_kwargs}
        try:
            reducer = FusedReducer(model, **arguments)
        except (TypeError, ValueError, RuntimeError) as e:
            raise type(e)(
                f"fused_reducer.accelerate.Accelerator.prepare: FusedReducer(model, "
                f"**{arguments}) (DistributedDataParallelKwargs gave {from_ddp}, "
                f"fused_reducer_kwargs {self.fused_reducer_kwargs}) refused: {e}") from e
        if self.ddp_handler is not None:
            self.ddp_handler.register_comm_hook(reducer)  # comm_hook / comm_wrapper, as for DDP
        reducer._is_accelerate_prepared = True
        self._reducers.add(reducer)
        return reducer

    def shard_when_prepared(self, optimizer, **sharded_kwargs):
        """Have ``prepare()`` replace `optimizer` (a fresh torch optimizer over a model prepared
        before it, or earlier in the same call) by ``ShardedOptimizer(model, type(optimizer),
        its param groups, **sharded_kwargs)``: the way to a ShardedOptimizer for code that
        builds its optimizer before the model is wrapped (transformers' Trainer)."""
        if optimizer.state:
            raise ValueError("shard_when_prepared: the optimizer has state already (it has "
                             "stepped); shard a fresh one, or load its state_dict() into the "
                             "ShardedOptimizer afterwards (the plain format)")
        self._to_shard[id(optimizer)] = sharded_kwargs

    def prepare_optimizer(self, optimizer, device_placement=None):
        sharded_kwargs = self._to_shard.pop(id(optimizer), None)
        if sharded_kwargs is not None:
            optimizer = ShardedOptimizer(self._reducer_of(optimizer), type(optimizer),
                                         params=[dict(g) for g in optimizer.param_groups],
                                         **sharded_kwargs)
        return super().prepare_optimizer(optimizer, device_placement)

    def _reducer_of(self, optimizer):
        params = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
        for reducer in list(self._reducers):
            if params <= {id(p) for p in reducer.attachment.params}:
                return reducer
        raise ValueError(
            "fused_reducer.accelerate.Accelerator.prepare: a ShardedOptimizer needs its model's "
            "FusedReducer, and no model prepared so far holds all of this optimizer's "
            "parameters; prepare the model first (or before the optimizer in the same call)")

    def unwrap_model(self, model, keep_fp32_wrapper=True, keep_torch_compile=True):
        if isinstance(model, FusedReducer):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    @staticmethod
    @contextmanager
    def trigger_sync_in_backward(model):
        if not isinstance(model, FusedReducer):
            with accelerate.Accelerator.trigger_sync_in_backward(model):
                yield
            return
        model.prepare_for_backward()
        yield

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        sharded = self._sharded_optimizer_of(parameters)
        if sharded is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        # No unscaling to do: a ShardedOptimizer refuses fp16's GradScaler (use bf16 autocast).
        return sharded.clip_grad_norm_(max_norm, norm_type)

    def _sharded_optimizer_of(self, parameters):
        """The ShardedOptimizer of the prepared model that `parameters` belong to, or None."""
        given = {id(p) for p in parameters if p.requires_grad}
        for reducer in list(self._reducers):
            optimizer = reducer.attachment.sharded_optimizer
            if optimizer is None:
                continue
            owned = {id(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
            if not given & owned:
                continue
            if given != owned:
                raise ValueError(
                    "fused_reducer.accelerate.Accelerator.clip_grad_norm_: with a "
                    "ShardedOptimizer the gradients exist only as shards, and the norm is the "
                    "optimizer's over all of its parameters; pass all of them "
                    "(accelerator.clip_grad_norm_(model.parameters(), ...)), not a subset or a mix")
            return optimizer
        return None

