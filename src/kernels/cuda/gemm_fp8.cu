// The FP8 weight-streaming linear of gemm_fp8.h. A block owns 4 rows of W (4 outputs per row of x); its 8 warps
// take the 128-column steps of K round robin (warp w: steps w, w + 8, ...). In a warp, lane 8r + j holds the 16
// codes [16j, 16j + 16) of the step for row r (one 16-byte load; the 8 lanes of a row read 128 contiguous bytes),
// decodes them to fp32 once and multiplies them with every row of x of the pass, which the warp has staged in
// shared memory as fp32. The next step's codes are loaded while the current one is computed. The partial sums are
// reduced in a fixed order: the 8 lanes of a row by a butterfly, then the 8 warps in order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "kernels/cuda/gemm_fp8.h"

namespace kestrel::cuda {
namespace {

constexpr int kWarps = 8;         // warps of a block, splitting K
constexpr int kRows = 4;          // rows of W a block owns
constexpr int kLanesPerRow = 8;   // 32 lanes / kRows
constexpr int kCodesPerLane = 16;
constexpr int kStep = kLanesPerRow * kCodesPerLane;  // 128 columns of K per warp step

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }

// Two e4m3 codes (low byte first) to fp32, exactly (every e4m3 value is an f16 value).
__device__ __forceinline__ float2 e4m3x2_to_f32x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), __NV_E4M3);
  return __half22float2(__half2(h));
}

// MT rows of x per pass. kVec: K % 16 == 0, the codes 16-byte aligned, x 8-byte aligned and ldx % 4 == 0, so a
// lane's 16 codes and each 4 values of x it stages are either all inside K or all outside.
template <int MT, bool kVec, bool kBf16Out>
__global__ void __launch_bounds__(kWarps * 32, 2)
    linear_fp8_kernel(const uint16_t* __restrict__ x, int64_t M, int64_t ldx, const uint8_t* __restrict__ codes,
                      const float* __restrict__ scales, int64_t N, int64_t K, int block, int64_t scale_cols,
                      void* __restrict__ y, int64_t ldy, int64_t passes) {
  // Per warp, its step of the pass's rows of x: float4 t of row m holds columns 16 (t % 8) + 4 (t / 8) + [0, 4),
  // so that lane j's 4 float4 reads (t = 8i + j) and the staging writes (lane t writes float4 t) are conflict-free.
  __shared__ float4 xs[kWarps][MT][kStep / 4];
  __shared__ float partial[kWarps][kRows][MT];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / kLanesPerRow, j = lane % kLanesPerRow;
  const int64_t row0 = (blockIdx.x / passes) * kRows;
  const int64_t m0 = (blockIdx.x % passes) * MT;
  const int64_t n = row0 + r;
  const bool row_ok = n < N;
  const uint8_t* wrow = codes + (row_ok ? n : 0) * K;
  const float* srow = scales + (row_ok ? n / block : 0) * scale_cols;
  const int64_t steps = (K + kStep - 1) / kStep;

  auto load_codes = [&](int64_t s, uint32_t (&c)[4]) {
    const int64_t k0 = s * kStep + j * kCodesPerLane;
    if constexpr (kVec) {
      if (row_ok && k0 < K) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(wrow + k0));
        c[0] = v.x;
        c[1] = v.y;
        c[2] = v.z;
        c[3] = v.w;
      } else {
        c[0] = c[1] = c[2] = c[3] = 0;
      }
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        uint32_t word = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const int64_t k = k0 + 4 * q + b;
          if (row_ok && k < K) word |= static_cast<uint32_t>(wrow[k]) << (8 * b);
        }
        c[q] = word;
      }
    }
  };

  float acc[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) acc[m] = 0.0f;

  uint32_t cur[4] = {0, 0, 0, 0}, next[4] = {0, 0, 0, 0};
  if (warp < steps) load_codes(warp, cur);
  for (int64_t s = warp; s < steps; s += kWarps) {
    if (s + kWarps < steps) load_codes(s + kWarps, next);
    // Stage x: lane t takes columns 16 (t % 8) + 4 (t / 8) + [0, 4) of the step, for every row of the pass.
    {
      const int64_t k = s * kStep + kCodesPerLane * (lane % 8) + 4 * (lane / 8);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (m0 + m < M) {
          const uint16_t* xr = x + (m0 + m) * ldx;
          if constexpr (kVec) {
            if (k < K) {
              const uint2 u = *reinterpret_cast<const uint2*>(xr + k);
              v = make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xFFFF0000u),
                              __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xFFFF0000u));
            }
          } else {
            if (k < K) v.x = bf16_bits_to_f32(xr[k]);
            if (k + 1 < K) v.y = bf16_bits_to_f32(xr[k + 1]);
            if (k + 2 < K) v.z = bf16_bits_to_f32(xr[k + 2]);
            if (k + 3 < K) v.w = bf16_bits_to_f32(xr[k + 3]);
          }
        }
        xs[warp][m][lane] = v;
      }
    }
    const int64_t k0 = s * kStep + j * kCodesPerLane;
    // Codes past K are zero, and so is their scale (its index would be past the scale grid).
    const float scale = row_ok && k0 < K ? __ldg(srow + k0 / block) : 0.0f;
    float w[kCodesPerLane];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 lo = e4m3x2_to_f32x2(cur[q]), hi = e4m3x2_to_f32x2(cur[q] >> 16);
      w[4 * q] = lo.x;
      w[4 * q + 1] = lo.y;
      w[4 * q + 2] = hi.x;
      w[4 * q + 3] = hi.y;
    }
    __syncwarp();
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float p = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 v = xs[warp][m][8 * i + j];
        p = __fmaf_rn(v.x, w[4 * i], p);
        p = __fmaf_rn(v.y, w[4 * i + 1], p);
        p = __fmaf_rn(v.z, w[4 * i + 2], p);
        p = __fmaf_rn(v.w, w[4 * i + 3], p);
      }
      acc[m] = __fmaf_rn(scale, p, acc[m]);
    }
    __syncwarp();  // the staged rows are read before the next step overwrites them
