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
// dst = src * scale for every job. On CUDA, the jobs whose two sides are dense
// blocks of one layout (contiguous, or equal strides such as channels_last)
// and of one supported dtype move in ONE fused kernel launch on the current
// stream (cuda/multi_tensor_copy.cu) instead of DDP's launch per parameter;
// any other job, and every job on CPU, is one ATen op. Copies never record
// autograd history. Returns the number of fused CUDA kernel launches.
int64_t scaled_copy(const std::vector<CopyJob>& jobs, double scale);

}  // namespace fused_reducer
