// Sparse MLA decode over an FP8 or bf16 latent on Hopper warpgroup MMAs (wgmma, sm_90a): the kernel
// sparse_mla_decode runs on a compute capability 9.0 GPU. Same contract as the mma.sync kernel in dsa_mla.cu (dsa.h):
// bf16 products of the exact bf16 query and the exactly decoded latent values, fp32 accumulation, P rounded to bf16
// for the value product, the normaliser summing the unrounded P.
//
// CTA: 256 threads = two warpgroups, for 64 heads of one query row (rows past the row's heads are zero queries,
// never stored) and one split of the row's index list, walked in tiles of 32 indices. With H = 128 two CTAs of the
// same row gather the same latent rows (the second mostly from L2). The warpgroups split a tile's work without
// sharing operand data, as the dense MLA decode (mla_decode.cu) does:
//  - scores: each computes a partial S (64 x 32, fp32) = Q K^T over its own 64-value column blocks of the 576
//    dims (WG 0: dims 0..255, WG 1: 256..575), wgmma m64n32k16 with Q (bf16, loaded once) and the tile (bf16, the
//    K-major B) in shared memory; the two partials are exchanged through shared memory and added (IEEE addition
//    commutes, so both warpgroups hold the same scores);
//  - values: each owns 256 of the 512 value columns, O (64 x 256, fp32) in registers += P V, wgmma m64n256k16 with
//    P from registers (the score accumulators re-packed as the A fragment) and the tile as the MN-major B;
//  - operands: each warpgroup copies (cp.async, 16-byte pieces, zero-filled for a skipped index) the bytes of the
//    latent rows it needs into a raw staging buffer, two tiles before converting them to bf16 in its own column
//    blocks of the operand tile (128-byte swizzle). Kimi: the codes (exact; kv_scale multiplies the fp32 scores
//    and outputs); deepseek_v32: fp32(code * tile scale) rounded to bf16 (exact for the writer's power-of-two
//    scales) and the bf16 tail copied. deepseek_v32's tile scales sit in one 16-byte piece that both warpgroups
//    need: each copies it into a place of its own, so a warpgroup only ever waits for itself (named barriers of
//    128 threads around its conversion; the CTA-wide barrier is the score exchange). bf16 entries need no
//    conversion: as in the dense kernel's bf16 path, each warpgroup copies its chunks of a row straight into their
//    swizzled places in one of three operand tiles, three tiles ahead (the staging buffer would not fit beside them).
// The row addresses of a tile (index -> block table -> page -> row; nullptr for an index < 0 or >= ctx_lens[r])
// are computed by warp 0 five tiles ahead: the index is loaded one tile before its page number, and the address is
// stored after the next CTA barrier, so neither load stalls the warpgroup. A skipped index has a zero row and a
// -inf score.
// Iteration i issues O += P_i V_i and the scores of tile i + 1 back to back; once the value product is done, tile
// i + 2 is converted into its buffer (bf16: the copies of tile i + 3 issued into it) while the scores run; then the
// softmax of tile i + 1 (online, in the log2 domain). No wgmma is in flight across iterations.
// The running maximum is raised whenever a tile's exceeds it, as in the mma.sync kernel, so the largest score of a
// split always gets P = 1, exact in bf16. A lazy maximum (raised only past a slack of 8, to rescale O rarely) made
// that probability 2^d, 0 < d <= 8, rounded to bf16 (up to 2^-9 relative): with a peaked softmax that is an error of
// up to 2^-9 of the dominant value in the output, in every split whose maximum is not in its first tile (measured on
// the H200: 2-10x the mma.sync kernel's largest error, only in cases of several tiles per CTA).
//
// Splits write their normalised output and lse to a workspace that dsa_mla.cu's combine kernel merges.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/cuda/dsa_common.cuh"
#include "kernels/cuda/dsa_mla_wgmma.h"
#include "kernels/cuda/mla_decode_wgmma.cuh"

