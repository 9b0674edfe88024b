#include "multi_tensor_copy.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "copy_split.h"
#include "cuda_check.h"

namespace fused_reducer::cuda {
namespace {

constexpr int kThreads = kCopyThreads;

// Everything one launch needs, passed by value as kernel parameters (no extra
// host-to-device copy of the segment table). ~22 KiB: needs CUDA >= 12.1, sm_70+.
struct LaunchArgs {
  int num_segments;
  double scale;
  CopyStatsDevice stats;
  int64_t starts[kMaxSegmentsPerLaunch + 1];  // prefix sums of numel: segment s owns [starts[s], starts[s+1])
  const void* src[kMaxSegmentsPerLaunch];
  void* dst[kMaxSegmentsPerLaunch];
  int32_t param[kMaxSegmentsPerLaunch];  // CopySegment::param
};

// One thread's share of the statistics (Note [Statistics from the copy]).
struct ThreadStats {
  unsigned long long nonfinite = 0;  // of the current segment's sources
  float sum_sq = 0, sum_abs = 0, max_abs = 0;  // of the destinations
};

// Arithmetic type of the scaling: float for 16/32-bit types (as torch's
// opmath), double when either side is fp64.
template <typename S, typename D>
using Math = std::conditional_t<std::is_same_v<S, double> || std::is_same_v<D, double>, double,
                                float>;

// Explicit conversions: torch builds with __CUDA_NO_HALF_CONVERSIONS__.
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }

// Round-to-nearest-even into the destination dtype, from the arithmetic type.
// fp64 -> 16 bit goes through float, as torch's casts do (c10::Half and
// c10::BFloat16 convert from float), so the fused kernel and the ATen fallback
// give the same bits.
template <typename D> struct Narrow;
template <> struct Narrow<float> {
  static __device__ __forceinline__ float from(float x) { return x; }
  static __device__ __forceinline__ float from(double x) { return static_cast<float>(x); }
};
template <> struct Narrow<double> {
  static __device__ __forceinline__ double from(float x) { return x; }
  static __device__ __forceinline__ double from(double x) { return x; }
};
template <> struct Narrow<__half> {
  static __device__ __forceinline__ __half from(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ __half from(double x) {
    return __float2half_rn(static_cast<float>(x));
  }
};
template <> struct Narrow<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ __nv_bfloat16 from(double x) {
    return __float2bfloat16_rn(static_cast<float>(x));
  }
};

// Scale in the arithmetic type, then cast: an fp16 destination sees the scaled
// value (see the header).
template <typename S, typename D>
__device__ __forceinline__ D scaled(S x, Math<S, D> scale) {
  return Narrow<D>::from(static_cast<Math<S, D>>(widen(x)) * scale);
}

// Elements per vector step: see vector_elements (copy_split.h).
template <typename S, typename D>
constexpr int kVec = vector_elements(sizeof(S), sizeof(D));

template <typename T, int N>
struct alignas(16) Pack {
  static_assert(N * sizeof(T) % 16 == 0, "a pack is whole 16-byte vectors");
  T v[N];
};

template <typename S, typename D>
__device__ __forceinline__ D observed(S x, Math<S, D> scale, bool count, bool norms,
                                     ThreadStats& stats) {
  const D out = scaled<S, D>(x, scale);
  if (count && !isfinite(widen(x))) stats.nonfinite += 1;
  if (norms) {
    const float a = fabsf(static_cast<float>(widen(out)));
    stats.sum_sq += a * a;
    stats.sum_abs += a;
    stats.max_abs = fmaxf(stats.max_abs, a);  // a NaN shows in the sums
  }
  return out;
}

// Block-cooperative copy of elements [begin, end) of one segment.
template <typename S, typename D>
__device__ void copy_range(const S* src, D* dst, int64_t begin, int64_t end, Math<S, D> scale,
                           bool count, bool norms, ThreadStats& stats) {
  constexpr int V = kVec<S, D>;
  using SrcPack = Pack<S, V>;
  using DstPack = Pack<D, V>;
  const int64_t n = end - begin;
  const S* s = src ? src + begin : nullptr;
  D* d = dst + begin;

  // Scalar head until the narrower side is 16-byte aligned, vectors where both
  // sides are, scalar tail: see Note [Copy alignment].
  const CopySplit split = split_for_vectors(reinterpret_cast<uintptr_t>(s), sizeof(S),
                                            reinterpret_cast<uintptr_t>(d), sizeof(D), n);
  const int64_t head = split.head;
  const int64_t vectors = split.vectors;
  const D zero = Narrow<D>::from(0.0f);

  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) {
    d[i] = s ? observed<S, D>(s[i], scale, count, norms, stats) : zero;
  }
  const SrcPack* sv = s ? reinterpret_cast<const SrcPack*>(s + head) : nullptr;
  DstPack* dv = reinterpret_cast<DstPack*>(d + head);
  for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x) {
    DstPack out;
    if (sv) {
      const SrcPack in = sv[i];
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = observed<S, D>(in.v[k], scale, count, norms, stats);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = zero;
    }
    dv[i] = out;
  }
  for (int64_t i = head + vectors * V + threadIdx.x; i < n; i += blockDim.x) {
    d[i] = s ? observed<S, D>(s[i], scale, count, norms, stats) : zero;
  }
}

