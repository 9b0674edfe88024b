// C++ test of the torch-free CUDA core (cuda/): built and linked against the
// CUDA runtime and NCCL only, never libtorch, which is the layering rule
// (cuda/ knows nothing of ext/ or torch). Without a GPU it checks what needs
// none and says that the device checks were skipped.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>

#include "nccl_comm.h"

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::cerr << "FAILED: " << what << "\n";
    ++failures;
  }
}

template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

int main() {
  using fused_reducer::cuda::NcclComm;
  using namespace std::chrono_literals;

  expect(fused_reducer::cuda::nccl_version() >= 21000, "NCCL >= 2.10 (ncclAvg)");

  const std::string bad_id = error_of([] { NcclComm comm("short", 0, 1, 0, 1000ms); });
  expect(bad_id.find("unique id has 128 bytes") != std::string::npos,
         "a malformed unique id is refused naming the expected size: " + bad_id);

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::cout << "no GPU: device checks of the CUDA core skipped\n";
  } else {
    // World size 1 on GPU 0: in-place sum of ones stays ones; average too.
    NcclComm comm(fused_reducer::cuda::nccl_unique_id(), 0, 1, 0, 30000ms);
    float* data = nullptr;
    expect(cudaMalloc(&data, 1024 * sizeof(float)) == cudaSuccess, "cudaMalloc");
    float host[1024];
    for (float& x : host) x = 1.0f;
    cudaMemcpy(data, host, sizeof(host), cudaMemcpyHostToDevice);
    comm.allreduce(data, 1024, ncclFloat32, ncclSum, nullptr, 30000ms);
    cudaMemcpy(host, data, sizeof(host), cudaMemcpyDeviceToHost);
    expect(host[0] == 1.0f && host[1023] == 1.0f, "world-1 all-reduce keeps the values");
    expect(comm.close(10000ms), "close() finalizes cleanly");
    expect(!comm.close(10000ms), "close() is idempotent");
    const std::string after = error_of([&] {
      comm.allreduce(data, 1024, ncclFloat32, ncclSum, nullptr, 1000ms);
    });
    expect(after.find("closed") != std::string::npos || after.find("aborted") != std::string::npos,
           "an all-reduce after close() is refused: " + after);
    cudaFree(data);
  }
  if (failures == 0) {
    std::cout << "cuda core: all checks passed\n";
  }
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