namespace kestrel::cuda::dsa {
namespace {

constexpr int kThreads = 256;
constexpr int kHeads = 64;                // heads per CTA (the M of one wgmma)
constexpr int kTile = 32;                 // indices per tile, as the mma.sync kernel's split counts them
constexpr int kBlocks = kLatentDim / 64;  // 64-value column blocks of a row (128 bytes each in bf16)
constexpr int kQBlock = kHeads * 128;     // bytes of one column block of Q
constexpr int kKBlock = kTile * 128;      // bytes of one column block of a tile
constexpr int kQBytes = kBlocks * kQBlock;
constexpr int kKBytes = kBlocks * kKBlock;
constexpr int kAddrSlots = 8;
constexpr int kXchBytes = 2 * 2 * 4 * 128 * 16;  // float4 [tile parity][warpgroup][4][128]

// deepseek_v32's entry: codes in 16-byte pieces 0-31 (4 tiles of 128), the 4 fp32 scales in piece 32, the 64 bf16
// tail values in pieces 33-40.
constexpr int kV32ScaleOffset = kLatentValueDim;
constexpr int kV32TailOffset = kV32ScaleOffset + 16;
static_assert(kV32TailOffset + (kLatentDim - kLatentValueDim) * 2 == kV32LatentEntryBytes);

// Shared memory, from a 1024-byte aligned base (the swizzle atoms of the operands must be aligned). A staged
// deepseek_v32 row has 16 bytes more than the entry: warpgroup 0's copy of the scales. bf16 entries have three
// operand tiles and no staging.
template <SparseMlaEntry kEntry>
struct Layout {
  static constexpr bool kV32 = kEntry == SparseMlaEntry::v32_fp8;
  static constexpr int kOpBufs = kEntry == SparseMlaEntry::bf16 ? 3 : 2;
  static constexpr int kStageRow = kV32 ? kV32LatentEntryBytes + 16 : kLatentDim;
  static constexpr int kStageBytes = kEntry == SparseMlaEntry::bf16 ? 0 : kTile * kStageRow;
  static constexpr int q = 0;
  static constexpr int op = q + kQBytes;  // the operand tiles
  static constexpr int stage = op + kOpBufs * kKBytes;
  static constexpr int xch = stage + 2 * kStageBytes;
  static constexpr int addr = xch + kXchBytes;  // row pointers [kAddrSlots][32]
  static constexpr int bytes = addr + kAddrSlots * kTile * 8;
};
static_assert(Layout<SparseMlaEntry::v32_fp8>::bytes + 1024 <= 227 * 1024 &&
                  Layout<SparseMlaEntry::bf16>::bytes + 1024 <= 227 * 1024,
              "one CTA per multiprocessor must fit");

struct Params {
  const uint16_t* q;
  int n_q;
  int heads;
  const int32_t* indices;
  int k;
  const int32_t* ctx_lens;
  Pages pages;
  int page_shift;  // log2(page_size)
  BlockTable bt;
  float log2_scale;  // softmax_scale * kv_scale * log2(e)
  float out_scale;   // kv_scale
  int tiles_per_split;
  int splits;
  float* out;
  float* lse;
  float* part_o;    // [rows * heads, splits, 512] when splits > 1
  float* part_lse;  // [rows * heads, splits]
};

// The wgmma code exists only in the sm_90a machine code (and the host pass, which parses it): the compute_90 PTX that
// the build also embeds gets a kernel that traps, and the launcher refuses devices other than compute capability 9.0.
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KESTREL_DSA_WGMMA 1

using mla::fence_proxy_async_smem;
using mla::smem_desc_sw128;
using mla::wgmma_commit;
using mla::wgmma_fence;
using mla::wgmma_m64n256k16_rs_mn;
using mla::wgmma_m64n32k16_ss;
using mla::wgmma_wait;

constexpr int kAddrAhead = 5;  // the row addresses of a tile are stored 5 tiles ahead of its use
constexpr float kInf = __builtin_huge_valf();
constexpr int kCodeChunksV32 = kLatentValueDim / 16;  // deepseek_v32's code pieces

// Score k-steps (16 dims each) of warpgroup WG: its column blocks 0-3 or 4-8.
template <int WG>
constexpr int kStep0 = WG == 0 ? 0 : 16;
template <int WG>
constexpr int kStep1 = WG == 0 ? 16 : 36;
// 16-byte pieces of a staged row that warpgroup WG copies (from piece kFirstPiece on; deepseek_v32's warpgroup 0
// also copies the scale piece, as its last), and the units it converts (a piece of 16 codes -> 16 bf16, or a
// deepseek_v32 tail piece of 8 bf16 values).
template <int WG>
constexpr int kFirstPiece = WG == 0 ? 0 : 16;
template <bool kV32, int WG>
constexpr int kCopyPieces = kV32 ? (WG == 0 ? 17 : 25) : (WG == 0 ? 16 : 20);
template <bool kV32, int WG>
constexpr int kConvertUnits = kV32 ? (WG == 0 ? 16 : 24) : (WG == 0 ? 16 : 20);
// bf16 entries: the 16-byte chunks kBf16Chunk0 .. + kBf16Chunks - 1 of a row (8 values each: chunk c is dims 8c ..
// 8c + 7, chunk c % 8 of column block c / 8) that warpgroup WG copies: its column blocks 0-3 or 4-8.
template <int WG>
constexpr int kBf16Chunk0 = WG == 0 ? 0 : 32;
template <int WG>
constexpr int kBf16Chunks = WG == 0 ? 32 : 40;
// Where warpgroup WG reads deepseek_v32's scales in a staged row.
template <int WG>
constexpr int kScaleAt = WG == 0 ? kV32LatentEntryBytes : kV32ScaleOffset;

__device__ __forceinline__ void bar_sync_cta() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }
template <int WG>
__device__ __forceinline__ void bar_sync_warpgroup() {
  asm volatile("bar.sync %0, 128;\n" ::"n"(2 + WG) : "memory");
}

// Index j of the row's list for tile `local` of the split, lane `lane` (-1 past the split or the list).
__device__ __forceinline__ int index_at(const Params& p, const int32_t* row_indices, int t_begin, int tiles, int local,
                                        int lane) {
  const int j = (t_begin + local) * kTile + lane;
  return local < tiles && j < p.k ? row_indices[j] : -1;
}

template <SparseMlaEntry kEntry>
__device__ __forceinline__ const uint8_t* row_address(const Params& p, int page, int pos) {
  constexpr int kEntryBytes = kEntry == SparseMlaEntry::v32_fp8 ? kV32LatentEntryBytes
                              : kEntry == SparseMlaEntry::bf16  ? kBf16LatentEntryBytes
                                                                : kLatentDim;
  return p.pages.base + int64_t{page} * p.pages.page_stride + int64_t{pos & (p.pages.page_size - 1)} * kEntryBytes;
}

// The 64 heads head0 .. head0 + 63 of query row `row` into shared memory in the swizzled K-major layout (heads past
// heads_here are zero).
__device__ __forceinline__ void load_query(const Params& p, uint8_t* q_s, int row, int head0, int heads_here) {
  constexpr int kChunks = kLatentDim / 8;  // 16-byte chunks of a bf16 row
  const uint4* src = reinterpret_cast<const uint4*>(p.q + (int64_t{row} * p.heads + head0) * kLatentDim);
#pragma unroll 2
  for (int u = threadIdx.x; u < kHeads * kChunks; u += kThreads) {
    const int m = u / kChunks, c = u % kChunks;
    const uint4 v = m < heads_here ? src[u] : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(q_s + (c >> 3) * kQBlock + m * 128 + (((c & 7) ^ (m & 7)) << 4)) = v;
  }
  fence_proxy_async_smem();
}

// The tile loop of warpgroup WG (see the file comment): `tiles` tiles from tile t_begin of query row `row`'s list.
// `pending` (warp 0 of WG 0): this lane's index of local tile kAddrAhead.
template <SparseMlaEntry kEntry, int WG>
__device__ __forceinline__ void attend(const Params& p, uint8_t* smem, int row, int head0, int heads_here, int split,
                                       int ctx, int t_begin, int tiles, int pending) {
  constexpr bool kV32 = kEntry == SparseMlaEntry::v32_fp8, kBf16 = kEntry == SparseMlaEntry::bf16;
  using L = Layout<kEntry>;
  constexpr int kCopy = kCopyPieces<kV32, WG>;
  constexpr int kUnits = kConvertUnits<kV32, WG>;
  const int wt = threadIdx.x - 128 * WG;
  const int lane = threadIdx.x & 31, warp = wt >> 5, tq = lane & 3;
  const uint8_t* q_s = smem + L::q;
  uint8_t* op_s = smem + L::op;
  uint8_t* stage_s = smem + L::stage;
  float4* xch = reinterpret_cast<float4*>(smem + L::xch);
  const uint8_t** addr = reinterpret_cast<const uint8_t**>(smem + L::addr);
  const int req = row / p.n_q;
  const int32_t* row_indices = p.indices + int64_t{row} * p.k;

  // Issues this warpgroup's copies of local tile `local` into staging slot local % 2 (bf16: straight into their
  // swizzled places in operand buffer local % 3); always commits a group, empty past the last tile.
  auto issue = [&](int local) {
    if (local < tiles) {
      const uint8_t* const* rows = addr + (local % kAddrSlots) * kTile;
      if constexpr (kBf16) {
        uint8_t* ob = op_s + (local % 3) * kKBytes;
        static_assert(kTile * kBf16Chunks<WG> % 128 == 0);
#pragma unroll
        for (int j = 0; j < kTile * kBf16Chunks<WG> / 128; ++j) {
          const int u = wt + 128 * j, r = u / kBf16Chunks<WG>, c = kBf16Chunk0<WG> + u % kBf16Chunks<WG>;
          const uint8_t* src = rows[r];
          cp_async_16(ob + (c >> 3) * kKBlock + r * 128 + (((c & 7) ^ (r & 7)) << 4),
                      src ? src + c * 16 : p.pages.base, src ? 16 : 0);
        }
      } else {
        uint8_t* st = stage_s + (local & 1) * L::kStageBytes;
#pragma unroll
        for (int j = 0; j < (kTile * kCopy + 127) / 128; ++j) {
          const int u = wt + 128 * j;
          if (kTile * kCopy % 128 != 0 && u >= kTile * kCopy) break;
          const int r = u / kCopy, c = u % kCopy;
          int src_off = (kFirstPiece<WG> + c) * 16, dst_off = src_off;
          if constexpr (kV32 && WG == 0) {
            if (c == kCopy - 1) {
              src_off = kV32ScaleOffset;
              dst_off = kScaleAt<0>;
            }
          }
          const uint8_t* src = rows[r];
          cp_async_16(st + r * L::kStageRow + dst_off, src ? src + src_off : p.pages.base, src ? 16 : 0);
        }
      }
    }
    cp_async_commit();
  };
  // Converts this warpgroup's part of local tile `local` from staging slot local % 2 to bf16 in operand buffer
  // local % 2. Needs every copy of the warpgroup for that tile landed (a warpgroup barrier after the waits).
  auto convert = [&](int local) {
    const uint8_t* st = stage_s + (local & 1) * L::kStageBytes;
    uint8_t* ob = op_s + (local & 1) * kKBytes;
    static_assert(kTile * kUnits % 128 == 0);
#pragma unroll
    for (int j = 0; j < kTile * kUnits / 128; ++j) {
      const int u = wt + 128 * j;
      const int r = u / kUnits, c = kFirstPiece<WG> + u % kUnits, sw = r & 7;
      const uint8_t* srow = st + r * L::kStageRow;
      uint8_t* orow = ob + r * 128;
      if (!kV32 || c < kCodeChunksV32) {
        // 16 codes = dims 16c .. 16c + 15 = bf16 chunks 2c, 2c + 1 of the row, in column block c / 4.
        const uint4 v = *reinterpret_cast<const uint4*>(srow + c * 16);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
        uint32_t h[8];
        if constexpr (kV32) {
          const float scale = *reinterpret_cast<const float*>(srow + kScaleAt<WG> + (c >> 3) * 4);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            h[2 * i] = e4m3x2_scaled_to_bf16x2(static_cast<uint16_t>(w[i] & 0xFFFFu), scale);
            h[2 * i + 1] = e4m3x2_scaled_to_bf16x2(static_cast<uint16_t>(w[i] >> 16), scale);
          }
        } else {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            h[2 * i] = e4m3x2_to_bf16x2(static_cast<uint16_t>(w[i] & 0xFFFFu));
            h[2 * i + 1] = e4m3x2_to_bf16x2(static_cast<uint16_t>(w[i] >> 16));
          }
        }
        // Threads of odd column blocks store their second chunk first, so that the 8 threads of a store phase
        // (4 pieces of 2 blocks, one row) hit 8 different bank groups.
        uint8_t* blk = orow + (c >> 2) * kKBlock;
        const int cc = (c & 3) * 2, second_first = (c >> 2) & 1;
        const uint4 lo = make_uint4(h[0], h[1], h[2], h[3]), hi = make_uint4(h[4], h[5], h[6], h[7]);
        *reinterpret_cast<uint4*>(blk + (((cc + second_first) ^ sw) << 4)) = second_first ? hi : lo;
        *reinterpret_cast<uint4*>(blk + (((cc + 1 - second_first) ^ sw) << 4)) = second_first ? lo : hi;
      } else {
        // deepseek_v32's tail piece j: bf16 dims 512 + 8j .. 512 + 8j + 7, chunk j of column block 8.
        const int j = c - kCodeChunksV32;
        *reinterpret_cast<uint4*>(orow + (kBlocks - 1) * kKBlock + ((j ^ sw) << 4)) =
            *reinterpret_cast<const uint4*>(srow + kV32TailOffset + j * 16);
      }
    }
  };
  // After this thread's copies of tile `local` have landed: converts it once all of the warpgroup's have, then
  // refills its staging slot with tile local + 2 once every thread has read it. The converted tile is published to
  // the wgmma (async proxy) by the fence and the second barrier.
  auto convert_and_refill = [&](int local) {
    bar_sync_warpgroup<WG>();
    if (local < tiles) convert(local);
    fence_proxy_async_smem();
    bar_sync_warpgroup<WG>();
    issue(local + 2);
  };

  // Operand tile t sits in buffer t % 2, its raw rows in staging slot t % 2 from two tiles before its conversion;
  // bf16: in buffer t % 3, copied three tiles ahead. Every step commits one cp.async group.
  if constexpr (kBf16) {
    issue(0);
    issue(1);
    issue(2);
    cp_async_wait<2>();  // this thread's copies of tile 0
    fence_proxy_async_smem();
    bar_sync_warpgroup<WG>();
  } else {
    issue(0);
    issue(1);
    cp_async_wait<1>();
    convert_and_refill(0);
  }

  const int r_lo = 16 * warp + (lane >> 2);  // this thread's accumulator rows r_lo and r_lo + 8
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float sc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) sc[i] = 0.0f;
  float m_run[2] = {-kInf, -kInf}, l_run[2] = {0.0f, 0.0f};
  uint32_t pa[2][4];  // P of the last softmax as the A fragments of its two 16-index k-steps

  // Partial scores of local tile `local` into sc (issued, not committed).
  auto scores = [&](int local) {
    const uint8_t* kb;
    if constexpr (kBf16) {
      kb = op_s + (local % 3) * kKBytes;
    } else {
      kb = op_s + (local & 1) * kKBytes;
    }
#pragma unroll
    for (int ks = kStep0<WG>; ks < kStep1<WG>; ++ks) {
      const int b = ks >> 2, kk = ks & 3;
      wgmma_m64n32k16_ss<true>(sc, smem_desc_sw128(q_s + b * kQBlock + kk * 32, 16, 1024),
                               smem_desc_sw128(kb + b * kKBlock + kk * 32, 16, 1024), ks != kStep0<WG>);
    }
  };
  // Warp 0 of WG 0, before the waits of tile `local`: the page number of tile local + kAddrAhead (its index was
  // loaded one tile earlier) and the index of tile local + kAddrAhead + 1; the address is stored after the next
  // CTA barrier (a tile's addresses are written one barrier before any thread issues its copies).
  int ahead_pos = -1, ahead_page = 0;
  auto prefetch = [&](int local) {
    if (WG == 0 && warp == 0) {
      ahead_pos = pending >= 0 && pending < ctx ? pending : -1;
      ahead_page = ahead_pos >= 0 ? p.bt.pages[int64_t{req} * p.bt.stride + (ahead_pos >> p.page_shift)] : 0;
      pending = index_at(p, row_indices, t_begin, tiles, local + kAddrAhead + 1, lane);
    }
  };
  // Full scores of local tile `local` (sc + the other warpgroup's part), skipped indices masked, then the online
  // softmax: P into pa, the running max, sum and O rescaled. Needs the value product of the previous tile finished.
  auto softmax = [&](int local) {
    float4* mine = xch + ((local & 1) * 2 + WG) * 4 * 128;
    const float4* theirs = xch + ((local & 1) * 2 + (1 - WG)) * 4 * 128;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      mine[k * 128 + wt] = make_float4(sc[4 * k], sc[4 * k + 1], sc[4 * k + 2], sc[4 * k + 3]);
    // Publishes the partial scores (and orders the address slots: see prefetch).
    bar_sync_cta();
    if (WG == 0 && warp == 0)
      addr[((local + kAddrAhead) % kAddrSlots) * kTile + lane] =
          ahead_pos >= 0 ? row_address<kEntry>(p, ahead_page, ahead_pos) : nullptr;
    const uint8_t* const* rows = addr + (local % kAddrSlots) * kTile;

    // x[4k + e]: head row r_lo + 8 (e / 2), index 8k + 2 tq + (e % 2) of the tile; scores in the log2 domain.
    float x[16];
    float mx[2] = {-kInf, -kInf};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float4 a = theirs[k * 128 + wt];
      const float other[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int v = 4 * k + e, r = e >> 1;
        const float s = rows[8 * k + 2 * tq + (e & 1)] ? (sc[v] + other[e]) * p.log2_scale : -kInf;
        x[v] = s;
        mx[r] = fmaxf(mx[r], s);
      }
    }
    // No slack: the running maximum rises whenever a tile's exceeds it (see the file comment).
    mla::online_softmax_step(x, mx, m_run, l_run, pa, o, 0.0f,
                             [](float lo, float hi) { return pack_bf16(lo, hi); });
  };

  // Tile 0's scores, with tile 1 converted meanwhile (bf16: tile 1's copies landed and published by the barrier in
  // softmax(0)).
  if (tiles > 0) {
    prefetch(0);
    wgmma_fence();
    scores(0);
    wgmma_commit();
    cp_async_wait<1>();  // this thread's copies of tile 1
    if constexpr (kBf16) {
      fence_proxy_async_smem();
    } else {
      convert_and_refill(1);
    }
    wgmma_wait<0>();
    softmax(0);
  }
  // Iteration i: O += P_i V_i and the scores of tile i + 1 are issued back to back; once the value product is done
  // its buffer takes tile i + 2 (bf16: the copies of tile i + 3) while the scores run; then the softmax of tile i + 1.
