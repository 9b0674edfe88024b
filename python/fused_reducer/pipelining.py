"""torch.distributed.pipelining with FusedReducer as the data-parallel dimension: each stage's
module wrapped in a FusedReducer over the DP group, driven by ``PipelineStage`` (torch's
constructor arguments) under torch's schedules (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleLoopedBFS, and the split-backward (zero-bubble)
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV: Note [Split backward]).

torch's PipelineStage recognises only DistributedDataParallel (and FSDP) by isinstance, and then
reaches into DDP's reducer (``submod.reducer.prepare_for_backward(outputs)``) before the last
microbatch's backward; any other module is run with a plain forward and backward, which under a
pipeline schedule (several forwards before their backwards) reduces every microbatch (Note
[Several forwards before their backwards] in core/backward_arming.py). This subclass drives a
FusedReducer stage module through its public API with the protocol torch uses for DDP: every
forward and all but the last backward of a step inside ``no_sync()`` (the gradients accumulate
locally), ``prepare_for_backward()`` just before the last microbatch's backward, which then
reduces each bucket once, overlapped with that backward. The schedule's gradient scaling by the
number of microbatches (``scale_grads``) divides the averaged ``param.grad`` as for DDP (with a
ShardedOptimizer, whose averaged gradients exist only as shards, it divides the shards).

Schedules that split the backward into an input and a weight part (zero-bubble:
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) compute the weight
gradients with torch.autograd.grad and add them to ``param.grad`` by hand, which no gradient hook
sees. See Note [Split backward].

Note [Split backward]
A split backward runs an input half (the gradients of the stage's inputs, sent upstream at once)
and, later, a weight half (the parameters' gradients, from the gradients the input half saved at
the "intermediates" where each group of parameters joins the input's graph). torch's weight half
computes them with torch.autograd.grad and adds them to param.grad by hand, past every gradient
hook, and both halves find the weights by the gradient accumulators of submod.parameters(). So
this stage runs the halves itself:
- The input half is torch's (stage_backward_input), given the tensors the graph really
  accumulates into (``model.attachment.autograd_leaves``): for a DTensor parameter, FusedReducer's
  plain leaf (Note [DTensor parameters] in core/tensor_parallel.py), which torch's own call
  would miss, computing no weight gradient for it at all.
- A weight half runs each parameter group's weight backward as a torch.autograd.backward whose
  inputs are the group's leaves (``_group_backward``): the gradients reach .grad through the
  gradient accumulators, so the reducer's hooks (and the user's) fire as each one lands. A
  group with several intermediates has its intermediates' incoming gradients replaced by the
  saved ones (a node pre-hook), as torch does: otherwise a gradient reaching one intermediate
  through another would be counted twice. The groups run in backward order (the last layer's
  first), so that the buckets, laid out in that order, fill one after the other. Afterwards
  DTensor parameters' .grad is made to view their leaves' again (the backward did not pass
  through the outputs, whose hooks do that after a full backward).
- Every weight half but the step's last runs inside no_sync(): .grad accumulates locally. The
  step's last (the schedule's ``last_backward``) arms the reducer (``prepare_for_backward()``)
  first: a bucket's reduction starts as soon as its last parameter is in, while the later
  groups' weight gradients are still being computed, so the reduction overlaps the last weight
  half as it overlaps the last backward under 1F1B. Between two groups' backwards the reducer
  stays armed: its end of backward sees parameters not yet ready and waits for them (Note [End
  of backward] in ext/reducer.cpp); each bucket is reduced once and .grad ends as the average of
  the summed gradients. The schedule's scaling follows at REDUCE_GRAD.
- With find_unused_parameters the end of each group's backward would decide the later groups'
  parameters unused, so the last weight half also runs inside no_sync(), and REDUCE_GRAD
  reduces once through a backward of zeros into the reducer's leaves (each gradient hook fires
  once, on the accumulated gradient): exact, but not overlapped.
- A first stage has no input half (torch runs its whole backward at the weight action, a "full"
  backward): it reduces in its last backward as under 1F1B.
"""
import contextlib

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage
# torch's input half, given the tensors the graph accumulates into (for DTensor parameters,
# FusedReducer's plain leaves): the only function of torch's we call besides the stage's own.
from torch.distributed.pipelining._backward import stage_backward_input

