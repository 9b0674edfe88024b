"""How this copy of fused_reducer was built (the base layer: only the extension and torch)."""
import torch

from . import _C


def build_info():
    """How this copy was built: cuda (bool), nccl_version, torch_version, cuda_arch_list."""
    info = dict(_C.BUILD_INFO)
    code = info["nccl_version"]
    if code is not None:  # NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch
        info["nccl_version"] = f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    info["torch_version"] = torch.__version__
    return info
