"""Hugging Face transformers' Trainer on FusedReducer instead of DistributedDataParallel.

    from fused_reducer.transformers import FusedReducerTrainer        # instead of: Trainer
    trainer = FusedReducerTrainer(model=model, args=args, train_dataset=data,
                                  fused_reducer_kwargs={"first_bucket_mb": 16})

    from fused_reducer.transformers import with_fused_reducer         # any Trainer subclass
    trainer = with_fused_reducer(SFTTrainer)(model=model, args=args, ...)

The Trainer is unchanged but for its accelerator, which is ``fused_reducer.accelerate.Accelerator``
built from the Trainer's own arguments: the model is wrapped in ``FusedReducer`` (the Trainer's
``ddp_find_unused_parameters`` / ``ddp_bucket_cap_mb`` / ``ddp_broadcast_buffers`` become its
arguments, ``fused_reducer_kwargs`` win), and ``trainer.model_wrapped`` is that FusedReducer while
training. Gradient accumulation (``no_sync``), ``max_grad_norm``, evaluation, checkpoints and
``train(resume_from_checkpoint=...)``, ``save_model`` (a plain transformers checkpoint) work as
with DDP; see fused_reducer/accelerate.py for what the accelerator changes.

Hook point (not public API, checked at construction):
``Trainer.create_accelerator_and_postprocess`` builds the accelerator as ``Accelerator(**args)``
from the name ``transformers.trainer.Accelerator``; while the Trainer runs it, that name is
FusedReducer's Accelerator (restored right after; do not construct two Trainers concurrently in
two threads). Where a transformers version builds it some
other way, construction raises naming both versions.

A ``ShardedOptimizer`` comes through the Trainer's ``optimizer_cls_and_kwargs``:
``(fused_reducer.ShardedOptimizer, {"optimizer_class": torch.optim.AdamW, "lr": ...,
"master_dtype": ...})``. The Trainer builds its optimizer (of optimizer_class, over its parameter
groups) before the model is wrapped; accelerate's prepare() replaces it by the ShardedOptimizer
on the FusedReducer (Accelerator.shard_when_prepared). Checkpoints save the plain optimizer's
format: the Trainer calls ``optimizer.state_dict()`` on the main process only, a
ShardedOptimizer's is collective, so ``_save_optimizer_and_scheduler`` (not public API, checked
at construction) computes it on every rank first. A ready-made ShardedOptimizer in
``optimizers=`` is refused (it would need the FusedReducer before there is one).
"""
import functools
import inspect
from contextlib import contextmanager

import accelerate
import accelerate.optimizer
import transformers
import transformers.trainer

from .accelerate import Accelerator, check_reducer_kwargs
from .sharded.optimizer import ShardedOptimizer

TESTED_TRANSFORMERS = "5.25.0"

__all__ = ["FusedReducerTrainer", "SHARDED_ARGUMENTS", "TESTED_TRANSFORMERS", "with_fused_reducer"]


def _version_error(what):
    return RuntimeError(
        f"fused_reducer.transformers relies on {what}, which the installed transformers "
        f"{transformers.__version__} does not do (tested with transformers {TESTED_TRANSFORMERS}); "
        f"install that version (pip install transformers=={TESTED_TRANSFORMERS}) or use the "
        "plain Trainer (DDP). Nothing was wrapped in FusedReducer.")


@contextmanager
def _trainer_builds(factory):
    """transformers.trainer's name `Accelerator` is `factory` inside the block."""
    original = getattr(transformers.trainer, "Accelerator", None)
    if original is not accelerate.Accelerator:
        raise _version_error("transformers.trainer building accelerate.Accelerator (the module "
                             "name transformers.trainer.Accelerator)")
    transformers.trainer.Accelerator = factory
    try:
        yield
    finally:
        transformers.trainer.Accelerator = original


# ShardedOptimizer's own arguments (the rest of optimizer_cls_and_kwargs goes to optimizer_class).
SHARDED_ARGUMENTS = tuple(name for name, p in inspect.signature(ShardedOptimizer.__init__)
                          .parameters.items()
                          if name not in ("self", "model", "optimizer_class", "params")
                          and p.kind == p.POSITIONAL_OR_KEYWORD)


