// IndexScoreMode::exact on Hopper: the exact indexer scores of dsa_index.cu (same limbs, same int32 limb
// accumulators, same single-rounding combine, same ReLU, weight and in-order head sum; dsa_exact.cuh) with the nine
// limb products on warpgroup MMAs (wgmma m64n32k32, s8 x s8 -> s32) instead of mma.sync.
//
// CTA = one warpgroup (4 warps) for one request, one group of 64 query rows (64 / H_I tokens x H_I heads, token-major:
// the wgmma M) and a contiguous range of 32-key tiles (the wgmma N). The query limbs are the A operand, in
// registers for the whole kernel (3 limbs x 4 k32 steps x 4 registers). Per tile, each key's 128 codes become three
// limb planes of the B operand in shared memory, K-major without swizzle: the 16-byte piece p of key n (codes
// 16p .. 16p+15) sits at byte chunk_offset(n, p) of a 4 KB plane, i.e. k32 step s = p / 2 is a 1 KB block whose core
// matrices (8 keys x 16 bytes) are ordered (key group, k half). The raw codes arrive through a 3-stage cp.async
// ring in the same order, and every thread converts exactly the pieces it copied (no barrier between copy and
// conversion).
//
// Iteration i (tile i of the CTA's range), after one barrier:
//   issue the copy of tile i + 2; issue the 36 wgmmas of tile i (4 k-steps x 9 limb pairs, the pairs with equal
//   a + b chained into one of five accumulators of 16 registers); while they run, convert tile i + 1 into the other
//   limb buffer and add the heads of tile i - 1 in order (one thread per key and query token over the [key][row] term
//   tile); then wait for the wgmmas and write w_row * ReLU(dot) of tile i into its term tile.
// The conversion and the head sums of a tile overlap the MMAs of the next; the epilogue (the exact combine) does not,
// and other resident CTAs fill that gap.
#include "kernels/cuda/dsa_index_wgmma.h"

#include <algorithm>
#include <string>

#include "kernels/cuda/dsa_common.cuh"
#include "kernels/cuda/dsa_exact.cuh"
#include "kernels/cuda/dsa_index_wgmma.cuh"

namespace kestrel::cuda::dsa {
namespace {

constexpr int kD = kIndexHeadDim;
constexpr int kThreads = 128;                  // one warpgroup
constexpr int kRows = 64;                      // query rows per CTA: the wgmma M
constexpr int kKeys = 32;                      // keys per tile: the wgmma N
constexpr int kSteps = kD / 32;                // k32 steps per dot
constexpr int kStages = 3;                     // cp.async ring of code tiles
constexpr int kPlaneBytes = kKeys * kD;        // one tile of codes or of one limb
constexpr int kStepBytes = kPlaneBytes / kSteps;  // one k32 step of a plane: 4 key groups x 2 core matrices
constexpr int kCoreBytes = 128;                // 8 keys x 16 bytes
constexpr int kGroupBytes = 2 * kCoreBytes;    // the two k halves of one 8-key group
constexpr int kTermStride = kRows + 4;         // floats per key in the term tile (16-byte rows, conflict-free)
static_assert(kStepBytes == (kKeys / 8) * kGroupBytes);

struct Smem {
  alignas(128) uint8_t limbs[2][3][kPlaneBytes];  // B operands of the tile being multiplied and of the next one
  alignas(128) uint8_t raw[kStages][kPlaneBytes];  // codes, in the planes' order
  alignas(16) float terms[2][kKeys * kTermStride];  // w_row * ReLU(dot), [key][row], per tile parity
  uint32_t lut[256];                                // e4m3 code -> its three limbs as signed bytes 0..2
  float raw_scale[kStages][kKeys];
  float scale[3][kKeys];  // per tile mod 3: written one iteration before the tile's MMAs, read one after
  int knan[3][kKeys];
  int qnan[kRows / 32];  // per query token of the group
};

// The wgmma code exists only in the sm_90a machine code (and the host pass): the compute_90 PTX that the build also
// embeds gets a kernel that traps, and index_scores_decode takes this kernel only on compute capability 9.0.
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KESTREL_DSA_WGMMA 1

// Byte offset of piece p (codes 16p .. 16p+15) of key n in a plane: k32 step p / 2, key group n / 8, k half p % 2,
// row n % 8.
__device__ __forceinline__ int chunk_offset(int n, int p) {
  return (p >> 1) * kStepBytes + (n >> 3) * kGroupBytes + (p & 1) * kCoreBytes + (n & 7) * 16;
}

// Thread tid copies and converts pieces pq and pq + 4 of key 8 (tid / 32) + tid % 8, pq = (tid / 8) % 4: eight
// neighbouring lanes handle one piece of eight keys, 128 contiguous bytes of a plane (conflict-free), and a warp
// reads 64 contiguous bytes of each of its keys.
struct Piece {
  int key, pq;
};
__device__ __forceinline__ Piece my_piece() {
  const int tid = threadIdx.x;
  return {8 * (tid >> 5) + (tid & 7), (tid >> 3) & 3};
}

__device__ __forceinline__ void issue_tile(Smem& sm, const ScoreParams& p, int req, int ctx, int tile, int st) {
  const Piece pc = my_piece();
  const int pos = tile * kKeys + pc.key;
  const bool ok = pos < ctx;
  const uint8_t* page = p.pages.base;
  if (ok) page += int64_t{p.bt.pages[int64_t{req} * p.bt.stride + page_index(p.pages, pos)]} * p.pages.page_stride;
  const int row = pos & (p.pages.page_size - 1);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int part = pc.pq + 4 * h;
    cp_async_16(&sm.raw[st][chunk_offset(pc.key, part)], ok ? page + int64_t{row} * kD + 16 * part : page,
                ok ? 16 : 0);
  }
  if (pc.pq == 0)
    cp_async_4(&sm.raw_scale[st][pc.key], ok ? page + int64_t{p.pages.page_size} * kD + 4 * row : page, ok ? 4 : 0);
}

// Tile (relative index i, ring stage st) -> limb buffer i & 1, NaN flags and scales i % 3. Only this thread's own
// pieces, so its cp.async wait suffices; the caller fences for the wgmma reads and synchronises.
__device__ __forceinline__ void convert_tile(Smem& sm, int i, int st) {
  const Piece pc = my_piece();
  bool nan = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int off = chunk_offset(pc.key, pc.pq + 4 * h);
    const uint4 v = *reinterpret_cast<const uint4*>(&sm.raw[st][off]);
    nan = nan | has_e4m3_nan(v.x) | has_e4m3_nan(v.y) | has_e4m3_nan(v.z) | has_e4m3_nan(v.w);
    uint4 l[3];
    to_limbs(sm.lut, v, l);
#pragma unroll
    for (int b = 0; b < 3; ++b) *reinterpret_cast<uint4*>(&sm.limbs[i & 1][b][off]) = l[b];
  }
  // Lanes r, r + 8, r + 16, r + 24 hold the four piece pairs of the warp's key r.
  const uint32_t nan_lanes = __ballot_sync(0xFFFFFFFFu, nan);
  if (pc.pq == 0) {
    const int r = threadIdx.x & 7;
    sm.knan[i % 3][pc.key] = (nan_lanes >> r) & 0x01010101u;
    sm.scale[i % 3][pc.key] = sm.raw_scale[st][pc.key];
  }
  fence_proxy_async_smem();
}

