"""Uneven inputs: FusedReducer.join(), built on torch.distributed.algorithms.Join.

Ranks that ran out of inputs shadow the collectives the others still issue each step, in the
same order: the layout broadcast of a rebuild, the buffer broadcast (from the highest rank still
training, as DDP does), whether the step synchronises, one all-reduce of zeros per bucket (or
the communication hook on a zero bucket), the unused-parameter map (its last one, as DDP). At
the end every rank takes the parameters of the last rank to join. Same collectives and results
as DDP's join.
"""
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from .module_states import synced_states, will_sync_buffers


class FusedReducerJoinHook(JoinHook):
    def __init__(self, model, attachment):
        self.model = model
        self.attachment = attachment

    def main_hook(self):
        """One step of the non-joined ranks, as seen by the collectives."""
        model, attachment = self.model, self.attachment
        reducer = attachment.reducer
        reducer.prepare_forward(will_sync=False)  # the layout broadcast, if they rebuild
        if will_sync_buffers(model):
            attachment.sync_buffers(common_rank(attachment, False))
        should_sync = sync_requested(attachment, model.require_backward_grad_sync, joined=True)
        model.require_forward_param_sync = should_sync
        if not should_sync:
            return
        pending = []
        for flat, views, params, is_last in reducer.zero_buckets():
            if attachment.has_comm_hook:
                pending.append(attachment.run_comm_hook(len(pending), is_last, flat, views,
                                                        params))
            else:
                work = attachment.transport.allreduce_sum(flat)
                pending.append(work.wait)
        for wait in pending:
            wait()
        if model.find_unused_parameters:
            # Not zeros: DDP's joined rank all-reduces its last used map in place (what it used
            # last still counts as used for the others; results must equal DDP's).
            attachment.transport.allreduce_sum(reducer.joined_used_map()).wait()
        reducer.shadow_health_exchange()  # check_finite, stragglers: Note [Health exchange]
        reducer.note_shadowed_step()

    def post_hook(self, is_last_joiner):
        """Every rank ends with the model of the last rank to join."""
        model, attachment = self.model, self.attachment
        source = common_rank(attachment, is_last_joiner)
        attachment.broadcast(synced_states(model.module, model.forward_sync_buffers), source)
        attachment.reducer.set_divide_factor(0)


def sync_requested(attachment, syncing, joined):
    """All-reduce whether any non-joined rank synchronises this step (DDP's
    _check_global_requires_backward_grad_sync)."""
    flag = torch.tensor([0 if joined or not syncing else 1], dtype=torch.int64,
                        device=attachment.control_device)
    dist.all_reduce(flag, group=attachment.group)
    return bool(flag.item())


def common_rank(attachment, candidate):
    """The highest rank (in the group) for which `candidate` holds (DDP's _find_common_rank)."""
    group = attachment.group
    choice = torch.tensor([dist.get_rank(group) if candidate else -1], dtype=torch.int64,
                          device=attachment.control_device)
    dist.all_reduce(choice, op=dist.ReduceOp.MAX, group=group)
    if choice.item() < 0:
        raise RuntimeError("FusedReducer.join: no rank is still training; this is a bug")
    return int(choice.item())
