// Dense MLA decode over the paged latent (absorbed form), flash-decoding on Hopper warpgroup MMAs (wgmma).
//
// CTA: 256 threads = two warpgroups, for 64 query rows of one request (row m = token i * heads + head h, so that
// one CTA covers all heads of a token when heads <= 64) and one split of the request's positions, walked in tiles
// of 32 positions. Every latent byte of a split is read once per CTA; with more than 64 rows the CTAs of the other
// row groups of the same split are launched next to it and read the same tiles, mostly from L2.
//
// The two warpgroups split the work of a tile (32 positions) without sharing operand data:
//  - scores: each computes a partial S (64 x 32, fp32) = Q K^T over its own 64-value blocks of the 576 dims
//    (WG 0: dims 0..255, WG 1: dims 256..575), wgmma m64n32k16 with both operands in shared memory (Q as f16 or
//    bf16, the tile as the K-major B); the partial scores are exchanged through shared memory and added (IEEE
//    addition is commutative, so both warpgroups hold the same scores);
//  - values: each owns 256 of the 512 value columns: O (64 x 256, fp32, in registers) += P V, wgmma m64n256k16 with
//    P from registers (the score accumulators re-packed as the A fragment) and the tile as the MN-major B;
//  - operands: each thread copies (cp.async) and, for FP8, converts exactly to f16 the bytes of the blocks its own
//    warpgroup reads (its score dims and its value columns); FP8 rows arrive in a raw staging buffer two tiles
//    before their conversion, bf16 rows are copied straight into the operand buffer three tiles ahead.
// Iteration i issues O += P_i V_i and the scores of tile i + 1 back to back; once the value product is done, the
// buffer of tile i is refilled while the scores run (FP8: tile i + 2 converted from staging; bf16: the copies of
// tile i + 3 issued); then the softmax of tile i + 1 (masked past each row's causal limit, online, in the log2
// domain) rescales O and makes P_{i+1}. No wgmma is in flight across iterations (ptxas serialises the pipeline
// otherwise). The running maximum is raised only when a tile's maximum exceeds it by more than 8 (log2 units), so
// O is rescaled rarely; probabilities stay <= 2^8, exact to the final normalisation.
//
// Splits write their normalised output and lse to a workspace; a second kernel merges them by lse.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/cuda/dsa_common.cuh"
#include "kernels/cuda/mla_decode.h"
#include "kernels/cuda/mla_decode_wgmma.cuh"

namespace kestrel::cuda::mla {
namespace {

constexpr int kThreads = 256;
constexpr int kRows = 64;                 // query rows per CTA (the M of one wgmma)
constexpr int kTile = 32;                 // positions per tile
constexpr int kBlocks = kLatentDim / 64;  // 64-value column blocks of a row (128 bytes each at 16 bits)
constexpr int kQBlock = kRows * 128;      // bytes of one column block of Q
constexpr int kKBlock = kTile * 128;      // bytes of one column block of a tile
constexpr int kQBytes = kBlocks * kQBlock;
constexpr int kKBytes = kBlocks * kKBlock;
constexpr int kStageBytes = kTile * kLatentDim;  // one tile of raw FP8 rows
constexpr int kAddrSlots = 8;
[[maybe_unused]] constexpr float kInf = __builtin_huge_valf();  // used only by the sm_90a (wgmma) code path

// Shared memory, from a 1024-byte aligned base (the swizzle atoms of the operands must be aligned).
template <bool kFp8>
struct Layout {
  static constexpr int kOpBufs = kFp8 ? 2 : 3;  // operand tiles: FP8 double-buffered (+ staging), bf16 three deep
  static constexpr int q = 0;
  static constexpr int op = q + kQBytes;
  static constexpr int stage = op + kOpBufs * kKBytes;
  static constexpr int xch = stage + (kFp8 ? 2 * kStageBytes : 0);  // float4 [tile parity][warpgroup][4][128]
  static constexpr int addr = xch + 2 * 2 * 4 * 128 * 16;          // row pointers [slot][32]
  static constexpr int row_mult = addr + kAddrSlots * kTile * 8;    // [64] fp32
  static constexpr int bytes = row_mult + kRows * 4;
};

struct Params {
  const uint16_t* q;
  int n_q;
  int heads;
  int rows_per_req;  // n_q * heads
  const int32_t* ctx_lens;
  int max_ctx;
  Pages pages;
  int page_shift;  // log2(page_size)
  int row_bytes;
  BlockTable bt;
  float log2_scale;  // softmax_scale * kv_scale * log2(e)
  float out_scale;   // kv_scale
  int tiles_per_split;
  int splits;
  float* out;
  float* lse;
  float* part_o;    // [rows, splits, 512] when splits > 1
  float* part_lse;  // [rows, splits]
};

// The wgmma code exists only in the sm_90a machine code (and the host pass, which parses it): the compute_90 PTX that
// the build also embeds gets a kernel that traps, and mla_decode refuses devices other than compute capability 9.0.
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KESTREL_MLA_WGMMA 1

constexpr int kAddrAhead = 5;  // the row addresses of a tile are stored 5 tiles ahead of its use
constexpr float kRescaleSlack = 8.0f;

// Score k-steps (16 dims each) of warpgroup WG.
template <int WG>
constexpr int kStep0 = WG == 0 ? 0 : 16;
template <int WG>
constexpr int kStep1 = WG == 0 ? 16 : 36;

__device__ __forceinline__ void bar_sync_cta() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }
template <int WG>
__device__ __forceinline__ void bar_sync_warpgroup() {
  asm volatile("bar.sync %0, 128;\n" ::"n"(2 + WG) : "memory");
}

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | static_cast<uint32_t>(h.y) << 16;
}

