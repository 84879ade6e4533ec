// The FP8 weight-streaming linear of gemm_fp8.h, for decode steps (M = 1..16; more rows make more passes).
//
// Layout (the one the summation order of gemm_fp8.h describes). A block owns 4 rows of W (4 outputs per row of x)
// and its 8 warps split K: warp w takes the 128-column steps w, w + 8, w + 16, ... In a warp, lane 8r + j holds the
// 16 codes [16j, 16j + 16) of a step for row r: one 16-byte load, the 8 lanes of a row read 128 contiguous bytes
// (4 full 32-byte sectors). 4 rows a block keeps the grid large for narrow weights (N = 2048: 512 blocks, ~4 per SM
// of an H200) without splitting K across blocks, which would need a workspace and a second pass to stay
// deterministic.
//
// Bytes in flight. A lane issues the code loads of up to kUnroll = 8 of its steps (and their scales) before it
// decodes any of them: up to 128 bytes per lane, 32 KB per block, all of a lane's share of the row when
// K <= 8 * 8 * 128 = 8192 (K = 7168: 112 bytes a lane; K = 2048: 32). Nothing between the loads and the sums
// waits on shared memory or on the other warps; the only block-wide step is the final reduction.
//
// x is read straight from global memory through L1 (ld.global.nc), not staged per block: every block of an SM reads
// the same rows of x, so L1 serves them to all of them (MT * K * 2 bytes: 112 KB for 8 rows of K = 7168), while the
// weight codes, read once, bypass L1 (L1::no_allocate) so that they do not evict x. Lane 8r + j reads the 16 values
// of x of its codes, [16j, 16j + 16) of the step: the 8 lanes of a row of W read 8 different pieces (256 contiguous
// bytes per row of x), and the 4 lanes with equal j, one per row of W, read the same piece (broadcast). A lane
// converts its 16 values of x per row of the pass once per step.
//
// Arithmetic. Each code pair is decoded by the hardware conversion e4m3x2 -> f16x2 -> 2 x fp32 (exact: every e4m3
// value is an f16 value), multiplied with x in fp32 FMAs (every product is exact) in ascending k within the
// lane's 16 columns, and the 16-column sum is scaled once by its block scale and added to the lane's running sum
// (a fused multiply-add): the reference x · (code * scale) up to fp32 rounding order. At M = 8 the 8 FMAs per
// weight byte (128 per SM and cycle) bound the kernel near 4 TB/s before the decode and the x conversion; M = 16
// runs two passes of 8 rows, whose blocks sit next to each other in the grid so that the second reads the codes
// from L2.
//
// The scale multiplies each 16-column sum rather than each 128-column block sum because a block may be as narrow
// as 16 columns; it costs one FMA per 16 codes and row of x.
//
// The partial sums are reduced in a fixed order (the lane order above, a butterfly over the 8 lanes of a row,
// then the 8 warps in order), the same for every number of rows of a pass: no atomics, the same bits every call.
// The order is the one of the kernel this replaced (which staged each 128-column step of x in shared memory, a
// global load whose latency every step waited for, and had one step of codes in flight), so the results are the
// same bits as before.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <bit>

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

