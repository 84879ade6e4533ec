// IndexScoreMode::fast_fp8 on Hopper: the indexer scores on native e4m3 warpgroup MMAs (wgmma m64n64k32,
// e4m3 x e4m3 -> f32), the key codes multiplied straight from shared memory as they arrive from the pages (no
// per-element conversion: the mma.sync kernel in dsa_index.cu converts every code to f16 and is ALU-bound).
//
// CTA = one warpgroup (4 warps) for one request, one group of 64 query rows (64 / H_I tokens x H_I heads,
// token-major: the wgmma M) and a contiguous range of 64-key tiles (the wgmma N). The query codes are the A operand,
// in registers for the whole kernel (4 k32 steps x 4 registers of 4 codes). A tile's codes are copied by cp.async
// into a 4-stage ring in the B layout (K-major, no swizzle, as dsa_index_wgmma.cu's limb planes: the 16-byte piece p
// of key n, codes 16p .. 16p+15, at byte piece_offset(n, p)), its scales next to them.
//
// Iteration i (tile i of the CTA's range): wait for this thread's copies of tile i, flag its keys with NaN codes
// (each thread reads back the pieces it copied), fence for the async proxy, one barrier; issue the copy of tile
// i + 3 into the stage freed by tile i - 1; four chained wgmmas (k = 128) into 32 fp32 accumulators per thread, wait;
// epilogue: ReLU, times w_row, the head sum as a tree (each thread's two rows, a butterfly over the eight lanes of a
// key column, then the warps of the token through shared memory after a second barrier), times the key's scale,
// the NaN and future-position rules, one coalesced row of 64 scores per token. A CTA's epilogue does not overlap its
// own MMAs; the other resident CTAs fill that time, and three tiles (25 KB) per CTA stay in flight meanwhile.
//
// NaN rules (dsa.h, as the mma.sync fast kernel): a key with a NaN code (0x7F/0xFF) gives NaN for every row, a
// query token with a NaN code in any head gives NaN for every key; both come from explicit flags, so what the
// tensor cores make of NaN operands (and ReLU by fmaxf, which maps NaN to 0) does not matter. -inf past a row's own
// position takes precedence, as everywhere.
//
// Accuracy (the bound of dsa.h: |score - exact| <= 2^-6 k_scale sum_j |w_j| sum_d |q_jd k_d|). Products of two e4m3
// codes are exact in the MMA (8-bit significands). Hopper's FP8 MMA does not accumulate in full fp32: it aligns the
// products of a k32 step to the largest one and keeps about 13-14 bits below it (DeepSeek-V3 report: ~14 bits), so
// one k32 step errs by < 32 * 2^-13 * max |q_d k_d| <= 2^-8 sum_d |q_d k_d| over its 32 terms, and adding a step's sum
// into the fp32 accumulator (aligned to the larger, 13+ bits kept) by < 2^-13 of the running magnitude, four times:
// < (2^-8 + 2^-11) sum_d |q_d k_d| per head, a quarter of the bound. ReLU is 1-Lipschitz; the fp32 weight product,
// tree sum over <= 64 heads and scale product add < 8 * 2^-24 relative of sum_j |w_j| |dot_j| (no cancellation
// beyond the absolute sum). This is the model the bound was written for (docs/dsa-kernels.md).
#include "kernels/cuda/dsa_index_fp8_wgmma.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cuda/dsa_common.cuh"
#include "kernels/cuda/dsa_exact.cuh"
#include "kernels/cuda/dsa_index_wgmma.cuh"

