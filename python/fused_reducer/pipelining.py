"""`fused_reducer.pipelining`: torch.distributed.pipelining's PipelineStage for FusedReducer stage
modules (fused_reducer.integrations.pipelining)."""
from .integrations.pipelining import PipelineStage

__all__ = ["PipelineStage"]
