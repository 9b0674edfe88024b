"""The old path of fused_reducer.tuning.costmodel: `fused_reducer.costmodel` is that very module (imports,
pickles and patches made through the old name keep working)."""
import sys

from .tuning import costmodel as _module

sys.modules[__name__] = _module
