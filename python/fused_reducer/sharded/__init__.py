"""The sharded optimizer (ShardedOptimizer, optimizer.py): each rank steps the shard of the
parameters it owns, on top of the core. `fused_reducer.sharded` was this module before it
became a folder: its public names stay importable from here."""
from .optimizer import ELEMENTWISE, ShardedOptimizer

__all__ = ["ELEMENTWISE", "ShardedOptimizer"]
