#include "bucket_copy.h"

#include <ATen/Parallel.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/grad_mode.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>

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
int64_t fused_copy(const std::vector<CopyJob>& jobs, double scale, const CopyStats* stats,
                   std::vector<CopyJob>* rest) {
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
                          job.dst.numel(), job.param});
    } else {
      rest->push_back(job);  // falls back per segment, not per bucket
    }
  }
  if (segments.empty()) {
    return 0;
  }
  c10::cuda::CUDAGuard guard(first.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(first.device().index());
  cuda::CopyStatsDevice device_stats;
  if (stats != nullptr && stats->nonfinite.defined()) {
    TORCH_INTERNAL_ASSERT(stats->nonfinite.device() == first.device() &&
                          stats->nonfinite.scalar_type() == at::kLong);
    device_stats.nonfinite =
        reinterpret_cast<unsigned long long*>(stats->nonfinite.mutable_data_ptr<int64_t>());
  }
  if (stats != nullptr && stats->norms.defined()) {
    TORCH_INTERNAL_ASSERT(stats->norms.device() == first.device() &&
                          stats->norms.scalar_type() == at::kDouble);
    device_stats.norms = stats->norms.mutable_data_ptr<double>();
  }
  return cuda::scaled_copy(segments, src_dtype, dst_dtype, scale, stream.stream(), device_stats);
}
#endif

// The common CPU job, an fp32 gradient scaled into an fp32, bf16 or fp16 slot
// of the same layout, in one plain pass: for small gradients the set-up of an
// ATen op costs several times the copy (400 gradients of 16 KB: 1.6 ms per
// step through at::mul_out, 0.5 ms here). Same arithmetic as at::mul_out: the
// product in fp32, rounded once (to nearest even) into the slot's dtype.
// kCount: also returns the number of NaN/Inf sources (check_finite).
template <bool kCount, typename Dst>
int64_t scale_into(const float* src, Dst* dst, int64_t n, float scale) {
  std::atomic<int64_t> nonfinite{0};
  at::parallel_for(0, n, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    int64_t local = 0;
    for (int64_t i = begin; i < end; ++i) {
      const float x = src[i];
      dst[i] = static_cast<Dst>(x * scale);
      if constexpr (kCount) local += std::isfinite(x) ? 0 : 1;
    }
    if (local != 0) nonfinite += local;
  });
  return nonfinite.load();
}

// The common CPU unpack: a bucket (fp32, bf16 or fp16) into an fp32 gradient of the
// same layout, with the gradient's norms accumulated on the way (in double).
// The sums are vectorised (omp simd, built with -fopenmp-simd: no OpenMP runtime), which adds
// them in another order than one by one: the same double sums to within a few ulps, and
// about 3 times faster (16 MiB: 1.3 ms against 3.5-4.5 ms), so the unpack costs about what a
// plain copy does (DDP's), not a serial chain of double additions per element.
template <typename Src>
void copy_with_norms(const Src* src, float* dst, int64_t n, double* norms) {
  std::mutex mutex;
  at::parallel_for(0, n, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    double sum_sq = 0, sum_abs = 0, max_abs = 0;
#pragma omp simd reduction(+ : sum_sq, sum_abs) reduction(max : max_abs)
    for (int64_t i = begin; i < end; ++i) {
      const float x = static_cast<float>(src[i]);
      dst[i] = x;
      const double a = std::fabs(static_cast<double>(x));
      sum_sq += a * a;
      sum_abs += a;
      max_abs = std::max(max_abs, a);  // a NaN shows in the sums
    }
    std::lock_guard<std::mutex> lock(mutex);
    norms[0] += sum_sq;
    norms[1] += sum_abs;
    norms[2] = std::max(norms[2], max_abs);
  });
}

// Both sides on the CPU, one dense block in the same element order.
bool same_cpu_layout(const at::Tensor& src, const at::Tensor& dst) {
  return src.defined() && src.is_cpu() && dst.is_cpu() && src.sizes() == dst.sizes() &&
         src.strides() == dst.strides() && src.is_non_overlapping_and_dense();
}

