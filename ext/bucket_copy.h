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
// dst = src * scale for every job, cast to dst's dtype when src's differs (a
// bucket in a reduce dtype, see Note [Reduce dtype]): the product is formed in
// the wider of the two dtypes (at least fp32 on CUDA) and rounded once into
// dst, so scaling happens before a narrowing cast. On CUDA, the jobs whose two
// sides are dense blocks of one layout (contiguous, or equal strides such as
// channels_last), of the first job's (src, dst) pair of supported dtypes, move
// in ONE fused kernel launch on the current stream (cuda/multi_tensor_copy.cu)
// instead of DDP's launch per parameter; on CPU an fp32 gradient into a slot
// of its layout is one plain loop; any other job is one ATen op (two when
// widening: cast, then scale). Copies never record autograd history. Returns
// the number of fused CUDA kernel launches.
int64_t scaled_copy(const std::vector<CopyJob>& jobs, double scale);

}  // namespace fused_reducer
