"""The model's side of a ShardedOptimizer (sharded/optimizer.py): released gradients, and the
parameter all-gathers a forward must see finished. See Note [Sharded mode] and Note [Released
gradients] in ext/reducer.cpp, Note [Overlapped parameter all-gather] in the optimizer."""
import torch

from ..errors import ShardedGradientError


class ReleasedGradient(torch.Tensor):
    """param.grad after a synchronised backward in sharded mode: the parameter's metadata and no
    storage; every operation on it raises ShardedGradientError naming the parameter."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, param, name):
        self = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, strides=param.stride(), storage_offset=param.storage_offset(),
            dtype=param.dtype, device=param.device, requires_grad=False)
        self.parameter_name = name
        return self

    def __repr__(self):
        return (f"<released gradient of '{self.parameter_name}': averaged only as shards of a "
                "ShardedOptimizer>")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        names = [a.parameter_name for a in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(a, cls)]
        raise ShardedGradientError(
            f"param.grad of '{names[0]}' was used ({func}) after a synchronised backward with a "
            "ShardedOptimizer: the averaged gradients exist only as shards across the ranks, and "
            "this rank's local gradient was released. Clip with opt.clip_grad_norm_(max_norm) "
            "(the global norm, as torch.nn.utils.clip_grad_norm_ under DDP) instead of a torch "
            "utility over model.parameters(); call opt.step() and opt.zero_grad() before the "
            "next backward; accumulate micro-batches under model.no_sync().")


def released_gradients(params, names):
    """The placeholders the C++ reducer leaves in param.grad, one per reduced parameter."""
    return [ReleasedGradient(p, name) for p, name in zip(params, names)]


@torch.compiler.disable
def before_sharded_forward(attachment, traced):
    """Before a sharded forward's module runs: when this forward records a graph, the
    released-gradient placeholders are cleared, so that neither the forward nor autograd's
    accumulation ever sees one; `traced`: this forward is being compiled (Note [Overlapped
    parameter all-gather])."""
    if torch.is_grad_enabled():
        attachment.reducer.clear_released_gradients()
    optimizer = attachment.sharded_optimizer
    if optimizer is not None:
        optimizer.finish_before_forward(traced)


@torch.compiler.disable
def finish_param_gather(attachment):
    """A ShardedOptimizer's parameter all-gathers left in flight by step()
    (overlap_param_gather): finished before anything reads the parameters."""
    optimizer = attachment.sharded_optimizer if attachment is not None else None
    if optimizer is not None:
        optimizer.finish_param_gather()
