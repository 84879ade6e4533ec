// Sparse MLA decode over an FP8 or bf16 latent: Kimi's 576-byte rows (576 e4m3 codes, one fp32 scale per layer),
// deepseek_v32's 656-byte rows (512 e4m3 codes in 4 tiles of 128, the tiles' fp32 scales, 64 bf16 rope values) or the
// 1152-byte bf16 rows (576 bf16 values, no scale).
//
// CTA: 256 threads (8 warps) for one query row, 64 heads and one split of the row's index list, walked in tiles
// of 32 indices. Warp w owns heads 16 (w % 4) .. +15 and half h = w / 4 of the work: for the scores it multiplies
// dims 288 h .. 288 h + 287 of the query and the key (the two partial 16 x 32 score tiles of a pair of warps are
// added through shared memory in one fixed order, so both warps see the same scores), for the output it owns value
// columns 256 h .. 256 h + 255 (a 16 x 256 fp32 accumulator in registers).
//
// Per tile: the 32 selected latent rows are gathered with cp.async into a staging buffer (two buffers: the next tile
// is in flight while this one is used; invalid indices are zero-filled and masked), converted to bf16 into a padded
// tile that ldmatrix reads conflict-free (Kimi: the codes, exact since every e4m3 value is a bf16 value, kv_scale
// applied to the fp32 scores and outputs; deepseek_v32: fp32(code * tile scale) as read_latent computes it, rounded
// to bf16 -- exact for the writer's power-of-two scales -- and the bf16 tail copied; bf16 rows: copied as they are,
// since a staged row of 1152 bytes puts the 8 rows of an ldmatrix on the same banks), then
// S = Q K^T (bf16 MMA, fp32 accumulate), an online softmax in the log2 domain (with the -inf guards that keep
// rows without any valid index at 0), P rounded to bf16, O += P V; the normaliser sums the unrounded P. The query tile stays in shared memory.
//
// When there are few rows the index list is split over several CTAs (flash-decoding); each split writes its
// normalised partial output and lse, and a second kernel merges them by their lse.
//
// On a compute capability 9.0 GPU sparse_mla_decode runs the warpgroup-MMA kernel of dsa_mla_wgmma.cu instead (same
// splits, same merge) unless SparseMlaDecodeArgs::kernel asks for mma_sync.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>

#include "kernels/cuda/dsa_common.cuh"
#include "kernels/cuda/dsa_mla_wgmma.h"