template <bool kBf16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (kBf16) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&b);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }  // |e| <= 126

__device__ __forceinline__ const uint8_t* row_address(const Params& p, int page, int pos) {
  return p.pages.base + int64_t{page} * p.pages.page_stride + int64_t{pos & (p.pages.page_size - 1)} * p.row_bytes;
}

// Q rows row0 .. row0 + 63 of request req into shared memory in the swizzled K-major layout (rows past the
// request's rows are zero), and each row's score multiplier. FP8 latent: the bf16 query is converted to f16 times
// 2^e, e chosen per row so that its largest magnitude lands in [2^14, 2^15) (exact for every value above 2^-24 of
// f16's range, and never overflowing), and the multiplier carries 2^-e.
template <bool kFp8>
__device__ __forceinline__ void load_query(const Params& p, uint8_t* smem, int req, int row0) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint8_t* q_s = smem + Layout<kFp8>::q;
  float* row_mult = reinterpret_cast<float*>(smem + Layout<kFp8>::row_mult);
  constexpr int kChunks = kLatentDim / 8;  // 16-byte chunks of a bf16 row
#pragma unroll 1
  for (int rr = 0; rr < kRows / 8; ++rr) {
    const int m = warp * (kRows / 8) + rr;
    const bool valid = row0 + m < p.rows_per_req;
    const uint4* src = reinterpret_cast<const uint4*>(p.q + (int64_t{req} * p.rows_per_req + row0 + m) * kLatentDim);
    uint4 v[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const int c = lane + 32 * k;
      v[k] = valid && c < kChunks ? src[c] : make_uint4(0, 0, 0, 0);
    }
    int e = 0;
    if constexpr (kFp8) {
      float amax = 0.0f;
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        const uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          amax = fmaxf(amax, fabsf(__uint_as_float(w[i] << 16)));
          amax = fmaxf(amax, fabsf(__uint_as_float(w[i] & 0xFFFF0000u)));
        }
      }
#pragma unroll
      for (int s = 16; s > 0; s >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, s));
      if (amax > 0.0f && amax < kInf) {
        int x = 0;
        frexpf(amax, &x);
        e = min(96, max(-96, 15 - x));
      }
      const float scale = pow2(e);
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        const uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
        uint32_t h[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
          h[i] = pack2<false>(__uint_as_float(w[i] << 16) * scale, __uint_as_float(w[i] & 0xFFFF0000u) * scale);
        v[k] = make_uint4(h[0], h[1], h[2], h[3]);
      }
    }
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const int c = lane + 32 * k;
      if (c < kChunks)
        *reinterpret_cast<uint4*>(q_s + (c >> 3) * kQBlock + m * 128 + (((c & 7) ^ (m & 7)) << 4)) = v[k];
    }
    if (lane == 0) row_mult[m] = p.log2_scale * pow2(-e);
  }
  fence_proxy_async_smem();
}

