"""The global gradient norm behind FusedReducer.grad_norm() and clip_grad_norm_(): read off the
statistics the unpack into param.grad accumulated (Note [Statistics from the copy] in
ext/bucket_copy.h) where they still describe param.grad, else torch's computation."""
import functools
import math

import torch

from .tensor_parallel import local_of


def gradient_norm(attachment, module, norm_type):
    """(total norm, "copy" or "torch"): what torch.nn.utils.clip_grad_norm_ over
    module.parameters() computes, and how it was found."""
    # Asked first, even with no gradients yet: from then on each backward keeps the probes
    # that tell an unchanged param.grad (Reducer::copy_norms), so that call itself is torch's.
    from_copy = _norm_from_copy(attachment.reducer, norm_type)
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return torch.tensor(0.0), None
    if attachment.tensor_parallel:
        return _tensor_parallel_norm(attachment, module, grads, norm_type, from_copy is not None)
    # The copy saw only the reduced parameters' gradients: a frozen or ignored parameter
    # that holds a .grad counts in torch's norm over model.parameters() too.
    if from_copy is None or len(grads) != _reduced_grads(attachment):
        return torch.nn.utils.get_total_norm(grads, norm_type), "torch"
    return from_copy.to(device=grads[0].device, dtype=_norm_dtype(grads)), "copy"


def clip_targets(attachment, module):
    """The tensors clip_grad_norm_ scales: the module's gradients, or for DTensor parameters the
    plain leaves whose storage their gradients view."""
    params = [p for p in module.parameters() if p.grad is not None]
    return attachment.tensor_parallel.clip_targets(params) if attachment.tensor_parallel \
        else params


def _tensor_parallel_norm(attachment, module, grads, norm_type, copy_usable):
    """With DTensor parameters: torch's norm over DTensor gradients (shards summed over their
    tensor-parallel groups, replicated ones counted once), from the copy's statistics where they
    cover every gradient (collective over the tensor-parallel groups). A frozen or ignored
    parameter's gradient counts as replicated."""
    tp = attachment.tensor_parallel
    reduced = [p.grad for p in attachment.params]
    extra = len(grads) - _reduced_grads(attachment)
    copied = None
    if copy_usable and extra == 0:
        copied = tuple(attachment.reducer.copy_norms().tolist())
    others = []
    if extra:
        mine = {id(e.param) for e in tp.entries.values()} | {id(p) for p in attachment.params}
        others = [local_of(p.grad) for p in module.parameters()
                  if p.grad is not None and id(p) not in mine]
    total = tp.global_norm(reduced, norm_type, attachment.control_device, copied, others)
    source = "copy" if copied is not None else "torch"
    return total.to(device=local_of(grads[0]).device, dtype=_norm_dtype(grads)), source


def _reduced_grads(attachment):
    return sum(p.grad is not None for p in attachment.params)


def _norm_from_copy(reducer, norm_type):
    norms = None if reducer is None else reducer.copy_norms()
    if norms is None or norm_type not in (1.0, 2.0, math.inf):
        return None
    sum_sq, sum_abs, max_abs = norms.tolist()
    if not math.isfinite(sum_abs):
        return None  # a NaN/Inf (or a CUDA float sum past its range): torch's norm says which
    if norm_type == 2.0:
        return torch.tensor(math.sqrt(sum_sq), dtype=torch.float64)
    if norm_type == 1.0:
        return torch.tensor(sum_abs, dtype=torch.float64)
    return torch.tensor(max_abs, dtype=torch.float64)


def _norm_dtype(grads):
    """torch's norm has the gradients' widest real dtype (a complex gradient's norm is real)."""
    return functools.reduce(torch.promote_types, (g.dtype.to_real() for g in grads))
