// topk_decode_bounded (dsa_candidates.h): fast scores, per-key bounds, the threshold, the candidates, their exact
// scores and the top-k among them, as a sequence of kernels on one stream.
//
// Workspace (each region 256-byte aligned, S = max_ctx_len, R = batch * n_q rows, C = max_candidates); the top-k
// scratch of both topk_decode calls is the caller's separate, zero-filled topk_workspace:
//   fast      [R, S] fp32  fast_fp8_mma scores
//   scratch   [R, S] fp32  first the lower ends lo, then (once tau is known) the exact scores by candidate number
//   key_info  [batch, S]   (k_scale, ||k||_2 rounded up) per key
//   row_w     [R]          W = sum_j |w_j| ||q_j||_2 rounded up
//   tau       [R]
//   selected  [R, k]       topk_decode's output, first over lo (for tau), then over the exact scores
//   cand      [R, C]       candidate positions, ascending
//   chunk_counts [R, chunks], counts [R], lens [R] (candidates to rescore: counts, or n for an overflowed row)
//
// Everything is deterministic: integer counts and prefix sums, fixed-order fp32 reductions with directed rounding,
// and the exact scores are the exact mode's bits (dsa_exact.cuh's limbs and combine, the in-order head sum).
#include <cuda_fp8.h>

#include <algorithm>
#include <string>

#include "kernels/cuda/dsa_candidates.h"
#include "kernels/cuda/dsa_common.cuh"
#include "kernels/cuda/dsa_exact.cuh"

namespace kestrel::cuda::dsa {
namespace {

constexpr int kD = kIndexHeadDim;
constexpr int kChunk = 4096;          // positions per CTA of the compaction kernels
constexpr int kCompactThreads = 256;
constexpr int kRescoreKeys = 32;      // candidates per tile of the rescoring kernel
constexpr int kRescoreThreads = 256;  // lane = key of the tile, warp = head group (heads warp, warp + 8, ...)
constexpr int kWords = kD / 4;        // 32-bit words of codes per key or query head

// ---------------------------------------------------------------- bounds

__device__ __forceinline__ float e4m3_value(uint32_t code) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3)));
}

// The square of every e4m3 value, exact in fp32 (at most 8 significant bits, 2^-18 .. 448^2); NaN for NaN codes.
// Built in shared memory by each CTA that needs it: a table read instead of two conversions per code.
__device__ __forceinline__ void fill_square_table(float* squares) {
  for (int c = threadIdx.x; c < 256; c += blockDim.x) {
    const float v = e4m3_value(static_cast<uint32_t>(c));
    squares[c] = v * v;
  }
}

// The sum of squares of the four e4m3 values in `word`, added to acc, rounded up (NaN codes give NaN): the same
// bits as fmaf_ru(v, v, acc) in byte order, since every v * v is exact.
__device__ __forceinline__ float add_squares_ru(const float* squares, uint32_t word, float acc) {
#pragma unroll
  for (int b = 0; b < 4; ++b) acc = __fadd_ru(acc, squares[(word >> (8 * b)) & 0xFFu]);
  return acc;
}

// Warp sum, rounded up; every lane ends with the same value (each step adds the same two numbers on both lanes).
__device__ __forceinline__ float warp_sum_ru(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x = __fadd_ru(x, __shfl_xor_sync(0xFFFFFFFFu, x, off));
  return x;
}

// e = c * k_scale * ||k|| * W + k_scale * 2^-120, rounded up; +inf when nothing can be assumed. The absolute term
// covers the roundings of subnormal intermediate results (each at most 2^-149 before the scale), which the relative
// model does not.
__device__ __forceinline__ float fast_score_bound(float c, float2 key, float w_row) {
  const float k_scale = fabsf(key.x);
  const float mass = __fmul_ru(key.y, w_row);
  const float scaled = __fmul_ru(k_scale, mass);
  if (!(mass < 0x1p100f) || !(scaled < 0x1p100f)) return INFINITY;  // also NaN
  return __fmaf_ru(c, scaled, __fmul_ru(k_scale, 0x1p-120f));
}

