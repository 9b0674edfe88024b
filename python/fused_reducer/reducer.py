"""The old path of fused_reducer.core.wrapper: `fused_reducer.reducer` is that very module (imports,
pickles and patches made through the old name keep working)."""
import sys

from .core import wrapper as _module

sys.modules[__name__] = _module
