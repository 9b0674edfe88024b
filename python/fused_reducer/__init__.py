"""FusedReducer: bucketed gradient all-reduce for data-parallel PyTorch, with a first bucket and
bucket cap that stay tunable at runtime.

    import fused_reducer
    model = fused_reducer.FusedReducer(model, first_bucket_mb=16)
"""
import torch
import torch.distributed  # registers ProcessGroup with pybind11 before _C needs it

from . import _C
from .reducer import FusedReducer
from .transport import make_transport
from .settings import get_default_first_bucket_bytes, set_default_first_bucket_bytes


def build_info():
    """How this copy was built: cuda (bool), nccl_version, torch_version, cuda_arch_list."""
    info = dict(_C.BUILD_INFO)
    code = info["nccl_version"]
    if code is not None:  # NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch
        info["nccl_version"] = f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    info["torch_version"] = torch.__version__
    return info


__all__ = ["FusedReducer", "build_info", "make_transport", "get_default_first_bucket_bytes",
           "set_default_first_bucket_bytes"]
