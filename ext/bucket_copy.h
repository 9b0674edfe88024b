// Moving gradients into and out of a bucket's flat buffer.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace fused_reducer {

struct CopyJob {
  at::Tensor src;  // undefined: write zeros (a parameter without gradient)
  at::Tensor dst;  // may be src itself: scale in place
};

// Note [Bucket copies]
// dst = src * scale for every job. On CUDA, when every tensor is contiguous and
// of one supported dtype, this is ONE fused kernel launch on the current stream
// (cuda/multi_tensor_copy.cu) instead of DDP's launch per parameter; otherwise,
// and on CPU, one ATen op per tensor. Returns the number of CUDA kernel
// launches made by the fused path (0 on the per-tensor path).
int64_t scaled_copy(const std::vector<CopyJob>& jobs, double scale);

}  // namespace fused_reducer
