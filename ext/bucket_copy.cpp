#include "bucket_copy.h"

#include <ATen/Parallel.h>
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
// same strides such as channels_last), of the fused pair of dtypes, on `device`.
bool fits_fused_kernel(const CopyJob& job, at::ScalarType src_type, at::ScalarType dst_type,
                       at::Device device) {
  const at::Tensor& dst = job.dst;
  if (dst.scalar_type() != dst_type || dst.device() != device ||
      !dst.is_non_overlapping_and_dense()) {
    return false;
  }
  const at::Tensor& src = job.src;
  return !src.defined() ||
         (src.scalar_type() == src_type && src.device() == device && src.sizes() == dst.sizes() &&
          src.strides() == dst.strides() && (src_type == dst_type || !src.is_same(dst)));
}

// Fused launches for the jobs that fit the kernel; the others are left in `rest`.
// The (source, destination) dtype pair is the first job's: within a bucket every
// job has the same pair (gradients of one dtype, one bucket dtype).
int64_t fused_copy(const std::vector<CopyJob>& jobs, double scale, std::vector<CopyJob>* rest) {
  const at::Tensor& first = jobs.front().dst;
  at::ScalarType src_type = first.scalar_type();
  for (const auto& job : jobs) {
    if (job.src.defined()) {
      src_type = job.src.scalar_type();
      break;
    }
  }
  cuda::DType src_dtype;
  cuda::DType dst_dtype;
  if (!first.is_cuda() || !fused_dtype(src_type, &src_dtype) ||
      !fused_dtype(first.scalar_type(), &dst_dtype)) {
    *rest = jobs;
    return 0;
  }
  std::vector<cuda::CopySegment> segments;
  segments.reserve(jobs.size());
  for (const auto& job : jobs) {
    if (fits_fused_kernel(job, src_type, first.scalar_type(), first.device())) {
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
  return cuda::scaled_copy(segments, src_dtype, dst_dtype, scale, stream.stream());
}
#endif

// The common CPU job, an fp32 gradient scaled into an fp32, bf16 or fp16 slot
// of the same layout, in one plain pass: for small gradients the set-up of an
// ATen op costs several times the copy (400 gradients of 16 KB: 1.6 ms per
// step through at::mul_out, 0.5 ms here). Same arithmetic as at::mul_out: the
// product in fp32, rounded once (to nearest even) into the slot's dtype.
template <typename Dst>
void scale_into(const float* src, Dst* dst, int64_t n, float scale) {
  at::parallel_for(0, n, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      dst[i] = static_cast<Dst>(src[i] * scale);
    }
  });
}

bool cpu_scaled_copy(const CopyJob& job, double scale) {
  const at::Tensor& src = job.src;
  const at::Tensor& dst = job.dst;
  if (!src.defined() || !src.is_cpu() || !dst.is_cpu() || src.scalar_type() != at::kFloat ||
      src.sizes() != dst.sizes() || src.strides() != dst.strides() ||
      !src.is_non_overlapping_and_dense()) {
    return false;  // one dense block in the same element order on both sides, or ATen
  }
  const float* in = src.const_data_ptr<float>();
  const auto n = src.numel();
  const auto factor = static_cast<float>(scale);
  switch (dst.scalar_type()) {
    case at::kFloat: scale_into(in, dst.mutable_data_ptr<float>(), n, factor); return true;
    case at::kBFloat16: scale_into(in, dst.mutable_data_ptr<at::BFloat16>(), n, factor); return true;
    case at::kHalf: scale_into(in, dst.mutable_data_ptr<at::Half>(), n, factor); return true;
    default: return false;
  }
}

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
    const at::Tensor& src = job.src;
    if (!src.defined()) {
      dst.zero_();
    } else if (scale == 1.0) {
      if (!src.is_same(dst)) dst.copy_(src);  // casts when the dtypes differ
    } else if (cpu_scaled_copy(job, scale)) {
      continue;
    } else if (src.scalar_type() == dst.scalar_type() ||
               at::promote_types(src.scalar_type(), dst.scalar_type()) == src.scalar_type()) {
      // Same dtype, or narrowing (fp32 -> bf16): the product is formed in the
      // source dtype and rounded once into dst (TensorIterator casts the
      // common dtype to the output), so an fp16 bucket sees the scaled value.
      at::mul_out(dst, src, scale_tensor);
    } else if (at::promote_types(src.scalar_type(), dst.scalar_type()) == dst.scalar_type()) {
      // Widening (bf16 -> fp32): a product in the source dtype would round to
      // bf16 first; cast exactly, then scale in the wider dtype.
      dst.copy_(src);
      dst.mul_(scale_tensor);
    } else {
      // Neither holds the other (bf16 <-> fp16): scale in fp32, round once.
      at::mul_out(dst, src.to(at::kFloat), scale_tensor);
    }
  }
  return launches;
}

}  // namespace fused_reducer
