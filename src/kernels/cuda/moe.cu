// MoE kernels: routing, the counting sort of the (token, slot) pairs by expert, the two grouped GEMMs and the combine.
//
// Sort. Pairs are cut into chunks of kMoeSortChunk. count_kernel writes, per chunk, how many pairs of each expert it
// holds; plan_kernel (one block) turns those into each expert's start in the sorted list, each chunk's base position
// per expert, and the table of row tiles (expert, first row) that the GEMM grids walk; scatter_kernel places each
// pair at its chunk's base plus the number of earlier pairs of its chunk with the same expert. All integer, no
// atomics, so the order within an expert is the pair order and every run gives the same list.
//
// GEMM. One block computes a tile of up to kRows sorted rows of one expert against kTileN weight rows, over K in
// steps of kTileK: the next step's activation and weight chunks are loaded into registers while the tensor cores
// (WMMA bf16 16x16x16, fp32 accumulators) work on the current step in shared memory. MXFP4 weights are expanded to
// bf16 when they are stored to shared memory. The gate/up GEMM's 64 weight rows are 32 gate rows and the 32 up rows
// of the same columns, so swiglu happens in its epilogue; the down GEMM's 64 weight rows are 64 output columns.
// The grid's x covers a bound on the number of tiles (the host knows it from T, top_k and E); blocks past the real
// tile count find expert -1 in the table and return.
//
// FP8 block-scaled experts use the same sort, tiles and combine. Their GEMMs are fp8_block_mma.cuh's tile (codes
// widened to f16 in shared memory, f16 MMAs with fp32 accumulation, each 128-wide group's sum scaled by the row's
// activation scale and the weight block's scale and added in fp32). The token rows of x are quantized once
// (gemm_fp8_block.h's quantizer, per token, not per slot); the gate/up tile holds 32 gate and the 32 matching up rows
// so that each thread applies swiglu to its own accumulators and writes the fp32 swiglu rows; those are quantized by
// the same quantizer (per sorted row) before the down GEMM.
#include <cuda_bf16.h>
#include <mma.h>

#include <cstdint>

#include "kernels/cuda/fp8_block_mma.cuh"
#include "kernels/cuda/gemm_fp8_block.h"
#include "kernels/cuda/moe.h"