// The in-order head sums of tile `tile` (relative index i): thread (token tl, key) adds its H terms j = 0..H-1.
__device__ __forceinline__ void head_sums(const Smem& sm, const ScoreParams& p, int req, int ctx, int token0, int tokens,
                                          int tile, int i) {
  const int tid = threadIdx.x;
  if (tid >= kKeys * tokens) return;
  const int tl = tid / kKeys, key = tid % kKeys;
  const int pos = tile * kKeys + key;
  if (pos >= ctx) return;
  const float* terms = &sm.terms[i & 1][key * kTermStride + tl * p.heads];
  const float acc = p.heads == 64 ? ordered_head_sum<64>(terms) : ordered_head_sum<32>(terms);
  const int token = token0 + tl;
  float score = __fmul_rn(sm.scale[i % 3][key], acc);
  if (sm.knan[i % 3][key] || sm.qnan[tl]) score = __uint_as_float(0x7FC00000u);
  if (pos > p.ctx_lens[req] - p.n_q + token) score = -INFINITY;
  p.scores[(int64_t{req} * p.n_q + token) * p.stride + pos] = score;
}

#endif  // wgmma code

__global__ void __launch_bounds__(kThreads, 3) index_scores_exact_wgmma_kernel(ScoreParams p) {
#ifdef KESTREL_DSA_WGMMA
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int req = blockIdx.y;
  const int row0 = static_cast<int>(blockIdx.z) * kRows;          // first row of the group in the request
  const int rows = min(kRows, p.n_q * p.heads - row0);            // 32 or 64: H_I is 32 or 64
  const int token0 = row0 / p.heads, tokens = rows / p.heads;
  const int ctx = min(p.ctx_lens[req], p.max_ctx);
  const int n_tiles = (ctx + kKeys - 1) / kKeys;
  const int t_begin = blockIdx.x * p.tiles_per_split, t_end = min(n_tiles, t_begin + p.tiles_per_split);
  if (t_begin >= t_end) return;
  const int n = t_end - t_begin;

  issue_tile(sm, p, req, ctx, t_begin, 0);
  cp_async_commit();
  if (n > 1) issue_tile(sm, p, req, ctx, t_begin + 1, 1);
  cp_async_commit();

  for (int c = tid; c < 256; c += kThreads) sm.lut[c] = limb_entry(c);
  if (tid < kRows / 32) sm.qnan[tid] = 0;
  __syncthreads();

  // A: rows 16 warp + g (half 0) and + 8 (half 1) of the group; register half + 2c of k-step s holds the row's
  // codes 32 s + 16 c + 4 tq .. + 3, as limbs. Rows past the group are zero (their terms are never read).
  uint32_t qa[3][kSteps][4];
  float w_row[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 16 * warp + g + 8 * half;
    uint32_t words[kSteps][2] = {};
    w_row[half] = 0.0f;
    if (row < rows) {
      const int64_t qrow = int64_t{req} * p.n_q * p.heads + row0 + row;
      const uint8_t* q = p.q + qrow * kD + 4 * tq;
      bool nan = false;
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          words[s][c] = *reinterpret_cast<const uint32_t*>(q + 32 * s + 16 * c);
          nan = nan | has_e4m3_nan(words[s][c]);
        }
      w_row[half] = p.w[qrow];
      if (nan) atomicOr(&sm.qnan[row / p.heads], 1);
    }
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        to_limbs(sm.lut, words[s][c], qa[0][s][half + 2 * c], qa[1][s][half + 2 * c], qa[2][s][half + 2 * c]);
  }

  cp_async_wait<1>();
  convert_tile(sm, 0, 0);

