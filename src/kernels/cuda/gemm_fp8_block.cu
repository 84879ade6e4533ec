// Kernels of gemm_fp8_block.h: the activation quantizer, the fallback tensor-core GEMM (fp8_block_mma.cuh with a
// plain output epilogue) and the copy of a staged cuBLASLt output.
//
// Quantizer: one warp per (row, group); lane l holds columns 128 g + l + 32 j, j < 4 (each load instruction of the
// warp reads 128 contiguous bytes). amax is the warp's fmaxf reduction (order-free, and like std::fmax it passes
// NaN over), s = __fdiv_rn(fmaxf(amax, 1e-10), 448) and each code the hardware's round-to-nearest-even saturating
// conversion of __fdiv_rn(x, s): the CPU's fp32 operations, so the same bits. A NaN quotient is written as 0x7F
// explicitly (the CPU's NaN code), whatever NaN the conversion would give.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda/fp8_block_mma.cuh"
#include "kernels/cuda/gemm_fp8_block.h"

namespace kestrel::cuda::detail {
namespace {

constexpr int kQuantThreads = 256;
constexpr int kGroup = kFp8BlockGroup;
constexpr float kScaleFloor = 1e-10f;
constexpr float kE4m3Max = 448.0f;

__global__ void __launch_bounds__(kQuantThreads) quantize_kernel(QuantizeArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t groups = (a.K + kGroup - 1) / kGroup;
  const int64_t item = (static_cast<int64_t>(blockIdx.x) * kQuantThreads + threadIdx.x) / 32;
  const int64_t r = item / groups, g = item % groups;
  if (r >= a.padded_rows) return;
  const bool real = r < a.rows;
  float v[4];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t k = g * kGroup + lane + 32 * j;
    v[j] = real && k < a.K ? a.x[r * a.ldx + k] : 0.0f;
    amax = fmaxf(amax, fabsf(v[j]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = __fdiv_rn(fmaxf(amax, kScaleFloor), kE4m3Max);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t k = g * kGroup + lane + 32 * j;
    if (k >= a.code_ld) continue;
    uint8_t code = 0;
    if (real && k < a.K) {
      const float q = __fdiv_rn(v[j], s);
      code = isnan(q) ? uint8_t{0x7F} : static_cast<uint8_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3));
    }
    a.codes[r * a.code_ld + k] = code;
  }
  if (lane == 0) a.scales[r * a.scale_row_stride + g * a.scale_group_stride] = real ? s : 0.0f;
}

struct DenseArgs {
  fp8mma::ActOperand A;
  fp8mma::WeightOperand W;
  int64_t M, N, K;
  int groups;
  void* y;
  bool y_bf16, accumulate;
  int64_t ldy;
};

__device__ __forceinline__ void write_output(void* y, bool y_bf16, bool accumulate, int64_t at, float v) {
  if (y_bf16) {
    const __nv_bfloat16 b = __float2bfloat16_rn(v);
    static_cast<uint16_t*>(y)[at] = *reinterpret_cast<const uint16_t*>(&b);
  } else {
    float* out = static_cast<float*>(y) + at;
    *out = accumulate ? __fadd_rn(*out, v) : v;
  }
}

template <int kRows>
__global__ void __launch_bounds__(fp8mma::kThreads) dense_kernel(DenseArgs a) {
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kRows, n0 = static_cast<int64_t>(blockIdx.y) * fp8mma::kTileN;
  auto src_row = [&](int r) -> int64_t { return m0 + r < a.M ? m0 + r : -1; };
  fp8mma::Accum<kRows> acc;
  fp8mma::block_tile<kRows, fp8mma::WeightRows::contiguous>(a.A, a.W, n0, a.K, a.groups, src_row, acc);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mf = 0; mf < kRows / 16; ++mf)
#pragma unroll
    for (int nf = 0; nf < 2; ++nf)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t m = m0 + mf * 16 + g + 8 * (e >> 1);
        const int64_t n = n0 + 16 * warp + 8 * nf + 2 * t + (e & 1);
        if (m < a.M && n < a.N) write_output(a.y, a.y_bf16, a.accumulate, m * a.ldy + n, acc.v[mf][nf][e]);
      }
}

constexpr int kCopyThreads = 256;

__global__ void __launch_bounds__(kCopyThreads)
    stage_copy_kernel(const float* __restrict__ staged, int64_t staged_ld, int64_t M, int64_t N, void* y, bool y_bf16,
                      int64_t ldy, bool accumulate) {
  const int64_t m = blockIdx.x;
  for (int64_t n = static_cast<int64_t>(blockIdx.y) * kCopyThreads + threadIdx.x; n < N;
       n += static_cast<int64_t>(gridDim.y) * kCopyThreads)
    write_output(y, y_bf16, accumulate, m * ldy + n, staged[m * staged_ld + n]);
}

}  // namespace

cudaError_t launch_quantize_fp8(const QuantizeArgs& a, cudaStream_t stream) {
  const int64_t groups = (a.K + kGroup - 1) / kGroup;
  const int64_t warps = a.padded_rows * groups;
  const int64_t blocks = (warps * 32 + kQuantThreads - 1) / kQuantThreads;
  quantize_kernel<<<static_cast<unsigned>(blocks), kQuantThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_fp8_block_gemm_mma(const Fp8BlockProblem& p, cudaStream_t stream) {
  const Fp8ActivationLayout al = fp8_activation_layout(p.a.M, p.a.K);
  const Fp8BlockWeightLayout wl = fp8_block_weight_layout(p.w.N, p.w.K);
  DenseArgs a{};
  a.A = fp8mma::ActOperand{p.a.codes, al.row_bytes, p.a.scales, 1, al.padded_rows};
  a.W = fp8mma::WeightOperand{p.w.codes, wl.row_bytes, p.w.scales, wl.scale_row_floats, p.w.N, 0};
  a.M = p.a.M;
  a.N = p.w.N;
  a.K = al.row_bytes;
  a.groups = static_cast<int>(al.groups);
  a.y = p.y;
  a.y_bf16 = p.y_bf16;
  a.accumulate = p.accumulate;
  a.ldy = p.ldy;
  const int rows = a.M <= 16 ? 16 : a.M <= 32 ? 32 : a.M <= 48 ? 48 : 64;
  const dim3 grid(static_cast<unsigned>((a.M + rows - 1) / rows),
                  static_cast<unsigned>((a.N + fp8mma::kTileN - 1) / fp8mma::kTileN));
  switch (rows) {
    case 16: dense_kernel<16><<<grid, fp8mma::kThreads, 0, stream>>>(a); break;
    case 32: dense_kernel<32><<<grid, fp8mma::kThreads, 0, stream>>>(a); break;
    case 48: dense_kernel<48><<<grid, fp8mma::kThreads, 0, stream>>>(a); break;
    default: dense_kernel<64><<<grid, fp8mma::kThreads, 0, stream>>>(a); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_fp8_stage_copy(const float* staged, int64_t staged_ld, int64_t M, int64_t N, void* y, bool y_bf16,
                                  int64_t ldy, bool accumulate, cudaStream_t stream) {
  const int64_t column_blocks = (N + kCopyThreads - 1) / kCopyThreads;
  const dim3 grid(static_cast<unsigned>(M), static_cast<unsigned>(column_blocks < 64 ? column_blocks : 64));
  stage_copy_kernel<<<grid, kCopyThreads, 0, stream>>>(staged, staged_ld, M, N, y, y_bf16, ldy, accumulate);
  return cudaGetLastError();
}

}  // namespace kestrel::cuda::detail