namespace kestrel::cuda::dsa {
namespace {

constexpr int kD = kIndexHeadDim;
constexpr int kThreads = 128;                    // one warpgroup
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 64;                        // query rows per CTA: the wgmma M
constexpr int kKeys = 64;                        // keys per tile: the wgmma N
constexpr int kSteps = kD / 32;                  // k32 steps per dot
constexpr int kStages = 4;                       // cp.async ring: 3 tiles in flight while one is multiplied
constexpr int kTileBytes = kKeys * kD;           // 8 KB of codes per tile
constexpr int kStepBytes = kTileBytes / kSteps;  // one k32 step of a tile: 8 key groups x 2 core matrices
constexpr int kCoreBytes = 128;                  // core matrix: 8 keys x 16 bytes
constexpr int kGroupBytes = 2 * kCoreBytes;      // the two k halves of one 8-key group
static_assert(kStepBytes == (kKeys / 8) * kGroupBytes);
static_assert(kKeys * 8 == 4 * kThreads);  // 16-byte pieces per tile: four per thread

struct Smem {
  alignas(128) uint8_t codes[kStages][kTileBytes];  // B operands, in piece_offset order
  float scale[kStages][kKeys];
  int knan[kStages][kKeys];     // the key has a NaN code
  alignas(16) float red[kWarps][kKeys];  // per warp: its 16 rows' sum for each key
  int qnan[kRows / 32];         // per query token of the group
};

// The wgmma code exists only in the sm_90a machine code (and the host pass): the compute_90 PTX that the build also
// embeds gets a kernel that traps, and index_scores_decode takes this kernel only on compute capability 9.0.
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KESTREL_DSA_FP8_WGMMA 1

constexpr int kAcc = kKeys / 2;  // fp32 accumulators per thread (m64n64)

// d (64 x 64 fp32) = (scale_d ? d : 0) + A B, A = 64 x 32 e4m3 from registers, B = 32 x 64 e4m3, K-major
// (descriptor). The 8-bit operand layouts are those of the s8 form (dsa_index_wgmma.cuh: A fragment as mma.sync
// m16n8k32's per warp, B core matrices of 8 rows x 16 bytes; PTX ISA, wgmma "Register Fragments and Shared Memory
// Matrix Layouts", .e4m3/.s8 share them); accumulator register 4i + e: row 16w + g + 8 (e / 2), column 8i + 2t + (e % 2).
__device__ __forceinline__ void wgmma_m64n64k32_e4m3_rs(float (&d)[kAcc], const uint32_t (&a)[4], uint64_t desc_b,
                                                        int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// Byte offset of piece p (codes 16p .. 16p+15) of key n in a tile: k32 step p / 2, key group n / 8, k half p % 2,
// row n % 8.
__device__ __forceinline__ int piece_offset(int n, int p) {
  return (p >> 1) * kStepBytes + (n >> 3) * kGroupBytes + (p & 1) * kCoreBytes + (n & 7) * 16;
}

// Thread tid copies pieces pq and pq + 4 of keys k0 and k0 + 32, k0 = 8 (tid / 32) + tid % 8, pq = (tid / 8) % 4:
// eight neighbouring lanes handle one piece of eight keys, 128 contiguous bytes of the tile (conflict-free), and a
// warp reads 64 contiguous bytes of each of its keys per instruction. Lanes with pq = 0 copy the keys' scales.
struct Piece {
  int key, pq;
};
__device__ __forceinline__ Piece my_piece() {
  const int tid = threadIdx.x;
  return {8 * (tid >> 5) + (tid & 7), (tid >> 3) & 3};
}

// Copies tile `tile` into stage `st`; positions from ctx on are zero-filled (scale 0, never written out).
__device__ __forceinline__ void issue_tile(Smem& sm, const ScoreParams& p, int req, int ctx, int tile, int st) {
  const Piece pc = my_piece();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = pc.key + 32 * half;
    const int pos = tile * kKeys + key;
    const bool ok = pos < ctx;
    const uint8_t* page = p.pages.base;
    if (ok) page += int64_t{p.bt.pages[int64_t{req} * p.bt.stride + page_index(p.pages, pos)]} * p.pages.page_stride;
    const int row = pos & (p.pages.page_size - 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int part = pc.pq + 4 * h;
      cp_async_16(&sm.codes[st][piece_offset(key, part)], ok ? page + int64_t{row} * kD + 16 * part : page,
                  ok ? 16 : 0);
    }
    if (pc.pq == 0)
      cp_async_4(&sm.scale[st][key], ok ? page + int64_t{p.pages.page_size} * kD + 4 * row : page, ok ? 4 : 0);
  }
}

// NaN flags of stage st's keys from the pieces this thread copied (its own cp.async wait suffices); the caller
// synchronises before they are read.
__device__ __forceinline__ void flag_nan_keys(Smem& sm, int st) {
  const Piece pc = my_piece();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = pc.key + 32 * half;
    bool nan = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 v = *reinterpret_cast<const uint4*>(&sm.codes[st][piece_offset(key, pc.pq + 4 * h)]);
      nan = nan | has_e4m3_nan(v.x) | has_e4m3_nan(v.y) | has_e4m3_nan(v.z) | has_e4m3_nan(v.w);
    }
    // Lanes r, r + 8, r + 16, r + 24 hold the four piece pairs of the warp's key r.
    const uint32_t nan_lanes = __ballot_sync(0xFFFFFFFFu, nan);
    if (pc.pq == 0) sm.knan[st][key] = (nan_lanes >> (threadIdx.x & 7)) & 0x01010101u;
  }
}

