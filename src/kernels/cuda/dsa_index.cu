// DSA indexer on the GPU: the index-key writer and the decode scores over paged index keys.
//
// Exact scores. Every finite e4m3 value is an integer multiple of 2^-9: value * 512 = u with |u| <= 448 * 512 <
// 2^18. Split u into three signed 7-bit limbs, u = l0 + l1 2^7 + l2 2^14 (each limb carries u's sign, |l0|, |l1|
// <= 127, |l2| <= 14), so a 128-term dot is sum over limb pairs (a, b) of 2^(7(a+b)) * sum_d lq_a[d] lk_b[d]. Each
// limb product is an int8 tensor-core MMA with an int32 accumulator; the pairs with the same a + b share one
// accumulator acc[a + b] (at most 3 * 128 * 127^2 < 2^23 in magnitude, no overflow). The exact dot
// S = sum_i 2^(7i) acc[i] (|S| < 2^36) is rounded to fp32 once, without 64-bit arithmetic: with
// mid = acc[1] + 2^7 acc[2] (< 2^29) and hi = acc[3] + 2^7 acc[4] (< 2^22), S = 2^21 high + low where
// high = hi + (mid >> 14) and low = acc[0] + 2^7 (mid & 0x3FFF) both lie within +-2^22, so both are exact fp32
// values and one IEEE addition of 8 high and 2^-18 low rounds S * 2^-18 exactly as cpu::indexer_scores'
// static_cast<float>(S) * 2^-18 does. The ReLU, the weight product and the head sum j = 0..H_I-1 are then the same
// fp32 operations in the same order.
//
// The dot runs over d in any order, so lane t of a quad takes bytes 32t .. 32t+31 of a key (two 16-byte loads)
// and the MMA's k index is mapped onto them: k-step s, register r of the B fragment holds the key's word 2s + r of
// those 32 bytes; the query's A fragment is built with the same map.
//
// Exact kernel (IndexScoreMode::exact_mma, and exact off Hopper; dsa_index_wgmma.cu has the wgmma one): CTA of 8
// warps for one request, one group of 64 query rows (64 / H_I query tokens x H_I heads) and a contiguous range of
// 64-key tiles. Raw key tiles arrive through a 3-stage cp.async ring; per tile the CTA
// converts the codes to their limbs (through a 256-entry table) in shared memory, warp w multiplies rows
// 16 (w % m) .. +15 (m = 16-row tiles of the group, A limbs in registers for the whole kernel) by its share of the
// tile's keys, and writes w_j * ReLU(dot) to a double-buffered term tile; the in-order head sums of a tile (one
// thread per key and query token) run during the next tile's conversion.
//
// Fast FP8 kernel (IndexScoreMode::fast_fp8_mma, and fast_fp8 off Hopper; dsa_index_fp8_wgmma.cu has the wgmma
// one): e4m3 MMAs on the codes. Every warp owns all rows of the group (A codes in registers) and its
// own stream of 32-key tiles with a private 4-stage cp.async ring, so warps never wait for each other. The head
// sum is a tree (in registers, then a butterfly over the eight lanes that share a key column), which leaves each
// lane with one key's score; its order differs from the CPU's, within the mode's stated bound.
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>

#include "kernels/cuda/dsa_common.cuh"
#include "kernels/cuda/dsa_exact.cuh"
#include "kernels/cuda/dsa_index_fp8_wgmma.h"
#include "kernels/cuda/dsa_index_wgmma.h"
#include "kernels/cuda/quant_device.cuh"