from .core.wrapper import FusedReducer

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
        if backward_type == "input":  # See Note [Split backward]
            leaves, _ = self._leaves()
            return stage_backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                        bwd_kwargs["input_values"], iter(leaves))
        if backward_type == "weight":
            reduce = last_backward and not self.submod.find_unused_parameters
            self._weight_half(bwd_kwargs["param_groups"], reduce)
            self._unreduced_weights = not reduce  # REDUCE_GRAD reduces them
            return (), None
        if last_backward:
            self.submod.prepare_for_backward()
            self._unreduced_weights = False  # this backward reduces them too
            guard = contextlib.nullcontext()
        else:
            guard = self.submod.no_sync()
        with guard:
            # torch's own path for a module that is neither DDP nor FSDP: the plain backward.
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def _weight_half(self, param_groups, reduce):
        """One microbatch's weight half: each parameter group's gradients accumulated through
        the gradient accumulators, last layer first, inside no_sync() or, when `reduce` (the
        step's last weight half), reduced as they land. See Note [Split backward]."""
        _, by_accumulator = self._leaves()
        groups = [(max(by_accumulator[node][0] for node in group["params"]), group)
                  for group in param_groups or ()]
        if reduce:
            self.submod.prepare_for_backward()
        with contextlib.nullcontext() if reduce else self.submod.no_sync():
            for _, group in sorted(groups, key=lambda item: -item[0]):  # the last layer's first
                _group_backward(group, [by_accumulator[node][1] for node in group["params"]])
        self.submod.attachment.publish_gradients()

    def _leaves(self):
        """The stage module's autograd leaves and {their AccumulateGrad node: (position, leaf)},
        found once per attachment of its FusedReducer (not per microbatch: a node is looked up
        through a view of its leaf; the reducer keeps the nodes alive)."""
        attachment = self.submod.attachment
        key = id(attachment.reducer)  # a new one after re-attaching: new leaves
        cached = self.__dict__.get("_leaves_cache")
        if cached is None or cached[0] != key:
            leaves = attachment.autograd_leaves
            cached = (key, leaves, {_gradient_accumulator(t): (position, t)
                                    for position, t in enumerate(leaves)})
            self._leaves_cache = cached
        return cached[1], cached[2]

    def scale_grads(self, grad_scale_factor):
        """torch's scaling by the number of microbatches, on param.grad; with a ShardedOptimizer
        on its gradient shards (param.grad is then a placeholder)."""
        optimizer = (self.submod.attachment.sharded_optimizer
                     if isinstance(self.submod, FusedReducer) else None)
        if optimizer is None:
            return super().scale_grads(grad_scale_factor)
        optimizer.divide_gradients(grad_scale_factor)

    def perform_reduce_grad(self, grad_scale_factor):
        if isinstance(self.submod, FusedReducer) and self.__dict__.get("_unreduced_weights"):
            self._unreduced_weights = False
            # See Note [Split backward]: a backward of zeros fires every gradient hook once.
            reduced = self.submod.attachment.params[::-1]
            self.submod.prepare_for_backward()
            torch.autograd.backward(reduced, grad_tensors=[t.new_zeros(()).expand_as(t)
                                                           for t in reduced])
            self.submod.attachment.publish_gradients()
        super().perform_reduce_grad(grad_scale_factor)


def _gradient_accumulator(param):
    """The AccumulateGrad node of a leaf (created on first use): what torch's split backward keeps
    in its parameter groups."""
    return param.view_as(param).grad_fn.next_functions[0][0]


def _group_backward(group, weights):
    """A parameter group's weight gradients from the gradients the input half saved at its
    intermediates, accumulated into `weights` (their .grad) by autograd."""
    intermediates = group.pop("intermediates")
    saved = group.pop("grads", None) or [()] * len(intermediates)
    # None where no gradient reached an intermediate in the input half.
    roots = [GradientEdge(node, i) for node, grads in zip(intermediates, saved)
             for i, grad in enumerate(grads or ()) if grad is not None]
    if not roots:
        return
    root_grads = [grad for grads in saved for grad in grads or () if grad is not None]
    # Each intermediate gets its saved gradient only, not one more through another intermediate.
    clamps = ([node.register_prehook(lambda _, grads=grads: grads)
               for node, grads in zip(intermediates, saved)] if len(intermediates) > 1 else [])
    try:
        torch.autograd.backward(roots, grad_tensors=root_grads, inputs=weights)
    finally:
        for clamp in clamps:
            clamp.remove()
