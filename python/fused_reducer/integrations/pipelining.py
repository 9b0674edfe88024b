"""torch.distributed.pipelining with FusedReducer as the data-parallel dimension: each stage's
module wrapped in a FusedReducer over the DP group, driven by ``PipelineStage`` (torch's
constructor arguments) under torch's schedules (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleLoopedBFS, and the zero-bubble ScheduleInterleavedZeroBubble and
ScheduleZBVZeroBubble: Note [Split backward]).

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
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) compute the weight
gradients with torch.autograd.grad and add them to ``param.grad`` by hand, which no gradient hook
sees. See Note [Split backward].

Note [Split backward]
The input and weight halves of a split backward run inside no_sync(): param.grad accumulates
each microbatch's weight gradient locally (torch adds them by hand). The schedule then runs its
REDUCE_GRAD action once per step, after every backward of the stage (``perform_reduce_grad``);
there, if a weight half ran this step, the stage arms the reducer (``prepare_for_backward()``)
and runs a backward of zeros into every parameter: each gradient hook fires once, on the whole
accumulated param.grad, so each bucket is reduced once and param.grad ends as the average of the
summed gradients, as for the other schedules; the schedule's scaling follows. A first stage (no
input half: torch runs its whole backward at the weight action) reduces in its last backward
as under 1F1B. The cost: that reduction starts after the last weight half, so it does not
overlap that backward (the zero-bubble schedule has already filled the bubbles it could).
DTensor (tensor-parallel) parameters are refused: torch's split backward finds the weights by
their gradient accumulators in the graph, and the graph holds the reducer's plain leaves (Note
[DTensor parameters] in core/tensor_parallel.py), so it would compute no weight gradient at all.
"""
import contextlib

import torch
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from ..core.tensor_parallel import is_dtensor
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
        if backward_type != "full":  # See Note [Split backward]
            self._refuse_split_backward_of_dtensors(backward_type)
            with self.submod.no_sync():
                result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs,
                                                            last_backward)
            if backward_type == "weight":
                self._weights_by_hand = True
            return result
        if last_backward:
            self.submod.prepare_for_backward()
            self._weights_by_hand = False  # this backward reduces them too
            guard = contextlib.nullcontext()
        else:
            guard = self.submod.no_sync()
        with guard:
            # torch's own path for a module that is neither DDP nor FSDP: the plain backward.
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def perform_reduce_grad(self, grad_scale_factor):
        if isinstance(self.submod, FusedReducer) and self.__dict__.get("_weights_by_hand"):
            self._weights_by_hand = False
            # See Note [Split backward]: a backward of zeros fires every gradient hook once.
            params = [p for p in self.submod.parameters() if p.requires_grad][::-1]
            self.submod.prepare_for_backward()
            torch.autograd.backward(params, grad_tensors=[p.new_zeros(()).expand_as(p)
                                                          for p in params])
        super().perform_reduce_grad(grad_scale_factor)

    def _refuse_split_backward_of_dtensors(self, backward_type):
        tensor_parallel = [n for n, p in self.submod.module.named_parameters() if is_dtensor(p)]
        if tensor_parallel:
            raise FusedReducerError(
                f"fused_reducer.pipelining.PipelineStage: stage {self.stage_index} was asked for a "
                f"split backward ('{backward_type}'), which zero-bubble schedules use, but its "
                f"parameters include DTensors ({tensor_parallel[0]!r}, ...): torch's weight "
                "backward finds the weights by their gradient accumulators, which are not in the "
                "graph FusedReducer builds for tensor-parallel parameters (Note [DTensor "
                "parameters]), so their gradients would not be computed. Use ScheduleGPipe, "
                "Schedule1F1B, ScheduleInterleaved1F1B or ScheduleLoopedBFS with tensor "
                "parallelism.")