// 16 codes that no other lane of the SM reads again: not allocated in L1, which keeps x.
__device__ __forceinline__ uint4 load_codes_streaming(const uint8_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// k / block: a shift for the usual power-of-two blocks (block_shift >= 0), else a division in 32-bit arithmetic
// whenever k allows (a 64-bit division is a long subroutine, and this runs for every 16 codes).
__device__ __forceinline__ int64_t scale_column(int64_t k, int block, int block_shift) {
  if (block_shift >= 0) return k >> block_shift;
  return k <= 0xFFFFFFFFll ? static_cast<int64_t>(static_cast<uint32_t>(k) / static_cast<uint32_t>(block)) : k / block;
}

// MT rows of x per pass. kVec: K % 16 == 0, the codes 16-byte aligned, x 16-byte aligned and ldx % 8 == 0 (or
// M == 1: ldx is not used), so a lane's 16 codes and 16 values of x are one 16-byte and two 16-byte loads, all
// inside K or all outside.
// Blocks of 256 threads per SM the registers allow (without spills, sm_90a): 4 for 1 row (64 registers), 3 for
// 2 rows (80), 2 for 4 and 8 rows (94, 104).
template <int MT, bool kVec, bool kBf16Out>
__global__ void __launch_bounds__(kWarps * 32, MT == 1 ? 4 : MT == 2 ? 3 : 2)
    linear_fp8_kernel(const uint16_t* __restrict__ x, int64_t M, int64_t ldx, const uint8_t* __restrict__ codes,
                      const float* __restrict__ scales, int64_t N, int64_t K, int block, int block_shift,
                      int64_t scale_cols, void* __restrict__ y, int64_t ldy, int64_t passes) {
  __shared__ float partial[kWarps][kRows][MT];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / kLanesPerRow, j = lane % kLanesPerRow;
  const int64_t row0 = (blockIdx.x / passes) * kRows;
  const int64_t m0 = (blockIdx.x % passes) * MT;
  const int rows = static_cast<int>(M - m0 < MT ? M - m0 : MT);  // rows of x in this pass, 1..MT
  const int64_t n = row0 + r;
  const bool row_ok = n < N;
  const uint8_t* wrow = codes + (row_ok ? n : 0) * K;
  const float* srow = scales + (row_ok ? n / block : 0) * scale_cols;
  const uint16_t* xpass = x + m0 * ldx;
  const int64_t steps = (K + kStep - 1) / kStep;
  // Steps whose codes a lane loads before it decodes the first (the byte-wise loads of the fallback take more
  // registers).
  constexpr int kUnroll = kVec ? 8 : 4;

  float acc[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) acc[m] = 0.0f;

  for (int64_t s0 = warp; s0 < steps; s0 += kWarps * kUnroll) {
    // Every load of the batch first (up to 8 x 16 bytes of codes in flight per lane), then the arithmetic.
    uint32_t c[kUnroll][4];
    float scale[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k0 = (s0 + u * kWarps) * kStep + j * kCodesPerLane;
      // Codes past K (or of a row past N) are zero, and so is their scale (its index would be past the grid).
      const bool live = row_ok && k0 < K;
      scale[u] = live ? __ldg(srow + scale_column(k0, block, block_shift)) : 0.0f;
      if constexpr (kVec) {
        const uint4 v = live ? load_codes_streaming(wrow + k0) : make_uint4(0, 0, 0, 0);
        c[u][0] = v.x;
        c[u][1] = v.y;
        c[u][2] = v.z;
        c[u][3] = v.w;
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint32_t word = 0;
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const int64_t k = k0 + 4 * q + b;
            if (row_ok && k < K) word |= static_cast<uint32_t>(wrow[k]) << (8 * b);
          }
          c[u][q] = word;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t s = s0 + u * kWarps;
      if (s >= steps) break;  // the same for the whole warp
      const int64_t k0 = s * kStep + j * kCodesPerLane;
      float w[kCodesPerLane];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 lo = e4m3x2_to_f32x2(c[u][q]), hi = e4m3x2_to_f32x2(c[u][q] >> 16);
        w[4 * q] = lo.x;
        w[4 * q + 1] = lo.y;
        w[4 * q + 2] = hi.x;
        w[4 * q + 3] = hi.y;
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m >= rows) break;  // the same for the whole block
        // x past K is never read (it may be any bits, NaN included); its codes are zero.
        float xv[kCodesPerLane];
        const uint16_t* xr = xpass + m * ldx;
        if constexpr (kVec) {
          uint32_t xw[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          if (k0 < K) {
            const uint4* xp = reinterpret_cast<const uint4*>(xr + k0);
            const uint4 a = __ldg(xp), b = __ldg(xp + 1);
            xw[0] = a.x, xw[1] = a.y, xw[2] = a.z, xw[3] = a.w, xw[4] = b.x, xw[5] = b.y, xw[6] = b.z, xw[7] = b.w;
          }
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            xv[2 * q] = __uint_as_float(xw[q] << 16);
            xv[2 * q + 1] = __uint_as_float(xw[q] & 0xFFFF0000u);
          }
        } else {
#pragma unroll
          for (int i = 0; i < kCodesPerLane; ++i) xv[i] = k0 + i < K ? bf16_bits_to_f32(__ldg(xr + k0 + i)) : 0.0f;
        }
        float p = 0.0f;
#pragma unroll
        for (int i = 0; i < kCodesPerLane; ++i) p = __fmaf_rn(xv[i], w[i], p);
        acc[m] = __fmaf_rn(scale[u], p, acc[m]);
      }
    }
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
  // A row group's passes are neighbours in the grid: they run at about the same time, so the later ones find the
  // codes in L2.
  const int64_t passes = (M + MT - 1) / MT;
  const int64_t blocks = (w.N + kRows - 1) / kRows * passes;
  const int64_t scale_cols = (w.K + w.block - 1) / w.block;
  const unsigned block = static_cast<unsigned>(w.block);
  const int block_shift = std::has_single_bit(block) ? std::countr_zero(block) : -1;
  if (y_bf16)
    linear_fp8_kernel<MT, kVec, true><<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream>>>(
        x, M, ldx, w.codes, w.scales, w.N, w.K, w.block, block_shift, scale_cols, y, ldy, passes);
  else
    linear_fp8_kernel<MT, kVec, false><<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream>>>(
        x, M, ldx, w.codes, w.scales, w.N, w.K, w.block, block_shift, scale_cols, y, ldy, passes);
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

bool linear_fp8_vectorised(const uint16_t* x, int64_t M, int64_t ldx, const Fp8BlockMatrix& w) {
  // With one row, x + m * ldx is x: the row stride does not matter.
  return w.K % 16 == 0 && reinterpret_cast<uintptr_t>(w.codes) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0 && (M == 1 || ldx % 8 == 0);
}

cudaError_t launch_linear_fp8(const uint16_t* x, int64_t M, int64_t ldx, const Fp8BlockMatrix& w, void* y,
                              bool y_bf16, int64_t ldy, cudaStream_t stream) {
  return linear_fp8_vectorised(x, M, ldx, w) ? launch_rows<true>(x, M, ldx, w, y, y_bf16, ldy, stream)
             : launch_rows<false>(x, M, ldx, w, y, y_bf16, ldy, stream);
}

}  // namespace detail
}  // namespace kestrel::cuda
