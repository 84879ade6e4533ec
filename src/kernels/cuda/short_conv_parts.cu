// Kernels of short_conv_parts.h: kda_glue.cu's short convolution and history update with the channel index running
// over all parts (channel cc = p*C + c of x and of the stacked taps) and the history and output of part p found at
// p times their part strides. The arithmetic per output is kda_glue.cu's, in the same order.
#include <algorithm>

#include "kernels/cuda/kda_device.cuh"
#include "kernels/cuda/kda_glue.h"

namespace kestrel::cuda::detail {
namespace {

constexpr int kConvThreads = 128;  // channels (of all parts) per block
// Grid split over tokens as kda_glue.cu's: the token counts live on the device, so a batch of few sequences gets
// several blocks per (sequence, channel tile), each taking every gridDim.y-th token.
constexpr int64_t kConvTargetBlocks = 2048;
constexpr int kConvMaxSplit = 256;

__device__ __forceinline__ float silu(float x) { return x * sigmoid(x); }

// One thread per (sequence, channel of any part) and token subset. Window element i of token t is the input at
// packed row t - (W-1) + i; rows before the sequence's first token come from the part's history.
__global__ void __launch_bounds__(kConvThreads)
    short_conv_parts_kernel(const float* __restrict__ x, int64_t ldx, const int64_t* __restrict__ cu_seqlens,
                            int64_t C, int64_t channels, int channel_tiles, const float* __restrict__ w, int W,
                            const float* const* hist, int64_t hist_part_stride, float* __restrict__ out,
                            int64_t out_part_stride) {
  const int b = blockIdx.x / channel_tiles;
  const int64_t cc = static_cast<int64_t>(blockIdx.x % channel_tiles) * kConvThreads + threadIdx.x;
  if (cc >= channels) return;
  const int64_t p = cc / C, c = cc - p * C;
  const int64_t begin = cu_seqlens[b], end = cu_seqlens[b + 1];
  const float* h = W > 1 ? hist[b] + p * hist_part_stride : nullptr;
  float* o = out + p * out_part_stride;
  float taps[kShortConvMaxWidth];
#pragma unroll
  for (int i = 0; i < kShortConvMaxWidth; ++i) taps[i] = i < W ? w[cc * W + i] : 0.0f;
  for (int64_t t = begin + blockIdx.y; t < end; t += gridDim.y) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < kShortConvMaxWidth; ++i) {
      if (i < W) {
        const int64_t src = t - (W - 1) + i;
        const float xv = src >= begin ? x[src * ldx + cc] : h[(src - begin + W - 1) * C + c];
        acc = fmaf(taps[i], xv, acc);
      }
    }
    o[t * C + c] = silu(acc);
  }
}

// Runs after the convolution (stream order), which has read the old histories. New row i is the input at
// relative position len - (W-1) + i, or, before the sequence, old row len + i; rows are written in ascending
// order, so old row len + i (> i) is still unwritten when it is read.
__global__ void __launch_bounds__(kConvThreads)
    short_conv_parts_history_kernel(const float* __restrict__ x, int64_t ldx, const int64_t* __restrict__ cu_seqlens,
                                    int64_t C, int64_t channels, int channel_tiles, int W, float* const* hist,
                                    int64_t hist_part_stride) {
  const int b = blockIdx.x / channel_tiles;
  const int64_t cc = static_cast<int64_t>(blockIdx.x % channel_tiles) * kConvThreads + threadIdx.x;
  if (cc >= channels) return;
  const int64_t p = cc / C, c = cc - p * C;
  const int64_t begin = cu_seqlens[b], len = cu_seqlens[b + 1] - begin;
  float* h = hist[b] + p * hist_part_stride;
  for (int i = 0; i < W - 1; ++i) {
    const int64_t rel = len - (W - 1) + i;
    h[i * C + c] = rel >= 0 ? x[(begin + rel) * ldx + cc] : h[(rel + W - 1) * C + c];
  }
}

}  // namespace

cudaError_t launch_short_conv_silu_varlen_parts(const float* x, int64_t ldx, const int64_t* cu_seqlens, int B,
                                                int parts, int64_t C, const float* w, int W, float* const* hist,
                                                int64_t hist_part_stride, float* out, int64_t out_part_stride,
                                                cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  const int64_t channels = parts * C;
  const int channel_tiles = static_cast<int>((channels + kConvThreads - 1) / kConvThreads);
  const int64_t tiles = static_cast<int64_t>(B) * channel_tiles;
  const int64_t split = std::min<int64_t>(kConvMaxSplit, std::max<int64_t>(1, kConvTargetBlocks / tiles));
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(split));
  short_conv_parts_kernel<<<grid, kConvThreads, 0, stream>>>(x, ldx, cu_seqlens, C, channels, channel_tiles, w, W,
                                                             hist, hist_part_stride, out, out_part_stride);
  if (W == 1) return cudaGetLastError();
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  short_conv_parts_history_kernel<<<static_cast<unsigned>(tiles), kConvThreads, 0, stream>>>(
      x, ldx, cu_seqlens, C, channels, channel_tiles, W, hist, hist_part_stride);
  return cudaGetLastError();
}

}  // namespace kestrel::cuda::detail
