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

``ShardedOptimizer`` is refused through the Trainer's optimizer arguments (see
``_refuse_sharded_optimizer``): use it from a custom loop with fused_reducer.accelerate.
"""
import functools
from contextlib import contextmanager

import accelerate
import transformers
import transformers.trainer

from .accelerate import Accelerator, check_reducer_kwargs
from .sharded import ShardedOptimizer

TESTED_TRANSFORMERS = "5.25.0"

__all__ = ["FusedReducerTrainer", "TESTED_TRANSFORMERS", "with_fused_reducer"]


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


def _refuse_sharded_optimizer(trainer_name, optimizers, optimizer_cls_and_kwargs):
    optimizer = optimizers[0] if optimizers else None
    cls = optimizer_cls_and_kwargs[0] if optimizer_cls_and_kwargs else None
    if isinstance(optimizer, ShardedOptimizer) or (isinstance(cls, type)
                                                   and issubclass(cls, ShardedOptimizer)):
        raise TypeError(
            f"{trainer_name}: a ShardedOptimizer cannot be the Trainer's optimizer: the Trainer "
            "builds its optimizer before accelerate wraps the model (a ShardedOptimizer needs the "
            "FusedReducer), and saves optimizer.state_dict() on the main process only, while a "
            "ShardedOptimizer's state_dict() is collective (each rank holds a shard). Use a "
            "plain torch optimizer with the Trainer (args.optim, optimizers=, "
            "optimizer_cls_and_kwargs=), or a ShardedOptimizer in a custom loop with "
            "fused_reducer.accelerate.Accelerator (prepare the model, then "
            "ShardedOptimizer(model, torch.optim.AdamW, ...), then prepare the optimizer).")


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
            _refuse_sharded_optimizer(name, kwargs.get("optimizers"),
                                      kwargs.get("optimizer_cls_and_kwargs"))
            super().__init__(*args, **kwargs)
            # Also when given positionally (or set by a subclass's __init__).
            _refuse_sharded_optimizer(name, (self.optimizer,),
                                      getattr(self, "optimizer_cls_and_kwargs", None))

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
