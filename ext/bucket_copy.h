// Moving gradients into and out of a bucket's flat buffer.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace fused_reducer {

struct CopyJob {
  at::Tensor src;  // undefined: write zeros (a parameter without gradient)
  at::Tensor dst;  // may be src itself: scale in place
  int64_t param = -1;  // the parameter's index: where CopyStats counts its non-finite elements
};

// Note [Statistics from the copy]
// The reducer reads every gradient element on its way into a bucket (pack) and out of it
// (unpack). Two statistics ride on those reads instead of taking passes of their own:
// - `nonfinite` (check_finite): the NaN/Inf elements of each *source* (the local gradient,
//   before scaling), added to nonfinite[job.param] (int64, one entry per parameter);
// - `norms`: of each *destination* (param.grad after the unpack, the averaged gradient),
//   added to norms = float64 [sum of x^2, sum of |x|, max |x|].
// Both tensors live on the copies' device: the CUDA kernel adds to them atomically (no host
// synchronisation); the host reads them at the end of backward (nonfinite, and with
// check_finite sum |x| too: Note [Averages that overflow] in health_exchange.cpp) or when the norm
// is asked for (norms). Jobs the fused kernel or the CPU loop cannot take are observed by
// ATen reductions on the same tensors (a pass of their own: strided or unusual dtypes only).
struct CopyStats {
  at::Tensor nonfinite;  // undefined: not counted
  at::Tensor norms;      // undefined: not accumulated
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
// widening: cast, then scale). Copies never record autograd history. `stats`
// (may be null): see Note [Statistics from the copy]. Returns the number of fused
// CUDA kernel launches.
int64_t scaled_copy(const std::vector<CopyJob>& jobs, double scale,
                    const CopyStats* stats = nullptr);

// What scaled_copy adds to `stats` for `job`, by ATen reductions, without copying: a
// gradient that already is its bucket slot (gradient_as_bucket_view).
void observe_with_aten(const CopyJob& job, const CopyStats& stats);

}  // namespace fused_reducer