namespace kestrel::cuda::dsa {
namespace {

constexpr int kThreads = 256;
constexpr int kHeadsPerCta = 64;
constexpr int kTile = 32;               // indices per tile
constexpr int kRowElems = kLatentDim + 8;  // bf16 per shared row: 16 bytes of padding against bank conflicts
constexpr int kHalfDims = kLatentDim / 2;  // score dims per warp half
constexpr int kHalfCols = kLatentValueDim / 2;
constexpr int kChunks = kLatentDim / 16;   // 16-byte pieces of a Kimi FP8 row

// deepseek_v32's entry: 4 tiles of 128 codes, their 4 fp32 scales at byte 512, the bf16 tail at byte 528. An entry
// is 41 16-byte pieces, so every piece of a 16-byte aligned row is aligned: pieces 0-31 codes, 32 the scales, 33-40
// the tail.
constexpr int kV32Tile = 128;
constexpr int kV32ScaleOffset = kLatentValueDim;
constexpr int kV32TailOffset = kV32ScaleOffset + kLatentValueDim / kV32Tile * 4;
constexpr int kV32CodeChunks = kLatentValueDim / 16;
constexpr int kV32TailChunks = (kLatentDim - kLatentValueDim) * 2 / 16;
static_assert(kV32TailOffset % 16 == 0 && kV32TailOffset + kV32TailChunks * 16 == kV32LatentEntryBytes);

template <int kEntryBytes>
struct MlaSmem {
  alignas(16) uint16_t q[kHeadsPerCta][kRowElems];
  alignas(16) uint16_t kv[kTile][kRowElems];
  alignas(16) uint8_t stage[2][kTile][kEntryBytes];
  float s_part[2][4][4][4][32];  // [half][head tile][n8 tile][register][lane]
  // Per tile, in slot (tile - first tile) % 3: the latent row of each index (nullptr when the index is skipped).
  const uint8_t* src[3][kTile];
};

static_assert(sizeof(MlaSmem<kBf16LatentEntryBytes>) <= 227 * 1024, "one CTA per multiprocessor must fit");

struct MlaParams {
  const uint16_t* q;
  int n_q;
  int heads;
  const int32_t* indices;
  int k;
  const int32_t* ctx_lens;
  Pages pages;
  BlockTable bt;
  float score_log2_scale;  // softmax_scale * kv_scale * log2(e)
  float kv_scale;
  int tiles_per_split;
  int splits;
  float* out;
  float* lse;
  float* part_o;    // [rows * heads, splits, 512] when splits > 1
  float* part_lse;  // [rows * heads, splits]
};

// The staged rows of a tile -> bf16 rows of `kv`, each value as MlaCore::read_latent decodes it (Kimi's
// without kv_scale, which the caller applies to the fp32 scores and outputs).
template <int kEntryBytes>
__device__ __forceinline__ void convert_tile(const uint8_t (&stage)[kTile][kEntryBytes],
                                             uint16_t (&kv)[kTile][kRowElems], int tid) {
  if constexpr (kEntryBytes == kLatentDim) {
    for (int u = tid; u < kTile * kChunks; u += kThreads) {
      const int key = u / kChunks, chunk = u % kChunks;
      const uint4 v = *reinterpret_cast<const uint4*>(&stage[key][chunk * 16]);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
      uint32_t b[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        b[2 * i] = e4m3x2_to_bf16x2(static_cast<uint16_t>(w[i] & 0xFFFFu));
        b[2 * i + 1] = e4m3x2_to_bf16x2(static_cast<uint16_t>(w[i] >> 16));
      }
      uint4* dst = reinterpret_cast<uint4*>(&kv[key][chunk * 16]);
      dst[0] = make_uint4(b[0], b[1], b[2], b[3]);
      dst[1] = make_uint4(b[4], b[5], b[6], b[7]);
    }
  } else if constexpr (kEntryBytes == kBf16LatentEntryBytes) {
    constexpr int kRowChunks = kBf16LatentEntryBytes / 16;
    for (int u = tid; u < kTile * kRowChunks; u += kThreads) {
      const int key = u / kRowChunks, chunk = u % kRowChunks;
      *reinterpret_cast<uint4*>(&kv[key][chunk * 8]) = *reinterpret_cast<const uint4*>(&stage[key][chunk * 16]);
    }
  } else {
    static_assert(kEntryBytes == kV32LatentEntryBytes);
    constexpr int kUnits = kV32CodeChunks + kV32TailChunks;
    for (int u = tid; u < kTile * kUnits; u += kThreads) {
      const int key = u / kUnits, chunk = u % kUnits;
      if (chunk < kV32CodeChunks) {
        const uint4 v = *reinterpret_cast<const uint4*>(&stage[key][chunk * 16]);
        const float scale =
            *reinterpret_cast<const float*>(&stage[key][kV32ScaleOffset + chunk * 16 / kV32Tile * 4]);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
        uint32_t b[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          b[2 * i] = e4m3x2_scaled_to_bf16x2(static_cast<uint16_t>(w[i] & 0xFFFFu), scale);
          b[2 * i + 1] = e4m3x2_scaled_to_bf16x2(static_cast<uint16_t>(w[i] >> 16), scale);
        }
        uint4* dst = reinterpret_cast<uint4*>(&kv[key][chunk * 16]);
        dst[0] = make_uint4(b[0], b[1], b[2], b[3]);
        dst[1] = make_uint4(b[4], b[5], b[6], b[7]);
      } else {
        const int t = chunk - kV32CodeChunks;
        *reinterpret_cast<uint4*>(&kv[key][kLatentValueDim + t * 8]) =
            *reinterpret_cast<const uint4*>(&stage[key][kV32TailOffset + t * 16]);
      }
    }
  }
}

template <int kEntryBytes>
__global__ void __launch_bounds__(kThreads, 1) sparse_mla_decode_kernel(MlaParams p) {
  constexpr int kEntryChunks = kEntryBytes / 16;  // 16-byte pieces of a staged row
  static_assert(kEntryBytes % 16 == 0);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  MlaSmem<kEntryBytes>& sm = *reinterpret_cast<MlaSmem<kEntryBytes>*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int mt = warp & 3, half = warp >> 2;
  const int g = lane >> 2, tq = lane & 3;
  const int split = blockIdx.x, head0 = blockIdx.y * kHeadsPerCta, row = blockIdx.z;
  const int req = row / p.n_q;
  const int heads_here = min(kHeadsPerCta, p.heads - head0);
  const bool active = mt * 16 < heads_here;
  const int ctx = p.ctx_lens[req];
  const int tiles = (p.k + kTile - 1) / kTile;
  const int t_begin = split * p.tiles_per_split, t_end = min(tiles, t_begin + p.tiles_per_split);

  // Row addresses: warp 0 looks up tile t + 2's (index, then page) during tile t, so that the gather of a tile
  // issues its 16-byte copies from shared memory without a dependent global load per copy.
  const int32_t* row_indices = p.indices + int64_t{row} * p.k;
  auto index_of = [&](int t) {
    const int j = t * kTile + lane;
    return t < t_end && j < p.k ? row_indices[j] : -1;
  };
  auto page_of = [&](int pos) {
    return pos >= 0 && pos < ctx ? p.bt.pages[int64_t{req} * p.bt.stride + pos / p.pages.page_size] : 0;
  };
  auto row_of = [&](int pos, int page) -> const uint8_t* {
    return pos >= 0 && pos < ctx ? p.pages.base + int64_t{page} * p.pages.page_stride +
                                       int64_t{pos & (p.pages.page_size - 1)} * kEntryBytes
                                 : nullptr;
  };
  auto issue_tile = [&](int slot, int buf) {
    for (int u = tid; u < kTile * kEntryChunks; u += kThreads) {
      const int key = u / kEntryChunks, chunk = u % kEntryChunks;
      const uint8_t* src = sm.src[slot][key];
      cp_async_16(&sm.stage[buf][key][chunk * 16], src ? src + chunk * 16 : p.pages.base, src ? 16 : 0);
    }
    cp_async_commit();
  };
  if (warp == 0) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int pos = index_of(t_begin + t);
      sm.src[t][lane] = row_of(pos, page_of(pos));
    }
  }
  __syncthreads();
  issue_tile(0, 0);