namespace kestrel::cuda::detail {
namespace {

// ---------------------------------------------------------------- routing

// cpu::sigmoid's formula, 1 / (1 + exp(-x)) in fp32, with exp correctly rounded to fp32 (through double) as the
// host's expf is, and no contraction, so the biased scores and hence the selection match the CPU bit for bit.
__device__ float sigmoid_as_cpu(float x) {
  const float e = static_cast<float>(exp(-static_cast<double>(x)));
  return __fdiv_rn(1.0f, __fadd_rn(1.0f, e));
}

// One block per token, one thread per expert. A candidate's rank is the number of allowed experts that precede it in
// the CPU's stable descending sort (higher biased score, or equal score and lower id), so rank < top_k picks the
// same experts in the same order; groups are ranked the same way.
__global__ void __launch_bounds__(kMoeMaxRoutedExperts) route_kernel(MoeRouteArgs a) {
  __shared__ float score[kMoeMaxRoutedExperts], biased[kMoeMaxRoutedExperts];
  __shared__ float group_score[kMoeMaxRoutedExperts], chosen[kMoeMaxRoutedExperts];
  __shared__ unsigned char group_kept[kMoeMaxRoutedExperts], allowed[kMoeMaxRoutedExperts];
  const int E = a.n_experts, e = threadIdx.x;
  const int64_t t = blockIdx.x;
  if (e < E) {
    const float s = sigmoid_as_cpu(a.logits[t * E + e]);
    score[e] = s;
    biased[e] = a.bias ? __fadd_rn(s, a.bias[e]) : s;
  }
  __syncthreads();
  const int per_group = E / a.n_group;
  if (a.n_group > 1) {
    if (e < a.n_group) {
      const float* g = biased + e * per_group;
      float best = g[0], second = -INFINITY;
      for (int i = 1; i < per_group; ++i) {
        const float v = g[i];
        if (v > best) {
          second = best;
          best = v;
        } else if (v > second) {
          second = v;
        }
      }
      group_score[e] = per_group >= 2 ? __fadd_rn(best, second) : best;
    }
    __syncthreads();
    if (e < a.n_group) {
      const float mine = group_score[e];
      int rank = 0;
      for (int h = 0; h < a.n_group; ++h) {
        const float other = group_score[h];
        rank += other > mine || (other == mine && h < e);
      }
      group_kept[e] = rank < a.topk_group;
    }
    __syncthreads();
  }
  if (e < E) allowed[e] = a.n_group == 1 || group_kept[e / per_group];
  __syncthreads();
  if (e < E && allowed[e]) {
    const float mine = biased[e];
    int rank = 0;
    for (int f = 0; f < E && rank < a.top_k; ++f) {
      const float other = biased[f];
      rank += allowed[f] && (other > mine || (other == mine && f < e));
    }
    if (rank < a.top_k) {
      a.ids[t * a.top_k + rank] = e;
      chosen[rank] = score[e];
    }
  }
  __syncthreads();
  if (e < a.top_k) {
    float total = 0.0f;
    for (int i = 0; i < a.top_k; ++i) total = __fadd_rn(total, chosen[i]);
    float w = chosen[e];
    if (a.renormalize) w = __fdiv_rn(w, total);
    a.weights[t * a.top_k + e] = __fmul_rn(w, a.scaling);
  }
}

// ---------------------------------------------------------------- counting sort

constexpr int kChunk = kMoeSortChunk;
constexpr int kPlanThreads = 1024;

__global__ void __launch_bounds__(kChunk) count_kernel(const int32_t* __restrict__ ids, int64_t P, int E,
                                                        int32_t* __restrict__ chunk_counts) {
  __shared__ int4 chunk_ids[kChunk / 4];
  const int64_t c = blockIdx.x, i = c * kChunk + threadIdx.x;
  reinterpret_cast<int*>(chunk_ids)[threadIdx.x] = i < P ? ids[i] : -1;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kChunk) {
    int n = 0;
    for (int j = 0; j < kChunk / 4; ++j) {
      const int4 v = chunk_ids[j];
      n += (v.x == e) + (v.y == e) + (v.z == e) + (v.w == e);
    }
    chunk_counts[c * E + e] = n;
  }
}

// Exclusive prefix sum of v over the block's threads in thread order; *total gets the sum over the block.
__device__ int block_exclusive_scan(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  int inclusive = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += n;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int s = lane < n_warps ? warp_sums[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += n;
    }
    warp_sums[lane] = s;
  }
  __syncthreads();
  const int before = (warp > 0 ? warp_sums[warp - 1] : 0) + inclusive - v;
  *total = warp_sums[n_warps - 1];
  __syncthreads();  // warp_sums is reused by the next scan
  return before;
}

// One block. Turns chunk_base from per-chunk counts into per-chunk base positions, writes expert_offset and
// tile_start (each [E + 1]) and the tile table.
__global__ void __launch_bounds__(kPlanThreads)
    plan_kernel(int64_t n_chunks, int E, int rows_per_tile, int64_t max_tiles, int32_t* __restrict__ chunk_base,
                int32_t* __restrict__ expert_offset, int32_t* __restrict__ tile_start, int2* __restrict__ tiles) {
  __shared__ int warp_sums[32];
  int carry_rows = 0, carry_tiles = 0;
  for (int e0 = 0; e0 < E; e0 += kPlanThreads) {
    const int e = e0 + threadIdx.x;
    int count = 0;
    if (e < E)
      for (int64_t c = 0; c < n_chunks; ++c) count += chunk_base[c * E + e];
    int rows_total, tiles_total;
    const int row0 = carry_rows + block_exclusive_scan(count, warp_sums, &rows_total);
    const int tile0 = carry_tiles + block_exclusive_scan((count + rows_per_tile - 1) / rows_per_tile, warp_sums,
                                                         &tiles_total);
    if (e < E) {
      expert_offset[e] = row0;
      tile_start[e] = tile0;
      int base = row0;
      for (int64_t c = 0; c < n_chunks; ++c) {
        const int n = chunk_base[c * E + e];
        chunk_base[c * E + e] = base;
        base += n;
      }
    }
    carry_rows += rows_total;
    carry_tiles += tiles_total;
  }
  if (threadIdx.x == 0) {
    expert_offset[E] = carry_rows;
    tile_start[E] = carry_tiles;
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < max_tiles; j += kPlanThreads) {
    int2 tile = make_int2(-1, 0);
    if (j < carry_tiles) {
      // The last expert whose first tile is <= j; tile_start is non-decreasing and tile_start[E] > j, so that
      // expert owns tile j.
      int lo = 0, hi = E - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tile_start[mid] <= j) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      tile = make_int2(lo, expert_offset[lo] + static_cast<int>(j - tile_start[lo]) * rows_per_tile);
    }
    tiles[j] = tile;
  }
}