def _sharded_request(trainer_name, optimizers, optimizer_cls_and_kwargs):
    """(optimizer_class, its kwargs, ShardedOptimizer's kwargs) when the Trainer is asked for a
    ShardedOptimizer through optimizer_cls_and_kwargs, else None; refuses a ShardedOptimizer
    passed ready-made through optimizers=."""
    if optimizers and isinstance(optimizers[0], ShardedOptimizer):
        raise TypeError(
            f"{trainer_name}: a ready-made ShardedOptimizer cannot be the Trainer's optimizer: "
            "it needs the FusedReducer, which accelerate builds when training starts. Pass "
            "optimizer_cls_and_kwargs=(fused_reducer.ShardedOptimizer, {'optimizer_class': "
            "torch.optim.AdamW, 'lr': ...}) instead: the Trainer then builds it on the "
            "FusedReducer")
    cls, kwargs = optimizer_cls_and_kwargs or (None, None)
    if not (isinstance(cls, type) and issubclass(cls, ShardedOptimizer)):
        return None
    kwargs = dict(kwargs)
    optimizer_class = kwargs.pop("optimizer_class", None)
    if optimizer_class is None:
        raise TypeError(f"{trainer_name}: optimizer_cls_and_kwargs=(ShardedOptimizer, kwargs) "
                        "needs kwargs['optimizer_class'] (e.g. torch.optim.AdamW), the torch "
                        "optimizer each rank runs on its shard")
    sharded = {name: kwargs.pop(name) for name in SHARDED_ARGUMENTS if name in kwargs}
    return optimizer_class, kwargs, sharded


def _inner_optimizer(optimizer):
    while isinstance(optimizer, accelerate.optimizer.AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def with_fused_reducer(trainer_class):
    """A subclass of `trainer_class` (transformers.Trainer or any subclass of it) that trains on
    FusedReducer and takes one more keyword argument, ``fused_reducer_kwargs`` (FusedReducer's
    constructor arguments)."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"with_fused_reducer: expected transformers.Trainer or a subclass of it, "
                        f"got {trainer_class!r}")
    if not callable(getattr(trainer_class, "create_accelerator_and_postprocess", None)):
        raise _version_error("Trainer.create_accelerator_and_postprocess()")
    if getattr(trainer_class, "_trains_on_fused_reducer", False):
        return trainer_class

    class WithFusedReducer(trainer_class):
        _trains_on_fused_reducer = True

        def __init__(self, *args, fused_reducer_kwargs=None, **kwargs):
            name = type(self).__name__
            self.fused_reducer_kwargs = check_reducer_kwargs(fused_reducer_kwargs, name)
            _sharded_request(name, kwargs.get("optimizers"),
                             kwargs.get("optimizer_cls_and_kwargs"))  # refusals before the work
            super().__init__(*args, **kwargs)
            # Also when given positionally (or set by a subclass's __init__).
            self._sharding = _sharded_request(
                name, (self.optimizer,), getattr(self, "optimizer_cls_and_kwargs", None))
            if self._sharding is not None and not callable(
                    getattr(super(), "_save_optimizer_and_scheduler", None)):
                raise _version_error("Trainer._save_optimizer_and_scheduler(output_dir)")

        def create_optimizer(self, model=None):
            """With a ShardedOptimizer requested: the Trainer's own optimizer (its parameter
            groups, weight decay split included) of optimizer_class, which accelerate's
            prepare() then turns into a ShardedOptimizer on the FusedReducer."""
            if self.optimizer is not None or self._sharding is None:
                return super().create_optimizer(model)
            optimizer_class, kwargs, sharded = self._sharding
            requested = self.optimizer_cls_and_kwargs
            self.optimizer_cls_and_kwargs = (optimizer_class, kwargs)
            try:
                optimizer = super().create_optimizer(model)
            finally:
                self.optimizer_cls_and_kwargs = requested
            self.accelerator.shard_when_prepared(optimizer, **sharded)
            return optimizer

        def _save_optimizer_and_scheduler(self, output_dir):
            # The Trainer calls optimizer.state_dict() on the main process only; a
            # ShardedOptimizer's is collective, so every rank computes it first.
            sharded = _inner_optimizer(self.optimizer)
            if not isinstance(sharded, ShardedOptimizer):
                return super()._save_optimizer_and_scheduler(output_dir)
            state = sharded.state_dict()
            sharded.state_dict = lambda: state
            try:
                return super()._save_optimizer_and_scheduler(output_dir)
            finally:
                del sharded.state_dict

        def create_accelerator_and_postprocess(self):
            factory = functools.partial(Accelerator,
                                        fused_reducer_kwargs=self.fused_reducer_kwargs)
            with _trainer_builds(factory):
                super().create_accelerator_and_postprocess()
            if not isinstance(self.accelerator, Accelerator):
                raise _version_error("Trainer.create_accelerator_and_postprocess() building its "
                                     "accelerator as transformers.trainer.Accelerator(**args)")

    base = trainer_class.__name__
    WithFusedReducer.__name__ = WithFusedReducer.__qualname__ = (
        "FusedReducerTrainer" if trainer_class is transformers.Trainer else f"FusedReducer{base}")
    WithFusedReducer.__module__ = __name__
    WithFusedReducer.__doc__ = (f"{base} training on fused_reducer.FusedReducer instead of DDP "
                                "(fused_reducer.transformers.with_fused_reducer). One more "
                                "keyword argument: fused_reducer_kwargs.")
    return WithFusedReducer


FusedReducerTrainer = with_fused_reducer(transformers.Trainer)
