// DSA indexer on the GPU: the index-key writer and the decode scores over paged index keys.
//
// Exact scores. Every finite e4m3 value is an integer multiple of 2^-9: value * 512 = u with |u| <= 448 * 512 <
// 2^18. Split u into three signed 7-bit limbs, u = l0 + l1 2^7 + l2 2^14 (each limb carries u's sign, |l| <= 127),
// so a 128-term dot is sum over limb pairs (a, b) of 2^(7(a+b)) * sum_d lq_a[d] lk_b[d]. Each limb product is an
// int8 tensor-core MMA with an int32 accumulator; the pairs with the same a + b share one accumulator (at most
// 3 * 128 * 127^2 < 2^23 in magnitude, no overflow). The five accumulators are combined in int64 (|dot| * 2^18 <
// 2^43), rounded to fp32 once (__ll2float_rn) and scaled by 2^-18: exactly cpu::indexer_scores' dot. The ReLU,
// the weight product and the head sum j = 0..H_I-1 are then the same fp32 operations in the same order.
//
// The dot runs over d in any order, so lane t of a quad takes bytes 32t .. 32t+31 of a key (two 16-byte loads)
// and the MMA's k index is mapped onto them: k-step s, register r of the B fragment holds the key's word 2s + r of
// those 32 bytes; the query's A fragment is built with the same map.
//
// CTA: 128 threads (4 warps) for one request, 64 query rows (64 / H_I query tokens x H_I heads; warp w owns rows
// 16w .. 16w+15, its A fragments in registers for the whole kernel) and a strided set of 64-key tiles. Per tile the
// keys are staged in shared memory (the exact mode stores their limbs instead of the codes), each warp computes its 16 x 64 dots
// as 8 n8 tiles, writes w_j * ReLU(dot) to shared memory, and one thread per (query token, key) sums the heads in
// order and writes the score.
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>

#include "kernels/cuda/dsa_common.cuh"