// The tile loop of warpgroup WG (see the file comment). `tiles` tiles from tile t_begin of the request's positions.
template <bool kFp8, int WG>
__device__ __forceinline__ void attend(const Params& p, uint8_t* smem, int req, int split, int row0, int ctx,
                                       int t_begin, int tiles) {
  using L = Layout<kFp8>;
  constexpr bool kBf16 = !kFp8;
  // 16-byte chunks kC0 .. kC0 + kCpr - 1 of every row of a tile are loaded (and converted) by this warpgroup.
  constexpr int kCpr = kFp8 ? (WG == 0 ? 16 : 20) : (WG == 0 ? 32 : 40);
  constexpr int kC0 = kFp8 ? (WG == 0 ? 0 : 16) : (WG == 0 ? 0 : 32);
  constexpr int kPer = kCpr * kTile / 128;
  const int wt = threadIdx.x - 128 * WG;
  const int lane = threadIdx.x & 31, warp = wt >> 5, g = lane >> 2, tq = lane & 3;
  const uint8_t* q_s = smem + L::q;
  uint8_t* op_s = smem + L::op;
  uint8_t* stage_s = smem + L::stage;
  float4* xch = reinterpret_cast<float4*>(smem + L::xch);
  const uint8_t** addr = reinterpret_cast<const uint8_t**>(smem + L::addr);
  const float* row_mult = reinterpret_cast<const float*>(smem + L::row_mult);

  // Issues this warpgroup's copies of local tile `local` (always commits a group, empty past the last tile).
  auto issue = [&](int local) {
    if (local < tiles) {
      const uint8_t* const* rows = addr + (local % kAddrSlots) * kTile;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int u = wt + 128 * j, r = u / kCpr, c = kC0 + u % kCpr;
        const uint8_t* src = rows[r];
        uint8_t* dst;
        if constexpr (kFp8) {
          dst = stage_s + (local & 1) * kStageBytes + r * kLatentDim + c * 16;
        } else {
          dst = op_s + (local % L::kOpBufs) * kKBytes + (c >> 3) * kKBlock + r * 128 + (((c & 7) ^ (r & 7)) << 4);
        }
        dsa::cp_async_16(dst, src ? src + c * 16 : p.pages.base, src ? 16 : 0);
      }
    }
    dsa::cp_async_commit();
  };
  // FP8: converts this thread's chunks of local tile `local` from staging to f16 in its operand buffer.
  auto convert = [&](int local) {
    const uint8_t* st = stage_s + (local & 1) * kStageBytes;
    uint8_t* ob = op_s + (local % L::kOpBufs) * kKBytes;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int u = wt + 128 * j, r = u / kCpr, c = kC0 + u % kCpr;
      const uint4 v = *reinterpret_cast<const uint4*>(st + r * kLatentDim + c * 16);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
      uint32_t h[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        h[2 * i] = e4m3x2_to_f16x2(w[i] & 0xFFFFu);
        h[2 * i + 1] = e4m3x2_to_f16x2(w[i] >> 16);
      }
      // 16 codes = dims 16c .. 16c + 15 = f16 chunks 2c, 2c + 1 of the row. Threads of odd column blocks store
      // their second chunk first, so that the 8 threads of a store phase (4 chunks of 2 blocks) hit 8 bank groups.
      uint8_t* row = ob + (c >> 2) * kKBlock + r * 128;
      const int cc = (c & 3) * 2, sw = r & 7, second_first = (c >> 2) & 1;
      const uint4 lo = make_uint4(h[0], h[1], h[2], h[3]), hi = make_uint4(h[4], h[5], h[6], h[7]);
      *reinterpret_cast<uint4*>(row + (((cc + second_first) ^ sw) << 4)) = second_first ? hi : lo;
      *reinterpret_cast<uint4*>(row + (((cc + 1 - second_first) ^ sw) << 4)) = second_first ? lo : hi;
    }
  };

  // Operand tile t sits in buffer t % kOpBufs. FP8: raw tile t in staging slot t % 2, two tiles ahead of its
  // conversion; bf16: copied straight into its buffer three tiles ahead. Every step commits one cp.async group.
  issue(0);
  issue(1);
  if constexpr (kFp8) {
    dsa::cp_async_wait<1>();
    if (tiles > 0) convert(0);
    issue(2);
  } else {
    issue(2);
    dsa::cp_async_wait<2>();
  }
  fence_proxy_async_smem();
  bar_sync_warpgroup<WG>();

  // This thread's two rows (accumulator rows g and g + 8 of its warp) and their causal limits: the last position
  // each may attend to (rows past the request's rows get ctx - 1; they are never stored).
  const int r_lo = 16 * warp + g;
  int lim[2];
  float mult[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = row0 + r_lo + 8 * r;
    lim[r] = m < p.rows_per_req ? ctx - p.n_q + m / p.heads : ctx - 1;
    mult[r] = row_mult[r_lo + 8 * r];
  }

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float sc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) sc[i] = 0.0f;
  float m_run[2] = {-kInf, -kInf}, l_run[2] = {0.0f, 0.0f};
  uint32_t pa[2][4];  // P of the last softmax as the A fragments of its two 16-position k-steps

  // Partial scores of local tile `local` into sc (issued, not committed).
  auto scores = [&](int local) {
    const uint8_t* kb = op_s + (local % L::kOpBufs) * kKBytes;
#pragma unroll
    for (int ks = kStep0<WG>; ks < kStep1<WG>; ++ks) {
      const int b = ks >> 2, kk = ks & 3;
      wgmma_m64n32k16_ss<kBf16>(sc, smem_desc_sw128(q_s + b * kQBlock + kk * 32, 16, 1024),
                                smem_desc_sw128(kb + b * kKBlock + kk * 32, 16, 1024), ks != kStep0<WG>);
    }
  };
  // Warp 0 of WG 0 reads the page numbers of tile local + kAddrAhead before the waits and stores its row addresses
  // after the next barrier (a tile's addresses are written one barrier before any thread issues its copies).
  int ahead_pos = -1, ahead_page = 0;
  auto prefetch_page = [&](int local) {
    ahead_pos = -1;
    if (WG == 0 && warp == 0) {
      const int la = local + kAddrAhead, pos = (t_begin + la) * kTile + lane;
      if (la < tiles && pos < ctx) {
        ahead_pos = pos;
        ahead_page = p.bt.pages[int64_t{req} * p.bt.stride + (pos >> p.page_shift)];
      }
    }
  };
  // Full scores of local tile `local` (sc + the other warpgroup's part), masked, then the online softmax: P into
  // pa, the running max, sum and O rescaled. Needs the value product of the previous tile finished.
  auto softmax = [&](int local) {
    const int t = t_begin + local;
    float4* mine = xch + ((local & 1) * 2 + WG) * 4 * 128;
    const float4* theirs = xch + ((local & 1) * 2 + (1 - WG)) * 4 * 128;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      mine[k * 128 + wt] = make_float4(sc[4 * k], sc[4 * k + 1], sc[4 * k + 2], sc[4 * k + 3]);
    // Publishes the partial scores, and the operand tiles this warpgroup wrote since the last barrier.
    bar_sync_cta();
    if (WG == 0 && warp == 0)
      addr[((local + kAddrAhead) % kAddrSlots) * kTile + lane] =
          ahead_pos >= 0 ? row_address(p, ahead_page, ahead_pos) : nullptr;

    // x[4n + e]: row r_lo + 8 (e / 2), position t * 32 + 8n + 2 tq + (e % 2); scores in the log2 domain.
    float x[16];
    const bool masked = (t + 1) * kTile - 1 > ctx - p.n_q;
    float mx[2] = {-kInf, -kInf};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float4 a = theirs[k * 128 + wt];
      const float other[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int v = 4 * k + e, r = e >> 1;
        float s = (sc[v] + other[e]) * mult[r];
        if (masked && t * kTile + 8 * k + 2 * tq + (e & 1) > lim[r]) s = -kInf;
        x[v] = s;
        mx[r] = fmaxf(mx[r], s);
      }
    }
    mla::online_softmax_step(x, mx, m_run, l_run, pa, o, kRescaleSlack,
                             [](float lo, float hi) { return pack2<kBf16>(lo, hi); });
  };

  // Tile 0's scores, with tile 1's operand prepared meanwhile.
  if (tiles > 0) {
    prefetch_page(0);
    wgmma_fence();
    scores(0);
    wgmma_commit();
    dsa::cp_async_wait<1>();
    if constexpr (kFp8) {
      if (tiles > 1) convert(1);
      issue(3);
    }
    fence_proxy_async_smem();
    wgmma_wait<0>();
    softmax(0);
  }
  // Iteration i: O += P_i V_i and the scores of tile i + 1 are issued back to back; once the value product is done
  // its buffer takes tile i + 2 (FP8: converted) or i + 3 (bf16: copies issued) while the scores run; then the
  // softmax of tile i + 1. No wgmma is in flight across iterations.
