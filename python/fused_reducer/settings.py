"""Validation of the bucket-size settings and the process-wide first-bucket default.

Python checks what only Python can see (the type of a value, whether an int fits the C++
reducer's int64, MiB arithmetic); the rule a value must follow is written once, in C++
(ext/bucket_assignment.cpp, ext/bucket_layout.cpp), and called from here for values Python holds
before a reducer exists. A setter hands the value to the C++ reducer, which checks it itself.
"""
import math
import numbers
import os

from . import _C

MiB = 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1 * MiB  # DDP's default, kept so results are comparable
DEFAULT_BUCKET_CAP_MB = 25  # DDP's
ENV_FIRST_BUCKET_BYTES = "FUSED_REDUCER_FIRST_BUCKET_BYTES"
MAX_BYTES = 1 << 62  # a limit must fit the C++ reducer's int64

_default_first_bucket_bytes = None  # set_default_first_bucket_bytes() wins over the environment


def as_bytes(setting, value):
    """`value` as an int that fits the C++ reducer's int64, or a TypeError / ValueError naming
    `setting`; whether it is a valid limit is C++'s check (check_bytes, or the setter's)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{setting} must be a positive int number of bytes, got {value!r} "
                        f"({type(value).__name__})")
    if abs(value) > MAX_BYTES:
        raise ValueError(f"{setting}={value} bytes is beyond any memory (at most 2**62)")
    return int(value)


def check_bytes(setting, value):
    """Return `value` as a positive int number of bytes, or raise naming `setting`."""
    value = as_bytes(setting, value)
    _C.check_bucket_bytes(setting, value)
    return value


def megabytes_to_bytes(setting, value):
    """DDP-style size in MiB (int or float) -> bytes, or raise naming `setting`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{setting} must be a positive number of MiB, got {value!r} "
                        f"({type(value).__name__})")
    if math.isnan(value) or math.isinf(value) or value <= 0:
        raise ValueError(f"{setting} must be a positive, finite number of MiB, got {value}")
    size = int(value * MiB)
    if size <= 0:
        raise ValueError(f"{setting}={value} MiB is less than one byte")
    if size > MAX_BYTES:
        raise ValueError(f"{setting}={value} MiB is beyond any memory (at most 2**42 MiB)")
    return size


def set_default_first_bucket_bytes(nbytes):
    """Set the first-bucket size used by FusedReducers created after this call.

    Unlike ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` this really is used, by the initial
    layout and by every rebuild, until the reducer's own ``first_bucket_bytes`` is set.
    """
    global _default_first_bucket_bytes
    _default_first_bucket_bytes = check_bytes("default first_bucket_bytes", nbytes)


def get_default_first_bucket_bytes():
    """The value set by set_default_first_bucket_bytes(), else the environment variable
    FUSED_REDUCER_FIRST_BUCKET_BYTES, else 1 MiB."""
    chosen = user_default_first_bucket_bytes()
    return DEFAULT_FIRST_BUCKET_BYTES if chosen is None else chosen


def user_default_first_bucket_bytes():
    """The value set by set_default_first_bucket_bytes(), else the environment variable
    FUSED_REDUCER_FIRST_BUCKET_BYTES, else None (the user chose no default)."""
    if _default_first_bucket_bytes is not None:
        return _default_first_bucket_bytes
    raw = os.environ.get(ENV_FIRST_BUCKET_BYTES)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_FIRST_BUCKET_BYTES} must be a positive int number of bytes, "
                         f"got {raw!r}") from None
    return check_bytes(ENV_FIRST_BUCKET_BYTES, value)


def bucket_limits(bucket_cap_mb, first_bucket_mb, bucket_cap_mb_list):
    """The constructor's size arguments -> the list of bucket limits in bytes, by DDP's rules:
    a non-empty bucket_cap_mb_list is the list (bucket_cap_mb is then ignored, as DDP ignores
    it); otherwise [first, cap] with cap = bucket_cap_mb (25 MiB when None) and first =
    first_bucket_mb, else the process default if the user set one, else the cap when
    bucket_cap_mb was given (DDP: an explicit cap is also the first bucket's), else 1 MiB."""
    if bucket_cap_mb_list is not None and len(bucket_cap_mb_list) > 0:
        if first_bucket_mb is not None:
            raise ValueError("first_bucket_mb and bucket_cap_mb_list both set the first bucket's "
                             "limit; pass the first limit as bucket_cap_mb_list[0]")
        return [megabytes_to_bytes(f"bucket_cap_mb_list[{k}]", mb)
                for k, mb in enumerate(bucket_cap_mb_list)]
    cap = megabytes_to_bytes("bucket_cap_mb", DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None
                             else bucket_cap_mb)
    if first_bucket_mb is not None:
        return [megabytes_to_bytes("first_bucket_mb", first_bucket_mb), cap]
    chosen = user_default_first_bucket_bytes()
    if chosen is not None:
        return [chosen, cap]
    return [cap, cap] if bucket_cap_mb is not None else [DEFAULT_FIRST_BUCKET_BYTES, cap]


def as_byte_list(caps):
    """`caps` as a list of ints for bucket_caps_bytes (the C++ setter checks the values), or a
    TypeError / ValueError naming the entry."""
    if isinstance(caps, (str, bytes)) or not hasattr(caps, "__iter__"):
        raise TypeError(f"bucket_caps_bytes must be a list of positive int numbers of bytes, "
                        f"got {caps!r} ({type(caps).__name__})")
    return [as_bytes(f"bucket_caps_bytes[{k}]", c) for k, c in enumerate(caps)]


def as_reduce_dtype(value):
    """`value` if it is a torch.dtype or None, else a TypeError naming it and the accepted ones;
    which dtypes are accepted is C++'s check (check_reduce_dtype, or the setter's)."""
    import torch
    if value is not None and not isinstance(value, torch.dtype):
        raise TypeError("reduce_dtype must be one of torch.bfloat16, torch.float16, "
                        f"torch.float32 or None (each gradient's own dtype); got {value!r} "
                        f"({type(value).__name__})")
    return value


def check_reduce_dtype(value):
    """Return `value` if it is an accepted reduce dtype (torch.bfloat16, torch.float16,
    torch.float32 or None), else raise naming it and the accepted ones."""
    _C.check_reduce_dtype(as_reduce_dtype(value))
    return value
