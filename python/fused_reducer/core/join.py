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

from .module_states import synced_states


class FusedReducerJoinHook(JoinHook):
    def __init__(self, model, divide_by_initial_world_size):
        self.model = model
        model._attachment.set_join_options(divide_by_initial_world_size)

    def main_hook(self):
        """One step of the non-joined ranks, as seen by the collectives."""
        model = self.model
        model._attachment.reducer.prepare_forward(will_sync=False)  # the layout broadcast, if they rebuild
        if model._attachment.will_sync_buffers():
            model._attachment.sync_buffers(joined=True)
        should_sync = sync_requested(model, joined=True)
        model._attachment.set_forward_param_sync(should_sync)
        if not should_sync:
            return
        pending = []
        for flat, views, params, is_last in model._attachment.reducer.zero_buckets():
            if model._attachment.has_comm_hook:
                pending.append(model._attachment.run_comm_hook(len(pending), is_last, flat, views, params))
            else:
                work = model._attachment.transport.allreduce_sum(flat)
                pending.append(work.wait)
        for wait in pending:
            wait()
        if model.find_unused_parameters:
            # Not zeros: DDP's joined rank all-reduces its last used map in place (what it used
            # last still counts as used for the others; results must equal DDP's).
            model._attachment.transport.allreduce_sum(model._attachment.reducer.joined_used_map()).wait()
        model._attachment.reducer.shadow_health_exchange()  # check_finite, stragglers: Note [Health exchange]
        model._attachment.reducer.note_shadowed_step()

    def post_hook(self, is_last_joiner):
        """Every rank ends with the model of the last rank to join."""
        model = self.model
        source = common_rank(model, is_last_joiner)
        model._attachment.broadcast(synced_states(model.module, model.forward_sync_buffers), source)
        model._attachment.reducer.set_divide_factor(0)


def sync_requested(model, joined):
    """All-reduce whether any non-joined rank synchronises this step (DDP's
    _check_global_requires_backward_grad_sync)."""
    flag = torch.tensor([0 if joined or not model._attachment.syncing else 1], dtype=torch.int64,
                        device=model._attachment.control_device)
    dist.all_reduce(flag, group=model.process_group)
    return bool(flag.item())


def common_rank(model, candidate):
    """The highest rank (in the group) for which `candidate` holds (DDP's _find_common_rank)."""
    rank = dist.get_rank(model.process_group)
    choice = torch.tensor([rank if candidate else -1], dtype=torch.int64,
                          device=model._attachment.control_device)
    dist.all_reduce(choice, op=dist.ReduceOp.MAX, group=model.process_group)
    if choice.item() < 0:
        raise RuntimeError("FusedReducer.join: no rank is still training; this is a bug")
    return int(choice.item())
