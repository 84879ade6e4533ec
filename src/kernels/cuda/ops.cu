// Kernels of ops.h and gemm_simple (gemm.h). Plain CUDA, fp32 math, no atomics.
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"

namespace kestrel::cuda {

namespace {

constexpr int kThreads = 256;  // every kernel here runs blocks of 256 threads
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;  // grid-stride loops cover the rest

// kestrel::f32_to_bf16 bit for bit: round to nearest even by adding 0x7FFF plus the lowest kept bit (a carry into
// the exponent is how values near FLT_MAX overflow to inf); a NaN keeps its sign and high payload and gets the top
// mantissa bit, so a payload only in the dropped half does not turn it into inf.
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float x) {
  const uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }

int grid_for(int64_t work_items, int64_t per_block) {
  return static_cast<int>(std::clamp<int64_t>((work_items + per_block - 1) / per_block, 1, kMaxBlocks));
}

// Sum of one value per thread of the block: a butterfly inside each warp, then every thread adds the warp totals in
// warp order. The result, the same in every thread, depends only on the values. `scratch` holds kWarps floats and is
// free again when this returns.
__device__ float block_sum(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float total = scratch[0];
  for (int w = 1; w < kWarps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// One row per block (grid-stride over rows). Thread t sums the squares of elements t, t + 256, ... in order.
__global__ void __launch_bounds__(kThreads)
    rms_norm_kernel(const float* x, int64_t ldx, const float* w, int64_t M, int64_t D, float eps, float* y_f32,
                    uint16_t* y_bf16, int64_t ldy) {
  __shared__ float scratch[kWarps];
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    const float* xr = x + row * ldx;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < D; i += kThreads) ss += xr[i] * xr[i];
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + eps);
    // Each thread rewrites only the elements it read, after the block's last read of the row: in place is safe.
    for (int64_t i = threadIdx.x; i < D; i += kThreads) {
      const float v = xr[i] * inv * w[i];
      if (y_f32) y_f32[row * ldy + i] = v;
      if (y_bf16) y_bf16[row * ldy + i] = f32_to_bf16_bits(v);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    layer_norm_kernel(const float* x, const float* w, const float* b, int64_t M, int64_t D, float eps, float* y) {
  __shared__ float scratch[kWarps];
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    const float* xr = x + row * D;
    float s = 0.0f;
    for (int64_t i = threadIdx.x; i < D; i += kThreads) s += xr[i];
    const float mean = block_sum(s, scratch) / static_cast<float>(D);
    float sd = 0.0f;
    for (int64_t i = threadIdx.x; i < D; i += kThreads) {
      const float d = xr[i] - mean;
      sd += d * d;
    }
    const float var = block_sum(sd, scratch) / static_cast<float>(D);
    const float inv = 1.0f / sqrtf(var + eps);
    for (int64_t i = threadIdx.x; i < D; i += kThreads) y[row * D + i] = (xr[i] - mean) * inv * w[i] + b[i];
  }
}

__global__ void __launch_bounds__(kThreads) add_inplace_kernel(float* h, const float* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads)
    h[i] += y[i];
}

__global__ void __launch_bounds__(kThreads) to_bf16_kernel(const float* x, int64_t n, uint16_t* y) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads)
    y[i] = f32_to_bf16_bits(x[i]);
}

__global__ void __launch_bounds__(kThreads)
    swiglu_kernel(const float* gu, int64_t T, int64_t F, float* out_f32, uint16_t* out_bf16) {
  const int64_t n = T * F;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) {
    const int64_t t = i / F, j = i - t * F;
    const float gate = gu[t * 2 * F + j], up = gu[t * 2 * F + F + j];
    const float silu = gate * (1.0f / (1.0f + expf(-gate)));
    const float v = silu * up;
    if (out_f32) out_f32[i] = v;
    if (out_bf16) out_bf16[i] = f32_to_bf16_bits(v);
  }
}