namespace kestrel::cuda::dsa {
namespace {

constexpr int kD = kIndexHeadDim;
constexpr int kWriterThreads = 128;  // one warp per key

// ---------------------------------------------------------------- writer

__global__ void __launch_bounds__(kWriterThreads) index_key_write_kernel(const void* keys, bool bf16, int T,
                                                                         bool hadamard, float hadamard_norm,
                                                                         const int64_t* __restrict__ slots,
                                                                         Pages pages) {
  const int t = (blockIdx.x * kWriterThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (t >= T) return;
  const int64_t slot = slots[t];
  if (slot < 0) return;

  float x[4];
  if (bf16) {
    const uint2 raw = reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(keys) + int64_t{t} * kD)[lane];
    x[0] = __uint_as_float(raw.x << 16);
    x[1] = __uint_as_float(raw.x & 0xFFFF0000u);
    x[2] = __uint_as_float(raw.y << 16);
    x[3] = __uint_as_float(raw.y & 0xFFFF0000u);
  } else {
    const float4 v = reinterpret_cast<const float4*>(static_cast<const float*>(keys) + int64_t{t} * kD)[lane];
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
  }

  if (hadamard) {
    // Element i = 4 lane + r. Butterflies of span 1 and 2 stay inside the lane; spans 4 .. 64 pair lane with
    // lane ^ (span / 4). The low element of a pair becomes a + b, the high one a - b, as in cpu::hadamard_inplace.
    float y0 = __fadd_rn(x[0], x[1]), y1 = __fsub_rn(x[0], x[1]);
    float y2 = __fadd_rn(x[2], x[3]), y3 = __fsub_rn(x[2], x[3]);
    x[0] = __fadd_rn(y0, y2);
    x[2] = __fsub_rn(y0, y2);
    x[1] = __fadd_rn(y1, y3);
    x[3] = __fsub_rn(y1, y3);
#pragma unroll
    for (int span_lanes = 1; span_lanes < 32; span_lanes *= 2) {
      const bool low = (lane & span_lanes) == 0;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float other = __shfl_xor_sync(0xFFFFFFFFu, x[r], span_lanes);
        x[r] = low ? __fadd_rn(x[r], other) : __fsub_rn(other, x[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) x[r] = __fmul_rn(x[r], hadamard_norm);
  }

  bool finite = true;
  float amax = 0.0f;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    finite = finite && isfinite(x[r]);
    amax = fmaxf(amax, fabsf(x[r]));
  }
  finite = __all_sync(0xFFFFFFFFu, finite);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
  // As quantize_fp8_ue8m0: amax floored at 1e-4, times fp32(1/448), rounded up to a power of two; x / s is exact.
  const float s =
      finite ? quant::round_up_pow2(__fmul_rn(fmaxf(amax, 1e-4f), 1.0f / 448.0f)) : __uint_as_float(0x7FC00000u);
  uint32_t word = 0x7F7F7F7Fu;
  if (finite) {
    word = 0;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const uint32_t code = __nv_cvt_float_to_fp8(__fdiv_rn(x[r], s), __NV_SATFINITE, __NV_E4M3);
      word |= code << (8 * r);
    }
  }
  const int64_t page = slot / pages.page_size;
  const int row = static_cast<int>(slot & (pages.page_size - 1));
  uint8_t* page_base = pages.base + page * pages.page_stride;
  reinterpret_cast<uint32_t*>(page_base + int64_t{row} * kD)[lane] = word;
  if (lane == 0) reinterpret_cast<float*>(page_base + int64_t{pages.page_size} * kD)[row] = s;
}


// ---------------------------------------------------------------- scores

constexpr int kKeyStride = 144;  // bytes per staged key row: 128 + 16 of padding against bank conflicts
constexpr int kGroupRows = 64;   // query rows (token, head) per CTA

// The rows of blockIdx.z's group: rows 64 z .. 64 z + rows - 1 of the request's n_q * H_I rows (token-major).
struct RowGroup {
  int row0, rows, m_tiles, token0, tokens;
};

__device__ __forceinline__ RowGroup row_group(const ScoreParams& p) {
  RowGroup rg;
  rg.row0 = static_cast<int>(blockIdx.z) * kGroupRows;
  rg.rows = min(kGroupRows, p.n_q * p.heads - rg.row0);  // a multiple of 32: H_I is 32 or 64
  rg.m_tiles = rg.rows / 16;
  rg.token0 = rg.row0 / p.heads;
  rg.tokens = rg.rows / p.heads;
  return rg;
}

// Two e4m3 codes (low byte first) as an f16x2 word, low half first; exact (e4m3 is a subset of f16).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | static_cast<uint32_t>(h.y) << 16;
}

// The A fragment words of rows g and g + 8 of 16-row tile mt of the group: bytes 32 tq .. 32 tq + 31 of each
// row; rows past the group are zero. Returns whether a loaded word holds a NaN code; *w_lo / *w_hi get the rows'
// weights.
__device__ __forceinline__ bool load_query_rows(const ScoreParams& p, const RowGroup& rg, int req, int mt, int g,
                                                int tq, uint32_t (&qw)[2][8], float& w_lo, float& w_hi) {
  bool nan = false;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = rg.row0 + mt * 16 + g + 8 * half;
    uint4 v0 = make_uint4(0, 0, 0, 0), v1 = v0;
    float w = 0.0f;
    if (mt < rg.m_tiles) {
      const int64_t qrow = (int64_t{req} * p.n_q + row / p.heads) * p.heads + row % p.heads;
      const uint4* src = reinterpret_cast<const uint4*>(p.q + qrow * kD + 32 * tq);
      v0 = src[0];
      v1 = src[1];
      w = p.w[qrow];
    }
    (half ? w_hi : w_lo) = w;
    qw[half][0] = v0.x, qw[half][1] = v0.y, qw[half][2] = v0.z, qw[half][3] = v0.w;
    qw[half][4] = v1.x, qw[half][5] = v1.y, qw[half][6] = v1.z, qw[half][7] = v1.w;
#pragma unroll
    for (int i = 0; i < 8; ++i) nan = nan | has_e4m3_nan(qw[half][i]);
  }
  return nan;
}

