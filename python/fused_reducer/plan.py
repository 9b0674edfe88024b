"""The old path of fused_reducer.tuning.plan: `fused_reducer.plan` is that very module, and
`python -m fused_reducer.plan` runs its command line."""
import sys

from .tuning import plan as _module

if __name__ == "__main__":
    sys.exit(_module.main())
sys.modules[__name__] = _module
