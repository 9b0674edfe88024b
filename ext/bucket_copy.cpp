#include "bucket_copy.h"

#include <ATen/ScalarOps.h>
#include <ATen/core/grad_mode.h>

#ifdef FUSED_REDUCER_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "multi_tensor_copy.h"
#endif

namespace fused_reducer {
namespace {

#ifdef FUSED_REDUCER_WITH_CUDA
bool fused_dtype(at::ScalarType type, cuda::DType* out) {
  switch (type) {
    case at::kFloat: *out = cuda::DType::kFloat32; return true;
    case at::kHalf: *out = cuda::DType::kFloat16; return true;
    case at::kBFloat16: *out = cuda::DType::kBFloat16; return true;
    case at::kDouble: *out = cuda::DType::kFloat64; return true;
    default: return false;
  }
}

// Both sides one dense block in the same element order (contiguous, or the
// same strides such as channels_last), of the fused dtype, on `device`.
bool fits_fused_kernel(const CopyJob& job, at::ScalarType type, at::Device device) {
  const at::Tensor& dst = job.dst;
  if (dst.scalar_type() != type || dst.device() != device || !dst.is_non_overlapping_and_dense()) {
    return false;
  }
  const at::Tensor& src = job.src;
  return !src.defined() ||
         (src.scalar_type() == type && src.device() == device && src.sizes() == dst.sizes() &&
          src.strides() == dst.strides());
}

// Fused launches for the jobs that fit the kernel; the others are left in `rest`.
int64_t fused_copy(const std::vector<CopyJob>& jobs, double scale, std::vector<CopyJob>* rest) {
  const at::Tensor& first = jobs.front().dst;
  cuda::DType dtype;
  if (!first.is_cuda() || !fused_dtype(first.scalar_type(), &dtype)) {
    *rest = jobs;
    return 0;
  }
  std::vector<cuda::CopySegment> segments;
  segments.reserve(jobs.size());
  for (const auto& job : jobs) {
    if (fits_fused_kernel(job, first.scalar_type(), first.device())) {
      segments.push_back({job.src.defined() ? job.src.data_ptr() : nullptr, job.dst.data_ptr(),
                          job.dst.numel()});
    } else {
      rest->push_back(job);  // falls back per segment, not per bucket
    }
  }
  if (segments.empty()) {
    return 0;
  }
  c10::cuda::CUDAGuard guard(first.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(first.device().index());
  return cuda::scaled_copy(segments, dtype, scale, stream.stream());
}
#endif

}  // namespace

int64_t scaled_copy(const std::vector<CopyJob>& jobs, double scale) {
  if (jobs.empty()) {
    return 0;
  }
  // loss.backward(create_graph=True) gives gradients with history; the bucket
  // copies must not extend it.
  at::NoGradGuard no_grad;
  int64_t launches = 0;
  std::vector<CopyJob> rest;
#ifdef FUSED_REDUCER_WITH_CUDA
  launches = fused_copy(jobs, scale, &rest);
#else
  rest = jobs;
#endif
  const auto scale_tensor = at::native::wrapped_scalar_tensor(scale);
  for (const auto& job : rest) {
    at::Tensor dst = job.dst;
    if (!job.src.defined()) {
      dst.zero_();
    } else if (scale == 1.0) {
      if (!job.src.is_same(dst)) dst.copy_(job.src);
    } else {
      at::mul_out(dst, job.src, scale_tensor);
    }
  }
  return launches;
}

}  // namespace fused_reducer
