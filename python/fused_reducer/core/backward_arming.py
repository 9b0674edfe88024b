"""Which backward the C++ reducer averages: every backward of a synchronised forward.

Note [Several forwards before their backwards]
Pipeline schedules run several forwards before their backwards: GPipe F1 F2 B1 B2, 1F1B
F1 F2 B1 F3 B2 ..., a reversed order F1 F2 B2 B1. The C++ reducer is armed by a forward for
the next backward, and the end of that backward disarms it: B1 took the arm that F2 had set,
and B2 then stayed local, so param.grad ended as avg(g1) + g2 (DDP does exactly the same,
silently). Here every backward of a synchronised forward is reduced: the forward's outputs
are hooked, and when a backward first reaches them while the reducer's arm was used up by an
earlier backward (its step completed) or cancelled (a later forward inside no_sync), the arm
is renewed there, before any of that backward's gradients is ready
(BackwardArming.arm_for_backward_of_forward). The backward then reduces the whole param.grad,
the earlier averages included, so param.grad = avg(g1) + avg(g2) + ... = the average of the
summed gradients, in any order of forwards and backwards: exact. Each such backward is a step of
its own (one reduction of each bucket per backward); for one reduction per training step,
run the forwards and all but the last backward inside no_sync() and call
prepare_for_backward() before the last backward, as torch's PipelineStage drives DDP and
fused_reducer.pipelining.PipelineStage drives FusedReducer.
Why not defer the reduction to the last backward instead: whether more backwards will come is
unknowable at a backward's end, because a forward whose output is dropped (a GAN's extra
generator pass, a metric computed with grad enabled) never gets one; deferring would then
never average, while renewing the arm stays exact. A second backward through the same graph
(one forward, backward(retain_graph=True) twice, or one backward per output) is reduced the
same way: DDP leaves it local and the ranks' gradients silently differ. It is reduced if it
runs while the model syncs (inside no_sync() it stays local, as the user asked). A
ShardedOptimizer refuses a renewed arm: its averages exist only as shards, and the next
backward would have to accumulate into released gradients.
"""
import weakref

import torch
from torch.utils._pytree import tree_leaves

from ..errors import FusedReducerError


class BackwardArming:
    """The wrapper's record of whether the C++ reducer is armed for a backward, and the hooks on
    a forward's outputs that renew the arm. Holds the model weakly (the hooks outlive it when a
    graph is kept)."""

    def __init__(self, model):
        self._model = weakref.ref(model)
        self._armed_at = None  # completed_steps() when the reducer was armed, None: not armed
        self._publish_queued = False

    def note(self, reducer, armed):
        """The reducer was armed (prepare_forward for a synchronised backward) or was not."""
        self._armed_at = reducer.completed_steps() if armed else None

    def armed(self, reducer):
        """Whether the C++ reducer is armed for a backward that has not yet completed a step."""
        return self._armed_at is not None and self._armed_at == reducer.completed_steps()

    def forward_started(self):
        self._publish_queued = False  # a backward that raised left it set

    @torch.compiler.disable
    def hook_outputs(self, output, synced, find_unused, tensor_parallel, joining):
        """Hooks on a forward's outputs: the first backward reaching them is reduced if the
        forward was `synced`, a later one if the model syncs then; with `find_unused`, that
        backward is also the one whose end decides which parameters were unused, not a nested
        backward that reentrant checkpointing runs inside it (see Note [End of backward] in
        ext/reducer.cpp); with `tensor_parallel`, its end publishes param.grad as DTensors."""
        leaves = [leaf for leaf in tree_leaves(output)
                  if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if not leaves:
            if tensor_parallel:
                raise FusedReducerError(
                    "FusedReducer: with DTensor parameters the wrapped module's forward must "
                    "return its outputs as tensors (or lists, tuples, dicts of them) that require "
                    "grad: the end of their backward publishes param.grad as DTensors (Note "
                    "[DTensor parameters]). Return the tensors, or run this forward under "
                    "torch.no_grad().")
            return
        arming = weakref.ref(self)
        first = [True]  # the first backward through these outputs

        def reached(grad):
            self_ = arming()
            model = self_._model() if self_ is not None else None
            attachment = model.attachment if model is not None else None
            if attachment is None or attachment.reducer is None:
                return
            # The forward decided whether its first backward syncs (as DDP); a later backward
            # through the same graph syncs unless it runs inside no_sync().
            if synced and (first[0] or model.require_backward_grad_sync):
                self_.arm_for_backward_of_forward(attachment, model.require_backward_grad_sync,
                                                  joining)
            first[0] = False
            if tensor_parallel:
                self_._publish_at_end_of_backward(attachment)
            if find_unused:
                attachment.reducer.on_outputs_reached()

        for leaf in leaves:
            leaf.register_hook(reached)

    def arm_for_backward_of_forward(self, attachment, syncing, joining):
        """A backward reached the outputs of a synchronised forward: reduce it, renewing the arm
        if an earlier backward used it up."""
        reducer = attachment.reducer
        if self.armed(reducer):
            return
        if attachment.sharded:
            raise FusedReducerError(
                "FusedReducer: a second backward of this step reached the outputs of a forward run "
                "outside no_sync(), but with a ShardedOptimizer the previous backward already "
                "reduced and released the gradients (they exist only as shards), so this "
                "backward's gradients cannot be added to them. Run the forwards and all but the "
                "last backward of the step under model.no_sync() and call "
                "model.prepare_for_backward() before the last backward (one reduction per step), "
                "or drive the stage with fused_reducer.pipelining.PipelineStage, which does that "
                "for pipeline schedules.")
        if joining:
            raise FusedReducerError(
                "FusedReducer: several forwards before their backwards are not supported inside "
                "join() (the joined ranks shadow one reduction per forward). Run the forwards and "
                "all but the last backward under model.no_sync() and call "
                "model.prepare_for_backward() before the last backward, or drive the stage with "
                "fused_reducer.pipelining.PipelineStage.")
        if not syncing:  # no_sync() entered after this forward: its backward still syncs (DDP)
            reducer.set_sync_enabled(True)
        try:
            reducer.prepare_forward(will_sync=True)
        finally:
            if not syncing:
                reducer.set_sync_enabled(False)
        self.note(reducer, True)

    def _publish_at_end_of_backward(self, attachment):
        """With DTensor parameters: param.grad published as DTensors once this backward, and the
        reducer's end of it (queued later, by the first gradient hook), are done."""
        if self._publish_queued:
            return
        self._publish_queued = True
        engine = torch.autograd.Variable._execution_engine
        arming, tensor_parallel = weakref.ref(self), attachment.tensor_parallel

        def publish():
            self_ = arming()
            if self_ is not None:
                self_._publish_queued = False
                tensor_parallel.publish_gradients()

        # Callbacks run in the order queued, and one queued by a callback runs after the others:
        # publish after Reducer::finalize_backward, which may assign param.grad.
        engine.queue_callback(lambda: engine.queue_callback(publish))
