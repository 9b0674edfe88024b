"""The old path of fused_reducer.tuning.profile: `fused_reducer.profile` is that very module (imports,
pickles and patches made through the old name keep working)."""
import sys

from .tuning import profile as _module

sys.modules[__name__] = _module