#pragma unroll 1
  for (int i = 0; i < n; ++i) {
    const int tile = t_begin + i;
    // Tile i's limbs, tile i - 1's terms, flags and scales are complete; every thread is done with iteration i - 1.
    __syncthreads();
    if (i + 2 < n) issue_tile(sm, p, req, ctx, tile + 2, (i + 2) % kStages);
    cp_async_commit();

    // acc[a + b] = sum over limb pairs (a, b) of the k32-step products; the first product into each accumulator
    // (k-step 0, a = 0 or b = 2) starts it from zero.
    int32_t acc[5][16];
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
#pragma unroll
      for (int a = 0; a < 3; ++a)
#pragma unroll
        for (int b = 0; b < 3; ++b) {
          const uint64_t desc = smem_desc_interleave(&sm.limbs[i & 1][b][s * kStepBytes], kCoreBytes, kGroupBytes);
          wgmma_m64n32k32_s8_rs(acc[a + b], qa[a][s], desc, s > 0 || (a > 0 && b < 2));
        }
    wgmma_commit();

    if (i + 1 < n) {
      cp_async_wait<1>();  // tile i + 1 (this thread's pieces); tile i + 2 may still be in flight
      convert_tile(sm, i + 1, (i + 1) % kStages);
    }
    if (i > 0) head_sums(sm, p, req, ctx, token0, tokens, tile - 1, i - 1);

    wgmma_wait<0>();
#pragma unroll
    for (int k = 0; k < 5; ++k)
#pragma unroll
      for (int r = 0; r < 16; ++r) wgmma_fence_operand(acc[k][r]);
    // acc[.][4 c + e]: row 16 warp + g + 8 (e >> 1), key 8 c + 2 tq + (e & 1).
    float* terms = sm.terms[i & 1];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const int e = r & 3;
      const float dot = exact_dot(acc[0][r], acc[1][r], acc[2][r], acc[3][r], acc[4][r]);
      const float relu = dot > 0.0f ? dot : 0.0f;
      terms[(8 * (r >> 2) + 2 * tq + (e & 1)) * kTermStride + 16 * warp + g + 8 * (e >> 1)] =
          __fmul_rn(w_row[e >> 1], relu);
    }
  }
  __syncthreads();
  head_sums(sm, p, req, ctx, token0, tokens, t_end - 1, n - 1);
#else
  __trap();
#endif
}

}  // namespace

bool exact_wgmma_available() { return device_is_sm90(); }

void launch_index_scores_exact_wgmma(const IndexQueries& queries, const Pages& pages, const BlockTable& block_table,
                                     const int32_t* ctx_lens, int max_ctx_len, float* scores, int64_t score_stride,
                                     cudaStream_t stream) {
  constexpr size_t smem = sizeof(Smem);
  static DeviceCache resident;
  const int per_sm = resident.get([] {
    return prepare_kernel(index_scores_exact_wgmma_kernel, kThreads, smem, "index_scores_exact_wgmma_kernel");
  });
  ScoreParams p{queries.codes, queries.weights, queries.n_q, queries.heads, pages, block_table, ctx_lens, max_ctx_len,
                scores,        score_stride,    0};
  const int groups = (queries.n_q * queries.heads + kRows - 1) / kRows;
  const int tiles = (max_ctx_len + kKeys - 1) / kKeys;
  const dim3 grid = one_wave_grid(p, queries.batch, groups, tiles, tiles, per_sm);
  index_scores_exact_wgmma_kernel<<<grid, kThreads, smem, stream>>>(p);
}

}  // namespace kestrel::cuda::dsa