  const uint4* q_src = reinterpret_cast<const uint4*>(p.q + (int64_t{row} * p.heads + head0) * kLatentDim);
  for (int u = tid; u < kHeadsPerCta * (kLatentDim / 8); u += kThreads) {
    const int h = u / (kLatentDim / 8), c = u % (kLatentDim / 8);
    const uint4 v = h < heads_here ? q_src[u] : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(&sm.q[h][c * 8]) = v;
  }

  float o[kHalfCols / 8][4];
#pragma unroll
  for (int n = 0; n < kHalfCols / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

#pragma unroll 1
  for (int t = t_begin; t < t_end; ++t) {
    const int buf = (t - t_begin) & 1, slot = (t - t_begin) % 3;
    const int next_pos = warp == 0 ? index_of(t + 2) : -1;
    if (t + 1 < t_end) {
      issue_tile((slot + 1) % 3, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    convert_tile<kEntryBytes>(sm.stage[buf], sm.kv, tid);
    const int next_page = page_of(next_pos);
    __syncthreads();

    float s[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    if (active) {
#pragma unroll 2
      for (int ks = 0; ks < kHalfDims / 16; ++ks) {
        const int k0 = half * kHalfDims + ks * 16;
        uint32_t a[4];
        ldmatrix_x4(a, &sm.q[mt * 16 + (lane & 15)][k0 + (lane >> 4) * 8]);
#pragma unroll
        for (int n = 0; n < 4; n += 2) {
          uint32_t b[4];
          ldmatrix_x4(b, &sm.kv[n * 8 + (lane & 7) + ((lane >> 4) << 3)][k0 + ((lane >> 3) & 1) * 8]);
          mma_bf16(s[n], a, b[0], b[1]);
          mma_bf16(s[n + 1], a, b[2], b[3]);
        }
      }
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) sm.s_part[half][mt][n][e][lane] = s[n][e];
    }
    __syncthreads();

    if (active) {
      // s[n][e]: head row g + 8 (e >> 1), index n * 8 + 2 tq + (e & 1) of the tile; scores in the log2 domain.
      float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float dot = sm.s_part[0][mt][n][e][lane] + sm.s_part[1][mt][n][e][lane];
          s[n][e] = sm.src[slot][n * 8 + 2 * tq + (e & 1)] ? dot * p.score_log2_scale : -INFINITY;
          row_max[e >> 1] = fmaxf(row_max[e >> 1], s[n][e]);
        }
      float alpha[2], m_use[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xFFFFFFFFu, row_max[r], 1));
        row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xFFFFFFFFu, row_max[r], 2));
        const float m_new = fmaxf(m_run[r], row_max[r]);
        // With no finite score yet every exponent below is exp2(-inf) = 0, never exp2(-inf - -inf).
        m_use[r] = m_new == -INFINITY ? 0.0f : m_new;
        alpha[r] = exp2f(m_run[r] - m_use[r]);
        m_run[r] = m_new;
        l_run[r] *= alpha[r];
      }
      uint32_t pa[2][4];  // P as the A fragments of the two 16-index k-steps
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        float pr[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) pr[e] = exp2f(s[n][e] - m_use[e >> 1]);
        pa[n >> 1][(n & 1) * 2] = pack_bf16(pr[0], pr[1]);
        pa[n >> 1][(n & 1) * 2 + 1] = pack_bf16(pr[2], pr[3]);
        // The normaliser sums the unrounded probabilities: lse stays accurate to fp32 rounding, and the output,
        // sum(bf16(p) v) / sum(p), is off by at most 2^-9 max |v|.
        l_run[0] += pr[0] + pr[1];
        l_run[1] += pr[2] + pr[3];
      }
