#include "multi_tensor_copy.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda_check.h"

namespace fused_reducer::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVectorsPerThread = 4;  // per chunk: enough work per block to hide latency

// Everything one launch needs, passed by value as kernel parameters (no extra
// host-to-device copy of the segment table). ~19 KiB: needs CUDA >= 12.1, sm_70+.
struct LaunchArgs {
  int num_segments;
  double scale;
  int64_t starts[kMaxSegmentsPerLaunch + 1];  // prefix sums of numel: segment s owns [starts[s], starts[s+1])
  const void* src[kMaxSegmentsPerLaunch];
  void* dst[kMaxSegmentsPerLaunch];
};

// Arithmetic type for scaling: float for 16/32-bit types (as torch's opmath), double for fp64.
template <typename T> struct Math { using type = float; };
template <> struct Math<double> { using type = double; };

// Explicit conversions: torch builds with __CUDA_NO_HALF_CONVERSIONS__.
template <typename T> __device__ __forceinline__ float to_float(T x) { return static_cast<float>(x); }
template <> __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x) { return static_cast<T>(x); }
template <> __device__ __forceinline__ __half from_float(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16(x); }

template <typename T>
__device__ __forceinline__ T scaled(T x, float scale) { return from_float<T>(to_float(x) * scale); }
__device__ __forceinline__ double scaled(double x, double scale) { return x * scale; }

template <typename T>
struct alignas(16) Vector {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// Block-cooperative copy of elements [begin, end) of one segment.
template <typename T>
__device__ void copy_range(const T* src, T* dst, int64_t begin, int64_t end,
                           typename Math<T>::type scale) {
  using Vec = Vector<T>;
  constexpr int V = Vec::kSize;
  const int64_t n = end - begin;
  const T* s = src ? src + begin : nullptr;
  T* d = dst + begin;

  // Scalar head until dst is 16-byte aligned; vectors only if src is aligned there too.
  const auto dst_address = reinterpret_cast<uintptr_t>(d);
  int64_t head = static_cast<int64_t>(((16 - dst_address % 16) % 16) / sizeof(T));
  const bool dst_elements_aligned = dst_address % sizeof(T) == 0;
  if (!dst_elements_aligned || head > n ||
      (s && reinterpret_cast<uintptr_t>(s + head) % 16 != 0)) {
    head = n;  // no common alignment: all scalar
  }
  const int64_t vectors = (n - head) / V;
  const T zero = from_float<T>(0.0f);

  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) {
    d[i] = s ? scaled(s[i], scale) : zero;
  }
  const Vec* sv = s ? reinterpret_cast<const Vec*>(s + head) : nullptr;
  Vec* dv = reinterpret_cast<Vec*>(d + head);
  for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x) {
    Vec out;
    if (sv) {
      const Vec in = sv[i];
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = scaled(in.v[k], scale);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = zero;
    }
    dv[i] = out;
  }
  for (int64_t i = head + vectors * V + threadIdx.x; i < n; i += blockDim.x) {
    d[i] = s ? scaled(s[i], scale) : zero;
  }
}

// Each block owns `chunk` consecutive elements of the segments laid end to end,
// finds its first segment by binary search, then walks forward.
template <typename T>
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
  const auto scale = static_cast<typename Math<T>::type>(args.scale);
  for (int seg = lo; seg < n && args.starts[seg] < end; ++seg) {
    const int64_t first = max(begin, args.starts[seg]) - args.starts[seg];
    const int64_t last = min(end, args.starts[seg + 1]) - args.starts[seg];
    if (first < last) {
      copy_range<T>(static_cast<const T*>(args.src[seg]), static_cast<T*>(args.dst[seg]), first,
                    last, scale);
    }
  }
}

template <typename T>
void launch(const LaunchArgs& args, cudaStream_t stream) {
  const int64_t total = args.starts[args.num_segments];
  if (total == 0) return;
  const int64_t chunk = static_cast<int64_t>(kThreads) * kVectorsPerThread * Vector<T>::kSize;
  const int64_t blocks = (total + chunk - 1) / chunk;
  scaled_copy_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args, chunk);
  FR_CUDA_CHECK_LAUNCH();
}

}  // namespace

int scaled_copy(const std::vector<CopySegment>& segments, DType dtype, double scale,
                cudaStream_t stream) {
  int launches = 0;
  static thread_local LaunchArgs args;  // ~19 KiB: keep it off the stack
  for (size_t first = 0; first < segments.size(); first += kMaxSegmentsPerLaunch) {
    const size_t count = std::min<size_t>(kMaxSegmentsPerLaunch, segments.size() - first);
    args.num_segments = static_cast<int>(count);
    args.scale = scale;
    args.starts[0] = 0;
    for (size_t i = 0; i < count; ++i) {
      const CopySegment& segment = segments[first + i];
      args.src[i] = segment.src;
      args.dst[i] = segment.dst;
      args.starts[i + 1] = args.starts[i] + segment.numel;
    }
    switch (dtype) {
      case DType::kFloat32: launch<float>(args, stream); break;
      case DType::kFloat16: launch<__half>(args, stream); break;
      case DType::kBFloat16: launch<__nv_bfloat16>(args, stream); break;
      case DType::kFloat64: launch<double>(args, stream); break;
    }
    launches += args.starts[count] > 0 ? 1 : 0;
  }
  return launches;
}

}  // namespace fused_reducer::cuda