#endif  // wgmma code

__global__ void __launch_bounds__(kThreads, 4) index_scores_fp8_wgmma_kernel(ScoreParams p) {
#ifdef KESTREL_DSA_FP8_WGMMA
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int req = blockIdx.y;
  const int row0 = static_cast<int>(blockIdx.z) * kRows;  // first row of the group in the request
  const int rows = min(kRows, p.n_q * p.heads - row0);    // 32 or 64: H_I is 32 or 64
  const int token0 = row0 / p.heads, tokens = rows / p.heads;
  const int ctx = min(p.ctx_lens[req], p.max_ctx);
  const int n_tiles = (ctx + kKeys - 1) / kKeys;
  const int t_begin = blockIdx.x * p.tiles_per_split, t_end = min(n_tiles, t_begin + p.tiles_per_split);
  if (t_begin >= t_end) return;
  const int n = t_end - t_begin;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n) issue_tile(sm, p, req, ctx, t_begin + s, s);
    cp_async_commit();
  }

  if (tid < kRows / 32) sm.qnan[tid] = 0;
  __syncthreads();

  // A: rows 16 warp + g (half 0) and + 8 (half 1) of the group; register half + 2c of k-step s holds the row's
  // codes 32 s + 16 c + 4 tq .. + 3. Rows past the group are zero with weight 0.
  uint32_t qa[kSteps][4];
  float w_row[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 16 * warp + g + 8 * half;
    w_row[half] = 0.0f;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) qa[s][half] = qa[s][half + 2] = 0;
    if (row < rows) {
      const int64_t qrow = int64_t{req} * p.n_q * p.heads + row0 + row;
      const uint8_t* q = p.q + qrow * kD + 4 * tq;
      bool nan = false;
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          qa[s][half + 2 * c] = *reinterpret_cast<const uint32_t*>(q + 32 * s + 16 * c);
          nan = nan | has_e4m3_nan(qa[s][half + 2 * c]);
        }
      w_row[half] = p.w[qrow];
      if (nan) atomicOr(&sm.qnan[row / p.heads], 1);
    }
  }
  const int token_pos0 = p.ctx_lens[req] - p.n_q + token0;  // position of the group's first query token

