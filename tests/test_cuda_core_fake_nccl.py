"""The torch-free CUDA core (cuda/nccl_comm.*) against a fake NCCL, from pytest.

tests/cpp/test_cuda_core.cpp checks, without a GPU, the communicator's lock discipline (every NCCL
call and the abort under the communicator's lock, no call after the release), the watchdog's
state machine (timeouts and errors name the bucket, the device it could not select) and the
graph-capture refusal. ctest runs it in scripts/test.sh; this test compiles and runs the same
file so that a mutation of cuda/ (scripts/mutations.py) is killed by the pytest run too: the
Python extension's CPU build does not compile cuda/ at all.
"""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")


def nccl_home():
    try:
        import nvidia.nccl
    except ImportError:
        return None
    return list(nvidia.nccl.__path__)[0]


def test_cuda_core_against_a_fake_nccl(tmp_path):
    nccl = nccl_home()
    compiler = shutil.which("c++") or shutil.which("g++")
    if not (compiler and nccl and os.path.exists(os.path.join(CUDA_HOME, "include", "cuda_runtime_api.h"))):
        pytest.skip("needs a C++ compiler, the CUDA toolkit headers and the nvidia-nccl wheel")
    cudart = os.path.join(CUDA_HOME, "lib64")
    nccl_lib = os.path.join(nccl, "lib")
    binary = tmp_path / "test_cuda_core"
    build = subprocess.run(
        [compiler, "-std=c++20", "-O1", "-pthread",
         "-I", os.path.join(ROOT, "cuda"), "-I", os.path.join(CUDA_HOME, "include"),
         "-I", os.path.join(nccl, "include"),
         os.path.join(ROOT, "tests", "cpp", "test_cuda_core.cpp"),
         os.path.join(ROOT, "cuda", "nccl_comm.cpp"),
         "-L", cudart, "-lcudart", f"-Wl,-rpath,{cudart}",
         "-L", nccl_lib, "-l:libnccl.so.2", f"-Wl,-rpath,{nccl_lib}",
         "-o", str(binary)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "cuda core: all checks passed" in run.stdout
