// How the fused copy kernel (multi_tensor_copy.cu) splits one block's range of
// a segment into a scalar head, 16-byte vectors and a scalar tail. Plain
// arithmetic on addresses, shared verbatim by the kernel (device) and the
// torch-free C++ test (host, tests/cpp/test_cuda_core.cpp), which checks it on
// the reducer's slot layout without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define FR_HOST_DEVICE __host__ __device__
#else
#define FR_HOST_DEVICE
#endif

namespace fused_reducer::cuda {

// Elements per vector step for a (source, destination) pair of element sizes:
// 16 bytes of the narrower side (the wider side moves 16, 32 or 64 bytes, as
// 16-byte accesses).
FR_HOST_DEVICE constexpr int vector_elements(size_t src_size, size_t dst_size) {
  return static_cast<int>(16 / (src_size < dst_size ? src_size : dst_size));
}

// Threads per block, and vectors per thread in one block's range: a block owns
// copy_chunk_elements() consecutive elements of the segments laid end to end,
// so its range starts at an arbitrary element offset inside a segment.
constexpr int kCopyThreads = 256;
constexpr int kCopyVectorsPerThread = 4;  // enough work per block to hide latency
FR_HOST_DEVICE constexpr int64_t copy_chunk_elements(size_t src_size, size_t dst_size) {
  return int64_t{kCopyThreads} * kCopyVectorsPerThread * vector_elements(src_size, dst_size);
}

struct CopySplit {
  int64_t head;     // scalar elements first
  int64_t vectors;  // then this many steps of `vector_elements` elements
  int64_t tail;     // then scalar elements to the end
};

// Note [Copy alignment]
// The head runs until the NARROWER side is 16-byte aligned: vector_elements()
// elements of it are then exactly 16 bytes, so the wider side (an element size
// 2x, 4x or 8x as large) advances by 32, 64 or 128 bytes per vector and is
// 16-byte aligned at every vector once it is at the first. Aligning the wider
// side instead (the destination of a widening bf16/fp16 -> fp32 unpack) puts
// the narrower one half a vector off in every other block's range: the
// reducer's slots are 16-byte aligned on both sides, yet half of the ranges
// would run scalar. Vectors are used only where both sides are 16-byte aligned
// after the head; otherwise (no common alignment, e.g. a source at an odd
// element offset) the whole range is scalar: head == n. `src` == 0: no source
// (zeros are written), only the destination needs aligning.
FR_HOST_DEVICE inline CopySplit split_for_vectors(uintptr_t src, size_t src_size, uintptr_t dst,
                                                  size_t dst_size, int64_t n) {
  const int64_t vec = vector_elements(src_size, dst_size);
  const bool narrow_is_src = src != 0 && src_size <= dst_size;
  const uintptr_t narrow = narrow_is_src ? src : dst;
  const size_t narrow_size = narrow_is_src ? src_size : dst_size;
  CopySplit all_scalar{n, 0, 0};
  if (n <= 0 || narrow % narrow_size != 0) {
    return all_scalar;
  }
  const int64_t head = static_cast<int64_t>(((16 - narrow % 16) % 16) / narrow_size);
  if (head >= n || (dst + head * dst_size) % 16 != 0 ||
      (src != 0 && (src + head * src_size) % 16 != 0)) {
    return all_scalar;
  }
  const int64_t vectors = (n - head) / vec;
  return {head, vectors, n - head - vectors * vec};
}

}  // namespace fused_reducer::cuda