#pragma unroll
      for (int n = 0; n < kHalfCols / 8; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
      }
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
        for (int n = 0; n < kHalfCols / 8; n += 2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, &sm.kv[kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8]
                                     [half * kHalfCols + n * 8 + (lane >> 4) * 8]);
          mma_bf16(o[n], pa[kk], b[0], b[1]);
          mma_bf16(o[n + 1], pa[kk], b[2], b[3]);
        }
      }
    }
    // Slot (slot + 2) % 3 held tile t - 1, whose copies were issued and whose scores are done.
    if (warp == 0) sm.src[(slot + 2) % 3][lane] = row_of(next_pos, next_page);
    __syncthreads();
  }

  if (!active) return;
  const int64_t row_heads = int64_t{row} * p.heads;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xFFFFFFFFu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xFFFFFFFFu, l_run[r], 2);
    const int h = mt * 16 + g + 8 * r;
    if (h >= heads_here) continue;
    const float inv = p.kv_scale / l_run[r];
    const float lse = l_run[r] > 0.0f ? (m_run[r] + log2f(l_run[r])) * 0.69314718055994531f : -INFINITY;
    const int64_t hq = row_heads + head0 + h;
    float* dst = p.splits == 1 ? p.out + hq * kLatentValueDim
                               : p.part_o + (hq * p.splits + split) * kLatentValueDim;
    // A row without any valid index stores +0 itself rather than o * 0, which could be -0.
#pragma unroll
    for (int n = 0; n < kHalfCols / 8; ++n) {
      const int col = half * kHalfCols + n * 8 + 2 * tq;
      *reinterpret_cast<float2*>(dst + col) =
          l_run[r] > 0.0f ? make_float2(o[n][2 * r] * inv, o[n][2 * r + 1] * inv) : make_float2(0.0f, 0.0f);
    }
    if (half == 0 && tq == 0) {
      if (p.splits == 1) {
        p.lse[hq] = lse;
      } else {
        p.part_lse[hq * p.splits + split] = lse;
      }
    }
  }
}

// One CTA per (row, head): merges the splits' normalised outputs by their lse, in split order. Thread t owns value
// columns 4t .. 4t+3; the split loop is unrolled so that several splits' loads are in flight at once.
constexpr int kCombineThreads = kLatentValueDim / 4;

__global__ void __launch_bounds__(kCombineThreads) split_combine_kernel(const float* __restrict__ part_o,
                                                                            const float* __restrict__ part_lse,
                                                                            int splits, float* __restrict__ out,
                                                                            float* __restrict__ lse) {
  const int64_t hq = blockIdx.x;
  const int tid = threadIdx.x;
  const float* row_lse = part_lse + hq * splits;
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, row_lse[s]);
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float wsum = 0.0f;
  const float4* src = reinterpret_cast<const float4*>(part_o + hq * splits * kLatentValueDim) + tid;