__global__ void __launch_bounds__(kChunk) scatter_kernel(const int32_t* __restrict__ ids, int64_t P, int E,
                                                          const int32_t* __restrict__ chunk_base,
                                                          int32_t* __restrict__ sorted_pair) {
  __shared__ int chunk_ids[kChunk];
  const int64_t c = blockIdx.x, i = c * kChunk + threadIdx.x;
  const int e = i < P ? ids[i] : -1;
  chunk_ids[threadIdx.x] = e;
  __syncthreads();
  if (e < 0 || e >= E) return;
  int before = 0;
  for (int j = 0; j < static_cast<int>(threadIdx.x); ++j) before += chunk_ids[j] == e;
  sorted_pair[chunk_base[c * E + e] + before] = static_cast<int32_t>(i);
}

// ---------------------------------------------------------------- grouped GEMMs

constexpr int kGemmThreads = 128;  // 4 warps, each owning 16 of the tile's weight rows
constexpr int kTileN = 64;         // weight rows per block
constexpr int kTileK = 128;        // K per step; K itself is a multiple of 32, the last step may be partial
constexpr int kLds = kTileK + 8;   // bf16 row stride in shared memory: 272 bytes, an odd number of 16-byte units
constexpr int kLdc = kTileN + 4;   // fp32 row stride of the epilogue tile
constexpr int kGateCols = kTileN / 2;

enum class Stage { gate_up, down };

struct GemmArgs {
  const uint16_t* act;  // gate_up: x [T, D], rows gathered through sorted_pair; down: h [P, F] in sorted order
  int top_k;
  int64_t K;                // D (gate_up) or F (down)
  int64_t N;                // F (gate_up: columns of gate and of up) or D (down)
  int64_t rows_per_expert;  // weight rows per expert: 2F or D
  const uint16_t* w;        // bf16 [E, rows_per_expert, K]
  const uint8_t* w_packed;  // mxfp4 [E, rows_per_expert, K/2]
  const uint8_t* w_scales;  // mxfp4 [E, rows_per_expert, K/32]
  const int2* tiles;
  const int32_t* expert_offset;
  const int32_t* sorted_pair;
  uint16_t* h;      // gate_up output [P, F] bf16, sorted order
  float* pair_out;  // down output [P, D], pair order
};

__device__ float e2m1_to_float(uint32_t code) {
  const uint32_t m = code & 7u;
  // m = 2e + b (e > 0): (1 + b/2) * 2^(e-1); m < 2: m / 2.
  const float magnitude = m < 2 ? 0.5f * static_cast<float>(m)
                                : __int_as_float(static_cast<int>(((m >> 1) + 126u) << 23)) * (1.0f + 0.5f * (m & 1u));
  return (code & 8u) ? -magnitude : magnitude;
}

__device__ float e8m0_to_float(uint32_t e) {
  if (e == 0xFFu) return __int_as_float(0x7fc00000);
  return e == 0 ? __int_as_float(0x00400000) : __int_as_float(static_cast<int>(e << 23));  // 2^-127 is subnormal
}

// Two e2m1 codes of one byte (element 2i in the low nibble) times the block scale, as a bf16 pair; every product is
// exact in fp32 and in bf16.
__device__ uint32_t mxfp4_pair_to_bf16x2(uint32_t byte, float scale) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(e2m1_to_float(byte & 0xFu) * scale, e2m1_to_float(byte >> 4) * scale);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ float silu_times(float gate, float up) {
  const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gate)));
  return __fmul_rn(__fmul_rn(gate, sig), up);
}

