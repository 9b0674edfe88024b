"""The old path of fused_reducer.transports.elastic: `fused_reducer.elastic` is that very module (imports,
pickles and patches made through the old name keep working)."""
import sys

from .transports import elastic as _module

sys.modules[__name__] = _module
