#include "bucket_copy.h"

#include <ATen/ScalarOps.h>

#ifdef FUSED_REDUCER_WITH_CUDA
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

// One launch for all jobs, or -1 when some tensor does not fit the fused kernel.
int64_t try_fused_copy(const std::vector<CopyJob>& jobs, double scale) {
  const at::Tensor& first = jobs.front().dst;
  cuda::DType dtype;
  if (!first.is_cuda() || !fused_dtype(first.scalar_type(), &dtype)) {
    return -1;
  }
  std::vector<cuda::CopySegment> segments;
  segments.reserve(jobs.size());
  for (const auto& job : jobs) {
    const bool dst_ok = job.dst.is_contiguous() && job.dst.scalar_type() == first.scalar_type() &&
                        job.dst.device() == first.device();
    const bool src_ok = !job.src.defined() ||
                        (job.src.is_contiguous() && job.src.scalar_type() == first.scalar_type() &&
                         job.src.device() == first.device() && job.src.numel() == job.dst.numel());
    if (!dst_ok || !src_ok) {
      return -1;
    }
    segments.push_back({job.src.defined() ? job.src.data_ptr() : nullptr, job.dst.data_ptr(),
                        job.dst.numel()});
  }
  const auto stream = c10::cuda::getCurrentCUDAStream(first.device().index());
  return cuda::scaled_copy(segments, dtype, scale, stream.stream());
}
#endif

}  // namespace

int64_t scaled_copy(const std::vector<CopyJob>& jobs, double scale) {
  if (jobs.empty()) {
    return 0;
  }
#ifdef FUSED_REDUCER_WITH_CUDA
  const int64_t launches = try_fused_copy(jobs, scale);
  if (launches >= 0) {
    return launches;
  }
#endif
  const auto scale_tensor = at::native::wrapped_scalar_tensor(scale);
  for (const auto& job : jobs) {
    at::Tensor dst = job.dst;
    if (!job.src.defined()) {
      dst.zero_();
    } else if (scale == 1.0) {
      if (!job.src.is_same(dst)) dst.copy_(job.src);
    } else {
      at::mul_out(dst, job.src, scale_tensor);
    }
  }
  return 0;
}

}  // namespace fused_reducer