// ---- exact kernel

constexpr int kExactThreads = 256;
constexpr int kTileKeys = 64;
constexpr int kExactStages = 3;
constexpr int kTermStride = kGroupRows + 4;  // floats per key in the term tile (16-byte rows, conflict-free)

struct ExactSmem {
  uint32_t lut[256];                                        // e4m3 code -> its three limbs as signed bytes 0..2
  int qnan[kGroupRows / 32];                                // per query token of the group
  alignas(16) uint8_t raw[kExactStages][kTileKeys * kKeyStride];  // the cp.async ring of code tiles
  float raw_scale[kExactStages][kTileKeys];
  alignas(16) uint8_t limbs[3][kTileKeys * kKeyStride];     // the tile being multiplied, as its three limbs
  float scale[2][kTileKeys];                                // per term buffer: the keys' scales ...
  int knan[2][kTileKeys];                                   // ... and NaN flags
  alignas(16) float terms[2][kTileKeys * kTermStride];      // w_row * ReLU(dot), [key][row]
};

// Copies tile `tile` (64 keys from position 64 tile) into stage `st`; positions from ctx on are zero-filled.
__device__ __forceinline__ void issue_exact_tile(ExactSmem& sm, const ScoreParams& p, int req, int ctx, int tile,
                                                 int st) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int it = 0; it < kTileKeys * 8 / kExactThreads; ++it) {
    const int u = tid + it * kExactThreads;
    const int key = u >> 3, part = u & 7;
    const int pos = tile * kTileKeys + key;
    const bool ok = pos < ctx;
    const uint8_t* src = ok ? page_row(p.pages, p.bt, req, pos, kD) + part * 16 : p.pages.base;
    cp_async_16(&sm.raw[st][key * kKeyStride + part * 16], src, ok ? 16 : 0);
  }
  if (tid < kTileKeys) {
    const int pos = tile * kTileKeys + tid;
    const bool ok = pos < ctx;
    const uint8_t* src = p.pages.base;
    if (ok) {
      const int page = p.bt.pages[int64_t{req} * p.bt.stride + page_index(p.pages, pos)];
      src = p.pages.base + int64_t{page} * p.pages.page_stride + int64_t{p.pages.page_size} * kD +
            4 * (pos & (p.pages.page_size - 1));
    }
    cp_async_4(&sm.raw_scale[st][tid], src, ok ? 4 : 0);
  }
}