#pragma unroll 1
  for (int i = 0; i < tiles; ++i) {
    const bool next = i + 1 < tiles;
    prefetch(i + 1);
    const uint8_t* kb;
    if constexpr (kBf16) {
      kb = op_s + (i % 3) * kKBytes;
    } else {
      kb = op_s + (i & 1) * kKBytes;
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
      wgmma_m64n256k16_rs_mn<true>(o, pa[kk], smem_desc_sw128(kb + 4 * WG * kKBlock + kk * 16 * 128, kKBlock, 1024));
    wgmma_commit();
    if (next) {
      wgmma_fence();
      scores(i + 1);
      wgmma_commit();
      wgmma_wait<1>();  // this thread's part of the value product of tile i is done
    } else {
      wgmma_wait<0>();
    }
    if constexpr (kBf16) {
      // The value product of tile i (this warpgroup's, one collective operation) is done: its buffer takes tile i + 3.
      // Tile i + 2's copies are published by the barrier of softmax(i + 1), before its scores are issued.
      issue(i + 3);
      cp_async_wait<1>();  // this thread's copies of tile i + 2
      fence_proxy_async_smem();
    } else {
      cp_async_wait<1>();  // this thread's copies of tile i + 2
      // The barrier in it also waits for the whole warpgroup's value product before buffer i % 2 is overwritten.
      convert_and_refill(i + 2);
    }
    wgmma_wait<0>();
    if (next) softmax(i + 1);
  }
  wgmma_wait<0>();
  cp_async_wait<0>();

  const int64_t row_heads = int64_t{row} * p.heads;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xFFFFFFFFu, l, 1);
    l += __shfl_xor_sync(0xFFFFFFFFu, l, 2);
    const int m = r_lo + 8 * r;
    if (m >= heads_here) continue;
    const int64_t hq = row_heads + head0 + m;
    const float inv = l > 0.0f ? p.out_scale / l : 0.0f;
    float* dst = p.splits == 1 ? p.out + hq * kLatentValueDim : p.part_o + (hq * p.splits + split) * kLatentValueDim;
    // A row without any valid index stores +0 itself.
