"""ReducerConfig: what a FusedReducer reduces with, checked once at construction.

The constructor's keyword arguments that shape the reduction (bucket limits, the gradient route's
switches, the health checks, the transport asked for and the timeout) become one frozen
dataclass: the Python face of the C++ ``ReducerOptions`` (ext/reducer_options.h) plus the
transport request. Each attach builds its reducer from it (``options()``); a copy of the model
keeps the limits in force (``with_limits_in_force()``), so an unpickled model attaches with what
the original had at the time, not with what it was constructed with.
"""
import dataclasses
from typing import Optional, Tuple

import torch

from .. import _C
from ..settings import bucket_limits, check_reduce_dtype, megabytes_to_bytes
from ..transports.transport import timeout_seconds
from .validation import health_settings, reduce_dtype_of


@dataclasses.dataclass(frozen=True)
class ReducerConfig:
    bucket_caps_bytes: Tuple[int, ...]
    last_bucket_bytes: int = 0
    ddp_first_layout: bool = False  # DDP's first layout of a bucket_cap_mb_list
    gradient_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    skip_all_reduce_unused_params: bool = False
    reduce_dtype: Optional[torch.dtype] = None
    backend: str = "auto"  # the transport asked for; FusedReducer.backend names the one in use
    timeout: object = None  # as given (timedelta or seconds); None: the process group's
    # The health checks' options, (name, value) in C++'s names (ext/health_checks.h; see
    # health_settings in core/validation.py): hashable and picklable, as the rest.
    health: Tuple[Tuple[str, object], ...] = ()

    @classmethod
    def from_arguments(cls, *, bucket_cap_mb, first_bucket_mb, bucket_cap_mb_list, last_bucket_mb,
                       gradient_as_bucket_view, find_unused_parameters,
                       skip_all_reduce_unused_params, reduce_dtype, mixed_precision, backend,
                       timeout, health):
        """FusedReducer's keyword arguments, each checked (raising naming it) before any
        collective, so that every rank refuses alike; `health`: the health checks' keyword
        arguments by name."""
        off = last_bucket_mb is None or (not isinstance(last_bucket_mb, bool)
                                         and last_bucket_mb == 0)
        if timeout is not None:
            timeout_seconds(timeout)  # a bad value refused now, not at the first attach
        return cls(
            bucket_caps_bytes=tuple(bucket_limits(bucket_cap_mb, first_bucket_mb,
                                                  bucket_cap_mb_list)),
            last_bucket_bytes=0 if off else megabytes_to_bytes("last_bucket_mb", last_bucket_mb),
            ddp_first_layout=bool(bucket_cap_mb_list),
            gradient_as_bucket_view=bool(gradient_as_bucket_view),
            find_unused_parameters=bool(find_unused_parameters),
            # Needs find_unused_parameters, as in DDP; see Note [Skipping unused parameters].
            skip_all_reduce_unused_params=bool(skip_all_reduce_unused_params),
            reduce_dtype=check_reduce_dtype(reduce_dtype_of(mixed_precision, reduce_dtype)),
            backend=backend,
            timeout=timeout,
            health=tuple(health_settings(health).items()))

    def with_limits_in_force(self, bucket_caps_bytes, last_bucket_bytes, reduce_dtype):
        """This configuration with the limits a running reducer holds (set while training)."""
        return dataclasses.replace(self, bucket_caps_bytes=tuple(bucket_caps_bytes),
                                   last_bucket_bytes=last_bucket_bytes, reduce_dtype=reduce_dtype)

    def options(self, timeout_s):
        """The C++ reducer's options (ext/reducer_options.h) with the resolved timeout."""
        options = _C.ReducerOptions()
        options.bucket_caps_bytes = list(self.bucket_caps_bytes)
        options.last_bucket_bytes = self.last_bucket_bytes
        options.ddp_first_layout = self.ddp_first_layout
        options.gradient_as_bucket_view = self.gradient_as_bucket_view
        options.find_unused_parameters = self.find_unused_parameters
        options.skip_all_reduce_unused_params = self.skip_all_reduce_unused_params
        options.timeout_seconds = timeout_s
        options.reduce_dtype = self.reduce_dtype
        for name, value in self.health:
            setattr(options.health, name, value)
        return options