__device__ __forceinline__ void exact_head_sums(const ExactSmem& sm, const ScoreParams& p, const RowGroup& rg,
                                                int req, int ctx, int tile, int buf) {
  const int tid = threadIdx.x;
  if (tid >= kTileKeys * rg.tokens) return;
  const int tl = tid / kTileKeys, key = tid % kTileKeys;
  const int pos = tile * kTileKeys + key;
  if (pos >= ctx) return;
  const float* terms = &sm.terms[buf][key * kTermStride + tl * p.heads];
  const float acc = p.heads == 64 ? ordered_head_sum<64>(terms) : ordered_head_sum<32>(terms);
  const int token = rg.token0 + tl;
  float score = __fmul_rn(sm.scale[buf][key], acc);
  if (sm.knan[buf][key] || sm.qnan[tl]) score = __uint_as_float(0x7FC00000u);
  if (pos > p.ctx_lens[req] - p.n_q + token) score = -INFINITY;
  p.scores[(int64_t{req} * p.n_q + token) * p.stride + pos] = score;
}

__global__ void __launch_bounds__(kExactThreads, 2) index_scores_exact_kernel(ScoreParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ExactSmem& sm = *reinterpret_cast<ExactSmem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int req = blockIdx.y;
  const RowGroup rg = row_group(p);
  const int ctx = min(p.ctx_lens[req], p.max_ctx);
  const int n_tiles = (ctx + kTileKeys - 1) / kTileKeys;
  const int t_begin = blockIdx.x * p.tiles_per_split, t_end = min(n_tiles, t_begin + p.tiles_per_split);
  if (t_begin >= t_end) return;

  for (int t = 0; t < kExactStages - 1; ++t) {
    if (t_begin + t < t_end) issue_exact_tile(sm, p, req, ctx, t_begin + t, t);
    cp_async_commit();
  }

  for (int c = tid; c < 256; c += kExactThreads) sm.lut[c] = limb_entry(c);
  if (tid < kGroupRows / 32) sm.qnan[tid] = 0;
  __syncthreads();

  // Warp w: 16-row tile mt = w % m_tiles and key columns of n8 tiles slice * m_tiles .. + m_tiles - 1.
  const int mt = warp % rg.m_tiles, slice = warp / rg.m_tiles;
  uint32_t qw[2][8];
  float w_lo, w_hi;
  const bool nan = load_query_rows(p, rg, req, mt, g, tq, qw, w_lo, w_hi);
  if (nan) atomicOr(&sm.qnan[(mt * 16) / p.heads], 1);
  uint32_t qa[3][4][4];  // [limb][k-step][register]
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) to_limbs(sm.lut, qw[r & 1][2 * s + (r >> 1)], qa[0][s][r], qa[1][s][r], qa[2][s][r]);

  for (int tile = t_begin; tile < t_end; ++tile) {
    const int i = tile - t_begin, st = i % kExactStages, buf = i & 1;
    cp_async_wait<kExactStages - 2>();
    __syncthreads();  // raw tile `tile` has landed; every thread is done with the previous iteration
    if (tile + kExactStages - 1 < t_end)
      issue_exact_tile(sm, p, req, ctx, tile + kExactStages - 1, (i + kExactStages - 1) % kExactStages);
    cp_async_commit();

    // Codes -> limbs, NaN flags and scales; the 8 16-byte parts of a key are 8 neighbouring lanes.
#pragma unroll
    for (int it = 0; it < kTileKeys * 8 / kExactThreads; ++it) {
      const int u = tid + it * kExactThreads;
      const int key = u >> 3, part = u & 7;
      const uint4 v = *reinterpret_cast<const uint4*>(&sm.raw[st][key * kKeyStride + part * 16]);
      const bool key_nan = has_e4m3_nan(v.x) | has_e4m3_nan(v.y) | has_e4m3_nan(v.z) | has_e4m3_nan(v.w);
      const uint32_t nan_lanes = __ballot_sync(0xFFFFFFFFu, key_nan);
      if (part == 0) sm.knan[buf][key] = (nan_lanes >> (lane & 24)) & 0xFFu;
      uint4 l[3];
      to_limbs(sm.lut, v, l);
#pragma unroll
      for (int b = 0; b < 3; ++b) *reinterpret_cast<uint4*>(&sm.limbs[b][key * kKeyStride + part * 16]) = l[b];
    }
    if (tid < kTileKeys) sm.scale[buf][tid] = sm.raw_scale[st][tid];
    if (i > 0) exact_head_sums(sm, p, rg, req, ctx, tile - 1, buf ^ 1);
    __syncthreads();  // the limbs are ready

    const int row0 = mt * 16 + g;
    float* terms = sm.terms[buf];
#pragma unroll 1
    for (int j = 0; j < rg.m_tiles; ++j) {
      const int n = slice * rg.m_tiles + j;
      const int off = (n * 8 + g) * kKeyStride + 32 * tq;
      int32_t acc[5][4] = {};
#pragma unroll
      for (int sp = 0; sp < 2; ++sp) {  // two k-steps per 16-byte load (conflict-free with the padded rows)
        uint32_t kb[3][4];
#pragma unroll
        for (int b = 0; b < 3; ++b) {
          const uint4 v = *reinterpret_cast<const uint4*>(&sm.limbs[b][off + 16 * sp]);
          kb[b][0] = v.x, kb[b][1] = v.y, kb[b][2] = v.z, kb[b][3] = v.w;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int a = 0; a < 3; ++a)
#pragma unroll
            for (int b = 0; b < 3; ++b) mma_s8(acc[a + b], qa[a][2 * sp + h], kb[b][2 * h], kb[b][2 * h + 1]);
      }
      // acc[.][e]: row row0 + 8 (e >> 1), key n*8 + 2 tq + (e & 1).
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float dot = exact_dot(acc[0][e], acc[1][e], acc[2][e], acc[3][e], acc[4][e]);
        const float relu = dot > 0.0f ? dot : 0.0f;
        terms[(n * 8 + 2 * tq + (e & 1)) * kTermStride + row0 + 8 * (e >> 1)] = __fmul_rn(e < 2 ? w_lo : w_hi, relu);
      }
    }
  }
  __syncthreads();
  exact_head_sums(sm, p, rg, req, ctx, t_end - 1, (t_end - 1 - t_begin) & 1);
}