// The interval ends of topk_lower_bound / topk_upper_bound, rounded outward by the directed-rounding operations
// (at least as far out as the CPU's one-ulp TwoSum rule). f must not be NaN.
__device__ __forceinline__ float lower_end(float f, float e) {
  if (e == INFINITY) return -INFINITY;
  if (isinf(f)) return f;
  return __fsub_rd(f, e);
}
__device__ __forceinline__ float upper_end(float f, float e) {
  if (e == INFINITY) return INFINITY;
  if (isinf(f)) return f;
  return __fadd_ru(f, e);
}

struct Shape {
  int n_q;
  const int32_t* ctx_lens;
  int max_ctx;
};

// Candidates of row `row`: positions 0 .. n-1, as topk_decode counts them.
__device__ __forceinline__ int row_len(const Shape& s, int row) {
  const int req = row / s.n_q, i = row % s.n_q;
  return max(0, min(s.ctx_lens[req] - s.n_q + i + 1, s.max_ctx));
}

// One CTA per query row: W = sum_j |w_j| ||q_j||_2 over the heads in order, every step rounded up. The head norms
// are computed in parallel (warp w: heads w, w + 8, ...), then one thread adds them in head order.
constexpr int kMassWarps = 8;
constexpr int kMaxMassHeads = 64;
__global__ void __launch_bounds__(kMassWarps * 32) query_mass_kernel(const uint8_t* __restrict__ q,
                                                                     const float* __restrict__ w, int heads,
                                                                     float* __restrict__ row_w) {
  __shared__ float squares[256];
  __shared__ float norms[kMaxMassHeads];
  const int row = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  fill_square_table(squares);
  __syncthreads();
  for (int j = warp; j < heads; j += kMassWarps) {
    const int64_t head = int64_t{row} * heads + j;
    const uint32_t word = reinterpret_cast<const uint32_t*>(q + head * kD)[lane];
    const float norm = __fsqrt_ru(warp_sum_ru(add_squares_ru(squares, word, 0.0f)));
    if (lane == 0) norms[j] = norm;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int j = 0; j < heads; ++j) total = __fmaf_ru(fabsf(w[int64_t{row} * heads + j]), norms[j], total);
    row_w[row] = total;
  }
}

// (k_scale, ||k||_2 rounded up) of every position < ctx_lens[req]. Eight lanes per key, 16 codes each: a warp
// reads four neighbouring keys (512 contiguous bytes when page_size >= 4) per step and sums each lane's squares in code order, then the
// eight partial sums in xor order (offsets 4, 2, 1), every addition rounded up, so the result is deterministic and
// at least the true norm. The first version, a warp per key with one CTA per 8 keys, issued about 95 instructions
// per key and took 0.70 ms at B = 32, 128K on the H200 (ncu): most of topk_decode_bounded's overhead.
constexpr int kNormWarps = 8;
constexpr int kNormLanesPerKey = 8;
constexpr int kNormKeysPerStep = kNormWarps * 32 / kNormLanesPerKey;  // 32 keys per CTA step
constexpr int kNormSteps = 16;
constexpr int kNormKeysPerCta = kNormKeysPerStep * kNormSteps;
__global__ void __launch_bounds__(kNormWarps * 32) key_norm_kernel(Pages pages, BlockTable bt, Shape s,
                                                                   float2* __restrict__ key_info) {
  __shared__ float squares[256];
  const int part = threadIdx.x % kNormLanesPerKey, slot = threadIdx.x / kNormLanesPerKey;
  const int req = blockIdx.y;
  fill_square_table(squares);
  __syncthreads();
  const int n = min(s.ctx_lens[req], s.max_ctx);
  const int first = blockIdx.x * kNormKeysPerCta;
  if (first >= n) return;  // whole CTA: no shuffle partner is left behind
#pragma unroll 4
  for (int step = 0; step < kNormSteps; ++step) {
    const int pos = first + step * kNormKeysPerStep + slot;
    const bool live = pos < n;
    float sum = 0.0f;
    const uint8_t* key = nullptr;
    if (live) {
      key = page_row(pages, bt, req, pos, kD);
      const uint4 v = *reinterpret_cast<const uint4*>(key + 16 * part);
      sum = add_squares_ru(squares, v.x, sum);
      sum = add_squares_ru(squares, v.y, sum);
      sum = add_squares_ru(squares, v.z, sum);
      sum = add_squares_ru(squares, v.w, sum);
    }
#pragma unroll
    for (int off = kNormLanesPerKey / 2; off > 0; off /= 2)
      sum = __fadd_ru(sum, __shfl_xor_sync(0xFFFFFFFFu, sum, off));
    if (live && part == 0) {
      const int row = pos & (pages.page_size - 1);
      const float scale =
          *reinterpret_cast<const float*>(key - int64_t{row} * kD + int64_t{pages.page_size} * kD + 4 * row);
      key_info[int64_t{req} * s.max_ctx + pos] = make_float2(scale, __fsqrt_ru(sum));
    }
  }
}