template <int kRows, bool kMxfp4, Stage kStage>
__global__ void __launch_bounds__(kGemmThreads) grouped_gemm_kernel(GemmArgs a) {
  using namespace nvcuda;
  constexpr int kMFrags = kRows / 16;
  constexpr int kChunksPerRow = kTileK / 8;                        // 16-byte bf16 chunks per row and step
  constexpr int kAChunks = kRows * kChunksPerRow / kGemmThreads;   // activation chunks per thread
  constexpr int kBlocksPerRow = kTileK / 32;                       // MXFP4 blocks (16 packed bytes) per row and step
  constexpr int kBChunks = kMxfp4 ? kTileN * kBlocksPerRow / kGemmThreads : kTileN * kChunksPerRow / kGemmThreads;
  constexpr int kBRowsPerPass = kGemmThreads / (kMxfp4 ? kBlocksPerRow : kChunksPerRow);
  constexpr int kSmemAB = (kRows + kTileN) * kLds * 2;
  constexpr int kSmemC = kRows * kLdc * 4;
  constexpr int kSmem = kSmemAB > kSmemC ? kSmemAB : kSmemC;
  __shared__ __align__(128) unsigned char smem[kSmem];
  __nv_bfloat16* As = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* Bs = As + kRows * kLds;
  float* Cs = reinterpret_cast<float*>(smem);  // reused after the K loop

  const int2 tile = a.tiles[blockIdx.x];
  if (tile.x < 0) return;
  const int64_t expert = tile.x;
  const int row0 = tile.y;
  const int rows = min(kRows, a.expert_offset[expert + 1] - row0);
  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t K = a.K;

  // Activation chunk j of this thread: row tid / 16 + 8 j of the tile, columns (tid % 16) * 8 .. + 7 of the step.
  const int a_col = (tid % kChunksPerRow) * 8;
  const uint16_t* a_src[kAChunks];
#pragma unroll
  for (int j = 0; j < kAChunks; ++j) {
    const int r = tid / kChunksPerRow + j * (kGemmThreads / kChunksPerRow);
    a_src[j] = nullptr;
    if (r < rows) {
      const int p = row0 + r;
      const int64_t src_row = kStage == Stage::gate_up ? a.sorted_pair[p] / a.top_k : p;
      a_src[j] = a.act + src_row * K + a_col;
    }
  }
  // Weight chunk j of this thread: tile row tid / (chunks per row) + j * kBRowsPerPass.
  const int b_part = kMxfp4 ? tid % kBlocksPerRow : tid % kChunksPerRow;
  int64_t b_row[kBChunks];
#pragma unroll
  for (int j = 0; j < kBChunks; ++j) {
    const int i = tid / (kMxfp4 ? kBlocksPerRow : kChunksPerRow) + j * kBRowsPerPass;
    int64_t wr;
    if constexpr (kStage == Stage::gate_up) {
      const int64_t f0 = static_cast<int64_t>(blockIdx.y) * kGateCols;
      wr = i < kGateCols ? f0 + i : a.N + f0 + (i - kGateCols);
    } else {
      const int64_t d = static_cast<int64_t>(blockIdx.y) * kTileN + i;
      wr = d < a.N ? d : -1;
    }
    b_row[j] = wr < 0 ? -1 : expert * a.rows_per_expert + wr;
  }

  uint4 a_reg[kAChunks];
  uint4 b_reg[kBChunks];
  uint32_t s_reg[kMxfp4 ? kBChunks : 1];
  auto load = [&](int64_t k0) {
    const bool a_in = k0 + a_col < K;
#pragma unroll
    for (int j = 0; j < kAChunks; ++j)
      a_reg[j] = a_src[j] && a_in ? *reinterpret_cast<const uint4*>(a_src[j] + k0) : make_uint4(0, 0, 0, 0);
    if constexpr (kMxfp4) {
      const bool in = k0 + b_part * 32 < K;
#pragma unroll
      for (int j = 0; j < kBChunks; ++j) {
        const bool ok = b_row[j] >= 0 && in;
        b_reg[j] = ok ? *reinterpret_cast<const uint4*>(a.w_packed + b_row[j] * (K / 2) + k0 / 2 + b_part * 16)
                      : make_uint4(0, 0, 0, 0);
        s_reg[j] = ok ? a.w_scales[b_row[j] * (K / 32) + k0 / 32 + b_part] : 0u;
      }
    } else {
      const bool in = k0 + b_part * 8 < K;
#pragma unroll
      for (int j = 0; j < kBChunks; ++j)
        b_reg[j] = b_row[j] >= 0 && in ? *reinterpret_cast<const uint4*>(a.w + b_row[j] * K + k0 + b_part * 8)
                                       : make_uint4(0, 0, 0, 0);
    }
  };
  auto store = [&]() {
#pragma unroll
    for (int j = 0; j < kAChunks; ++j) {
      const int r = tid / kChunksPerRow + j * (kGemmThreads / kChunksPerRow);
      *reinterpret_cast<uint4*>(As + r * kLds + a_col) = a_reg[j];
    }
#pragma unroll
    for (int j = 0; j < kBChunks; ++j) {
      const int i = tid / (kMxfp4 ? kBlocksPerRow : kChunksPerRow) + j * kBRowsPerPass;
      if constexpr (kMxfp4) {
        // A zero-filled chunk has scale code 0 (2^-127) and zero codes: it expands to zeros.
        const float scale = e8m0_to_float(s_reg[j]);
        const uint32_t words[4] = {b_reg[j].x, b_reg[j].y, b_reg[j].z, b_reg[j].w};
        uint4* dst = reinterpret_cast<uint4*>(Bs + i * kLds + b_part * 32);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint32_t wd = words[q];
          dst[q] = make_uint4(mxfp4_pair_to_bf16x2(wd & 0xFFu, scale), mxfp4_pair_to_bf16x2((wd >> 8) & 0xFFu, scale),
                              mxfp4_pair_to_bf16x2((wd >> 16) & 0xFFu, scale), mxfp4_pair_to_bf16x2(wd >> 24, scale));
        }
      } else {
        *reinterpret_cast<uint4*>(Bs + i * kLds + b_part * 8) = b_reg[j];
      }
    }
  };

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kMFrags];
#pragma unroll
  for (int m = 0; m < kMFrags; ++m) wmma::fill_fragment(acc[m], 0.0f);

  const int64_t n_steps = (K + kTileK - 1) / kTileK;
  load(0);
  for (int64_t step = 0; step < n_steps; ++step) {
    store();
    __syncthreads();
    if (step + 1 < n_steps) load((step + 1) * kTileK);
#pragma unroll
    for (int ks = 0; ks < kTileK / 16; ++ks) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b_frag;
      wmma::load_matrix_sync(b_frag, Bs + warp * 16 * kLds + ks * 16, kLds);
#pragma unroll
      for (int m = 0; m < kMFrags; ++m) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a_frag;
        wmma::load_matrix_sync(a_frag, As + m * 16 * kLds + ks * 16, kLds);
        wmma::mma_sync(acc[m], a_frag, b_frag, acc[m]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int m = 0; m < kMFrags; ++m)
    wmma::store_matrix_sync(Cs + m * 16 * kLdc + warp * 16, acc[m], kLdc, wmma::mem_row_major);
  __syncthreads();

  if constexpr (kStage == Stage::gate_up) {
    const int64_t f0 = static_cast<int64_t>(blockIdx.y) * kGateCols;
    for (int idx = tid; idx < kRows * kGateCols; idx += kGemmThreads) {
      const int r = idx / kGateCols, f = idx % kGateCols;
      if (r >= rows) break;
      const float hv = silu_times(Cs[r * kLdc + f], Cs[r * kLdc + kGateCols + f]);
      const __nv_bfloat16 hb = __float2bfloat16_rn(hv);
      a.h[static_cast<int64_t>(row0 + r) * a.N + f0 + f] = *reinterpret_cast<const uint16_t*>(&hb);
    }
  } else {
    const int64_t d0 = static_cast<int64_t>(blockIdx.y) * kTileN;
    for (int idx = tid; idx < kRows * kTileN; idx += kGemmThreads) {
      const int r = idx / kTileN, d = idx % kTileN;
      if (r >= rows) break;
      if (d0 + d < a.N) a.pair_out[static_cast<int64_t>(a.sorted_pair[row0 + r]) * a.N + d0 + d] = Cs[r * kLdc + d];
    }
  }
}

