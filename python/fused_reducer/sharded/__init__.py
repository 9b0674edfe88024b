"""The sharded optimizer (ShardedOptimizer, optimizer.py): each rank steps the shard of the
parameters it owns, on top of the core; and its sharded checkpoints through
torch.distributed.checkpoint (checkpoint.py). `fused_reducer.sharded` was one module before it
became a folder: its public names stay importable from here."""
from .checkpoint import (load_checkpoint, load_plain_optimizer_state_dict,
                         plain_optimizer_state_dict)
from .optimizer import ELEMENTWISE, ShardedOptimizer

__all__ = ["ELEMENTWISE", "ShardedOptimizer", "load_checkpoint",
           "load_plain_optimizer_state_dict", "plain_optimizer_state_dict"]