// ---- fast FP8 kernel

constexpr int kFastThreads = 128;
constexpr int kFastWarps = kFastThreads / 32;
constexpr int kWarpTileKeys = 32;
constexpr int kFastStages = 3;

struct FastStage {
  alignas(16) uint8_t keys[kWarpTileKeys * kKeyStride];
  float scale[kWarpTileKeys];
};

struct FastSmem {
  FastStage stage[kFastWarps][kFastStages];  // one private ring per warp
  // The group's query codes in fragment order: [16-row tile][k16-step s][lane] = word s of the lane's 32 bytes of
  // rows g and g + 8; every warp reads all of them.
  uint2 q[4][8][32];
  float w[kGroupRows];
  int qnan[kFastWarps];  // per 16-row tile: a NaN code among its rows
};

// Copies warp tile `tile` (32 keys from position 32 tile) into `st`; positions from ctx on are zero-filled.
__device__ __forceinline__ void issue_fast_tile(FastStage& st, const ScoreParams& p, int req, int ctx, int tile,
                                                int lane) {
  const int pos_lane = tile * kWarpTileKeys + lane;
  const bool ok_lane = pos_lane < ctx;
  const int page_lane = ok_lane ? p.bt.pages[int64_t{req} * p.bt.stride + page_index(p.pages, pos_lane)] : 0;
#pragma unroll
  for (int it = 0; it < kWarpTileKeys * 8 / 32; ++it) {
    const int key = (lane >> 3) + 4 * it, part = lane & 7;
    const int pos = tile * kWarpTileKeys + key;
    const int page = __shfl_sync(0xFFFFFFFFu, page_lane, key);
    const bool ok = pos < ctx;
    const uint8_t* src = ok ? p.pages.base + int64_t{page} * p.pages.page_stride +
                                  int64_t{pos & (p.pages.page_size - 1)} * kD + part * 16
                            : p.pages.base;
    cp_async_16(&st.keys[key * kKeyStride + part * 16], src, ok ? 16 : 0);
  }
  const uint8_t* src = ok_lane ? p.pages.base + int64_t{page_lane} * p.pages.page_stride +
                                     int64_t{p.pages.page_size} * kD + 4 * (pos_lane & (p.pages.page_size - 1))
                               : p.pages.base;
  cp_async_4(&st.scale[lane], src, ok_lane ? 4 : 0);
}

