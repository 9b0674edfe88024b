"""The old path of fused_reducer.integrations.accelerate: `fused_reducer.accelerate` is that very module (imports,
pickles and patches made through the old name keep working)."""
import sys

from .integrations import accelerate as _module

sys.modules[__name__] = _module