struct BoundParams {
  Shape s;
  const float* fast;  // [rows, max_ctx]
  const float2* key_info;
  const float* row_w;
  float c;
};

__device__ __forceinline__ float bound_at(const BoundParams& p, int row, int pos) {
  const int req = row / p.s.n_q;
  return fast_score_bound(p.c, p.key_info[int64_t{req} * p.s.max_ctx + pos], p.row_w[row]);
}

// lo of every candidate position; -inf for NaN fast scores, which topk_decode never selects.
__global__ void __launch_bounds__(256) lower_end_kernel(BoundParams p, float* __restrict__ lo) {
  const int row = blockIdx.y, pos = blockIdx.x * 256 + threadIdx.x;
  if (pos >= row_len(p.s, row)) return;
  const int64_t at = int64_t{row} * p.s.max_ctx + pos;
  const float f = p.fast[at];
  lo[at] = isnan(f) ? -INFINITY : lower_end(f, bound_at(p, row, pos));
}

// tau of each row from topk_decode's k positions over lo: their smallest lo, or -inf when fewer than k were
// selected (fewer than k keys with lo > -inf). One warp per row, a fixed reduction order.
__global__ void __launch_bounds__(32) threshold_kernel(const int32_t* __restrict__ selected, int k,
                                                       const float* __restrict__ lo, int64_t stride,
                                                       float* __restrict__ tau) {
  const int row = blockIdx.x, lane = threadIdx.x;
  float m = INFINITY;
  bool short_row = false;
  for (int r = lane; r < k; r += 32) {
    const int32_t pos = selected[int64_t{row} * k + r];
    if (pos < 0) {
      short_row = true;
    } else {
      m = fminf(m, lo[int64_t{row} * stride + pos]);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) m = fminf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  short_row = __any_sync(0xFFFFFFFFu, short_row);
  if (lane == 0) tau[row] = short_row ? -INFINITY : m;
}

struct CompactParams {
  BoundParams b;
  const float* tau;
  int chunks;              // CTAs per row
  int32_t* chunk_counts;   // [rows, chunks]
  int32_t* cand;           // [rows, cap]
  int cap;
  int32_t* counts;         // [rows]
  int32_t* lens;           // [rows]
  int32_t* user_counts;    // optional
  int32_t* overflowed;     // optional
};

__device__ __forceinline__ bool is_candidate(const CompactParams& p, int row, int pos, int n, float tau) {
  if (pos >= n) return false;
  const float f = p.b.fast[int64_t{row} * p.b.s.max_ctx + pos];
  if (isnan(f)) return false;
  const float hi = upper_end(f, bound_at(p.b, row, pos));
  return hi > -INFINITY && hi >= tau;
}

// Candidates per chunk of kChunk positions.
__global__ void __launch_bounds__(kCompactThreads) candidate_count_kernel(CompactParams p) {
  __shared__ int32_t warp_counts[kCompactThreads / 32];
  const int row = blockIdx.y, base = blockIdx.x * kChunk;
  const int n = row_len(p.b.s, row);
  const float tau = p.tau[row];
  int32_t count = 0;
  for (int e = threadIdx.x; e < kChunk; e += kCompactThreads) count += is_candidate(p, row, base + e, n, tau);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) count += __shfl_xor_sync(0xFFFFFFFFu, count, off);
  if ((threadIdx.x & 31) == 0) warp_counts[threadIdx.x >> 5] = count;
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int w = 0; w < kCompactThreads / 32; ++w) total += warp_counts[w];
    p.chunk_counts[int64_t{row} * p.chunks + blockIdx.x] = total;
  }
}

