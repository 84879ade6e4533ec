// Kernels of kda_glue.h. Host-side validation lives in kda_glue.cpp, which declares the launchers defined at the end
// of this file; they only size grids and launch.
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/kda_device.cuh"
#include "kernels/cuda/kda_glue.h"

namespace kestrel::cuda::detail {
namespace {

// ------------------------------------------------------------------------------------------- short convolution

constexpr int kConvThreads = 128;  // channels per block
// Blocks the convolution aims for over the whole batch. The token counts live on the device, so the grid cannot
// follow them: a batch of few sequences gets several blocks per (sequence, channel tile), each taking every
// gridDim.y-th token, and a batch of many (short, decode-like) sequences gets one.
constexpr int64_t kConvTargetBlocks = 2048;
constexpr int kConvMaxSplit = 256;

__device__ __forceinline__ float silu(float x) { return x * sigmoid(x); }

// One thread per (sequence, channel) and token subset. Window element i of token t is the input at packed row
// t - (W-1) + i; rows before the sequence's first token come from its history, whose last row is the newest.
__global__ void __launch_bounds__(kConvThreads)
    short_conv_silu_kernel(const float* __restrict__ x, const int64_t* __restrict__ cu_seqlens, int64_t C,
                           int channel_tiles, const float* __restrict__ w, int W, const float* const* hist,
                           float* __restrict__ out) {
  const int b = blockIdx.x / channel_tiles;
  const int64_t c = static_cast<int64_t>(blockIdx.x % channel_tiles) * kConvThreads + threadIdx.x;
  if (c >= C) return;
  const int64_t begin = cu_seqlens[b], end = cu_seqlens[b + 1];
  const float* h = W > 1 ? hist[b] : nullptr;
  float taps[kShortConvMaxWidth];
#pragma unroll
  for (int i = 0; i < kShortConvMaxWidth; ++i) taps[i] = i < W ? w[c * W + i] : 0.0f;
  for (int64_t t = begin + blockIdx.y; t < end; t += gridDim.y) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < kShortConvMaxWidth; ++i) {
      if (i < W) {
        const int64_t src = t - (W - 1) + i;
        const float xv = src >= begin ? x[src * C + c] : h[(src - begin + W - 1) * C + c];
        acc = fmaf(taps[i], xv, acc);
      }
    }
    out[t * C + c] = silu(acc);
  }
}

// Runs after the convolution (stream order), which has read the old histories. New row i is the input at
// relative position len - (W-1) + i, or, before the sequence, old row len + i; rows are written in ascending
// order, so old row len + i (> i) is still unwritten when it is read.
__global__ void __launch_bounds__(kConvThreads)
    short_conv_history_kernel(const float* __restrict__ x, const int64_t* __restrict__ cu_seqlens, int64_t C,
                              int channel_tiles, int W, float* const* hist) {
  const int b = blockIdx.x / channel_tiles;
  const int64_t c = static_cast<int64_t>(blockIdx.x % channel_tiles) * kConvThreads + threadIdx.x;
  if (c >= C) return;
  const int64_t begin = cu_seqlens[b], len = cu_seqlens[b + 1] - begin;
  float* h = hist[b];
  for (int i = 0; i < W - 1; ++i) {
    const int64_t rel = len - (W - 1) + i;
    h[i * C + c] = rel >= 0 ? x[(begin + rel) * C + c] : h[(rel + W - 1) * C + c];
  }
}

// ------------------------------------------------------------------------------------------- gated RMSNorm

constexpr int kNormThreads = 256;
constexpr int kNormRowsPerBlock = kNormThreads / 32;  // one warp per row

__global__ void __launch_bounds__(kNormThreads)
    gated_rmsnorm_kernel(const float* __restrict__ o, const float* __restrict__ r, const float* __restrict__ w,
                         int64_t rows, int dv, float eps, float* __restrict__ y_f32, uint16_t* __restrict__ y) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kNormRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;  // whole warps leave together, so the shuffles below see full warps
  const float* orow = o + row * dv;
  const float* rrow = r + row * dv;
  float ss = 0.0f;
  for (int j = lane; j < dv; j += 32) ss += orow[j] * orow[j];
  ss = warp_sum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dv) + eps);
  for (int j = lane; j < dv; j += 32) {
    const float v = orow[j] * inv * w[j] * sigmoid(rrow[j]);
    if (y_f32) y_f32[row * dv + j] = v;
    if (y) y[row * dv + j] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}

// ------------------------------------------------------------------------------------------- recurrence

constexpr int kRecTileV = 32;  // value columns per block: lane = column

