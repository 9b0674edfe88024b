"""The old path of fused_reducer.transports.transport: `fused_reducer.transport` is that very module (imports,
pickles and patches made through the old name keep working)."""
import sys

from .transports import transport as _module

sys.modules[__name__] = _module