// Writes each chunk's candidates at their ranks (chunks before, warps before, lanes before), ascending. A row with
// more than `cap` candidates writes none and is rescored over all n positions (lens = n).
__global__ void __launch_bounds__(kCompactThreads) candidate_write_kernel(CompactParams p) {
  constexpr int kWarps = kCompactThreads / 32;
  __shared__ int32_t warp_counts[kWarps];
  __shared__ int32_t before_sh, total_sh;
  const int row = blockIdx.y, c = blockIdx.x, base = c * kChunk;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = row_len(p.b.s, row);
  if (threadIdx.x == 0) {
    int32_t before = 0, total = 0;
    for (int j = 0; j < p.chunks; ++j) {
      const int32_t v = p.chunk_counts[int64_t{row} * p.chunks + j];
      if (j < c) before += v;
      total += v;
    }
    before_sh = before;
    total_sh = total;
    if (c == 0) {
      const bool over = total > p.cap;
      p.counts[row] = total;
      p.lens[row] = over ? n : total;
      if (p.user_counts) p.user_counts[row] = total;
      if (over && p.overflowed) *p.overflowed = 1;
    }
  }
  __syncthreads();
  if (total_sh > p.cap) return;
  const float tau = p.tau[row];
  int32_t run = before_sh;
  int32_t* out = p.cand + int64_t{row} * p.cap;
  for (int e0 = 0; e0 < kChunk; e0 += kCompactThreads) {
    const int pos = base + e0 + static_cast<int>(threadIdx.x);
    const bool take = is_candidate(p, row, pos, n, tau);
    const uint32_t ballot = __ballot_sync(0xFFFFFFFFu, take);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int32_t at = run + __popc(ballot & ((1u << lane) - 1u));
    int32_t block_total = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) at += warp_counts[w];
      block_total += warp_counts[w];
    }
    if (take) out[at] = pos;
    run += block_total;
    __syncthreads();  // warp_counts is rewritten by the next step
  }
}

// ---------------------------------------------------------------- exact rescoring

template <int H>
struct RescoreSmem {
  uint32_t lut[256];
  uint32_t q[3][H][kWords];                 // the row's query limbs: [limb][head][word]
  uint32_t k[3][kRescoreKeys][kWords + 1];  // the tile's key limbs, rows padded against bank conflicts
  alignas(16) float terms[kRescoreKeys][H + 4];  // w_j * ReLU(dot), [key][head]; 16-byte rows
  float w[H];
  float scale[kRescoreKeys];
  int32_t pos[kRescoreKeys];
  int knan[kRescoreKeys];
  int qnan;
};

struct RescoreParams {
  const uint8_t* q;
  const float* w;
  Pages pages;
  BlockTable bt;
  CompactParams cp;
  float* exact;  // [rows, max_ctx], by candidate number
  int32_t* violations;  // optional [rows]
};

