"""The exceptions FusedReducer raises, in one module every other one can import."""


class FusedReducerError(RuntimeError, ValueError):
    """A model or setting FusedReducer cannot reduce. A RuntimeError where DDP raises one, and
    a ValueError as earlier releases of FusedReducer raised."""


class ShardedOptimizerError(ValueError):
    """A ShardedOptimizer cannot be built or stepped as asked (python/fused_reducer/sharded/optimizer.py)."""


class ShardedGradientError(RuntimeError):
    """param.grad was read after a synchronised backward in sharded mode (Note [Released
    gradients] in ext/reducer.cpp)."""


class NonFiniteGradientError(FloatingPointError):
    """check_finite=True: a rank's local gradients held NaN or Inf in this backward. Raised on
    every rank at the end of that backward, with the same message naming the ranks, the first
    offending parameters and counts (see FusedReducer's check_finite)."""


def raise_nonfinite(message):
    """What the C++ reducer calls at the end of a backward with non-finite gradients."""
    raise NonFiniteGradientError(message)
