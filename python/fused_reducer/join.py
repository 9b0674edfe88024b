"""The old path of fused_reducer.core.join: `fused_reducer.join` is that very module (imports,
pickles and patches made through the old name keep working)."""
import sys

from .core import join as _module

sys.modules[__name__] = _module