// Exact scores (cpu::indexer_scores' bits) of the row's candidates, tiles of 32 taken grid-stride. The dots are
// the nine limb products of the exact kernels, here as dp4a on CUDA cores (integer, so exact in any order), with
// the same int32 accumulators per limb-weight a + b and the same single-rounding combine (exact_dot); then ReLU,
// the weight, the in-order head sum and the scale, the same fp32 operations.
template <int H>
__global__ void __launch_bounds__(kRescoreThreads) rescore_kernel(RescoreParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  RescoreSmem<H>& sm = *reinterpret_cast<RescoreSmem<H>*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row = blockIdx.y;
  const CompactParams& cp = p.cp;
  const int n_q = cp.b.s.n_q, req = row / n_q;
  const int len = cp.lens[row];
  const bool identity = cp.counts[row] > cp.cap;  // overflowed: candidate number = position
  if (static_cast<int>(blockIdx.x) * kRescoreKeys >= len) return;

  for (int c = tid; c < 256; c += kRescoreThreads) sm.lut[c] = limb_entry(c);
  if (tid == 0) sm.qnan = 0;
  __syncthreads();
  for (int u = tid; u < H * kWords; u += kRescoreThreads) {
    const int j = u / kWords, word = u % kWords;
    const uint32_t codes = reinterpret_cast<const uint32_t*>(p.q + (int64_t{row} * H + j) * kD)[word];
    if (has_e4m3_nan(codes)) atomicOr(&sm.qnan, 1);
    to_limbs(sm.lut, codes, sm.q[0][j][word], sm.q[1][j][word], sm.q[2][j][word]);
  }
  for (int j = tid; j < H; j += kRescoreThreads) sm.w[j] = p.w[int64_t{row} * H + j];

  for (int tile = blockIdx.x; tile * kRescoreKeys < len; tile += gridDim.x) {
    const int first = tile * kRescoreKeys;
    __syncthreads();  // the previous tile's terms and keys are no longer read
    if (tid < kRescoreKeys) {
      const int c = first + tid;
      int pos = -1;
      float scale = 0.0f;
      if (c < len) {
        pos = identity ? c : cp.cand[int64_t{row} * cp.cap + c];
        const int page = p.bt.pages[int64_t{req} * p.bt.stride + page_index(p.pages, pos)];
        scale = *reinterpret_cast<const float*>(p.pages.base + int64_t{page} * p.pages.page_stride +
                                                int64_t{p.pages.page_size} * kD +
                                                4 * (pos & (p.pages.page_size - 1)));
      }
      sm.pos[tid] = pos;
      sm.scale[tid] = scale;
    }
    __syncthreads();
    // Warp w loads keys w, w + 8, ...: one 4-byte word per lane.
    for (int key = warp; key < kRescoreKeys; key += kRescoreThreads / 32) {
      const int pos = sm.pos[key];
      const uint32_t codes =
          pos >= 0 ? reinterpret_cast<const uint32_t*>(page_row(p.pages, p.bt, req, pos, kD))[lane] : 0u;
      const bool nan = __any_sync(0xFFFFFFFFu, has_e4m3_nan(codes));
      if (lane == 0) sm.knan[key] = nan;
      to_limbs(sm.lut, codes, sm.k[0][key][lane], sm.k[1][key][lane], sm.k[2][key][lane]);
    }
    __syncthreads();

    constexpr int kHeadsPerThread = H / (kRescoreThreads / 32);
    int32_t acc[kHeadsPerThread][5] = {};
    const int key = lane;
#pragma unroll 4
    for (int word = 0; word < kWords; ++word) {
      const int kl[3] = {static_cast<int>(sm.k[0][key][word]), static_cast<int>(sm.k[1][key][word]),
                         static_cast<int>(sm.k[2][key][word])};
#pragma unroll
      for (int t = 0; t < kHeadsPerThread; ++t) {
        const int j = warp + 8 * t;
#pragma unroll
        for (int a = 0; a < 3; ++a) {
          const int ql = static_cast<int>(sm.q[a][j][word]);
#pragma unroll
          for (int b = 0; b < 3; ++b) acc[t][a + b] = __dp4a(ql, kl[b], acc[t][a + b]);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kHeadsPerThread; ++t) {
      const int j = warp + 8 * t;
      const float dot = exact_dot(acc[t][0], acc[t][1], acc[t][2], acc[t][3], acc[t][4]);
      const float relu = dot > 0.0f ? dot : 0.0f;
      sm.terms[key][j] = __fmul_rn(sm.w[j], relu);
    }
    __syncthreads();

    if (tid < kRescoreKeys && first + tid < len) {
      const int pos = sm.pos[tid];
      float score = __fmul_rn(sm.scale[tid], ordered_head_sum<H>(sm.terms[tid]));
      if (sm.knan[tid] || sm.qnan) score = __uint_as_float(0x7FC00000u);
      p.exact[int64_t{row} * cp.b.s.max_ctx + first + tid] = score;
      if (p.violations) {
        const float f = cp.b.fast[int64_t{row} * cp.b.s.max_ctx + pos];
        if (!isnan(f)) {
          const float e = bound_at(cp.b, row, pos);
          const float ranked = isnan(score) ? -INFINITY : score;
          if (ranked < lower_end(f, e) || ranked > upper_end(f, e)) atomicAdd(&p.violations[row], 1);
        }
      }
    }
  }
}

// Candidate numbers -> positions (identity for an overflowed row), -1 kept.
__global__ void __launch_bounds__(256) map_back_kernel(const int32_t* __restrict__ selected, int k,
                                                       const int32_t* __restrict__ cand, const int32_t* counts,
                                                       int cap, int32_t* __restrict__ out) {
  const int row = blockIdx.y, r = blockIdx.x * 256 + threadIdx.x;
  if (r >= k) return;
  const int32_t c = selected[int64_t{row} * k + r];
  out[int64_t{row} * k + r] = c < 0 ? -1 : counts[row] > cap ? c : cand[int64_t{row} * cap + c];
}

// ---------------------------------------------------------------- host side

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

struct Layout {
  size_t fast, scratch, key_info, row_w, tau, selected, cand, chunk_counts, counts, lens, total;
  int chunks;
};

// Both topk_decode calls: over lo as `batch` requests of n_q rows, then over the candidates as `rows` rows of n_q = 1.
size_t topk_bytes(int batch, int n_q, int max_ctx, int k) {
  return std::max(topk_decode_workspace_bytes(batch, n_q, max_ctx, k),
                  topk_decode_workspace_bytes(batch * n_q, 1, max_ctx, k));
}

Layout plan_layout(int batch, int n_q, int max_ctx, int k, int cap) {
  const size_t rows = static_cast<size_t>(batch) * n_q, S = static_cast<size_t>(max_ctx);
  Layout l{};
  l.chunks = (max_ctx + kChunk - 1) / kChunk;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align_up(bytes);
    return here;
  };
  l.fast = take(rows * S * sizeof(float));
  l.scratch = take(rows * S * sizeof(float));
  l.key_info = take(static_cast<size_t>(batch) * S * sizeof(float2));
  l.row_w = take(rows * sizeof(float));
  l.tau = take(rows * sizeof(float));
  l.selected = take(rows * k * sizeof(int32_t));
  l.cand = take(rows * cap * sizeof(int32_t));
  l.chunk_counts = take(rows * l.chunks * sizeof(int32_t));
  l.counts = take(rows * sizeof(int32_t));
  l.lens = take(rows * sizeof(int32_t));
  l.total = at;
  return l;
}

void check_bounded_shapes(int batch, int n_q, int max_ctx, int k, int cap, const char* fn) {
  require(batch >= 0 && n_q >= 1 && max_ctx >= 1 && k >= 1 && cap >= k,
          std::string(fn) + ": need batch >= 0, n_q >= 1, max_ctx_len >= 1, k >= 1 and max_candidates >= k, got " +
              "batch " + std::to_string(batch) + ", n_q " + std::to_string(n_q) + ", max_ctx_len " +
              std::to_string(max_ctx) + ", k " + std::to_string(k) + ", max_candidates " + std::to_string(cap));
  require(int64_t{batch} * n_q <= 65535, std::string(fn) + ": at most 65535 query rows per call");
}

template <int H>
void launch_rescore(const RescoreParams& p, int rows, int cap, cudaStream_t stream) {
  static DeviceCache prepared;
  prepared.get([] {
    check(cudaFuncSetAttribute(rescore_kernel<H>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(sizeof(RescoreSmem<H>))),
          "cudaFuncSetAttribute(rescore_kernel)");
    return 1;
  });
  // Enough CTAs for a full list of every row at a few tiles each; overflowed rows loop over more tiles.
  const int tiles = (cap + kRescoreKeys - 1) / kRescoreKeys;
  const int ctas = std::clamp(8 * device_sm_count() / std::max(rows, 1), 1, tiles);
  rescore_kernel<H><<<dim3(ctas, rows), kRescoreThreads, sizeof(RescoreSmem<H>), stream>>>(p);
}

}  // namespace
}  // namespace kestrel::cuda::dsa