// The block's norms, one atomic each into `norms`.
__device__ void add_block_norms(ThreadStats stats, double* norms) {
  __shared__ float partial[3][kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    stats.sum_sq += __shfl_down_sync(0xffffffffu, stats.sum_sq, offset);
    stats.sum_abs += __shfl_down_sync(0xffffffffu, stats.sum_abs, offset);
    stats.max_abs = fmaxf(stats.max_abs, __shfl_down_sync(0xffffffffu, stats.max_abs, offset));
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    partial[0][warp] = stats.sum_sq;
    partial[1][warp] = stats.sum_abs;
    partial[2][warp] = stats.max_abs;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum_sq = 0, sum_abs = 0;
    float max_abs = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      sum_sq += partial[0][w];
      sum_abs += partial[1][w];
      max_abs = fmaxf(max_abs, partial[2][w]);
    }
    atomicAdd(norms, sum_sq);
    atomicAdd(norms + 1, sum_abs);
    atomicMax(reinterpret_cast<unsigned long long*>(norms + 2),
              static_cast<unsigned long long>(__double_as_longlong(static_cast<double>(max_abs))));
  }
}

// Each block owns `chunk` consecutive elements of the segments laid end to end,
// finds its first segment by binary search, then walks forward.
template <typename S, typename D>
__global__ void __launch_bounds__(kThreads)
    scaled_copy_kernel(const __grid_constant__ LaunchArgs args, int64_t chunk) {
  const int n = args.num_segments;
  const int64_t total = args.starts[n];
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t end = min(begin + chunk, total);
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (args.starts[mid] <= begin) lo = mid; else hi = mid - 1;
  }
  const auto scale = static_cast<Math<S, D>>(args.scale);
  const bool count = args.stats.nonfinite != nullptr;
  const bool norms = args.stats.norms != nullptr;
  ThreadStats stats;
  for (int seg = lo; seg < n && args.starts[seg] < end; ++seg) {
    const int64_t first = max(begin, args.starts[seg]) - args.starts[seg];
    const int64_t last = min(end, args.starts[seg + 1]) - args.starts[seg];
    if (first < last) {
      copy_range<S, D>(static_cast<const S*>(args.src[seg]), static_cast<D*>(args.dst[seg]),
                       first, last, scale, count && args.param[seg] >= 0, norms, stats);
      if (stats.nonfinite != 0) {  // rare: an atomic only where a NaN/Inf was seen
        atomicAdd(args.stats.nonfinite + args.param[seg], stats.nonfinite);
        stats.nonfinite = 0;
      }
    }
  }
  if (norms) {
    add_block_norms(stats, args.stats.norms);  // every thread of the block takes part
  }
}

template <typename S, typename D>
void launch(const LaunchArgs& args, cudaStream_t stream) {
  const int64_t total = args.starts[args.num_segments];
  if (total == 0) return;
  const int64_t chunk = copy_chunk_elements(sizeof(S), sizeof(D));
  const int64_t blocks = (total + chunk - 1) / chunk;
  scaled_copy_kernel<S, D><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args, chunk);
  FR_CUDA_CHECK_LAUNCH();
}

template <typename S>
void launch_from(DType dst, const LaunchArgs& args, cudaStream_t stream) {
  switch (dst) {
    case DType::kFloat32: launch<S, float>(args, stream); break;
    case DType::kFloat16: launch<S, __half>(args, stream); break;
    case DType::kBFloat16: launch<S, __nv_bfloat16>(args, stream); break;
    case DType::kFloat64: launch<S, double>(args, stream); break;
  }
}

}  // namespace

int scaled_copy(const std::vector<CopySegment>& segments, DType src_dtype, DType dst_dtype,
                double scale, cudaStream_t stream, CopyStatsDevice stats) {
  int launches = 0;
  static thread_local LaunchArgs args;  // ~22 KiB: keep it off the stack
  for (size_t first = 0; first < segments.size(); first += kMaxSegmentsPerLaunch) {
    const size_t count = std::min<size_t>(kMaxSegmentsPerLaunch, segments.size() - first);
    args.num_segments = static_cast<int>(count);
    args.scale = scale;
    args.stats = stats;
    args.starts[0] = 0;
    for (size_t i = 0; i < count; ++i) {
      const CopySegment& segment = segments[first + i];
      args.src[i] = segment.src;
      args.dst[i] = segment.dst;
      args.param[i] = static_cast<int32_t>(segment.param);
      args.starts[i + 1] = args.starts[i] + segment.numel;
    }
    switch (src_dtype) {
      case DType::kFloat32: launch_from<float>(dst_dtype, args, stream); break;
      case DType::kFloat16: launch_from<__half>(dst_dtype, args, stream); break;
      case DType::kBFloat16: launch_from<__nv_bfloat16>(dst_dtype, args, stream); break;
      case DType::kFloat64: launch_from<double>(dst_dtype, args, stream); break;
    }
    launches += args.starts[count] > 0 ? 1 : 0;
  }
  return launches;
}

}  // namespace fused_reducer::cuda