#pragma unroll
    for (int q = 0; q < 4; ++q) cur[q] = next[q];
  }

#pragma unroll
  for (int m = 0; m < MT; ++m) {
    float v = acc[m];
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 4);
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 2);
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
    if (j == 0) partial[warp][r][m] = v;
  }
  __syncthreads();
  if (threadIdx.x < kRows * MT) {
    const int rr = threadIdx.x / MT, mm = threadIdx.x % MT;
    float sum = partial[0][rr][mm];
#pragma unroll
    for (int w2 = 1; w2 < kWarps; ++w2) sum += partial[w2][rr][mm];
    const int64_t out_n = row0 + rr, out_m = m0 + mm;
    if (out_n < N && out_m < M) {
      if constexpr (kBf16Out)
        static_cast<uint16_t*>(y)[out_m * ldy + out_n] = __bfloat16_as_ushort(__float2bfloat16_rn(sum));
      else
        static_cast<float*>(y)[out_m * ldy + out_n] = sum;
    }
  }
}

template <int MT, bool kVec>
cudaError_t launch(const uint16_t* x, int64_t M, int64_t ldx, const Fp8BlockMatrix& w, void* y, bool y_bf16,
                   int64_t ldy, cudaStream_t stream) {
  const int64_t passes = (M + MT - 1) / MT;
  const int64_t blocks = (w.N + kRows - 1) / kRows * passes;
  const int64_t scale_cols = (w.K + w.block - 1) / w.block;
  if (y_bf16)
    linear_fp8_kernel<MT, kVec, true><<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream>>>(
        x, M, ldx, w.codes, w.scales, w.N, w.K, w.block, scale_cols, y, ldy, passes);
  else
    linear_fp8_kernel<MT, kVec, false><<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream>>>(
        x, M, ldx, w.codes, w.scales, w.N, w.K, w.block, scale_cols, y, ldy, passes);
  return cudaGetLastError();
}

template <bool kVec>
cudaError_t launch_rows(const uint16_t* x, int64_t M, int64_t ldx, const Fp8BlockMatrix& w, void* y, bool y_bf16,
                        int64_t ldy, cudaStream_t stream) {
  static_assert(kFp8RowsPerPass == 8, "the passes below are instantiated for up to 8 rows");
  if (M <= 1) return launch<1, kVec>(x, M, ldx, w, y, y_bf16, ldy, stream);
  if (M <= 2) return launch<2, kVec>(x, M, ldx, w, y, y_bf16, ldy, stream);
  if (M <= 4) return launch<4, kVec>(x, M, ldx, w, y, y_bf16, ldy, stream);
  return launch<8, kVec>(x, M, ldx, w, y, y_bf16, ldy, stream);
}

}  // namespace

namespace detail {

cudaError_t launch_linear_fp8(const uint16_t* x, int64_t M, int64_t ldx, const Fp8BlockMatrix& w, void* y,
                              bool y_bf16, int64_t ldy, cudaStream_t stream) {
  const bool vec = w.K % 16 == 0 && reinterpret_cast<uintptr_t>(w.codes) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(x) % 8 == 0 && ldx % 4 == 0;
  return vec ? launch_rows<true>(x, M, ldx, w, y, y_bf16, ldy, stream)
             : launch_rows<false>(x, M, ldx, w, y, y_bf16, ldy, stream);
}

}  // namespace detail
}  // namespace kestrel::cuda
