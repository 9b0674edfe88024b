"""The old path of fused_reducer.tuning.autotune: `fused_reducer.autotune` is that very module (imports,
pickles and patches made through the old name keep working)."""
import sys

from .tuning import autotune as _module

sys.modules[__name__] = _module