template <int kRows>
cudaError_t launch_gemm(bool mxfp4, Stage stage, dim3 grid, const GemmArgs& g, cudaStream_t s) {
  if (stage == Stage::gate_up) {
    if (mxfp4) {
      grouped_gemm_kernel<kRows, true, Stage::gate_up><<<grid, kGemmThreads, 0, s>>>(g);
    } else {
      grouped_gemm_kernel<kRows, false, Stage::gate_up><<<grid, kGemmThreads, 0, s>>>(g);
    }
  } else {
    if (mxfp4) {
      grouped_gemm_kernel<kRows, true, Stage::down><<<grid, kGemmThreads, 0, s>>>(g);
    } else {
      grouped_gemm_kernel<kRows, false, Stage::down><<<grid, kGemmThreads, 0, s>>>(g);
    }
  }
  return cudaGetLastError();
}

cudaError_t launch_gemm(int rows_per_tile, bool mxfp4, Stage stage, dim3 grid, const GemmArgs& g, cudaStream_t s) {
  switch (rows_per_tile) {
    case 16: return launch_gemm<16>(mxfp4, stage, grid, g, s);
    case 32: return launch_gemm<32>(mxfp4, stage, grid, g, s);
    case 48: return launch_gemm<48>(mxfp4, stage, grid, g, s);
    case 64: return launch_gemm<64>(mxfp4, stage, grid, g, s);
    default: return cudaErrorInvalidValue;
  }
}