#pragma unroll 8
  for (int s = 0; s < splits; ++s) {
    // An empty split stored lse = -inf and a zero output: its weight is 0.
    const float w = m == -INFINITY ? 0.0f : expf(row_lse[s] - m);
    const float4 v = src[static_cast<int64_t>(s) * (kLatentValueDim / 4)];
    wsum += w;
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
  }
  const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
  reinterpret_cast<float4*>(out + hq * kLatentValueDim)[tid] =
      make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  if (tid == 0) lse[hq] = wsum > 0.0f ? m + logf(wsum) : -INFINITY;
}

struct Split {
  int splits;
  int tiles_per_split;
};

// Enough splits to give every multiprocessor one CTA (the kernel runs one CTA per multiprocessor), whole tiles each.
Split choose_split(int rows, int heads, int k) {
  const int tiles = (k + kTile - 1) / kTile;
  const int base = rows * ((heads + kHeadsPerCta - 1) / kHeadsPerCta);
  const int wanted = std::clamp(device_sm_count() / std::max(base, 1), 1, tiles);
  const int per = (tiles + wanted - 1) / wanted;
  return {(tiles + per - 1) / per, per};
}

template <int kEntryBytes>
void launch_sparse_mla_kernel(dim3 grid, const MlaParams& p, cudaStream_t stream) {
  const size_t smem = sizeof(MlaSmem<kEntryBytes>);
  check(cudaFuncSetAttribute(sparse_mla_decode_kernel<kEntryBytes>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)),
        "cudaFuncSetAttribute(sparse_mla_decode_kernel)");
  sparse_mla_decode_kernel<kEntryBytes><<<grid, kThreads, smem, stream>>>(p);
  check(cudaGetLastError(), "sparse_mla_decode kernel launch");
}

void check_mla_shapes(int batch, int n_q, int heads, int k, const char* fn) {
  require(batch >= 0 && n_q >= 1 && heads >= 1 && k >= 1,
          std::string(fn) + ": need batch >= 0, n_q >= 1, heads >= 1 and k >= 1, got batch " +
              std::to_string(batch) + ", n_q " + std::to_string(n_q) + ", heads " + std::to_string(heads) + ", k " +
              std::to_string(k));
  require(int64_t{batch} * n_q <= 65535, std::string(fn) + ": at most 65535 query rows per call");
}

}  // namespace

void launch_split_combine(const float* part_o, const float* part_lse, int splits, int64_t rows, float* out,
                          float* lse, cudaStream_t stream, const char* what) {
  split_combine_kernel<<<static_cast<unsigned>(rows), kCombineThreads, 0, stream>>>(part_o, part_lse, splits,
                                                                                           out, lse);
  check(cudaGetLastError(), what);
}

}  // namespace kestrel::cuda::dsa