// The log gate of channel d of head h (head size dk) for the gate input x; kda_log_gate with a general dk.
__device__ __forceinline__ float log_gate(const KdaTokenArgs& in, int h, int d, int dk, float x) {
  if (!in.A_log) return x;
  const float a = expf(in.A_log[h]);
  const float z = x + in.dt_bias[h * dk + d];
  return in.has_lower_bound ? in.lower_bound * sigmoid(a * z) : -a * softplus(z);
}

// The raw inputs of one token that a thread reads: key channels threadIdx.x + c * kThreads, its value column j,
// beta.
template <int kThreads>
struct TokenLoad {
  static constexpr int kChannels = kKdaRecurrentMaxDim / kThreads;
  float q[kChannels], k[kChannels], gate[kChannels];
  float v, beta;

  __device__ __forceinline__ void load(const KdaTokenArgs& in, int64_t t, int h, int H, int dk, int dv, int j) {
    const int64_t qk = (t * H + h) * dk;
#pragma unroll
    for (int c = 0; c < kChannels; ++c) {
      const int d = threadIdx.x + c * kThreads;
      const bool in_head = d < dk;
      q[c] = in_head ? in.q[qk + d] : 0.0f;
      k[c] = in_head ? in.k[qk + d] : 0.0f;
      gate[c] = in_head ? in.gate[qk + d] : 0.0f;
    }
    v = j < dv ? in.v[(t * H + h) * dv + j] : 0.0f;
    beta = in.beta[t * H + h];
  }
};

// One block per (sequence, head, tile of 32 value columns). Lane = column j; warp w holds key rows
// w + kWarps r, r < kRows (dk <= kWarps kRows), of that column in registers. Per token, with S_d = diag(alpha) S:
//   S_d^T k and S_d^T (scale q) are reduced together; delta = beta (v - S_d^T k);
//   o = S_d^T (scale q) + delta (k . scale q)  (= the updated state read with scale q); S = S_d + k delta^T.
// The next token's inputs are loaded while the current one is processed.
template <int kWarps, int kRows>
__global__ void __launch_bounds__(kWarps * 32)
    kda_recurrent_varlen_kernel(KdaTokenArgs in, const int64_t* __restrict__ cu_seqlens, int H, int dk, int dv,
                                int tiles, float* __restrict__ state_pool, const int32_t* __restrict__ slots,
                                float* __restrict__ o) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kChannels = TokenLoad<kThreads>::kChannels;
  static_assert(kChannels * kThreads == kKdaRecurrentMaxDim);
  const int tile = blockIdx.x % tiles;
  const int seq_head = blockIdx.x / tiles;
  const int h = seq_head % H, b = seq_head / H;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t begin = cu_seqlens[b], end = cu_seqlens[b + 1];
  if (begin >= end) return;
  const int j = tile * kRecTileV + lane;
  const bool column = j < dv;

  __shared__ float s_q[kKdaRecurrentMaxDim], s_k[kKdaRecurrentMaxDim], s_alpha[kKdaRecurrentMaxDim];
  __shared__ float s_red[kWarps][3];
  __shared__ float s_part[kWarps][2][kRecTileV];

  const int64_t head_size = static_cast<int64_t>(dk) * dv;
  float* S = state_pool + static_cast<int64_t>(slots[b]) * in.state_stride + h * head_size + j;
  float s[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int d = warp + kWarps * r;
    s[r] = column && d < dk ? S[static_cast<int64_t>(d) * dv] : 0.0f;
  }

  TokenLoad<kThreads> cur, next;
  cur.load(in, begin, h, H, dk, dv, j);
  for (int64_t t = begin; t < end; ++t) {
    if (t + 1 < end) next.load(in, t + 1, h, H, dk, dv, j);

    // s_alpha was last read in the previous token's state pass, which every thread finished before the previous
    // token's third barrier.
    float qq = 0.0f, kk = 0.0f, kq = 0.0f;
#pragma unroll
    for (int c = 0; c < kChannels; ++c) {
      const int d = tid + c * kThreads;
      qq += cur.q[c] * cur.q[c];
      kk += cur.k[c] * cur.k[c];
      kq += cur.k[c] * cur.q[c];
      if (d < dk) s_alpha[d] = expf(log_gate(in, h, d, dk, cur.gate[c]));
    }
    qq = warp_sum(qq);
    kk = warp_sum(kk);
    kq = warp_sum(kq);
    if (lane == 0) {
      s_red[warp][0] = qq;
      s_red[warp][1] = kk;
      s_red[warp][2] = kq;
    }
    __syncthreads();
    qq = kk = kq = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      qq += s_red[w][0];
      kk += s_red[w][1];
      kq += s_red[w][2];
    }
    float inv_q = 1.0f, inv_k = 1.0f;
    if (in.normalize_qk) {
      inv_q = 1.0f / sqrtf(qq + 1e-6f);
      inv_k = 1.0f / sqrtf(kk + 1e-6f);
    }
    const float kq_scaled = in.scale * kq * inv_q * inv_k;  // k . (scale q), after normalisation
    // s_q and s_k are written only now: the previous token's update step reads s_k after its third barrier.
