// The tile product of FP8 block-scaled GEMMs on tensor cores, shared by the dense fallback (gemm_fp8_block.cu) and
// the FP8 routed experts (moe.cu): up to kRows rows of quantized activations (e4m3 codes, one fp32 scale per row and
// 128-column group) times kTileN = 64 rows of a block-scaled weight (e4m3 codes, one fp32 scale per 128 x 128 block),
// every 128-column group one step.
//
// A step: each thread loads its 16-byte pieces of the next step's codes into registers while the tensor cores work
// on the current one; the codes are widened to f16 (exact: every e4m3 value is an f16 value) as they are stored to
// shared memory, once per code; then 8 mma.sync m16n8k16 (f16 x f16 -> fp32) over the group give each output its
// group sum, which is scaled and added in fp32 as the CPU reference does:
//   total = total + (s_x[row] * s_w[block]) * partial    (each product and the sum rounded apart).
// (On sm_90 an e4m3 mma.sync is itself expanded by ptxas into conversions and f16 MMAs, on every operand use; widening
// once in shared memory converts each code once.) Products of two e4m3 values are exact in the MMA; the group's 8
// chained MMAs accumulate in fp32 registers, the only difference to the reference's exact group sum.
//
// Warp w owns 16 of the 64 weight rows, as two n8 fragments; its accumulators are the whole tile's kRows rows for
// those 16 columns: total[mf][nf][e] is row 16 mf + g + 8 (e / 2), column fragment_row(w, nf) + 2 t + (e % 2) with
// g = lane / 4, t = lane % 4 (the m16n8 C fragment). Which weight rows the 64 shared rows hold (WeightRows):
//   contiguous: rows row0 .. row0 + 63 of the matrix; warp w's fragments are rows 16 w .. 16 w + 15;
//   gate_up:    shared rows 0..31 are gate rows row0 .. row0 + 31, rows 32..63 the up rows up_offset + row0 ..;
//               warp w's fragment 0 is gate rows 8 w .. 8 w + 7 and fragment 1 the up rows of the same columns, so a
//               thread holds gate and up of the same (row, column) and applies swiglu in registers.
// The 8 rows of a fragment always lie in one 128-row scale block (row0 is a multiple of 64, resp. 32 with up_offset a
// multiple of 128).
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda::fp8mma {

constexpr int kThreads = 128;            // 4 warps
constexpr int kTileN = 64;               // weight rows per block
constexpr int kTileK = 128;              // columns per step: one scale group
constexpr int kPieces = kTileK / 16;     // 16-byte pieces of codes per row and step
constexpr int kLds = kTileK + 8;         // f16 row stride in shared memory: 272 bytes, conflict-free fragment reads
constexpr int kBPieces = kTileN * kPieces / kThreads;  // weight pieces per thread and step
static_assert(kBPieces == 4);

enum class WeightRows { contiguous, gate_up };

// Quantized activations: row r's codes at codes + r * ld (ld a multiple of 16), its scale for group g at
// scales[r * scale_row_stride + g * scale_group_stride].
struct ActOperand {
  const uint8_t* codes;
  int64_t ld;
  const float* scales;
  int64_t scale_row_stride, scale_group_stride;
};

// One block-scaled weight matrix: row n's codes at codes + n * ld (ld a multiple of 16), the scale of block
// (n / 128, g) at scales[(n / 128) * scale_ld + g]; rows >= rows do not exist (zero).
struct WeightOperand {
  const uint8_t* codes;
  int64_t ld;
  const float* scales;
  int64_t scale_ld;
  int64_t rows;
  int64_t up_offset;  // gate_up: first up row (F)
};

template <int kRows>
struct Accum {
  float v[kRows / 16][2][4];
};

__device__ __forceinline__ void mma_f16_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two e4m3 codes (the low byte first) as an f16 pair (the first in the low half), exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// 16 codes widened to 16 f16 values at dst (32 bytes, 16-byte aligned).
__device__ __forceinline__ void store_widened(__half* dst, const uint4& v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t h[8];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    h[2 * q] = e4m3x2_to_f16x2(w[q]);
    h[2 * q + 1] = e4m3x2_to_f16x2(w[q] >> 16);
  }
  reinterpret_cast<uint4*>(dst)[0] = make_uint4(h[0], h[1], h[2], h[3]);
  reinterpret_cast<uint4*>(dst)[1] = make_uint4(h[4], h[5], h[6], h[7]);
}

__device__ __forceinline__ uint32_t lds32(const __half* p) { return *reinterpret_cast<const uint32_t*>(p); }

// First shared row of warp w's fragment nf.
template <WeightRows kMap>
__device__ __forceinline__ int fragment_row(int warp, int nf) {
  return kMap == WeightRows::contiguous ? 16 * warp + 8 * nf : 8 * warp + 32 * nf;
}

// The matrix row held by shared row i of a block whose first row is row0 (-1: past the matrix).
template <WeightRows kMap>
__device__ __forceinline__ int64_t weight_row(const WeightOperand& w, int64_t row0, int i) {
  const int64_t r = kMap == WeightRows::contiguous ? row0 + i : (i < 32 ? row0 + i : w.up_offset + row0 + (i - 32));
  return r < w.rows ? r : -1;
}