namespace kestrel::cuda {

size_t sparse_mla_decode_workspace_bytes(int batch, int n_q, int heads, int k) {
  dsa::check_mla_shapes(batch, n_q, heads, k, "sparse_mla_decode_workspace_bytes");
  const int rows = batch * n_q;
  if (rows == 0) return 0;
  const dsa::Split sp = dsa::choose_split(rows, heads, k);
  if (sp.splits == 1) return 0;
  return static_cast<size_t>(rows) * heads * sp.splits * (kLatentValueDim + 1) * sizeof(float);
}

void sparse_mla_decode(const SparseMlaDecodeArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  using namespace dsa;
  check_mla_shapes(a.batch, a.n_q, a.heads, a.k, "sparse_mla_decode");
  check_pages(a.latent_pages, "sparse_mla_decode");
  const int rows = a.batch * a.n_q;
  if (rows == 0) return;
  require(a.q_abs && a.indices && a.ctx_lens && a.block_table.pages && a.out && a.lse,
          "sparse_mla_decode: a device pointer is missing");
  require(a.entry == SparseMlaEntry::kimi_fp8 || a.entry == SparseMlaEntry::v32_fp8 ||
              a.entry == SparseMlaEntry::bf16,
          "sparse_mla_decode: unknown latent entry layout");
  require(reinterpret_cast<uintptr_t>(a.latent_pages.base) % 16 == 0,
          "sparse_mla_decode: the latent pages' base must be 16-byte aligned (rows are copied in 16-byte pieces)");
  const bool v32 = a.entry == SparseMlaEntry::v32_fp8, bf16 = a.entry == SparseMlaEntry::bf16;
  const int entry_bytes = v32 ? kV32LatentEntryBytes : bf16 ? kBf16LatentEntryBytes : kLatentDim;
  require(a.latent_pages.page_stride >= int64_t{a.latent_pages.page_size} * entry_bytes,
          "sparse_mla_decode: a latent page of " + std::to_string(a.latent_pages.page_stride) +
              " bytes is smaller than its page_size rows of the entry layout");
  // deepseek_v32's values carry their tile scales and bf16 entries have none: kv_scale is not used.
  const float kv_scale = v32 || bf16 ? 1.0f : a.kv_scale;
  require(std::isfinite(kv_scale) && kv_scale > 0.0f && std::isfinite(a.softmax_scale),
          "sparse_mla_decode: kv_scale must be finite and > 0 and softmax_scale finite");
  const Split sp = choose_split(rows, a.heads, a.k);
  const size_t need = sparse_mla_decode_workspace_bytes(a.batch, a.n_q, a.heads, a.k);
  require(workspace_bytes >= need && (need == 0 || workspace != nullptr),
          "sparse_mla_decode: workspace of " + std::to_string(workspace_bytes) + " bytes, need " +
              std::to_string(need));
  // Both kernels load q_abs in 16-byte pieces and store out in 8-byte pieces; with splits the combine reads the
  // partials from the workspace and writes out in 16-byte pieces.
  const uintptr_t q_at = reinterpret_cast<uintptr_t>(a.q_abs), out_at = reinterpret_cast<uintptr_t>(a.out);
  require(q_at % 16 == 0 && out_at % (sp.splits > 1 ? 16 : 8) == 0 &&
              (sp.splits == 1 || reinterpret_cast<uintptr_t>(workspace) % 16 == 0),
          "sparse_mla_decode: q_abs, the workspace and out must be 16-byte aligned (out 8-byte when the index "
          "lists are not split)");

  MlaParams p{};
  p.q = a.q_abs;
  p.n_q = a.n_q;
  p.heads = a.heads;
  p.indices = a.indices;
  p.k = a.k;
  p.ctx_lens = a.ctx_lens;
  p.pages = a.latent_pages;
  p.bt = a.block_table;
  p.score_log2_scale = static_cast<float>(double{a.softmax_scale} * kv_scale * 1.4426950408889634);
  p.kv_scale = kv_scale;
  p.tiles_per_split = sp.tiles_per_split;
  p.splits = sp.splits;
  p.out = a.out;
  p.lse = a.lse;
  const int64_t row_heads = int64_t{rows} * a.heads;
  if (sp.splits > 1) {
    p.part_o = static_cast<float*>(workspace);
    p.part_lse = p.part_o + row_heads * sp.splits * kLatentValueDim;
  }
  const dim3 grid(sp.splits, (a.heads + kHeadsPerCta - 1) / kHeadsPerCta, rows);
  require(a.kernel == SparseMlaKernel::automatic || a.kernel == SparseMlaKernel::mma_sync ||
              a.kernel == SparseMlaKernel::wgmma,
          "sparse_mla_decode: unknown kernel choice");
  // automatic: the wgmma kernel wherever it runs (compute capability 9.0), else mma.sync.
  const bool wgmma = a.kernel == SparseMlaKernel::wgmma ||
                     (a.kernel == SparseMlaKernel::automatic && sparse_mla_wgmma_supported());
  if (wgmma) {
    launch_sparse_mla_wgmma(a, kv_scale, {sp.splits, sp.tiles_per_split, p.part_o, p.part_lse}, stream);
  } else if (v32) {
    launch_sparse_mla_kernel<kV32LatentEntryBytes>(grid, p, stream);
  } else if (bf16) {
    launch_sparse_mla_kernel<kBf16LatentEntryBytes>(grid, p, stream);
  } else {
    launch_sparse_mla_kernel<kLatentDim>(grid, p, stream);
  }
  if (sp.splits > 1) {
    dsa::launch_split_combine(p.part_o, p.part_lse, sp.splits, row_heads, a.out, a.lse, stream,
                              "sparse_mla_decode combine kernel launch");
  }
}

}  // namespace kestrel::cuda