// ---------------------------------------------------------------- FP8 block-scaled grouped GEMMs

struct Fp8GemmArgs {
  const uint8_t* act;      // gate_up: x codes [T, D]; down: h codes [P, F] in sorted order
  const float* act_scales;  // [rows, K / 128]
  int top_k;
  int64_t K;                // D (gate_up) or F (down)
  int64_t N;                // F (gate_up: columns of gate and of up) or D (down)
  int64_t rows_per_expert;  // weight rows per expert: 2F or D
  const uint8_t* w;         // [E, rows_per_expert, K]
  const float* w_scales;    // [E, rows_per_expert / 128, K / 128]
  const int2* tiles;
  const int32_t* expert_offset;
  const int32_t* sorted_pair;
  float* h;         // gate_up output [P, F] fp32, sorted order
  float* pair_out;  // down output [P, D], pair order
};

template <int kRows, Stage kStage>
__global__ void __launch_bounds__(fp8mma::kThreads) fp8_grouped_gemm_kernel(Fp8GemmArgs a) {
  const int2 tile = a.tiles[blockIdx.x];
  if (tile.x < 0) return;
  const int64_t expert = tile.x;
  const int row0 = tile.y;
  const int rows = min(kRows, a.expert_offset[expert + 1] - row0);
  const int64_t groups = a.K / fp8mma::kTileK;
  const fp8mma::ActOperand A{a.act, a.K, a.act_scales, groups, 1};
  const fp8mma::WeightOperand W{a.w + expert * a.rows_per_expert * a.K, a.K,
                                a.w_scales + expert * (a.rows_per_expert / fp8mma::kTileK) * groups, groups,
                                a.rows_per_expert, kStage == Stage::gate_up ? a.N : 0};
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (kStage == Stage::gate_up) {
    const int64_t f0 = static_cast<int64_t>(blockIdx.y) * (fp8mma::kTileN / 2);
    auto src_row = [&](int r) -> int64_t { return r < rows ? a.sorted_pair[row0 + r] / a.top_k : -1; };
    fp8mma::Accum<kRows> acc;
    fp8mma::block_tile<kRows, fp8mma::WeightRows::gate_up>(A, W, f0, a.K, static_cast<int>(groups), src_row, acc);
    const int64_t f = f0 + 8 * warp + 2 * t;
#pragma unroll
    for (int mf = 0; mf < kRows / 16; ++mf)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mf * 16 + g + 8 * half;
        if (r >= rows) continue;
        const float2 hv = make_float2(silu_times(acc.v[mf][0][2 * half], acc.v[mf][1][2 * half]),
                                      silu_times(acc.v[mf][0][2 * half + 1], acc.v[mf][1][2 * half + 1]));
        *reinterpret_cast<float2*>(a.h + static_cast<int64_t>(row0 + r) * a.N + f) = hv;
      }
  } else {
    const int64_t d0 = static_cast<int64_t>(blockIdx.y) * fp8mma::kTileN;
    auto src_row = [&](int r) -> int64_t { return r < rows ? row0 + r : -1; };
    fp8mma::Accum<kRows> acc;
    fp8mma::block_tile<kRows, fp8mma::WeightRows::contiguous>(A, W, d0, a.K, static_cast<int>(groups), src_row, acc);
#pragma unroll
    for (int mf = 0; mf < kRows / 16; ++mf)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mf * 16 + g + 8 * half;
        if (r >= rows) continue;
        float* out = a.pair_out + static_cast<int64_t>(a.sorted_pair[row0 + r]) * a.N + d0 + 16 * warp + 2 * t;
#pragma unroll
        for (int nf = 0; nf < 2; ++nf)
          *reinterpret_cast<float2*>(out + 8 * nf) = make_float2(acc.v[mf][nf][2 * half], acc.v[mf][nf][2 * half + 1]);
      }
  }
}