// total (zeroed here) = the block's tile over all `groups` steps of K columns (K a multiple of 16; columns past K are
// zero). src_row(r) gives tile row r's activation row, or -1 for a row the tile does not have (zero, not stored).
// Every thread of the block must call it (it synchronises the block).
template <int kRows, WeightRows kMap, class SrcRow>
__device__ __forceinline__ void block_tile(const ActOperand& A, const WeightOperand& W, int64_t row0, int64_t K,
                                           int groups, SrcRow src_row, Accum<kRows>& total) {
  constexpr int kMFrags = kRows / 16;
  constexpr int kAPieces = kRows * kPieces / kThreads;
  static_assert(kAPieces == kMFrags);
  __shared__ __align__(16) __half As[kRows * kLds];
  __shared__ __align__(16) __half Bs[kTileN * kLds];
  __shared__ float Sx[kRows];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int piece = tid % kPieces;

  const uint8_t* a_src[kAPieces];
#pragma unroll
  for (int j = 0; j < kAPieces; ++j) {
    const int64_t r = src_row(tid / kPieces + 16 * j);
    a_src[j] = r >= 0 ? A.codes + r * A.ld + piece * 16 : nullptr;
  }
  const uint8_t* b_src[kBPieces];
#pragma unroll
  for (int j = 0; j < kBPieces; ++j) {
    const int64_t n = weight_row<kMap>(W, row0, tid / kPieces + 16 * j);
    b_src[j] = n >= 0 ? W.codes + n * W.ld + piece * 16 : nullptr;
  }
  const float* sx_src = nullptr;
  if (tid < kRows) {
    const int64_t r = src_row(tid);
    if (r >= 0) sx_src = A.scales + r * A.scale_row_stride;
  }
  const float* sw_src[2];
#pragma unroll
  for (int nf = 0; nf < 2; ++nf) {
    const int64_t n = weight_row<kMap>(W, row0, fragment_row<kMap>(warp, nf));
    sw_src[nf] = n >= 0 ? W.scales + (n / kTileK) * W.scale_ld : nullptr;
  }

  uint4 a_reg[kAPieces], b_reg[kBPieces];
  float sx_reg = 0.0f;
  auto load = [&](int step) {
    const int64_t k = static_cast<int64_t>(step) * kTileK;
    const bool in = k + piece * 16 < K;
    const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < kAPieces; ++j) a_reg[j] = a_src[j] && in ? *reinterpret_cast<const uint4*>(a_src[j] + k) : zero;
#pragma unroll
    for (int j = 0; j < kBPieces; ++j) b_reg[j] = b_src[j] && in ? *reinterpret_cast<const uint4*>(b_src[j] + k) : zero;
    if (tid < kRows) sx_reg = sx_src ? sx_src[static_cast<int64_t>(step) * A.scale_group_stride] : 0.0f;
  };
  auto store = [&]() {
#pragma unroll
    for (int j = 0; j < kAPieces; ++j) store_widened(As + (tid / kPieces + 16 * j) * kLds + piece * 16, a_reg[j]);
#pragma unroll
    for (int j = 0; j < kBPieces; ++j) store_widened(Bs + (tid / kPieces + 16 * j) * kLds + piece * 16, b_reg[j]);
    if (tid < kRows) Sx[tid] = sx_reg;
  };

#pragma unroll
  for (int mf = 0; mf < kMFrags; ++mf)
#pragma unroll
    for (int nf = 0; nf < 2; ++nf)
#pragma unroll
      for (int e = 0; e < 4; ++e) total.v[mf][nf][e] = 0.0f;

  load(0);
  for (int step = 0; step < groups; ++step) {
    store();
    __syncthreads();
    if (step + 1 < groups) load(step + 1);
    float sw[2];
#pragma unroll
    for (int nf = 0; nf < 2; ++nf) sw[nf] = sw_src[nf] ? sw_src[nf][step] : 0.0f;

    float part[kMFrags][2][4];
#pragma unroll
    for (int mf = 0; mf < kMFrags; ++mf)
#pragma unroll
      for (int nf = 0; nf < 2; ++nf)
#pragma unroll
        for (int e = 0; e < 4; ++e) part[mf][nf][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kTileK / 16; ++ks) {
      uint32_t b[2][2];
#pragma unroll
      for (int nf = 0; nf < 2; ++nf) {
        const __half* row = Bs + (fragment_row<kMap>(warp, nf) + g) * kLds + ks * 16 + 2 * t;
        b[nf][0] = lds32(row);
        b[nf][1] = lds32(row + 8);
      }
#pragma unroll
      for (int mf = 0; mf < kMFrags; ++mf) {
        const __half* row = As + (mf * 16 + g) * kLds + ks * 16 + 2 * t;
        const uint32_t a[4] = {lds32(row), lds32(row + 8 * kLds), lds32(row + 8), lds32(row + 8 * kLds + 8)};
#pragma unroll
        for (int nf = 0; nf < 2; ++nf) mma_f16_m16n8k16(part[mf][nf], a, b[nf][0], b[nf][1]);
      }
    }
#pragma unroll
    for (int mf = 0; mf < kMFrags; ++mf)
#pragma unroll
      for (int nf = 0; nf < 2; ++nf)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float s = __fmul_rn(Sx[mf * 16 + g + 8 * (e >> 1)], sw[nf]);
          total.v[mf][nf][e] = __fadd_rn(total.v[mf][nf][e], __fmul_rn(s, part[mf][nf][e]));
        }
    __syncthreads();
  }
}

}  // namespace kestrel::cuda::fp8mma