#pragma unroll 1
  for (int i = 0; i < tiles; ++i) {
    const bool next = i + 1 < tiles;
    prefetch_page(i + 1);
    const uint8_t* kb = op_s + (i % L::kOpBufs) * kKBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
      wgmma_m64n256k16_rs_mn<kBf16>(o, pa[kk], smem_desc_sw128(kb + 4 * WG * kKBlock + kk * 16 * 128, kKBlock, 1024));
    wgmma_commit();
    if (next) {
      wgmma_fence();
      scores(i + 1);
      wgmma_commit();
      wgmma_wait<1>();  // the value product of tile i is done: its buffer may be refilled
    } else {
      wgmma_wait<0>();
    }
    if constexpr (kFp8) {
      dsa::cp_async_wait<1>();  // this thread's copies of tile i + 2
      if (i + 2 < tiles) convert(i + 2);
      issue(i + 4);
    } else {
      issue(i + 3);
      dsa::cp_async_wait<1>();  // this thread's copies of tile i + 2
    }
    fence_proxy_async_smem();
    wgmma_wait<0>();
    if (next) softmax(i + 1);
  }
  wgmma_wait<0>();
  dsa::cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xFFFFFFFFu, l, 1);
    l += __shfl_xor_sync(0xFFFFFFFFu, l, 2);
    const int m = row0 + r_lo + 8 * r;
    if (m >= p.rows_per_req) continue;
    const int64_t row = int64_t{req} * p.rows_per_req + m;
    const float inv = l > 0.0f ? p.out_scale / l : 0.0f;
    float* dst = p.splits == 1 ? p.out + row * kLatentValueDim
                               : p.part_o + (row * p.splits + split) * kLatentValueDim;