template <Stage kStage>
cudaError_t launch_fp8_gemm(int rows_per_tile, dim3 grid, const Fp8GemmArgs& g, cudaStream_t s) {
  switch (rows_per_tile) {
    case 16: fp8_grouped_gemm_kernel<16, kStage><<<grid, fp8mma::kThreads, 0, s>>>(g); break;
    case 32: fp8_grouped_gemm_kernel<32, kStage><<<grid, fp8mma::kThreads, 0, s>>>(g); break;
    case 48: fp8_grouped_gemm_kernel<48, kStage><<<grid, fp8mma::kThreads, 0, s>>>(g); break;
    case 64: fp8_grouped_gemm_kernel<64, kStage><<<grid, fp8mma::kThreads, 0, s>>>(g); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// Quantization of x, gate/up with swiglu, quantization of the swiglu rows, down; the sort has run.
cudaError_t launch_fp8_experts(const MoeExpertArgs& a, const int2* tiles, cudaStream_t s) {
  const int64_t P = a.T * a.top_k, D = a.w.D, F = a.w.F;
  const QuantizeArgs xq{a.x_f32, a.T, a.T, D, D, a.x_codes, D, a.x_scales, D / fp8mma::kTileK, 1};
  if (cudaError_t err = launch_quantize_fp8(xq, s); err != cudaSuccess) return err;
  const Fp8GemmArgs gate_up{a.x_codes, a.x_scales, a.top_k, D, F, 2 * F, a.w.fp8_w13, a.w.fp8_w13_scales,
                            tiles, a.expert_offset, a.sorted_pair, a.h_f32, a.pair_out};
  const dim3 gate_up_grid(static_cast<unsigned>(a.max_tiles), static_cast<unsigned>(F / (fp8mma::kTileN / 2)));
  if (cudaError_t err = launch_fp8_gemm<Stage::gate_up>(a.rows_per_tile, gate_up_grid, gate_up, s); err != cudaSuccess)
    return err;
  const QuantizeArgs hq{a.h_f32, P, P, F, F, a.h_codes, F, a.h_scales, F / fp8mma::kTileK, 1};
  if (cudaError_t err = launch_quantize_fp8(hq, s); err != cudaSuccess) return err;
  const Fp8GemmArgs down{a.h_codes, a.h_scales, a.top_k, F, D, D, a.w.fp8_w2, a.w.fp8_w2_scales,
                         tiles, a.expert_offset, a.sorted_pair, a.h_f32, a.pair_out};
  const dim3 down_grid(static_cast<unsigned>(a.max_tiles), static_cast<unsigned>(D / fp8mma::kTileN));
  return launch_fp8_gemm<Stage::down>(a.rows_per_tile, down_grid, down, s);
}

// ---------------------------------------------------------------- combine

constexpr int kCombineThreads = 128;  // each thread sums 4 consecutive columns of one token

__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const float* __restrict__ pair_out,
                                                                   const int32_t* __restrict__ ids,
                                                                   const float* __restrict__ weights, int top_k,
                                                                   int E, int64_t D, float* __restrict__ y) {
  const int64_t t = blockIdx.x;
  const int64_t c4 = static_cast<int64_t>(blockIdx.y) * kCombineThreads + threadIdx.x;
  if (c4 * 4 >= D) return;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int s = 0; s < top_k; ++s) {
    const int64_t pair = t * top_k + s;
    const int e = ids[pair];
    if (e < 0 || e >= E) continue;
    const float w = weights[pair];
    const float4 o = reinterpret_cast<const float4*>(pair_out + pair * D)[c4];
    acc.x = __fadd_rn(acc.x, __fmul_rn(w, o.x));
    acc.y = __fadd_rn(acc.y, __fmul_rn(w, o.y));
    acc.z = __fadd_rn(acc.z, __fmul_rn(w, o.z));
    acc.w = __fadd_rn(acc.w, __fmul_rn(w, o.w));
  }
  reinterpret_cast<float4*>(y + t * D)[c4] = acc;
}

}  // namespace