__global__ void __launch_bounds__(kFastThreads, 3) index_scores_fast_kernel(ScoreParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  FastSmem& sm = *reinterpret_cast<FastSmem*>(smem_raw);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int req = blockIdx.y;
  const RowGroup rg = row_group(p);
  const int ctx = min(p.ctx_lens[req], p.max_ctx);
  const int n_tiles = (ctx + kWarpTileKeys - 1) / kWarpTileKeys;
  const int t_begin = blockIdx.x * p.tiles_per_split + warp, t_end = min(n_tiles, t_begin - warp + p.tiles_per_split);
  const int my_tiles = t_begin < t_end ? (t_end - t_begin + kFastWarps - 1) / kFastWarps : 0;
  FastStage* ring = sm.stage[warp];

#pragma unroll
  for (int s = 0; s < kFastStages - 1; ++s) {
    if (s < my_tiles) issue_fast_tile(ring[s], p, req, ctx, t_begin + s * kFastWarps, lane);
    cp_async_commit();
  }

  // Warp w stores 16-row tile w of the group (rows past the group are zero), its weights and NaN flag.
  {
    uint32_t qw[2][8];
    float w_lo, w_hi;
    const bool nan = __any_sync(0xFFFFFFFFu, load_query_rows(p, rg, req, warp, g, tq, qw, w_lo, w_hi));
#pragma unroll
    for (int s = 0; s < 8; ++s) sm.q[warp][s][lane] = make_uint2(qw[0][s], qw[1][s]);
    if (tq == 0) {
      sm.w[warp * 16 + g] = w_lo;
      sm.w[warp * 16 + g + 8] = w_hi;
    }
    if (lane == 0) sm.qnan[warp] = nan;
  }
  __syncthreads();
  if (my_tiles == 0) return;
  float wr[4][2];  // weights of rows 16 mt + g and + 8
  bool qnan[2] = {false, false};
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
    wr[mt][0] = sm.w[mt * 16 + g];
    wr[mt][1] = sm.w[mt * 16 + g + 8];
    if (mt * 16 >= p.heads) {
      qnan[1] = qnan[1] || sm.qnan[mt];
    } else {
      qnan[0] = qnan[0] || sm.qnan[mt];
    }
  }
  const int token_pos0 = p.ctx_lens[req] - p.n_q + rg.token0;  // position of the group's first query token
  // After the butterfly, lane (g, tq) holds the sums of key 8 (g >> 1) + 2 tq + (g & 1) of the tile.
  const int my_key = 8 * (g >> 1) + 2 * tq + (g & 1);

