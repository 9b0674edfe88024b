"""PyTorch Lightning strategy that wraps the LightningModule in FusedReducer instead of DDP.

    from fused_reducer.lightning import FusedReducerStrategy
    trainer = Trainer(strategy=FusedReducerStrategy(first_bucket_mb=16), accelerator="gpu", devices=8)

FusedReducerStrategy is Lightning's DDPStrategy (same launch, process group, samplers,
checkpointing, precision, logging reductions) with one change: the model is wrapped in
``fused_reducer.FusedReducer(module, **kwargs)``. Every keyword that FusedReducer accepts can be
passed (``first_bucket_mb``, ``bucket_cap_mb``, ``last_bucket_mb``, ``find_unused_parameters``,
``gradient_as_bucket_view``, ``broadcast_buffers``, ``backend``, ``autotune``, ...), next to
DDPStrategy's own arguments. While fitting, ``trainer.strategy.model`` (also
``trainer.strategy.reducer``) is the FusedReducer, so a callback can tune it at runtime:
``trainer.strategy.model.first_bucket_bytes = 32 << 20``. See docs/LIGHTNING.md.

Works with ``pytorch_lightning`` and with ``lightning.pytorch``: the one already imported is
used; when neither (or both) is, ``pytorch_lightning`` is preferred if installed. Importing this
module registers the strategy names ``"fused_reducer"``, ``"fused_reducer_spawn"``,
``"fused_reducer_fork"`` and ``"fused_reducer_find_unused_parameters_true"``.
"""
import importlib
import inspect
import sys
from contextlib import contextmanager
from datetime import timedelta

import torch

_EXTRA_HINT = ("pip install fused_reducer[lightning] (or: pip install --no-build-isolation "
               ".[lightning] from a checkout), which installs pytorch-lightning")
_CANDIDATES = ("pytorch_lightning", "lightning.pytorch")


def _import_lightning():
    """(name, package) of the Lightning trainer package to build the strategy on."""
    loaded = [name for name in _CANDIDATES if name in sys.modules]
    order = (loaded + [n for n in _CANDIDATES if n not in loaded]) if len(loaded) == 1 \
        else list(_CANDIDATES)
    failures = []
    for name in order:
        try:
            return name, importlib.import_module(name)
        except ImportError as e:  # noqa: PERF203 - at most two tries
            failures.append(f"{name}: {e}")
    raise ImportError(
        "fused_reducer.lightning needs PyTorch Lightning (`pytorch_lightning` or "
        f"`lightning.pytorch`), which could not be imported: {'; '.join(failures)}. "
        f"Install the optional extra: {_EXTRA_HINT}.")


LIGHTNING_PACKAGE, _pl = _import_lightning()
_DDPStrategy = importlib.import_module(LIGHTNING_PACKAGE + ".strategies").DDPStrategy
_StrategyRegistry = importlib.import_module(LIGHTNING_PACKAGE + ".strategies").StrategyRegistry
_register_ddp_comm_hook = importlib.import_module(
    LIGHTNING_PACKAGE + ".overrides.distributed")._register_ddp_comm_hook

from .core.wrapper import FusedReducer  # noqa: E402 - after the clear ImportError above

# DDP's device arguments: Lightning places the module itself, so the strategy refuses them
# (FusedReducer itself accepts device_ids/output_device only to confirm the module's device).
_DDP_ONLY_KWARGS = {
    "device_ids": "FusedReducer uses the device the module is on (Lightning moves it there)",
    "output_device": "FusedReducer returns outputs where the module puts them",
    "dim": "FusedReducer does not scatter inputs",
}
_REDUCER_KWARGS = tuple(name for name, p in inspect.signature(FusedReducer.__init__).parameters.items()
                        if name not in ("self", "module") and name not in _DDP_ONLY_KWARGS
                        and p.kind == p.POSITIONAL_OR_KEYWORD)