cudaError_t launch_moe_route(const MoeRouteArgs& a, cudaStream_t s) {
  const int threads = (a.n_experts + 31) / 32 * 32;
  route_kernel<<<static_cast<unsigned>(a.T), threads, 0, s>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_moe_experts(const MoeExpertArgs& a, cudaStream_t s) {
  const int64_t P = a.T * a.top_k;
  const int E = a.w.n_experts;
  const int64_t n_chunks = (P + kChunk - 1) / kChunk;
  const bool mxfp4 = a.w.dtype == ExpertDtype::mxfp4;
  const int64_t D = a.w.D, F = a.w.F;

  count_kernel<<<static_cast<unsigned>(n_chunks), kChunk, 0, s>>>(a.ids, P, E, a.chunk_base);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  auto* tiles = reinterpret_cast<int2*>(a.tiles);
  plan_kernel<<<1, kPlanThreads, 0, s>>>(n_chunks, E, a.rows_per_tile, a.max_tiles, a.chunk_base, a.expert_offset,
                                         a.tile_start, tiles);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  scatter_kernel<<<static_cast<unsigned>(n_chunks), kChunk, 0, s>>>(a.ids, P, E, a.chunk_base, a.sorted_pair);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;

  if (a.w.dtype == ExpertDtype::fp8_block) {
    if (cudaError_t err = launch_fp8_experts(a, tiles, s); err != cudaSuccess) return err;
  } else {
    GemmArgs gate_up{a.x,           a.top_k,       D,     F,        2 * F,         a.w.w13, a.w.w13_packed,
                     a.w.w13_scales, tiles,      a.expert_offset, a.sorted_pair, a.h,     a.pair_out};
    const dim3 gate_up_grid(static_cast<unsigned>(a.max_tiles), static_cast<unsigned>(F / kGateCols));
    if (cudaError_t err = launch_gemm(a.rows_per_tile, mxfp4, Stage::gate_up, gate_up_grid, gate_up, s);
        err != cudaSuccess)
      return err;

    GemmArgs down{a.h,          a.top_k,       F,     D,        D,             a.w.w2, a.w.w2_packed,
                  a.w.w2_scales, tiles,        a.expert_offset, a.sorted_pair, a.h,    a.pair_out};
    const dim3 down_grid(static_cast<unsigned>(a.max_tiles), static_cast<unsigned>((D + kTileN - 1) / kTileN));
    if (cudaError_t err = launch_gemm(a.rows_per_tile, mxfp4, Stage::down, down_grid, down, s); err != cudaSuccess)
      return err;
  }

  const dim3 combine_grid(static_cast<unsigned>(a.T),
                          static_cast<unsigned>((D / 4 + kCombineThreads - 1) / kCombineThreads));
  combine_kernel<<<combine_grid, kCombineThreads, 0, s>>>(a.pair_out, a.ids, a.weights, a.top_k, E, D, a.y);
  return cudaGetLastError();
}

}  // namespace kestrel::cuda::detail