#pragma unroll 1
  for (int i = 0; i < my_tiles; ++i) {
    const int tile = t_begin + i * kFastWarps;
    cp_async_wait<kFastStages - 2>();
    __syncwarp();  // the tile has landed for every lane; every lane is done with the stage refilled below
    if (i + kFastStages - 1 < my_tiles)
      issue_fast_tile(ring[(i + kFastStages - 1) % kFastStages], p, req, ctx,
                      tile + (kFastStages - 1) * kFastWarps, lane);
    cp_async_commit();
    const FastStage& st = ring[i % kFastStages];

    // B: bytes 32 tq .. 32 tq + 31 of key 8 n + g of each n8 tile.
    uint32_t kb[4][8];
    uint32_t nan_mask[4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const uint8_t* kp = &st.keys[(n * 8 + g) * kKeyStride + 32 * tq];
      const uint4 a = *reinterpret_cast<const uint4*>(kp);
      const uint4 b = *reinterpret_cast<const uint4*>(kp + 16);
      kb[n][0] = a.x, kb[n][1] = a.y, kb[n][2] = a.z, kb[n][3] = a.w;
      kb[n][4] = b.x, kb[n][5] = b.y, kb[n][6] = b.z, kb[n][7] = b.w;
      bool nan = false;
#pragma unroll
      for (int j = 0; j < 8; ++j) nan = nan | has_e4m3_nan(kb[n][j]);
      nan_mask[n] = __ballot_sync(0xFFFFFFFFu, nan);  // bits 4c .. 4c+3: key column c
    }
    // k16-step s takes word s of every lane's 32 bytes, as f16 (exact): its bytes 0-1 are the k pair 2 tq, 2 tq + 1
    // of the fragments, bytes 2-3 the pair 8 + 2 tq, 9 + 2 tq, in A and B alike. The keys' words are converted
    // once per tile, the queries' once per use (kept as codes, they take half the shared-memory reads).
    float acc[4][4][4] = {};  // [n8 tile][16-row tile][register]
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      uint32_t bf[4][2];
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        bf[n][0] = e4m3x2_to_f16x2(kb[n][s] & 0xFFFFu);
        bf[n][1] = e4m3x2_to_f16x2(kb[n][s] >> 16);
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        if (mt >= rg.m_tiles) continue;
        const uint2 q = sm.q[mt][s][lane];
        const uint32_t af[4] = {e4m3x2_to_f16x2(q.x & 0xFFFFu), e4m3x2_to_f16x2(q.y & 0xFFFFu),
                                e4m3x2_to_f16x2(q.x >> 16), e4m3x2_to_f16x2(q.y >> 16)};
#pragma unroll
        for (int n = 0; n < 4; ++n) mma_f16(acc[n][mt], af, bf[n][0], bf[n][1]);
      }
    }
    // acc[n][mt][e]: row 16 mt + g + 8 (e >> 1), key 8 n + 2 tq + (e & 1).
    float part[2][8];  // [token][2 n + column parity]: this lane's rows summed
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) part[0][2 * n + e] = part[1][2 * n + e] = 0.0f;
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float term = wr[mt][e >> 1] * fmaxf(acc[n][mt][e], 0.0f);
          if (mt * 16 >= p.heads) {
            part[1][2 * n + (e & 1)] += term;
          } else {
            part[0][2 * n + (e & 1)] += term;
          }
        }
    }

    // Butterfly over the 8 lanes of a key column (lane bits 4, 3, 2 = g bits 2, 1, 0): each step keeps half of
    // the values and adds the partner's copy of them; lane g ends with value g.
    float sum[2];
#pragma unroll
    for (int tl = 0; tl < 2; ++tl) {
      float x4[4], x2[2];
      const bool b2 = g & 4, b1 = g & 2, b0 = g & 1;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        x4[j] = (b2 ? part[tl][4 + j] : part[tl][j]) +
                __shfl_xor_sync(0xFFFFFFFFu, b2 ? part[tl][j] : part[tl][4 + j], 16);
#pragma unroll
      for (int j = 0; j < 2; ++j)
        x2[j] = (b1 ? x4[2 + j] : x4[j]) + __shfl_xor_sync(0xFFFFFFFFu, b1 ? x4[j] : x4[2 + j], 8);
      sum[tl] = (b0 ? x2[1] : x2[0]) + __shfl_xor_sync(0xFFFFFFFFu, b0 ? x2[0] : x2[1], 4);
    }

    const int n = g >> 1, column = my_key & 7;
    const uint32_t mask = n == 0 ? nan_mask[0] : n == 1 ? nan_mask[1] : n == 2 ? nan_mask[2] : nan_mask[3];
    const bool key_nan = (mask >> (4 * column)) & 0xFu;
    const int pos = tile * kWarpTileKeys + my_key;
    const float scale = st.scale[my_key];
    if (pos < ctx) {
#pragma unroll
      for (int tl = 0; tl < 2; ++tl) {
        if (tl >= rg.tokens) break;
        float score = scale * sum[tl];
        if (key_nan || qnan[tl]) score = __uint_as_float(0x7FC00000u);
        if (pos > token_pos0 + tl) score = -INFINITY;
        p.scores[(int64_t{req} * p.n_q + rg.token0 + tl) * p.stride + pos] = score;
      }
    }
  }
}


}  // namespace

}  // namespace kestrel::cuda::dsa

namespace kestrel::cuda {

void index_key_write(const void* keys, KeyDtype dtype, int T, bool hadamard, const int64_t* slots,
                     const Pages& index_pages, cudaStream_t stream) {
  dsa::require(T >= 0, "index_key_write: negative token count " + std::to_string(T));
  dsa::check_pages(index_pages, "index_key_write");
  if (T == 0) return;
  dsa::require(keys != nullptr && slots != nullptr, "index_key_write: keys and slots must be given");
  // Computed as cpu::hadamard_inplace does: 1 / sqrt(n) in double, rounded to fp32.
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(kIndexHeadDim)));
  constexpr int kKeysPerBlock = dsa::kWriterThreads / 32;
  const int blocks = (T + kKeysPerBlock - 1) / kKeysPerBlock;
  dsa::index_key_write_kernel<<<blocks, dsa::kWriterThreads, 0, stream>>>(keys, dtype == KeyDtype::bf16, T, hadamard,
                                                                     norm, slots, index_pages);
  check(cudaGetLastError(), "index_key_write kernel launch");
}