#pragma unroll
    for (int n = 0; n < 32; ++n)
      *reinterpret_cast<float2*>(dst + 256 * WG + 8 * n + 2 * tq) =
          make_float2(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
    if (WG == 0 && tq == 0) {
      const float lse = l > 0.0f ? (m_run[r] + log2f(l)) * 0.69314718055994531f : -kInf;
      if (p.splits == 1) {
        p.lse[row] = lse;
      } else {
        p.part_lse[row * p.splits + split] = lse;
      }
    }
  }
}

#endif  // wgmma code

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_kernel(const __grid_constant__ Params p) {
#ifdef KESTREL_MLA_WGMMA
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* smem = smem_raw + ((1024u - (raw & 1023u)) & 1023u);
  const int group = blockIdx.x, split = blockIdx.y, req = blockIdx.z;
  const int ctx = min(p.ctx_lens[req], p.max_ctx);
  const int n_tiles = ctx > 0 ? (ctx + kTile - 1) / kTile : 0;
  const int t_begin = split * p.tiles_per_split;
  const int tiles = max(0, min(n_tiles - t_begin, p.tiles_per_split));
  const int row0 = group * kRows;

  if (threadIdx.x < 32) {
    const uint8_t** addr = reinterpret_cast<const uint8_t**>(smem + Layout<kFp8>::addr);
    for (int la = 0; la < kAddrAhead; ++la) {
      const int pos = (t_begin + la) * kTile + threadIdx.x;
      const uint8_t* a = nullptr;
      if (la < tiles && pos < ctx)
        a = row_address(p, p.bt.pages[int64_t{req} * p.bt.stride + (pos >> p.page_shift)], pos);
      addr[la * kTile + threadIdx.x] = a;
    }
  }
  load_query<kFp8>(p, smem, req, row0);
  __syncthreads();
  if (threadIdx.x < 128) {
    attend<kFp8, 0>(p, smem, req, split, row0, ctx, t_begin, tiles);
  } else {
    attend<kFp8, 1>(p, smem, req, split, row0, ctx, t_begin, tiles);
  }
#else
  // wgmma exists only in sm_90a machine code; mla_decode refuses every other device before launching.
  __trap();
#endif
}

