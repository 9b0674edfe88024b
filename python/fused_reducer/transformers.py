"""The old path of fused_reducer.integrations.transformers: `fused_reducer.transformers` is that very module (imports,
pickles and patches made through the old name keep working)."""
import sys

from .integrations import transformers as _module

sys.modules[__name__] = _module