void index_scores_decode(const IndexQueries& queries, const Pages& index_pages, const BlockTable& block_table,
                         const int32_t* ctx_lens, int max_ctx_len, IndexScoreMode mode, float* scores,
                         int64_t score_stride, cudaStream_t stream) {
  using namespace dsa;
  require(queries.heads == 32 || queries.heads == 64,
          "index_scores_decode: indexer heads must be 32 or 64, got " + std::to_string(queries.heads));
  require(queries.batch >= 0 && queries.n_q >= 1,
          "index_scores_decode: need batch >= 0 and n_q >= 1, got batch " + std::to_string(queries.batch) +
              ", n_q " + std::to_string(queries.n_q));
  require(max_ctx_len >= 0 && score_stride >= max_ctx_len,
          "index_scores_decode: score stride " + std::to_string(score_stride) + " is smaller than max_ctx_len " +
              std::to_string(max_ctx_len));
  check_pages(index_pages, "index_scores_decode");
  if (queries.batch == 0 || max_ctx_len == 0) return;
  require(queries.codes && queries.weights && block_table.pages && ctx_lens && scores,
          "index_scores_decode: a device pointer is missing");
  require(int64_t{queries.batch} <= 65535, "index_scores_decode: at most 65535 requests per call");

  ScoreParams p{queries.codes, queries.weights, queries.n_q, queries.heads, index_pages, block_table,
                ctx_lens,      max_ctx_len,     scores,        score_stride,  0};
  const int groups = (queries.n_q * queries.heads + kGroupRows - 1) / kGroupRows;
  // The wgmma kernel's row group is 64 (query, head) rows: with fewer (H_I = 32 at n_q = 1) half of every MMA is
  // empty and the H200 measured it 8% slower than the mma.sync kernel (bench/results/gpu_h200_session4.md).
  if (mode == IndexScoreMode::exact && exact_wgmma_available() && queries.n_q * queries.heads >= 64) {
    launch_index_scores_exact_wgmma(queries, index_pages, block_table, ctx_lens, max_ctx_len, scores, score_stride,
                                    stream);
  } else if (mode == IndexScoreMode::exact || mode == IndexScoreMode::exact_mma) {
    static DeviceCache resident;
    const int per_sm = resident.get([] {
      return prepare_kernel(index_scores_exact_kernel, kExactThreads, sizeof(ExactSmem), "index_scores_exact_kernel");
    });
    const int tiles = (max_ctx_len + kTileKeys - 1) / kTileKeys;
    const dim3 grid = one_wave_grid(p, queries.batch, groups, tiles, tiles, per_sm);
    index_scores_exact_kernel<<<grid, kExactThreads, sizeof(ExactSmem), stream>>>(p);
  } else if (mode == IndexScoreMode::fast_fp8 && exact_wgmma_available() && queries.n_q * queries.heads >= 64) {
    launch_index_scores_fp8_wgmma(queries, index_pages, block_table, ctx_lens, max_ctx_len, scores, score_stride,
                                  stream);
  } else {
    static DeviceCache resident;
    const int per_sm = resident.get([] {
      return prepare_kernel(index_scores_fast_kernel, kFastThreads, sizeof(FastSmem), "index_scores_fast_kernel");
    });
    const int tiles = (max_ctx_len + kWarpTileKeys - 1) / kWarpTileKeys;
    const dim3 grid = one_wave_grid(p, queries.batch, groups, tiles, (tiles + kFastWarps - 1) / kFastWarps, per_sm);
    index_scores_fast_kernel<<<grid, kFastThreads, sizeof(FastSmem), stream>>>(p);
  }
  check(cudaGetLastError(), "index_scores_decode kernel launch");
}

}  // namespace kestrel::cuda