namespace kestrel::cuda::dsa {
namespace {

constexpr int kD = kIndexHeadDim;
constexpr int kWriterThreads = 128;  // one warp per key

// ---------------------------------------------------------------- writer

__device__ __forceinline__ float round_up_pow2(float s) {
  const uint32_t bits = __float_as_uint(s);
  const uint32_t exp_field = bits >> 23;
  if (exp_field == 0) return __uint_as_float(1u << 23);
  if ((bits & 0x007FFFFFu) == 0) return s;
  return __uint_as_float((exp_field + 1) << 23);
}

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
  const float s = finite ? round_up_pow2(__fmul_rn(fmaxf(amax, 1e-4f), 1.0f / 448.0f)) : __uint_as_float(0x7FC00000u);
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

constexpr int kThreads = 128;
constexpr int kRows = 64;           // query rows (token, head) per CTA
constexpr int kTileKeys = 64;       // keys per tile
constexpr int kKeyStride = 144;     // bytes per staged key row: 128 + 16 of padding against bank conflicts
constexpr int kTermStride = kRows + 1;

struct ScoreParams {
  const uint8_t* q;
  const float* w;
  int n_q;
  int heads;
  Pages pages;
  BlockTable bt;
  const int32_t* ctx_lens;
  int max_ctx;
  float* scores;
  int64_t stride;
};

template <bool kExact>
struct ScoreSmem {
  uint32_t lut[256];  // e4m3 code -> its three limbs as signed bytes 0..2
  float terms[kTileKeys][kTermStride];  // w_row * ReLU(dot) for [key][row]
  float kscale[kTileKeys];
  int knan[kTileKeys];
  float w[kRows];
  int qnan[kRows / 32];  // per query token of the CTA: its codes hold a NaN
  // The staged keys: their three limbs (exact mode) or their codes (fast mode), [key][byte] with padded rows.
  alignas(16) uint8_t keys[kExact ? 3 : 1][kTileKeys * kKeyStride];
};

__device__ uint32_t limb_entry(int code) {
  const int mag = code & 0x7F;
  if (mag == 0x7F) return 0;  // NaN: its scores are set to NaN through the flags
  const int e = mag >> 3, m = mag & 7;
  const int u = e ? (8 + m) << (e - 1) : m;
  int l0 = u & 127, l1 = (u >> 7) & 127, l2 = u >> 14;
  if (code & 0x80) {
    l0 = -l0;
    l1 = -l1;
    l2 = -l2;
  }
  return static_cast<uint32_t>(static_cast<uint8_t>(l0)) | static_cast<uint32_t>(static_cast<uint8_t>(l1)) << 8 |
         static_cast<uint32_t>(static_cast<uint8_t>(l2)) << 16;
}

// Four e4m3 codes -> the same four positions of limb 0, 1 and 2.
__device__ __forceinline__ void to_limbs(const uint32_t* lut, uint32_t w, uint32_t& l0, uint32_t& l1,
                                         uint32_t& l2) {
  const uint32_t x0 = lut[w & 0xFF], x1 = lut[(w >> 8) & 0xFF], x2 = lut[(w >> 16) & 0xFF], x3 = lut[w >> 24];
  const uint32_t t01 = __byte_perm(x0, x1, 0x5140), t23 = __byte_perm(x2, x3, 0x5140);
  l0 = __byte_perm(t01, t23, 0x5410);
  l1 = __byte_perm(t01, t23, 0x7632);
  l2 = __byte_perm(__byte_perm(x0, x1, 0x0062), __byte_perm(x2, x3, 0x0062), 0x5410);
}

template <bool kExact>
__global__ void __launch_bounds__(kThreads, 3) index_scores_kernel(ScoreParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  ScoreSmem<kExact>& sm = *reinterpret_cast<ScoreSmem<kExact>*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int req = blockIdx.y;
  const int tokens_per_cta = kRows / p.heads;
  const int token0 = blockIdx.z * tokens_per_cta;
  const int ctx = min(p.ctx_lens[req], p.max_ctx);

  for (int c = tid; c < 256; c += kThreads) sm.lut[c] = limb_entry(c);
  if (tid < kRows / 32) sm.qnan[tid] = 0;
  if (tid < kRows) {
    const int token = token0 + tid / p.heads;
    sm.w[tid] = token < p.n_q ? p.w[(int64_t{req} * p.n_q + token) * p.heads + tid % p.heads] : 0.0f;
  }
  __syncthreads();

  // A fragments of rows 16 warp + g and + 8: bytes 32 tq .. 32 tq + 31 of each row (see the file comment).
  uint32_t qw[2][8];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = warp * 16 + g + 8 * half;
    const int token = token0 + row / p.heads;
    uint4 v0 = make_uint4(0, 0, 0, 0), v1 = v0;
    if (token < p.n_q) {
      const uint4* src = reinterpret_cast<const uint4*>(
          p.q + ((int64_t{req} * p.n_q + token) * p.heads + row % p.heads) * kD + 32 * tq);
      v0 = src[0];
      v1 = src[1];
    }
    qw[half][0] = v0.x, qw[half][1] = v0.y, qw[half][2] = v0.z, qw[half][3] = v0.w;
    qw[half][4] = v1.x, qw[half][5] = v1.y, qw[half][6] = v1.z, qw[half][7] = v1.w;
    bool nan = false;
#pragma unroll
    for (int i = 0; i < 8; ++i) nan = nan || has_e4m3_nan(qw[half][i]);
    if (nan) atomicOr(&sm.qnan[row / p.heads], 1);
  }
  // kExact: qa[limb][k-step]; fast: qa[0][k-step] holds the codes.
  uint32_t qa[kExact ? 3 : 1][4][4];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const uint32_t word = qw[r & 1][2 * s + (r >> 1)];
      if constexpr (kExact) {
        to_limbs(sm.lut, word, qa[0][s][r], qa[1][s][r], qa[2][s][r]);
      } else {
        qa[0][s][r] = word;
      }
    }
  }

  const int n_tiles = (ctx + kTileKeys - 1) / kTileKeys;
  for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
    // Stage the tile: 64 keys x 8 16-byte parts; the 8 parts of a key are 8 neighbouring lanes.
#pragma unroll
    for (int it = 0; it < kTileKeys * 8 / kThreads; ++it) {
      const int u = tid + it * kThreads;
      const int key = u >> 3, part = u & 7;
      const int pos = tile * kTileKeys + key;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (pos < ctx) v = __ldg(reinterpret_cast<const uint4*>(page_row(p.pages, p.bt, req, pos, kD)) + part);
      const bool nan = has_e4m3_nan(v.x) || has_e4m3_nan(v.y) || has_e4m3_nan(v.z) || has_e4m3_nan(v.w);
      const uint32_t nan_lanes = __ballot_sync(0xFFFFFFFFu, nan);
      if (part == 0) sm.knan[key] = (nan_lanes >> (lane & 24)) & 0xFFu;
      if constexpr (kExact) {
        uint4 l[3];
        to_limbs(sm.lut, v.x, l[0].x, l[1].x, l[2].x);
        to_limbs(sm.lut, v.y, l[0].y, l[1].y, l[2].y);
        to_limbs(sm.lut, v.z, l[0].z, l[1].z, l[2].z);
        to_limbs(sm.lut, v.w, l[0].w, l[1].w, l[2].w);
#pragma unroll
        for (int i = 0; i < 3; ++i) *reinterpret_cast<uint4*>(sm.keys[i] + key * kKeyStride + part * 16) = l[i];
      } else {
        *reinterpret_cast<uint4*>(sm.keys[0] + key * kKeyStride + part * 16) = v;
      }
    }
    if (tid < kTileKeys) {
      const int pos = tile * kTileKeys + tid;
      float scale = 0.0f;
      if (pos < ctx) {
        const int page = p.bt.pages[int64_t{req} * p.bt.stride + pos / p.pages.page_size];
        const uint8_t* page_base = p.pages.base + int64_t{page} * p.pages.page_stride;
        scale = __ldg(reinterpret_cast<const float*>(page_base + int64_t{p.pages.page_size} * kD) +
                      (pos & (p.pages.page_size - 1)));
      }
      sm.kscale[tid] = scale;
    }
    __syncthreads();

    const int row0 = warp * 16 + g;
    const float w_lo = sm.w[row0], w_hi = sm.w[row0 + 8];