#pragma unroll 1
  for (int i = 0; i < n; ++i) {
    const int tile = t_begin + i, st = i % kStages;
    cp_async_wait<kStages - 2>();  // tile i (this thread's pieces); later tiles may still be in flight
    flag_nan_keys(sm, st);
    fence_proxy_async_smem();
    // Tile i, its flags and scales are complete and visible to the wgmmas; every thread is done with iteration
    // i - 1 (its stage, refilled below, and the reduction buffer).
    __syncthreads();
    if (i + kStages - 1 < n) issue_tile(sm, p, req, ctx, tile + kStages - 1, (i + kStages - 1) % kStages);
    cp_async_commit();

    float acc[kAcc];
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const uint64_t desc = smem_desc_interleave(&sm.codes[st][s * kStepBytes], kCoreBytes, kGroupBytes);
      wgmma_m64n64k32_e4m3_rs(acc, qa[s], desc, s > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int r = 0; r < kAcc; ++r) fence_operand(acc[r]);

    // part[2 c + e]: key 8 c + 2 tq + e, this thread's rows (16 warp + g and + 8) summed.
    float part[kKeys / 4];
#pragma unroll
    for (int c = 0; c < kKeys / 8; ++c)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        part[2 * c + e] = w_row[0] * fmaxf(acc[4 * c + e], 0.0f) + w_row[1] * fmaxf(acc[4 * c + 2 + e], 0.0f);
    // Butterfly over the 8 lanes of a key column (lane bits 4, 3, 2 = g bits 2, 1, 0): each step keeps half of the
    // values and adds the partner's copy of them; lane g ends with part indices 2 g and 2 g + 1, keys 8 g + 2 tq
    // + {0, 1} = 2 lane + {0, 1}.
    const bool b2 = g & 4, b1 = g & 2, b0 = g & 1;
    float x8[8], x4[4], x2[2];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      x8[j] = (b2 ? part[8 + j] : part[j]) + __shfl_xor_sync(0xFFFFFFFFu, b2 ? part[j] : part[8 + j], 16);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      x4[j] = (b1 ? x8[4 + j] : x8[j]) + __shfl_xor_sync(0xFFFFFFFFu, b1 ? x8[j] : x8[4 + j], 8);
#pragma unroll
    for (int j = 0; j < 2; ++j)
      x2[j] = (b0 ? x4[2 + j] : x4[j]) + __shfl_xor_sync(0xFFFFFFFFu, b0 ? x4[j] : x4[2 + j], 4);
    *reinterpret_cast<float2*>(&sm.red[warp][2 * lane]) = make_float2(x2[0], x2[1]);
    __syncthreads();

    // Thread (token tl, key): the token's warps (all four for H_I = 64, warps 2 tl and 2 tl + 1 for H_I = 32).
    const int key = tid % kKeys, tl = tid / kKeys;
    const int pos = tile * kKeys + key;
    if (tl < tokens && pos < ctx) {
      const float sum = p.heads == 64 ? (sm.red[0][key] + sm.red[1][key]) + (sm.red[2][key] + sm.red[3][key])
                                      : sm.red[2 * tl][key] + sm.red[2 * tl + 1][key];
      float score = sm.scale[st][key] * sum;
      if (sm.knan[st][key] || sm.qnan[tl]) score = __uint_as_float(0x7FC00000u);
      if (pos > token_pos0 + tl) score = -INFINITY;
      p.scores[(int64_t{req} * p.n_q + token0 + tl) * p.stride + pos] = score;
    }
  }
#else
  __trap();
#endif
}

}  // namespace

void launch_index_scores_fp8_wgmma(const IndexQueries& queries, const Pages& pages, const BlockTable& block_table,
                                   const int32_t* ctx_lens, int max_ctx_len, float* scores, int64_t score_stride,
                                   cudaStream_t stream) {
  constexpr size_t smem = sizeof(Smem);
  static DeviceCache resident;
  const int per_sm = resident.get([] {
    return prepare_kernel(index_scores_fp8_wgmma_kernel, kThreads, smem, "index_scores_fp8_wgmma_kernel");
  });
  ScoreParams p{queries.codes, queries.weights, queries.n_q, queries.heads, pages, block_table, ctx_lens, max_ctx_len,
                scores,        score_stride,    0};
  const int groups = (queries.n_q * queries.heads + kRows - 1) / kRows;
  const int tiles = (max_ctx_len + kKeys - 1) / kKeys;
  const dim3 grid = one_wave_grid(p, queries.batch, groups, tiles, tiles, per_sm);
  index_scores_fp8_wgmma_kernel<<<grid, kThreads, smem, stream>>>(p);
}

}  // namespace kestrel::cuda::dsa
