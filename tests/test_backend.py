"""Backend selection: clear errors when NCCL is asked of what cannot use it, and every backend a
transport the build registered by its name (runs on CPU)."""
import pytest
import torch

import fused_reducer
from fused_reducer.transports import transport as transport_module
from fused_reducer.transports.transport import resolve_backend


def test_auto_tries_shared_memory_for_cpu_parameters():
    # make_transport falls back to the process group when the ranks do not share a host
    assert resolve_backend("auto", torch.device("cpu")) == "shm"


def test_shm_for_cuda_parameters_is_refused_naming_the_device():
    with pytest.raises(ValueError, match="shm.*cuda:0"):
        resolve_backend("shm", torch.device("cuda", 0))


def test_auto_picks_nccl_for_cuda_parameters_only_in_a_cuda_build():
    expected = "nccl" if fused_reducer.build_info()["cuda"] else "process_group"
    assert resolve_backend("auto", torch.device("cuda", 0)) == expected


def test_nccl_for_cpu_parameters_is_refused_naming_the_device():
    error = ValueError if fused_reducer.build_info()["cuda"] else RuntimeError
    with pytest.raises(error, match="nccl"):
        resolve_backend("nccl", torch.device("cpu"))


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("mpi-please", torch.device("cpu"))


def test_nccl_for_cuda_parameters_needs_a_cuda_build():
    if fused_reducer.build_info()["cuda"]:
        assert resolve_backend("nccl", torch.device("cuda", 0)) == "nccl"
    else:  # e.g. FUSED_REDUCER_NO_CUDA=1 with a CUDA build of torch
        with pytest.raises(RuntimeError, match="built without CUDA"):
            resolve_backend("nccl", torch.device("cuda", 0))


def test_build_info_reports_what_was_built():
    info = fused_reducer.build_info()
    assert set(info) >= {"cuda", "nccl_version", "torch_version", "cuda_arch_list"}
    assert info["torch_version"] == torch.__version__
    if info["cuda"]:  # the CUDA path: needs a CUDA build of torch; this project builds 8.0;9.0
        assert torch.version.cuda
        assert info["nccl_version"].startswith("2."), info
        assert "9.0" in info["cuda_arch_list"].split(";"), info
    else:  # the CPU/process-group path (CPU torch, no toolkit, or FUSED_REDUCER_NO_CUDA=1)
        assert info["nccl_version"] is None and info["cuda_arch_list"] == "", info
        assert not hasattr(fused_reducer._C, "NcclTransport")


def test_every_backend_is_a_transport_the_build_registered_by_the_same_name():
    absent = set() if transport_module.nccl_built() else {"nccl"}  # a CPU build has no NCCL
    built = set(transport_module.TRANSPORTS) - absent
    assert fused_reducer._C.registered_transports() == sorted(built)
    assert transport_module.BACKENDS == ("auto", "nccl", "shm", "process_group")


def test_a_transport_the_build_did_not_register_is_refused_naming_those_it_has():
    with pytest.raises(RuntimeError, match="no transport 'carrier-pigeon' in this build.*'shm'"):
        transport_module.registered_transport("carrier-pigeon", rank=0)
