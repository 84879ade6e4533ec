// The kernel of dummy_weights.h: every thread makes the elements of one 16-byte piece of the tensor with the host's
// generator (core/dummy_weights_element.h) and stores them. The argument checks are in dummy_weights.cpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/dummy_weights_element.h"
#include "kernels/cuda/dummy_weights.h"

namespace kestrel::cuda::detail {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;  // a grid-stride loop beyond this
constexpr int kPieceBytes = 16;

template <int kWidth>
__global__ __launch_bounds__(kThreads) void fill_dummy_kernel(DummyParams p, uint8_t* __restrict__ dst,
                                                               int64_t pieces) {
  constexpr int kPerPiece = kPieceBytes / kWidth;
  const bool aligned = (reinterpret_cast<uintptr_t>(dst) % kPieceBytes) == 0;
  for (int64_t piece = blockIdx.x * int64_t{kThreads} + threadIdx.x; piece < pieces;
       piece += int64_t{gridDim.x} * kThreads) {
    const int64_t first = piece * kPerPiece;
    const int n = static_cast<int>(min(int64_t{kPerPiece}, p.numel - first));
    uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
    for (int e = 0; e < kPerPiece; ++e) {
      if (e < n) {
        const uint32_t w = dummy_word(p, first + e);
        constexpr int kPerWord = 4 / kWidth;
        words[e / kPerWord] |= w << (8 * kWidth * (e % kPerWord));
      }
    }
    uint8_t* out = dst + first * kWidth;
    if (aligned && n == kPerPiece) {
      *reinterpret_cast<uint4*>(out) = make_uint4(words[0], words[1], words[2], words[3]);
    } else {
      for (int b = 0; b < n * kWidth; ++b) out[b] = static_cast<uint8_t>(words[b / 4] >> (8 * (b % 4)));
    }
  }
}

template <int kWidth>
cudaError_t launch(const DummyParams& p, void* dst, cudaStream_t s) {
  const int64_t pieces = (p.numel * kWidth + kPieceBytes - 1) / kPieceBytes;
  const int blocks = static_cast<int>(std::clamp<int64_t>((pieces + kThreads - 1) / kThreads, 1, kMaxBlocks));
  fill_dummy_kernel<kWidth><<<blocks, kThreads, 0, s>>>(p, static_cast<uint8_t*>(dst), pieces);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_fill_dummy(const DummyParams& p, int element_bytes, void* dst, cudaStream_t s) {
  switch (element_bytes) {
    case 1: return launch<1>(p, dst, s);
    case 2: return launch<2>(p, dst, s);
    case 4: return launch<4>(p, dst, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kestrel::cuda::detail