#pragma unroll
    for (int n = 0; n < 32; ++n)
      *reinterpret_cast<float2*>(dst + 256 * WG + 8 * n + 2 * tq) =
          l > 0.0f ? make_float2(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv) : make_float2(0.0f, 0.0f);
    if (WG == 0 && tq == 0) {
      const float lse = l > 0.0f ? (m_run[r] + log2f(l)) * 0.69314718055994531f : -kInf;
      if (p.splits == 1) {
        p.lse[hq] = lse;
      } else {
        p.part_lse[hq * p.splits + split] = lse;
      }
    }
  }
}

#endif  // wgmma code

template <SparseMlaEntry kEntry>
__global__ void __launch_bounds__(kThreads, 1) sparse_mla_wgmma_kernel(const __grid_constant__ Params p) {
#ifdef KESTREL_DSA_WGMMA
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* smem = smem_raw + ((1024u - (raw & 1023u)) & 1023u);
  const int split = blockIdx.x, head0 = blockIdx.y * kHeads, row = blockIdx.z;
  const int req = row / p.n_q;
  const int ctx = p.ctx_lens[req];
  const int heads_here = min(kHeads, p.heads - head0);
  const int n_tiles = (p.k + kTile - 1) / kTile;
  const int t_begin = split * p.tiles_per_split;
  const int tiles = max(0, min(n_tiles - t_begin, p.tiles_per_split));
  const int32_t* row_indices = p.indices + int64_t{row} * p.k;

  int pending = -1;
  if (threadIdx.x < 32) {
    const uint8_t** addr = reinterpret_cast<const uint8_t**>(smem + Layout<kEntry>::addr);
    for (int la = 0; la < kAddrAhead; ++la) {
      const int pos = index_at(p, row_indices, t_begin, tiles, la, threadIdx.x);
      const uint8_t* a = nullptr;
      if (pos >= 0 && pos < ctx)
        a = row_address<kEntry>(p, p.bt.pages[int64_t{req} * p.bt.stride + (pos >> p.page_shift)], pos);
      addr[la * kTile + threadIdx.x] = a;
    }
    pending = index_at(p, row_indices, t_begin, tiles, kAddrAhead, threadIdx.x);
  }
  load_query(p, smem + Layout<kEntry>::q, row, head0, heads_here);
  __syncthreads();
  if (threadIdx.x < 128) {
    attend<kEntry, 0>(p, smem, row, head0, heads_here, split, ctx, t_begin, tiles, pending);
  } else {
    attend<kEntry, 1>(p, smem, row, head0, heads_here, split, ctx, t_begin, tiles, pending);
  }
#else
  // wgmma exists only in sm_90a machine code; the launcher refuses every other device before launching.
  __trap();
#endif
}

