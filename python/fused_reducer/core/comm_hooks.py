"""DDP communication hooks on FusedReducer's buckets.

A hook registered with ``FusedReducer.register_comm_hook(state, hook)`` has DDP's signature,
``hook(state, bucket) -> torch.futures.Future``, so every hook of
``torch.distributed.algorithms.ddp_comm_hooks`` runs unchanged. The C++ reducer calls
``launch`` below when a bucket is complete (instead of its transport; gradients unscaled, the
hook averages as in DDP) and ``finish`` at the end of backward; the future's value (a tensor:
like DDP, a one-element list such as a work's ``[tensor]`` is refused) lands in the bucket and
flows through the same unpack into ``param.grad``. Without a hook nothing here runs.
"""
import torch

from ..errors import FusedReducerError


class GradBucket:
    """The bucket a hook sees, with the interface of ``torch.distributed.GradBucket``."""

    def __init__(self, index, is_last, buffer, gradients, parameters):
        self._index = index
        self._is_last = is_last
        self._buffer = buffer
        # (offset, numel, shape) of each parameter's slot in the buffer
        self._slots = [(g.storage_offset() - buffer.storage_offset(), g.numel(), g.shape)
                       for g in gradients]
        self._parameters = parameters

    def index(self):
        return self._index

    def buffer(self):
        """The flat buffer of the bucket (the hook may reduce it in place)."""
        return self._buffer

    def set_buffer(self, buffer):
        self._buffer = buffer

    def gradients(self):
        """Views of the buffer, one per parameter, as DDP's ``GradBucket.gradients()``: the
        parameter's slice of the buffer viewed with its shape, contiguously (for a channels_last
        slot the elements are in the slot's memory order, as in DDP), so hooks that reshape
        them (PowerSGD's ``tensor.view(n, -1)``) work on every memory format."""
        return [self._buffer.narrow(0, offset, numel).view(shape)
                for offset, numel, shape in self._slots]

    def parameters(self):
        return self._parameters

    def is_last(self):
        return self._is_last


def check_hook(hook):
    if not callable(hook):
        raise TypeError(f"FusedReducer: a communication hook must be callable as "
                        f"hook(state, bucket) -> torch.futures.Future, got {hook!r}")


def hook_name(hook):
    return getattr(hook, "__qualname__", None) or repr(hook)


def run_hook(state, hook, bucket):
    """Call the hook on `bucket`; return `finish()`, which waits for its future and writes the
    result into the bucket's flat buffer (the tensor the reducer unpacks from)."""
    flat = bucket.buffer()
    future = hook(state, bucket)
    if not isinstance(future, torch._C.Future):  # torch.futures.Future and c10d work futures
        raise RuntimeError(
            f"FusedReducer: communication hook {hook_name(hook)} returned "
            f"{type(future).__name__}; like a DDP hook it must return a torch.futures.Future "
            "whose value is the reduced bucket tensor (e.g. "
            "dist.all_reduce(t, async_op=True).get_future().then(...)).")

    def finish():
        result = future.wait()
        if isinstance(result, (list, tuple)):
            # Refused, as DDP refuses it: a hook that trains here must train under DDP too.
            raise FusedReducerError(
                f"FusedReducer: the future of communication hook {hook_name(hook)} for bucket "
                f"{bucket.index()} holds a {type(result).__name__} of {len(result)} element(s), "
                "not a tensor; DDP refuses it too. A work's future (dist.all_reduce(..., "
                "async_op=True).get_future()) holds [tensor]: return "
                "fut.then(lambda fut: fut.value()[0]), as the hooks of "
                "torch.distributed.algorithms.ddp_comm_hooks do.")
        if not isinstance(result, torch.Tensor) or result.numel() != flat.numel():
            got = (f"a tensor of {result.numel()} elements" if isinstance(result, torch.Tensor)
                   else type(result).__name__)
            raise RuntimeError(
                f"FusedReducer: the future of communication hook {hook_name(hook)} for bucket "
                f"{bucket.index()} holds {got}; expected the reduced bucket, a tensor of "
                f"{flat.numel()} elements")
        if result.data_ptr() != flat.data_ptr() or result.dtype != flat.dtype:
            with torch.no_grad():
                flat.copy_(result.view(-1))

    return finish


def bucket_launcher(state, hook, params):
    """What the C++ reducer calls when a bucket is complete and a hook is registered:
    ``launch(index, is_last, flat, views, indices)`` runs the hook on that bucket, its
    parameters ``params[i]`` for i in indices (the reducer's: a DTensor parameter's local leaf,
    shaped like its gradient), and returns run_hook's ``finish``."""
    def launch(index, is_last, flat, views, indices):
        return run_hook(state, hook, GradBucket(index, is_last, flat, views,
                                                [params[i] for i in indices]))

    return launch
