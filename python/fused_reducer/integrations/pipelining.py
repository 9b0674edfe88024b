"""torch.distributed.pipelining with FusedReducer as the data-parallel dimension: each stage's
module wrapped in a FusedReducer over the DP group, driven by ``PipelineStage`` (torch's
constructor arguments) under torch's schedules (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleLoopedBFS, and the split-backward (zero-bubble)
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV: Note [Split backward]).

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
A split backward runs an input half (the gradients of the stage's inputs, sent upstream at once)
and, later, a weight half (the parameters' gradients, from the gradients the input half saved at
the "intermediates" where each group of parameters joins the input's graph). torch computes a
weight half with torch.autograd.grad and adds the result to param.grad by hand, past every
gradient hook. So:
- The input halves and every weight half but the step's last run inside no_sync(): param.grad
  accumulates each microbatch's weight gradients locally, by torch's hand.
- The step's last weight half (the schedule's ``last_backward``) arms the reducer
  (``prepare_for_backward()``) and runs each parameter group's weight backward as a
  torch.autograd.backward whose inputs are the group's parameters
  (``_last_weight_half_reduces``): the gradients reach param.grad through the parameters'
  gradient accumulators, so the reducer's hooks fire as each one lands and a bucket's reduction
  starts as soon as its last parameter is in, while the later groups' weight gradients are still
  being computed: the reduction overlaps the last weight half, as it overlaps the last backward
  under 1F1B. The groups run in backward order (the last layer's first) so that the buckets, laid
  out in that order, fill one after the other. Between two groups' backwards the reducer stays
  armed: its end of backward sees parameters not yet ready and waits for them (Note [End of
  backward] in ext/reducer.cpp), so each bucket is reduced once and param.grad ends as the average
  of the summed gradients; the schedule's scaling follows at REDUCE_GRAD.
- A group with several intermediates has its intermediates' incoming gradients replaced by the
  saved ones (a node pre-hook), as torch does: otherwise a gradient reaching one intermediate
  through another would be counted twice.
- With find_unused_parameters the end of each group's backward would decide the parameters of
  the later groups unused, so the last weight half also runs by torch's hand inside no_sync(), and
  REDUCE_GRAD reduces once through a backward of zeros into every parameter (each gradient hook
  fires once, on the accumulated param.grad): exact, but not overlapped.
- A first stage has no input half (torch runs its whole backward at the weight action, a "full"
  backward): it reduces in its last backward as under 1F1B.
DTensor (tensor-parallel) parameters are refused: torch's input half finds the weights by their
gradient accumulators in the graph, and the graph holds the reducer's plain leaves (Note [DTensor
parameters] in core/tensor_parallel.py), so no weight gradient would be computed at all.
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
            if (backward_type == "weight" and last_backward
                    and not self.submod.find_unused_parameters):
                self._last_weight_half_reduces(bwd_kwargs["param_groups"])
                self._weights_by_hand = False  # reduced already
                return (), None
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

    def _last_weight_half_reduces(self, param_groups):
        """The step's last weight half, each parameter group's gradients accumulated through the
        parameters' gradient accumulators, so that the reduction overlaps it. See Note [Split
        backward]."""
        params = [p for p in self.submod.parameters() if p.requires_grad]
        by_accumulator = {_gradient_accumulator(p): (position, p)
                          for position, p in enumerate(params)}
        groups = [(max(by_accumulator[node][0] for node in group["params"]), group)
                  for group in param_groups]
        self.submod.prepare_for_backward()
        for _, group in sorted(groups, key=lambda item: -item[0]):  # the last layer's first
            intermediates = group.pop("intermediates")
            saved = group.pop("grads", None) or [()] * len(intermediates)
            roots = [torch.autograd.graph.GradientEdge(node, i)
                     for node, grads in zip(intermediates, saved)
                     for i, grad in enumerate(grads) if grad is not None]
            if not roots:
                continue
            root_grads = [grad for grads in saved for grad in grads if grad is not None]
            clamps = ([node.register_prehook(lambda _, grads=grads: grads)
                       for node, grads in zip(intermediates, saved)]
                      if len(intermediates) > 1 else [])
            try:
                torch.autograd.backward(
                    roots, grad_tensors=root_grads,
                    inputs=[by_accumulator[node][1] for node in group["params"]])
            finally:
                for clamp in clamps:
                    clamp.remove()

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


def _gradient_accumulator(param):
    """The AccumulateGrad node of a leaf (created on first use): what torch's split backward keeps
    in its parameter groups."""
    return param.view_as(param).grad_fn.next_functions[0][0]