template <SparseMlaEntry kEntry>
void launch(const Params& p, dim3 grid, cudaStream_t stream) {
  const int smem = Layout<kEntry>::bytes + 1024;
  static DeviceCache prepared;  // once per device: the shared-memory attribute
  prepared.get([smem] {
    check(cudaFuncSetAttribute(sparse_mla_wgmma_kernel<kEntry>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
          "cudaFuncSetAttribute(sparse_mla_wgmma_kernel)");
    return 1;
  });
  sparse_mla_wgmma_kernel<kEntry><<<grid, kThreads, smem, stream>>>(p);
  check(cudaGetLastError(), "sparse_mla_decode wgmma kernel launch");
}

}  // namespace

bool sparse_mla_wgmma_supported() { return device_is_sm90(); }

void launch_sparse_mla_wgmma(const SparseMlaDecodeArgs& a, float kv_scale, const SparseMlaSplit& split,
                             cudaStream_t stream) {
  require(sparse_mla_wgmma_supported(),
          "sparse_mla_decode: the wgmma kernel needs a compute capability 9.0 GPU (Hopper, sm_90a)");
  require(reinterpret_cast<uintptr_t>(a.q_abs) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 8 == 0,
          "sparse_mla_decode: q_abs must be 16-byte aligned and out 8-byte aligned");
  Params p{};
  p.q = a.q_abs;
  p.n_q = a.n_q;
  p.heads = a.heads;
  p.indices = a.indices;
  p.k = a.k;
  p.ctx_lens = a.ctx_lens;
  p.pages = a.latent_pages;
  p.page_shift = 0;
  while ((1 << p.page_shift) < a.latent_pages.page_size) ++p.page_shift;
  p.bt = a.block_table;
  p.log2_scale = static_cast<float>(double{a.softmax_scale} * kv_scale * 1.4426950408889634);
  p.out_scale = kv_scale;
  p.tiles_per_split = split.tiles_per_split;
  p.splits = split.splits;
  p.out = a.out;
  p.lse = a.lse;
  p.part_o = split.part_o;
  p.part_lse = split.part_lse;
  const dim3 grid(split.splits, (a.heads + kHeads - 1) / kHeads, a.batch * a.n_q);
  if (a.entry == SparseMlaEntry::v32_fp8) {
    launch<SparseMlaEntry::v32_fp8>(p, grid, stream);
  } else if (a.entry == SparseMlaEntry::bf16) {
    launch<SparseMlaEntry::bf16>(p, grid, stream);
  } else {
    launch<SparseMlaEntry::kimi_fp8>(p, grid, stream);
  }
}

}  // namespace kestrel::cuda::dsa