__global__ void __launch_bounds__(kThreads)
    embed_bf16_kernel(const int32_t* ids, int64_t T, const uint16_t* table, int64_t D, float* h) {
  const int64_t n = T * D;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) {
    const int64_t t = i / D, d = i - t * D;
    h[i] = bf16_bits_to_f32(table[static_cast<int64_t>(ids[t]) * D + d]);
  }
}

__global__ void __launch_bounds__(kThreads)
    gather_rows_kernel(const float* x, int64_t D, const int32_t* rows, int64_t n, float* y) {
  const int64_t total = n * D;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < total; i += int64_t{gridDim.x} * kThreads) {
    const int64_t r = i / D, d = i - r * D;
    y[i] = x[static_cast<int64_t>(rows[r]) * D + d];
  }
}

// A candidate of the argmax; index < 0: none yet.
struct Best {
  float value;
  int32_t index;
};

// The larger value, on equal values the lower index; NaN is never a candidate. Commutative and associative, so any
// reduction order gives the first maximum of the row.
__device__ __forceinline__ Best better(Best a, Best b) {
  if (b.index < 0) return a;
  if (a.index < 0) return b;
  if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
  return a;
}

__global__ void __launch_bounds__(kThreads) argmax_rows_kernel(const float* logits, int64_t M, int64_t V, int32_t* out) {
  __shared__ Best scratch[kWarps];
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    const float* lr = logits + row * V;
    Best best{0.0f, -1};
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
      const float v = lr[i];
      if (!isnan(v)) best = better(best, Best{v, static_cast<int32_t>(i)});
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      const Best other{__shfl_xor_sync(0xffffffffu, best.value, offset), __shfl_xor_sync(0xffffffffu, best.index, offset)};
      best = better(best, other);
    }
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
      Best total = scratch[0];
      for (int w = 1; w < kWarps; ++w) total = better(total, scratch[w]);
      out[row] = total.index < 0 ? 0 : total.index;
    }
    __syncthreads();
  }
}

constexpr int kGemmTile = 32;                            // outputs per block: 32 x 32
constexpr int kGemmRowsPerThread = kGemmTile * kGemmTile / kThreads;  // 4
constexpr int kGemmTileK = 32;

// y tile [m0, m0+32) x [n0, n0+32) of batch b per block (grid-stride over M tiles and batches). Thread (ty, tx) of
// 8 x 32 owns outputs (ty + 8i, tx); each is one fp32 sum over k in increasing order. Out-of-range tile entries
// are zeros, which leave the sums unchanged.
__global__ void __launch_bounds__(kThreads) gemm_simple_kernel(GemmProblem p) {
  __shared__ float xs[kGemmTile][kGemmTileK + 1];
  __shared__ float ws[kGemmTile][kGemmTileK + 1];
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  const int64_t n0 = int64_t{blockIdx.x} * kGemmTile;
  for (int64_t b = blockIdx.z; b < p.batch; b += gridDim.z) {
    const uint16_t* xb = p.x + b * p.stride_x;
    const uint16_t* wb = p.w + b * p.stride_w;
    for (int64_t m0 = int64_t{blockIdx.y} * kGemmTile; m0 < p.M; m0 += int64_t{gridDim.y} * kGemmTile) {
      float acc[kGemmRowsPerThread] = {};
      for (int64_t k0 = 0; k0 < p.K; k0 += kGemmTileK) {
        for (int r = 0; r < kGemmRowsPerThread; ++r) {
          const int e = threadIdx.x + r * kThreads;
          const int row = e / kGemmTileK, kk = e % kGemmTileK;  // k fastest: consecutive threads, consecutive k
          const int64_t m = m0 + row, k = k0 + kk;
          xs[row][kk] = m < p.M && k < p.K ? bf16_bits_to_f32(xb[m * p.ldx + k]) : 0.0f;
          if (p.transpose_w) {
            const int64_t n = n0 + row;
            ws[row][kk] = n < p.N && k < p.K ? bf16_bits_to_f32(wb[n * p.ldw + k]) : 0.0f;
          } else {  // w_b is [K, N]: consecutive threads take consecutive n
            const int64_t n = n0 + kk, kr = k0 + row;
            ws[kk][row] = n < p.N && kr < p.K ? bf16_bits_to_f32(wb[kr * p.ldw + n]) : 0.0f;
          }
        }
        __syncthreads();
        for (int kk = 0; kk < kGemmTileK; ++kk) {
          const float wv = ws[tx][kk];
          for (int i = 0; i < kGemmRowsPerThread; ++i) acc[i] += xs[ty + 8 * i][kk] * wv;
        }
        __syncthreads();
      }
      const int64_t n = n0 + tx;
      for (int i = 0; i < kGemmRowsPerThread; ++i) {
        const int64_t m = m0 + ty + 8 * i;
        if (m >= p.M || n >= p.N) continue;
        const int64_t at = b * p.stride_y + m * p.ldy + n;
        if (p.y_bf16) {
          static_cast<uint16_t*>(p.y)[at] = f32_to_bf16_bits(acc[i]);
        } else {
          float* y = static_cast<float*>(p.y);
          y[at] = p.accumulate ? y[at] + acc[i] : acc[i];
        }
      }
    }
  }
}

}  // namespace