#pragma unroll 1
    for (int n = 0; n < kTileKeys / 8; ++n) {
      const int off = (n * 8 + g) * kKeyStride + 32 * tq;
      float dot[4];
      if constexpr (kExact) {
        uint32_t kb[3][8];
#pragma unroll
        for (int i = 0; i < 3; ++i) {
          const uint4 a = *reinterpret_cast<const uint4*>(sm.keys[i] + off);
          const uint4 b = *reinterpret_cast<const uint4*>(sm.keys[i] + off + 16);
          kb[i][0] = a.x, kb[i][1] = a.y, kb[i][2] = a.z, kb[i][3] = a.w;
          kb[i][4] = b.x, kb[i][5] = b.y, kb[i][6] = b.z, kb[i][7] = b.w;
        }
        int32_t acc[5][4] = {};
#pragma unroll
        for (int s = 0; s < 4; ++s)
#pragma unroll
          for (int a = 0; a < 3; ++a)
#pragma unroll
            for (int b = 0; b < 3; ++b) mma_s8(acc[a + b], qa[a][s], kb[b][2 * s], kb[b][2 * s + 1]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t exact = int64_t{acc[0][e]} + int64_t{acc[1][e]} * (int64_t{1} << 7) +
                                int64_t{acc[2][e]} * (int64_t{1} << 14) + int64_t{acc[3][e]} * (int64_t{1} << 21) +
                                int64_t{acc[4][e]} * (int64_t{1} << 28);
          dot[e] = __fmul_rn(__ll2float_rn(exact), 0x1p-18f);
        }
      } else {
        const uint4 a = *reinterpret_cast<const uint4*>(sm.keys[0] + off);
        const uint4 b = *reinterpret_cast<const uint4*>(sm.keys[0] + off + 16);
        const uint32_t kb[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int s = 0; s < 4; ++s) mma_e4m3(acc, qa[0][s], kb[2 * s], kb[2 * s + 1]);
#pragma unroll
        for (int e = 0; e < 4; ++e) dot[e] = acc[e];
      }
      // dot[e]: row row0 + 8 (e >> 1), key n*8 + 2 tq + (e & 1).
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float relu = dot[e] > 0.0f ? dot[e] : 0.0f;
        sm.terms[n * 8 + 2 * tq + (e & 1)][row0 + 8 * (e >> 1)] = __fmul_rn(e < 2 ? w_lo : w_hi, relu);
      }
    }
    __syncthreads();

    if (tid < kTileKeys * tokens_per_cta) {
      const int tl = tid / kTileKeys, key = tid % kTileKeys;
      const int token = token0 + tl;
      const int pos = tile * kTileKeys + key;
      if (token < p.n_q && pos < ctx) {
        const float* terms = &sm.terms[key][tl * p.heads];
        float acc = 0.0f;
        for (int j = 0; j < p.heads; ++j) acc = __fadd_rn(acc, terms[j]);
        float score = __fmul_rn(sm.kscale[key], acc);
        if (sm.knan[key] || sm.qnan[tl]) score = __uint_as_float(0x7FC00000u);
        if (pos > p.ctx_lens[req] - p.n_q + token) score = -INFINITY;
        p.scores[(int64_t{req} * p.n_q + token) * p.stride + pos] = score;
      }
    }
    __syncthreads();
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

  ScoreParams p{queries.codes, queries.weights, queries.n_q, queries.heads, index_pages, block_table,
                ctx_lens,      max_ctx_len,     scores,        score_stride};
  const int row_groups = (queries.n_q * queries.heads + kRows - 1) / kRows;
  const int tiles = (max_ctx_len + kTileKeys - 1) / kTileKeys;
  const int ctas_per_request = std::max(1, 8 * device_sm_count() / (queries.batch * row_groups));
  const dim3 grid(std::min(tiles, ctas_per_request), queries.batch, row_groups);
  if (mode == IndexScoreMode::exact) {
    const size_t bytes = sizeof(ScoreSmem<true>);
    check(cudaFuncSetAttribute(index_scores_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes)),
          "cudaFuncSetAttribute(index_scores_kernel<exact>)");
    index_scores_kernel<true><<<grid, kThreads, bytes, stream>>>(p);
  } else {
    const size_t bytes = sizeof(ScoreSmem<false>);
    check(cudaFuncSetAttribute(index_scores_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes)),
          "cudaFuncSetAttribute(index_scores_kernel<fast_fp8>)");
    index_scores_kernel<false><<<grid, kThreads, bytes, stream>>>(p);
  }
  check(cudaGetLastError(), "index_scores_decode kernel launch");
}

}  // namespace kestrel::cuda