#pragma unroll
    for (int c = 0; c < kChannels; ++c) {
      const int d = tid + c * kThreads;
      if (d < dk) {
        s_q[d] = in.scale * (cur.q[c] * inv_q);
        s_k[d] = cur.k[c] * inv_k;
      }
    }
    __syncthreads();

    float sk = 0.0f, sq = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int d = warp + kWarps * r;
      if (d < dk) {
        s[r] *= s_alpha[d];
        sk += s[r] * s_k[d];
        sq += s[r] * s_q[d];
      }
    }
    s_part[warp][0][lane] = sk;
    s_part[warp][1][lane] = sq;
    __syncthreads();

    float stk = 0.0f, stq = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      stk += s_part[w][0][lane];
      stq += s_part[w][1][lane];
    }
    const float delta = kda_beta(in, cur.beta) * (cur.v - stk);
    if (warp == 0 && column) o[(t * H + h) * dv + j] = stq + delta * kq_scaled;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int d = warp + kWarps * r;
      if (d < dk) s[r] += s_k[d] * delta;
    }
    cur = next;
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int d = warp + kWarps * r;
    if (column && d < dk) S[static_cast<int64_t>(d) * dv] = s[r];
  }
}

template <int kWarps, int kRows>
void launch_recurrent(const KdaTokenArgs& in, const int64_t* cu_seqlens, unsigned blocks, int H, int dk, int dv,
                      int tiles, float* state_pool, const int32_t* slots, float* o, cudaStream_t stream) {
  kda_recurrent_varlen_kernel<kWarps, kRows>
      <<<blocks, kWarps * 32, 0, stream>>>(in, cu_seqlens, H, dk, dv, tiles, state_pool, slots, o);
}

}  // namespace

cudaError_t launch_short_conv_silu_varlen(const float* x, const int64_t* cu_seqlens, int B, int64_t C, const float* w,
                                          int W, float* const* hist, float* out, cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  const int channel_tiles = static_cast<int>((C + kConvThreads - 1) / kConvThreads);
  const int64_t tiles = static_cast<int64_t>(B) * channel_tiles;
  const int64_t split = std::min<int64_t>(kConvMaxSplit, std::max<int64_t>(1, kConvTargetBlocks / tiles));
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(split));
  short_conv_silu_kernel<<<grid, kConvThreads, 0, stream>>>(x, cu_seqlens, C, channel_tiles, w, W, hist, out);
  if (W == 1) return cudaGetLastError();
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  short_conv_history_kernel<<<static_cast<unsigned>(tiles), kConvThreads, 0, stream>>>(x, cu_seqlens, C,
                                                                                       channel_tiles, W, hist);
  return cudaGetLastError();
}

cudaError_t launch_kda_gated_rmsnorm(const float* o, const float* r, const float* w, int64_t rows, int dv, float eps,
                                     float* y_f32, uint16_t* y, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = (rows + kNormRowsPerBlock - 1) / kNormRowsPerBlock;
  gated_rmsnorm_kernel<<<static_cast<unsigned>(blocks), kNormThreads, 0, stream>>>(o, r, w, rows, dv, eps, y_f32, y);
  return cudaGetLastError();
}

cudaError_t launch_kda_recurrent_varlen(const KdaTokenArgs& in, const int64_t* cu_seqlens, int B, int H, int dk,
                                        int dv, float* state_pool, const int32_t* slots, float* o,
                                        cudaStream_t stream) {
  if (B == 0) return cudaSuccess;
  const int tiles = (dv + kRecTileV - 1) / kRecTileV;
  const unsigned blocks = static_cast<unsigned>(static_cast<int64_t>(B) * H * tiles);
  // Key rows per thread: the smallest count that covers dk, so small heads do not walk empty registers; the
  // largest heads take 8 warps, which keeps the state slice of a thread at 32 registers.
  if (dk <= 32)
    launch_recurrent<4, 8>(in, cu_seqlens, blocks, H, dk, dv, tiles, state_pool, slots, o, stream);
  else if (dk <= 64)
    launch_recurrent<4, 16>(in, cu_seqlens, blocks, H, dk, dv, tiles, state_pool, slots, o, stream);
  else if (dk <= 128)
    launch_recurrent<4, 32>(in, cu_seqlens, blocks, H, dk, dv, tiles, state_pool, slots, o, stream);
  else
    launch_recurrent<8, 32>(in, cu_seqlens, blocks, H, dk, dv, tiles, state_pool, slots, o, stream);
  return cudaGetLastError();
}

}  // namespace kestrel::cuda::detail
