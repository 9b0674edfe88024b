"""torch.distributed.pipelining with FusedReducer as the data-parallel dimension: each stage's
module wrapped in a FusedReducer over the DP group, driven by ``PipelineStage`` (torch's
constructor arguments) under torch's schedules (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleLoopedBFS).

torch's PipelineStage recognises only DistributedDataParallel (and FSDP) by isinstance, and then
reaches into DDP's reducer (``submod.reducer.prepare_for_backward(outputs)``) before the last
microbatch's backward; any other module is run with a plain forward and backward, which under a
pipeline schedule (several forwards before their backwards) reduces every microbatch (Note
[Several forwards before their backwards] in core/wrapper.py). This subclass drives a
FusedReducer stage module through its public API with the protocol torch uses for DDP: every
forward and all but the last backward of a step inside ``no_sync()`` (the gradients accumulate
locally), ``prepare_for_backward()`` just before the last microbatch's backward, which then
reduces each bucket once, overlapped with that backward. The schedule's gradient scaling by the
number of microbatches (``scale_grads``) divides the averaged ``param.grad`` as for DDP.

Schedules that split the backward into an input and a weight part (zero-bubble:
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble) compute the weight gradients with
torch.autograd.grad and add them to ``param.grad`` by hand, which no gradient hook sees: they are
refused with a FusedReducerError rather than left unreduced.
"""
import contextlib

from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from ..core.wrapper import FusedReducer
from ..errors import FusedReducerError

__all__ = ["PipelineStage"]


class PipelineStage(_TorchPipelineStage):
    """torch.distributed.pipelining.PipelineStage (same arguments) whose ``submodule`` may be a
    FusedReducer: one reduction of each bucket per schedule step. Other submodules behave as
    under torch's class."""

    def forward_maybe_with_nosync(self, *args, **kwargs):
        if not isinstance(self.submod, FusedReducer):
            return super().forward_maybe_with_nosync(*args, **kwargs)
        with self.submod.no_sync():  # the reduction is decided at the last backward
            return self.submod(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        if not isinstance(self.submod, FusedReducer):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type != "full":
            raise FusedReducerError(
                f"fused_reducer.pipelining.PipelineStage: stage {self.stage_index} was asked for a "
                f"split backward ('{backward_type}'), which zero-bubble schedules use: their weight "
                "gradients are computed with torch.autograd.grad and added to param.grad by hand, "
                "past FusedReducer's gradient hooks, so they would not be averaged. Use "
                "ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B or ScheduleLoopedBFS.")
        if last_backward:
            self.submod.prepare_for_backward()
            guard = contextlib.nullcontext()
        else:
            guard = self.submod.no_sync()
        with guard:
            # torch's own path for a module that is neither DDP nor FSDP: the plain backward.
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
