#!/usr/bin/env bash
# The test command: set-up (idempotent), C++ unit tests (CMake + ctest against libtorch),
# then the Python test suite (CPU, multi-process gloo; GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
export PATH="$PWD/.venv/bin:$PATH"

echo "== C++ unit tests (ctest)"
site=$($PY -c 'import site; print(site.getsitepackages()[0])')
nvrtc=$(ls "$site"/nvidia/cu*/lib/libnvrtc.so.* 2>/dev/null | head -n 1 || true)
cuda_home=${CUDA_HOME:-/usr/local/cuda}
nccl_home=$($PY -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
# torch's CMake config looks for the CUDA toolkit of a CUDA build of torch; point it at the real one.
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0} cmake -S . -B cmake-build -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$($PY -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
  -DCUDA_TOOLKIT_ROOT_DIR="$cuda_home" -DCMAKE_CUDA_COMPILER="$cuda_home/bin/nvcc" \
  ${nvrtc:+-DCUDA_nvrtc_LIBRARY="$nvrtc"} ${nccl_home:+-DFUSED_REDUCER_NCCL_HOME="$nccl_home"} \
  > cmake-build.log 2>&1 || { cat cmake-build.log; exit 1; }
cmake --build cmake-build -j2 >> cmake-build.log 2>&1 || { tail -50 cmake-build.log; exit 1; }
ctest --test-dir cmake-build --output-on-failure

echo "== Python tests"
$PY -m pytest -q tests "$@"