_STRATEGY_KWARGS = tuple(name for name, p in inspect.signature(_DDPStrategy.__init__).parameters.items()
                        if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
_UNSET = object()

__all__ = ["FusedReducerStrategy", "LIGHTNING_PACKAGE"]


class FusedReducerStrategy(_DDPStrategy):
    """Lightning's DDPStrategy with the model wrapped in ``FusedReducer`` instead of
    ``DistributedDataParallel``.

    Keyword arguments that are not DDPStrategy's own go to ``FusedReducer`` (all of its options,
    e.g. ``first_bucket_mb=16, bucket_cap_mb=25, last_bucket_mb=..., autotune=True``); an unknown
    one raises TypeError here rather than at the first ``fit``. ``timeout`` (a timedelta or
    seconds), when given, is both the process group's timeout (as in DDPStrategy) and the
    reducer's bound on every wait; when not given, each keeps its default. ``ddp_comm_hook`` / ``ddp_comm_state`` / ``ddp_comm_wrapper``
    are registered through ``FusedReducer.register_comm_hook`` on every device (DDPStrategy
    registers them on CUDA only).

    While fitting, ``self.model`` / ``self.reducer`` is the ``FusedReducer``: its runtime knobs
    (``first_bucket_bytes``, ``bucket_cap_bytes``, ``last_bucket_bytes``, ``rebuild_buckets()``,
    ``autotune()``, ``stats()``...) can be used from callbacks. Gradient accumulation
    (``accumulate_grad_batches``) and ``block_backward_sync()`` use ``FusedReducer.no_sync()``.
    As with DDPStrategy, validation inside ``fit`` goes through the wrapper's forward (no
    gradient, no reduction), and ``trainer.validate/test/predict`` run the unwrapped module.
    """

    strategy_name = "fused_reducer"

    def __init__(self, accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision_plugin=None, ddp_comm_state=None, ddp_comm_hook=None,
                 ddp_comm_wrapper=None, model_averaging_period=None, process_group_backend=None,
                 timeout=_UNSET, start_method="popen", **reducer_kwargs):
        strategy_kwargs = {}
        for name in list(reducer_kwargs):
            if name in _REDUCER_KWARGS:
                continue
            if name in _STRATEGY_KWARGS:  # one of a newer DDPStrategy's own arguments
                strategy_kwargs[name] = reducer_kwargs.pop(name)
            elif name in _DDP_ONLY_KWARGS:
                raise TypeError(f"FusedReducerStrategy: `{name}` is a DistributedDataParallel "
                                f"argument that FusedReducer does not take: {_DDP_ONLY_KWARGS[name]}")
            else:
                raise TypeError(
                    f"FusedReducerStrategy got an unexpected keyword argument `{name}`: neither "
                    f"DDPStrategy nor FusedReducer takes it (FusedReducer takes "
                    f"{', '.join(_REDUCER_KWARGS)})")
        if timeout is not _UNSET:
            if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
                timeout = timedelta(seconds=timeout)  # FusedReducer's seconds; Lightning's timedelta
            strategy_kwargs["timeout"] = timeout
            if timeout is not None:
                reducer_kwargs.setdefault("timeout", timeout)
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin, ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook, ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            process_group_backend=process_group_backend, start_method=start_method,
            **strategy_kwargs)
        self._reducer_kwargs = dict(reducer_kwargs)

    @property
    def reducer_kwargs(self):
        """The keyword arguments the model is wrapped with: FusedReducer(module, **reducer_kwargs)."""
        return dict(self._reducer_kwargs)

    @property
    def reducer(self):
        """The FusedReducer wrapping the LightningModule while fitting, else None."""
        return self.model if isinstance(self.model, FusedReducer) else None

    # -- wrapping (DDPStrategy.configure_ddp calls these two) ----------------------------------
    def _setup_model(self, model):
        """Wrap the LightningModule (already on its device) in FusedReducer. Unlike DDPStrategy
        on CUDA, no side stream: construction broadcasts on the current stream, which the
        optimizer and the first forward then see in order."""
        return FusedReducer(model, **self._reducer_kwargs)

    def _register_ddp_hooks(self):
        if self._ddp_comm_hook is None:
            return
        if not hasattr(self.model, "register_comm_hook"):
            raise NotImplementedError(
                "FusedReducerStrategy: ddp_comm_hook was given but this FusedReducer has no "
                "register_comm_hook(); upgrade fused_reducer")
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                ddp_comm_hook=self._ddp_comm_hook,
                                ddp_comm_wrapper=self._ddp_comm_wrapper)

    # -- DDP-specific paths of DDPStrategy, each made to work with FusedReducer -------------------
    @contextmanager
    def block_backward_sync(self):
        """Gradient accumulation: backward passes inside keep gradients local
        (FusedReducer.no_sync), like DDPStrategy with DDP.no_sync."""
        if isinstance(self.model, FusedReducer):
            with self.model.no_sync():
                yield None
        else:
            with super().block_backward_sync():
                yield None

    def pre_backward(self, closure_loss):
        """Manual optimization: DDPStrategy calls DDP's ``reducer.prepare_for_backward`` before
        every ``manual_backward``, so that each backward of a training_step is reduced (a GAN's
        generator and discriminator losses, two optimizers). FusedReducer arms one reduction
        per forward, and the whole training_step runs inside one forward: re-arm it here, or
        the second backward would stay local and the ranks would silently diverge."""
        model = self.model
        if not isinstance(model, FusedReducer):
            return super().pre_backward(closure_loss)
        module = self.lightning_module
        if module is None or module.automatic_optimization or not torch.is_grad_enabled():
            return None
        model.prepare_for_backward()
        return None

    def post_backward(self, closure_loss):
        return None  # DDPStrategy: DDP's static-graph flush only

    def teardown(self):
        # DDPStrategy unwraps a DistributedDataParallel here; do the same for FusedReducer so
        # that validate/test/predict after fit (and checkpoints) see the LightningModule.
        if isinstance(self.model, FusedReducer):
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry):
        entries = (
            ("fused_reducer", "popen", {}),
            ("fused_reducer_spawn", "spawn", {}),
            ("fused_reducer_fork", "fork", {}),
            ("fused_reducer_find_unused_parameters_true", "popen", {"find_unused_parameters": True}),
        )
        for name, start_method, extra in entries:
            if name in strategy_registry:
                continue
            strategy_registry.register(
                name, cls, description=f"FusedReducer strategy with `start_method` '{start_method}'"
                + "".join(f", `{k}={v}`" for k, v in extra.items()),
                start_method=start_method, **extra)


FusedReducerStrategy.register_strategies(_StrategyRegistry)
