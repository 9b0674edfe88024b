"""The old path of fused_reducer.integrations.lightning: `fused_reducer.lightning` is that very module (imports,
pickles and patches made through the old name keep working)."""
import sys

from .integrations import lightning as _module

sys.modules[__name__] = _module
