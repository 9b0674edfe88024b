"""FusedReducer: bucketed gradient all-reduce for data-parallel PyTorch, with a first bucket and
bucket cap that stay tunable at runtime.

    import fused_reducer
    model = fused_reducer.FusedReducer(model, first_bucket_mb=16)

The layers, each importing only those before it: errors.py and settings.py (the base);
transports/ (NCCL, gloo or shared memory, store exchanges, torchrun restarts); core/ (the module
wrapper, its validation, join, comm hooks); sharded/ (ShardedOptimizer); tuning/ (cost model,
probe, profiles, planner, autotuner, trace). At this level beside them, the entry points users
import, each a module of its own: lightning.py (FusedReducerStrategy), accelerate.py and
transformers.py (Hugging Face), pipelining.py (PipelineStage) and plan.py (`python -m
fused_reducer.plan`, the planner of tuning/plan.py); docs/API.md lists them.
"""
import torch
import torch.distributed  # registers ProcessGroup with pybind11 before _C needs it

REINSTALL = "pip install --no-build-isolation --no-deps --force-reinstall ."


def check_torch_version(built, running):
    """Raise ImportError unless `running` is the torch `built` (the version _C was compiled
    against) names; a C++ extension is tied to the exact torch build (a local tag like +cu130
    included) and under another one fails with undefined symbols or worse. built=None: not
    recorded (built by an older setup.py), nothing to check."""
    if built is not None and built != running:
        raise ImportError(
            f"fused_reducer was compiled against torch {built}, but torch {running} is installed; "
            f"rebuild it against this torch: `{REINSTALL}` in the fused_reducer source tree "
            "(--no-build-isolation compiles against the installed torch)")


try:
    from ._build_torch import TORCH_VERSION as _BUILD_TORCH
except ImportError:
    _BUILD_TORCH = None
check_torch_version(_BUILD_TORCH, torch.__version__)  # before _C: its load is what would fail

from . import _C  # noqa: E402
from .errors import (FusedReducerError, NonFiniteGradientError,  # noqa: E402
                     ShardedGradientError, ShardedOptimizerError)
from .core.wrapper import FusedReducer  # noqa: E402
from .sharded.optimizer import ShardedOptimizer  # noqa: E402
from .transports.transport import make_transport  # noqa: E402
from .settings import get_default_first_bucket_bytes, set_default_first_bucket_bytes  # noqa: E402
from .build import build_info  # noqa: E402
# The tuning layer plugs its tools into the core (core/plugins.py): imported here, never by it.
from .tuning import autotune as _autotune, profile as _profile, trace as _trace  # noqa: E402,F401


__all__ = ["FusedReducer", "FusedReducerError", "NonFiniteGradientError", "ShardedGradientError", "ShardedOptimizer",
           "ShardedOptimizerError", "build_info", "make_transport", "get_default_first_bucket_bytes",
           "set_default_first_bucket_bytes"]