// The CPU loops above, where they fit the job; false: the caller uses ATen.
bool cpu_scaled_copy(const CopyJob& job, double scale, const CopyStats* stats) {
  const at::Tensor& src = job.src;
  const at::Tensor& dst = job.dst;
  if (!same_cpu_layout(src, dst) || src.is_same(dst)) {
    return false;
  }
  const bool count = stats != nullptr && stats->nonfinite.defined() && job.param >= 0;
  const bool norms = stats != nullptr && stats->norms.defined();
  if (norms) {
    if (scale != 1.0 || count || dst.scalar_type() != at::kFloat) return false;
    double* out = stats->norms.mutable_data_ptr<double>();
    float* to = dst.mutable_data_ptr<float>();
    switch (src.scalar_type()) {
      case at::kFloat: copy_with_norms(src.const_data_ptr<float>(), to, src.numel(), out); return true;
      case at::kBFloat16: copy_with_norms(src.const_data_ptr<at::BFloat16>(), to, src.numel(), out); return true;
      case at::kHalf: copy_with_norms(src.const_data_ptr<at::Half>(), to, src.numel(), out); return true;
      default: return false;
    }
  }
  if (src.scalar_type() != at::kFloat || (scale == 1.0 && !count)) {
    return false;  // a plain copy_ is as fast
  }
  const float* in = src.const_data_ptr<float>();
  const auto n = src.numel();
  const auto factor = static_cast<float>(scale);
  int64_t nonfinite = 0;
  switch (dst.scalar_type()) {
    case at::kFloat:
      nonfinite = count ? scale_into<true>(in, dst.mutable_data_ptr<float>(), n, factor)
                        : scale_into<false>(in, dst.mutable_data_ptr<float>(), n, factor);
      break;
    case at::kBFloat16:
      nonfinite = count ? scale_into<true>(in, dst.mutable_data_ptr<at::BFloat16>(), n, factor)
                        : scale_into<false>(in, dst.mutable_data_ptr<at::BFloat16>(), n, factor);
      break;
    case at::kHalf:
      nonfinite = count ? scale_into<true>(in, dst.mutable_data_ptr<at::Half>(), n, factor)
                        : scale_into<false>(in, dst.mutable_data_ptr<at::Half>(), n, factor);
      break;
    default: return false;
  }
  if (nonfinite != 0) {
    stats->nonfinite.mutable_data_ptr<int64_t>()[job.param] += nonfinite;
  }
  return true;
}

void observe_sources(const CopyJob& job, const CopyStats* stats) {
  if (stats != nullptr && stats->nonfinite.defined() && job.src.defined() && job.param >= 0) {
    stats->nonfinite.narrow(0, job.param, 1).add_(at::isfinite(job.src).logical_not().sum());
  }
}

void observe_destination(const CopyJob& job, const CopyStats* stats) {
  if (stats == nullptr || !stats->norms.defined() || job.dst.numel() == 0) {
    return;
  }
  // Reductions that widen on the fly: no float64 copy of the gradient (a temporary that
  // size would stay resident in the allocator's cache). A complex gradient's norm is that of its
  // magnitudes (as torch's clip_grad_norm_); vector_norm widens it only to a complex dtype.
  const auto wide = job.dst.is_complex() ? at::kComplexDouble : at::kDouble;
  const auto norm = [&](double ord) {
    return at::linalg_vector_norm(job.dst, ord, at::OptionalIntArrayRef(), false, wide);
  };
  stats->norms.narrow(0, 0, 1).add_(norm(2.0).square());
  stats->norms.narrow(0, 1, 1).add_(norm(1.0));
  at::Tensor max_abs = stats->norms.narrow(0, 2, 1);
  max_abs.copy_(at::fmax(max_abs, norm(std::numeric_limits<double>::infinity()).reshape({1})));
}

}  // namespace

void observe_with_aten(const CopyJob& job, const CopyStats& stats) {
  at::NoGradGuard no_grad;
  observe_sources(job, &stats);
  observe_destination(job, &stats);
}

int64_t scaled_copy(const std::vector<CopyJob>& jobs, double scale, const CopyStats* stats) {
  if (jobs.empty()) {
    return 0;
  }
  // loss.backward(create_graph=True) gives gradients with history; the bucket
  // copies must not extend it.
  at::NoGradGuard no_grad;
  int64_t launches = 0;
  std::vector<CopyJob> rest;
#ifdef FUSED_REDUCER_WITH_CUDA
  launches = fused_copy(jobs, scale, stats, &rest);
#else
  rest = jobs;
#endif
  const auto scale_tensor = at::native::wrapped_scalar_tensor(scale);
  for (const auto& job : rest) {
    at::Tensor dst = job.dst;
    const at::Tensor& src = job.src;
    if (cpu_scaled_copy(job, scale, stats)) {
      continue;  // statistics included
    }
    observe_sources(job, stats);
    if (!src.defined()) {
      dst.zero_();
    } else if (scale == 1.0) {
      if (!src.is_same(dst)) dst.copy_(src);  // casts when the dtypes differ
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
    observe_destination(job, stats);
  }
  return launches;
}

}  // namespace fused_reducer