namespace detail {

cudaError_t launch_rms_norm(const float* x, int64_t ldx, const float* w, int64_t M, int64_t D, float eps,
                            float* y_f32, uint16_t* y_bf16, int64_t ldy, cudaStream_t s) {
  rms_norm_kernel<<<grid_for(M, 1), kThreads, 0, s>>>(x, ldx, w, M, D, eps, y_f32, y_bf16, ldy);
  return cudaGetLastError();
}

cudaError_t launch_layer_norm(const float* x, const float* w, const float* b, int64_t M, int64_t D, float eps,
                              float* y, cudaStream_t s) {
  layer_norm_kernel<<<grid_for(M, 1), kThreads, 0, s>>>(x, w, b, M, D, eps, y);
  return cudaGetLastError();
}

cudaError_t launch_add_inplace(float* h, const float* y, int64_t n, cudaStream_t s) {
  add_inplace_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(h, y, n);
  return cudaGetLastError();
}

cudaError_t launch_to_bf16(const float* x, int64_t n, uint16_t* y, cudaStream_t s) {
  to_bf16_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(x, n, y);
  return cudaGetLastError();
}

cudaError_t launch_swiglu(const float* gu, int64_t T, int64_t F, float* out_f32, uint16_t* out_bf16,
                          cudaStream_t s) {
  swiglu_kernel<<<grid_for(T * F, kThreads), kThreads, 0, s>>>(gu, T, F, out_f32, out_bf16);
  return cudaGetLastError();
}

cudaError_t launch_embed_bf16(const int32_t* ids, int64_t T, const uint16_t* table, int64_t D, float* h,
                              cudaStream_t s) {
  embed_bf16_kernel<<<grid_for(T * D, kThreads), kThreads, 0, s>>>(ids, T, table, D, h);
  return cudaGetLastError();
}

cudaError_t launch_gather_rows(const float* x, int64_t D, const int32_t* rows, int64_t n, float* y, cudaStream_t s) {
  gather_rows_kernel<<<grid_for(n * D, kThreads), kThreads, 0, s>>>(x, D, rows, n, y);
  return cudaGetLastError();
}

cudaError_t launch_argmax_rows(const float* logits, int64_t M, int64_t V, int32_t* out, cudaStream_t s) {
  argmax_rows_kernel<<<grid_for(M, 1), kThreads, 0, s>>>(logits, M, V, out);
  return cudaGetLastError();
}

cudaError_t launch_gemm_simple(const GemmProblem& p, cudaStream_t stream) {
  constexpr int64_t kMaxGridYZ = 65535;
  const dim3 grid(static_cast<unsigned>((p.N + kGemmTile - 1) / kGemmTile),
                  static_cast<unsigned>(std::min((p.M + kGemmTile - 1) / kGemmTile, kMaxGridYZ)),
                  static_cast<unsigned>(std::min(p.batch, kMaxGridYZ)));
  gemm_simple_kernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace detail

}  // namespace kestrel::cuda