namespace kestrel::cuda {

size_t topk_decode_bounded_topk_bytes(int batch, int n_q, int max_ctx_len, int k) {
  dsa::check_bounded_shapes(batch, n_q, max_ctx_len, k, k, "topk_decode_bounded_topk_bytes");
  if (batch == 0) return 0;
  return dsa::topk_bytes(batch, n_q, max_ctx_len, k);
}

size_t topk_decode_bounded_workspace_bytes(int batch, int n_q, int max_ctx_len, int k, int max_candidates) {
  dsa::check_bounded_shapes(batch, n_q, max_ctx_len, k, max_candidates, "topk_decode_bounded_workspace_bytes");
  if (batch == 0) return 0;
  return dsa::plan_layout(batch, n_q, max_ctx_len, k, max_candidates).total;
}

void topk_decode_bounded(const BoundedTopkArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  using namespace dsa;
  const IndexQueries& q = a.queries;
  check_bounded_shapes(q.batch, q.n_q, a.max_ctx_len, a.k, a.max_candidates, "topk_decode_bounded");
  require(q.heads == 32 || q.heads == 64,
          "topk_decode_bounded: indexer heads must be 32 or 64, got " + std::to_string(q.heads));
  require(a.bound_factor >= 0.0f && a.bound_factor < 1.0f,
          "topk_decode_bounded: bound_factor must be in [0, 1), got " + std::to_string(a.bound_factor));
  check_pages(a.index_pages, "topk_decode_bounded");
  require(reinterpret_cast<uintptr_t>(a.index_pages.base) % 16 == 0,
          "topk_decode_bounded: the index pages' base must be 16-byte aligned (keys are read in 16-byte pieces)");
  if (q.batch == 0) return;
  require(q.codes && q.weights && a.block_table.pages && a.ctx_lens && a.out,
          "topk_decode_bounded: a device pointer is missing");
  const int rows = q.batch * q.n_q, S = a.max_ctx_len, k = a.k, cap = a.max_candidates;
  const Layout l = plan_layout(q.batch, q.n_q, S, k, cap);
  require(workspace != nullptr && workspace_bytes >= l.total,
          "topk_decode_bounded: workspace of " + std::to_string(workspace_bytes) + " bytes, need " +
              std::to_string(l.total));
  const size_t topk_need = topk_bytes(q.batch, q.n_q, S, k);
  require(a.topk_workspace != nullptr && a.topk_workspace_bytes >= topk_need,
          "topk_decode_bounded: top-k workspace of " + std::to_string(a.topk_workspace_bytes) + " bytes, need " +
              std::to_string(topk_need));
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  void* topk_ws = a.topk_workspace;
  float* fast = reinterpret_cast<float*>(ws + l.fast);
  float* scratch = reinterpret_cast<float*>(ws + l.scratch);
  float2* key_info = reinterpret_cast<float2*>(ws + l.key_info);
  float* row_w = reinterpret_cast<float*>(ws + l.row_w);
  float* tau = reinterpret_cast<float*>(ws + l.tau);
  int32_t* selected = reinterpret_cast<int32_t*>(ws + l.selected);
  int32_t* cand = reinterpret_cast<int32_t*>(ws + l.cand);
  int32_t* chunk_counts = reinterpret_cast<int32_t*>(ws + l.chunk_counts);
  int32_t* counts = reinterpret_cast<int32_t*>(ws + l.counts);
  int32_t* lens = reinterpret_cast<int32_t*>(ws + l.lens);

  if (a.overflowed) check(cudaMemsetAsync(a.overflowed, 0, sizeof(int32_t), stream), "topk_decode_bounded memset");
  if (a.bound_violations)
    check(cudaMemsetAsync(a.bound_violations, 0, static_cast<size_t>(rows) * sizeof(int32_t), stream),
          "topk_decode_bounded memset");

  const Shape shape{q.n_q, a.ctx_lens, S};
  static_assert(kMaxMassHeads >= 64, "query_mass_kernel holds the norms of every head (32 or 64, checked above)");
  query_mass_kernel<<<rows, kMassWarps * 32, 0, stream>>>(q.codes, q.weights, q.heads, row_w);
  check(cudaGetLastError(), "topk_decode_bounded: query_mass_kernel launch");
  key_norm_kernel<<<dim3((S + kNormKeysPerCta - 1) / kNormKeysPerCta, q.batch), kNormWarps * 32, 0, stream>>>(
      a.index_pages, a.block_table, shape, key_info);
  check(cudaGetLastError(), "topk_decode_bounded: key_norm_kernel launch");
  // The bound's model is the f16 mma.sync kernel's (fp32 accumulation): fast_fp8_mma, not the e4m3 wgmma kernel,
  // whose FP8 accumulation keeps only about 14 bits and would need a bound of its own.
  index_scores_decode(q, a.index_pages, a.block_table, a.ctx_lens, S, IndexScoreMode::fast_fp8_mma, fast, S, stream);

  const BoundParams bp{shape, fast, key_info, row_w, a.bound_factor};
  lower_end_kernel<<<dim3((S + 255) / 256, rows), 256, 0, stream>>>(bp, scratch);
  check(cudaGetLastError(), "topk_decode_bounded: lower_end_kernel launch");
  topk_decode(scratch, S, q.batch, q.n_q, a.ctx_lens, S, k, selected, topk_ws, a.topk_workspace_bytes, stream);
  threshold_kernel<<<rows, 32, 0, stream>>>(selected, k, scratch, S, tau);
  check(cudaGetLastError(), "topk_decode_bounded: threshold_kernel launch");

  const CompactParams cp{bp, tau, l.chunks, chunk_counts, cand, cap, counts, lens, a.candidate_counts, a.overflowed};
  candidate_count_kernel<<<dim3(l.chunks, rows), kCompactThreads, 0, stream>>>(cp);
  check(cudaGetLastError(), "topk_decode_bounded: candidate_count_kernel launch");
  candidate_write_kernel<<<dim3(l.chunks, rows), kCompactThreads, 0, stream>>>(cp);
  check(cudaGetLastError(), "topk_decode_bounded: candidate_write_kernel launch");

  // lo is dead once tau is known: scratch now takes the exact scores by candidate number.
  const RescoreParams rp{q.codes, q.weights, a.index_pages, a.block_table, cp, scratch, a.bound_violations};
  if (q.heads == 64) {
    launch_rescore<64>(rp, rows, cap, stream);
  } else {
    launch_rescore<32>(rp, rows, cap, stream);
  }
  check(cudaGetLastError(), "topk_decode_bounded: rescore_kernel launch");

  // One "request" per row with n_q = 1 and lens as its length: topk_decode's n is then lens[row].
  topk_decode(scratch, S, rows, 1, lens, S, k, selected, topk_ws, a.topk_workspace_bytes, stream);
  map_back_kernel<<<dim3((k + 255) / 256, rows), 256, 0, stream>>>(selected, k, cand, counts, cap, a.out);
  check(cudaGetLastError(), "topk_decode_bounded: map_back_kernel launch");
}

}  // namespace kestrel::cuda
