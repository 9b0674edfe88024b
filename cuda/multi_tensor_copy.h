// Fused multi-tensor scaled copy: one kernel launch moves many gradients into
// (or out of) a bucket's flat buffer, casting between floating-point dtypes on
// the way (a bucket may hold a reduce dtype other than the gradients').
//
// Torch-free on purpose (CUDA runtime only): it builds fast, and a reader can
// test it alone. ext/ calls it through this header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace fused_reducer::cuda {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// dst[i] = cast<dst dtype>(src[i] * scale) for i < numel. src == nullptr
// writes zeros; src == dst (same dtype only) scales in place. The product is
// formed in float (double when either side is fp64) and rounded once, to the
// destination dtype: scaling happens before a narrowing cast, so an fp16
// destination overflows only where the scaled value itself is beyond fp16's
// range (it becomes +-inf, as any float -> half conversion does). Any sizes and
// offsets: 16-byte vector accesses where both pointers allow (aligned on the
// narrower dtype, so widening copies vectorise too: Note [Copy alignment] in
// copy_split.h), scalar accesses elsewhere.
struct CopySegment {
  const void* src;
  void* dst;
  int64_t numel;
  int64_t param = -1;  // index into CopyStatsDevice::nonfinite (-1: not counted)
};

// What the copy accumulates on the way (Note [Statistics from the copy] in
// ext/bucket_copy.h); device pointers, null: not wanted. `nonfinite[param]` gets the
// number of NaN/Inf source elements of each segment; `norms` (3 doubles) gets the
// destination's sum of x^2 and of |x| added and its max |x| (as the bits of a
// non-negative double, which order like the values) maxed, one atomic per block.
struct CopyStatsDevice {
  unsigned long long* nonfinite = nullptr;
  double* norms = nullptr;
};

// Segments fitting one launch's kernel parameters (CUDA 12.1+ allows 32 KiB).
constexpr int kMaxSegmentsPerLaunch = 800;

// Copies every segment (sources all of `src_dtype`, destinations all of
// `dst_dtype`; every pair of the four dtypes is supported) in
// ceil(n / kMaxSegmentsPerLaunch) launches on `stream`; throws
// std::runtime_error naming file:line and the CUDA error if a launch fails.
// Returns the number of kernel launches.
int scaled_copy(const std::vector<CopySegment>& segments, DType src_dtype, DType dst_dtype,
                double scale, cudaStream_t stream, CopyStatsDevice stats = {});

// Same dtype on both sides.
inline int scaled_copy(const std::vector<CopySegment>& segments, DType dtype, double scale,
                       cudaStream_t stream, CopyStatsDevice stats = {}) {
  return scaled_copy(segments, dtype, dtype, scale, stream, stats);
}

}  // namespace fused_reducer::cuda