struct Plan {
  int groups;  // CTAs of 64 rows per request
  int splits;
  int tiles_per_split;
};

// The split count that minimises (waves of CTAs) x (tiles per split + a fixed cost per split: the query load, the
// pipeline start and the partial output it writes and the merge reads back), on one resident CTA per
// multiprocessor; ties go to fewer splits. Only the smallest split count of each tiles-per-split value is a
// candidate (larger ones give the same splits), so the search visits O(sqrt(tiles)) counts, up to 4096 splits.
constexpr int kSplitCostTiles = 8;

Plan make_plan(int batch, int n_q, int heads, int max_ctx_len) {
  Plan plan{};
  plan.groups = (n_q * heads + kRows - 1) / kRows;
  const int n_tiles = (max_ctx_len + kTile - 1) / kTile;
  const int64_t base = int64_t{batch} * plan.groups;
  const int sms = dsa::device_sm_count();
  int64_t best_cost = -1;
  plan.splits = 1;
  for (int s = 1; s <= std::min(n_tiles, 4096);) {
    const int per = (n_tiles + s - 1) / s;
    const int64_t waves = (base * s + sms - 1) / sms;
    const int64_t cost = waves * (per + kSplitCostTiles);
    if (best_cost < 0 || cost < best_cost) {
      best_cost = cost;
      plan.splits = s;
    }
    if (per == 1) break;
    s = (n_tiles + per - 2) / (per - 1);  // the smallest split count with fewer tiles per split
  }
  plan.tiles_per_split = (n_tiles + plan.splits - 1) / plan.splits;
  return plan;
}

size_t workspace_bytes(const Plan& plan, int batch, int n_q, int heads) {
  if (plan.splits == 1) return 0;
  return static_cast<size_t>(batch) * n_q * heads * plan.splits * (kLatentValueDim + 1) * sizeof(float);
}

void check_shapes(int batch, int n_q, int heads, int max_ctx_len, const char* fn) {
  dsa::require(batch >= 0 && batch <= 65535 && n_q >= 1 && heads >= 1 && int64_t{n_q} * heads <= (1 << 20) &&
                   max_ctx_len >= 1,
               std::string(fn) + ": need 0 <= batch <= 65535, n_q >= 1, heads >= 1, n_q * heads <= 2^20 and " +
                   "max_ctx_len >= 1, got batch " + std::to_string(batch) + ", n_q " + std::to_string(n_q) +
                   ", heads " + std::to_string(heads) + ", max_ctx_len " + std::to_string(max_ctx_len));
}

template <bool kFp8>
void launch(const Params& p, const Plan& plan, int batch, cudaStream_t stream) {
  const int smem = Layout<kFp8>::bytes + 1024;
  static dsa::DeviceCache prepared;  // once per device: the architecture check and the shared-memory attribute
  prepared.get([smem] {
    int device = 0, major = 0, minor = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
    dsa::require(major == 9 && minor == 0, "mla_decode: needs a compute capability 9.0 GPU (Hopper, sm_90a wgmma), got " +
                                               std::to_string(major) + "." + std::to_string(minor));
    check(cudaFuncSetAttribute(mla_decode_kernel<kFp8>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
          "cudaFuncSetAttribute(mla_decode_kernel)");
    return 1;
  });
  const dim3 grid(plan.groups, plan.splits, batch);
  mla_decode_kernel<kFp8><<<grid, kThreads, smem, stream>>>(p);
  check(cudaGetLastError(), "mla_decode kernel launch");
}

}  // namespace
}  // namespace kestrel::cuda::mla

