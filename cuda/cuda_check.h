// One family of checks for CUDA and NCCL calls: file:line, the call, the
// library's own error string, and what to do. Throws std::runtime_error,
// which reaches Python as RuntimeError.
#pragma once

#include <cuda_runtime_api.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace fused_reducer::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t error, const char* call, const char* file,
                                          int line) {
  std::ostringstream msg;
  msg << "FusedReducer: CUDA call " << call << " failed at " << file << ":" << line << ": "
      << cudaGetErrorName(error) << " (" << cudaGetErrorString(error) << ")";
  throw std::runtime_error(msg.str());
}

}  // namespace fused_reducer::cuda

#define FR_CUDA_CHECK(call)                                                         \
  do {                                                                              \
    const cudaError_t fr_status_ = (call);                                          \
    if (fr_status_ != cudaSuccess) {                                                \
      ::fused_reducer::cuda::throw_cuda_error(fr_status_, #call, __FILE__, __LINE__); \
    }                                                                               \
  } while (0)

// After a kernel launch: launch-configuration errors surface here, not later.
#define FR_CUDA_CHECK_LAUNCH() FR_CUDA_CHECK(cudaGetLastError())