namespace kestrel::cuda {

size_t mla_decode_workspace_bytes(int batch, int n_q, int heads, int max_ctx_len) {
  mla::check_shapes(batch, n_q, heads, max_ctx_len, "mla_decode_workspace_bytes");
  if (batch == 0) return 0;
  return mla::workspace_bytes(mla::make_plan(batch, n_q, heads, max_ctx_len), batch, n_q, heads);
}

void mla_decode(const MlaDecodeArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  using dsa::require;
  mla::check_shapes(a.batch, a.n_q, a.heads, a.max_ctx_len, "mla_decode");
  dsa::check_pages(a.latent_pages, "mla_decode");
  if (a.batch == 0) return;
  require(a.q_abs && a.ctx_lens && a.block_table.pages && a.out && a.lse,
          "mla_decode: a device pointer is missing");
  require(reinterpret_cast<uintptr_t>(a.q_abs) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 8 == 0 &&
              reinterpret_cast<uintptr_t>(a.latent_pages.base) % 16 == 0,
          "mla_decode: q_abs and the latent pages must be 16-byte aligned, out 8-byte aligned");
  require(a.latent_dtype == LatentDtype::fp8_e4m3 || a.latent_dtype == LatentDtype::bf16,
          "mla_decode: unknown latent dtype");
  require(int64_t{a.latent_pages.page_size} * latent_row_bytes(a.latent_dtype) <= a.latent_pages.page_stride,
          "mla_decode: a page of " + std::to_string(a.latent_pages.page_size) + " rows of " +
              std::to_string(latent_row_bytes(a.latent_dtype)) + " bytes does not fit its stride of " +
              std::to_string(a.latent_pages.page_stride) + " bytes");
  require(std::isfinite(a.kv_scale) && a.kv_scale > 0.0f && std::isfinite(a.softmax_scale),
          "mla_decode: kv_scale must be finite and > 0 and softmax_scale finite");
  const mla::Plan plan = mla::make_plan(a.batch, a.n_q, a.heads, a.max_ctx_len);
  const size_t need = mla::workspace_bytes(plan, a.batch, a.n_q, a.heads);
  require(workspace_bytes >= need && (need == 0 || workspace != nullptr),
          "mla_decode: workspace of " + std::to_string(workspace_bytes) + " bytes, need " + std::to_string(need));

  mla::Params p{};
  p.q = a.q_abs;
  p.n_q = a.n_q;
  p.heads = a.heads;
  p.rows_per_req = a.n_q * a.heads;
  p.ctx_lens = a.ctx_lens;
  p.max_ctx = a.max_ctx_len;
  p.pages = a.latent_pages;
  p.page_shift = 0;
  while ((1 << p.page_shift) < a.latent_pages.page_size) ++p.page_shift;
  p.row_bytes = latent_row_bytes(a.latent_dtype);
  p.bt = a.block_table;
  p.log2_scale = static_cast<float>(double{a.softmax_scale} * a.kv_scale * 1.4426950408889634);
  p.out_scale = a.kv_scale;
  p.tiles_per_split = plan.tiles_per_split;
  p.splits = plan.splits;
  p.out = a.out;
  p.lse = a.lse;
  const int64_t rows = int64_t{a.batch} * p.rows_per_req;
  if (plan.splits > 1) {
    p.part_o = static_cast<float*>(workspace);
    p.part_lse = p.part_o + rows * plan.splits * kLatentValueDim;
  }
  if (a.latent_dtype == LatentDtype::fp8_e4m3) {
    mla::launch<true>(p, plan, a.batch, stream);
  } else {
    mla::launch<false>(p, plan, a.batch, stream);
  }
  if (plan.splits > 1) {
    dsa::launch_split_combine(p.part_o, p.part_lse, plan.splits, rows, a.out, a.lse, stream,
                              "mla_decode combine kernel launch");
  }
}

}  // namespace kestrel::cuda
