// Kernels of dsa_generic.h: plain CUDA, every floating-point operation spelled out (__fadd_rn and friends) so that
// nvcc's contraction into fused multiply-adds cannot change a rounding the CPU reference does separately. The host
// checks live in dsa_generic.cpp.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dsa_generic.h"
#include "kernels/cuda/fp4_cache.cuh"
#include "kernels/cuda/quant_device.cuh"

namespace kestrel::cuda::detail {
namespace {

constexpr uint8_t kE4m3NaN = 0x7F;
constexpr float kInvE4m3Max = 1.0f / 448.0f;  // fp32(1/448), as quantize_fp8_ue8m0 multiplies by it
constexpr float kAmaxFloor = 1e-4f;

// ---------------------------------------------------------------- Hadamard + ue8m0 FP8, one warp per vector

constexpr int kPrepWarps = 8;
constexpr int kPrepThreads = kPrepWarps * 32;

// hadamard_inplace then quantize_fp8_ue8m0 of the D values at x, by the calling warp, with buf (D floats of shared
// memory) as its scratch. The butterflies of one stage touch disjoint pairs, each pair by one lane, so a stage is
// the CPU's stage whatever lane does which pair. Writes the codes; returns the scale (NaN for a non-finite vector,
// whose codes are then 0x7F).
__device__ float hadamard_quantize_warp(const float* __restrict__ x, int D, float norm, float* buf,
                                        uint8_t* __restrict__ codes) {
  const int lane = threadIdx.x & 31;
  quant::hadamard_butterflies_warp(x, D, buf);
  bool finite = true;
  float amax = 0.0f;
  for (int i = lane; i < D; i += 32) {
    const float v = __fmul_rn(buf[i], norm);
    buf[i] = v;
    finite = finite && isfinite(v);
    amax = fmaxf(amax, fabsf(v));
  }
  finite = __all_sync(0xFFFFFFFFu, finite);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
  if (!finite) {
    for (int i = lane; i < D; i += 32) codes[i] = kE4m3NaN;
    return __uint_as_float(0x7FC00000u);
  }
  // s is a power of two, so v / s is exact; the saturating conversion is the CPU's clamp to +-448.
  const float s = quant::round_up_pow2(__fmul_rn(fmaxf(amax, kAmaxFloor), kInvE4m3Max));
  for (int i = lane; i < D; i += 32)
    codes[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(buf[i], s), __NV_SATFINITE, __NV_E4M3));
  return s;
}

// Vector v = t * heads + j of q; its folded weight as MlaCore::select: ((w * c_heads) * q_scale) * c_dim, where
// c_dim = fp32(D^-1/2) is also the Hadamard norm.
__global__ __launch_bounds__(kPrepThreads) void query_prep_kernel(const float* __restrict__ q,
                                                                  const float* __restrict__ raw_weights,
                                                                  int64_t vectors, int D, float head_norm,
                                                                  float dim_norm, uint8_t* __restrict__ codes,
                                                                  float* __restrict__ weights) {
  extern __shared__ float prep_smem[];
  const int warp = threadIdx.x / 32;
  const int64_t v = static_cast<int64_t>(blockIdx.x) * kPrepWarps + warp;
  if (v >= vectors) return;  // whole warps only: no CTA-wide barrier below
  const float q_scale = hadamard_quantize_warp(q + v * D, D, dim_norm, prep_smem + warp * D, codes + v * D);
  if ((threadIdx.x & 31) == 0)
    weights[v] = __fmul_rn(__fmul_rn(__fmul_rn(raw_weights[v], head_norm), q_scale), dim_norm);
}

__global__ __launch_bounds__(kPrepThreads) void key_write_kernel(const float* __restrict__ keys, int64_t T, int D,
                                                                 float dim_norm, const int64_t* __restrict__ slots,
                                                                 Pages pages) {
  extern __shared__ float prep_smem[];
  const int warp = threadIdx.x / 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kPrepWarps + warp;
  if (t >= T) return;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  const int64_t page = slot / pages.page_size, row = slot & (pages.page_size - 1);
  uint8_t* page_base = pages.base + page * pages.page_stride;
  const float s = hadamard_quantize_warp(keys + t * D, D, dim_norm, prep_smem + warp * D, page_base + row * D);
  if ((threadIdx.x & 31) == 0) reinterpret_cast<float*>(page_base + int64_t{pages.page_size} * D)[row] = s;
}

// ---------------------------------------------------------------- exact scores

constexpr int kScoreThreads = 128;  // one key per thread
constexpr int kScoreTokens = kGenericScoreTokensPerCta;

struct ScoreParams {
  const uint8_t* codes;
  const float* weights;
  int n_q, heads, D;
  Pages pages;
  BlockTable bt;
  const int32_t* ctx_lens;
  int max_ctx;
  float* scores;
  int64_t stride;
  IndexKeyFormat keys;
};

// e4m3 code -> its value, exactly, as a double (NaN for 0x7F / 0xFF).
__device__ double e4m3_value(int code) {
  const int mag = code & 0x7F;
  if (mag == 0x7F) return __longlong_as_double(0x7FF8000000000000LL);
  const int e = mag >> 3, m = mag & 7;
  const double v = e ? ldexp(static_cast<double>(8 + m), e - 10) : ldexp(static_cast<double>(m), -9);
  return (code & 0x80) ? -v : v;
}

// Shared memory: the code table, the CTA's key tile (rows padded by one word so that the threads' word reads fall in
// distinct banks), the current token's query codes and folded weights.
__host__ __device__ constexpr int64_t score_key_row_bytes(int D) { return D + 4; }
__host__ __device__ constexpr int64_t score_smem_bytes(int D, int heads) {
  return 256 * sizeof(double) + kScoreThreads * score_key_row_bytes(D) + int64_t{heads} * D +
         int64_t{heads} * sizeof(float);
}

// Within the default 48 KiB for every accepted shape: the size is convex in D (for the most heads H = 8192 / D), so
// the largest is at one end of the range of D.
static_assert(score_smem_bytes(kMinGenericIndexScoreDim, kMaxGenericIndexQueryBytes / kMinGenericIndexScoreDim) <=
                  48 * 1024 &&
              score_smem_bytes(kMaxGenericIndexScoreDim, kMaxGenericIndexQueryBytes / kMaxGenericIndexScoreDim) <=
                  48 * 1024);

// CTA (x, r, z): positions 128 x .. 128 x + 127 of request r against query tokens 8 z .. 8 z + 7 of it.
__global__ __launch_bounds__(kScoreThreads) void scores_generic_kernel(ScoreParams p) {
  extern __shared__ __align__(16) uint8_t score_smem[];
  double* lut = reinterpret_cast<double*>(score_smem);
  uint8_t* key_tile = score_smem + 256 * sizeof(double);
  const int64_t key_row = score_key_row_bytes(p.D);
  uint32_t* q_words = reinterpret_cast<uint32_t*>(key_tile + kScoreThreads * key_row);
  float* w = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(q_words) + int64_t{p.heads} * p.D);

  const int r = blockIdx.y;
  const int ctx = min(p.ctx_lens[r], p.max_ctx);
  const int s0 = blockIdx.x * kScoreThreads;
  if (s0 >= ctx) return;  // the same for the whole CTA
  const int tid = threadIdx.x;
  const int s = s0 + tid;
  const int words = p.D / 4;

  for (int b = tid; b < 256; b += kScoreThreads) lut[b] = e4m3_value(b);
  const bool mxfp4 = p.keys == IndexKeyFormat::mxfp4;
  // The key tile, word by word: consecutive threads read consecutive words of a key row. (An MXFP4 key is converted
  // into its tile row by its own thread below.)
  for (int idx = tid; !mxfp4 && idx < kScoreThreads * words; idx += kScoreThreads) {
    const int key = idx / words, word = idx % words;
    const int pos = s0 + key;
    if (pos >= ctx) break;  // idx only grows, and so does pos
    const int page = p.bt.pages[static_cast<int64_t>(r) * p.bt.stride + pos / p.pages.page_size];
    const uint8_t* row = p.pages.base + static_cast<int64_t>(page) * p.pages.page_stride +
                         static_cast<int64_t>(pos & (p.pages.page_size - 1)) * p.D;
    reinterpret_cast<uint32_t*>(key_tile + key * key_row)[word] = reinterpret_cast<const uint32_t*>(row)[word];
  }
  float k_scale = 0.0f;
  if (s < ctx) {
    const int page = p.bt.pages[static_cast<int64_t>(r) * p.bt.stride + s / p.pages.page_size];
    const uint8_t* page_base = p.pages.base + static_cast<int64_t>(page) * p.pages.page_stride;
    const int64_t row = s & (p.pages.page_size - 1);
    if (mxfp4)  // the FP8 codes and scale the CPU scores it as (mxfp4_key_as_fp8)
      k_scale = fp4::mxfp4_key_as_fp8(page_base + row * (p.D / 2),
                                      page_base + int64_t{p.pages.page_size} * (p.D / 2) + row * (p.D / 32), p.D,
                                      key_tile + tid * key_row);
    else
      k_scale = reinterpret_cast<const float*>(page_base + int64_t{p.pages.page_size} * p.D)[row];
  }
  const uint32_t* my_key = reinterpret_cast<const uint32_t*>(key_tile + tid * key_row);

  const int i_end = min(p.n_q, static_cast<int>(blockIdx.z + 1) * kScoreTokens);
  for (int i = blockIdx.z * kScoreTokens; i < i_end; ++i) {
    const int64_t q_row = static_cast<int64_t>(r) * p.n_q + i;
    __syncthreads();  // the previous token's query is no longer read (and, the first time, the tiles are written)
    const uint32_t* q_src = reinterpret_cast<const uint32_t*>(p.codes + q_row * p.heads * p.D);
    for (int idx = tid; idx < p.heads * words; idx += kScoreThreads) q_words[idx] = q_src[idx];
    for (int j = tid; j < p.heads; j += kScoreThreads) w[j] = p.weights[q_row * p.heads + j];
    __syncthreads();
    if (s >= ctx) continue;
    float* out = p.scores + q_row * p.stride + s;
    if (s > ctx - p.n_q + i) {
      *out = -INFINITY;
      continue;
    }
    float acc = 0.0f;
    for (int j = 0; j < p.heads; ++j) {
      const uint32_t* qj = q_words + j * words;
      double dot = 0.0;  // exact: see the header
      for (int k = 0; k < words; ++k) {
        const uint32_t qw = qj[k], kw = my_key[k];
#pragma unroll
        for (int b = 0; b < 32; b += 8) dot = fma(lut[(qw >> b) & 0xFF], lut[(kw >> b) & 0xFF], dot);
      }
      const float d = __double2float_rn(dot);
      // cpu::indexer_scores' ReLU, which keeps a NaN.
      const float relu = d > 0.0f ? d : (d <= 0.0f ? 0.0f : d);
      acc = __fadd_rn(acc, __fmul_rn(w[j], relu));
    }
    *out = __fmul_rn(k_scale, acc);
  }
}

__global__ void shift_ctx_lens_kernel(const int32_t* ctx_lens, int n, int32_t shift, int32_t* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = ctx_lens[i] - shift;
}

}  // namespace

cudaError_t launch_index_query_prep(const float* q, const float* raw_weights, int64_t T, int heads, int head_dim,
                                    float head_norm, float dim_norm, uint8_t* codes, float* weights, cudaStream_t s) {
  const int64_t vectors = T * heads;
  if (vectors == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((vectors + kPrepWarps - 1) / kPrepWarps);
  const size_t smem = size_t{kPrepWarps} * head_dim * sizeof(float);
  query_prep_kernel<<<blocks, kPrepThreads, smem, s>>>(q, raw_weights, vectors, head_dim, head_norm, dim_norm, codes,
                                                       weights);
  return cudaGetLastError();
}

cudaError_t launch_index_key_write_generic(const float* keys, int64_t T, int head_dim, float dim_norm,
                                           const int64_t* slots, const Pages& index_pages, cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((T + kPrepWarps - 1) / kPrepWarps);
  const size_t smem = size_t{kPrepWarps} * head_dim * sizeof(float);
  key_write_kernel<<<blocks, kPrepThreads, smem, s>>>(keys, T, head_dim, dim_norm, slots, index_pages);
  return cudaGetLastError();
}

cudaError_t launch_index_scores_generic(const IndexQueries& queries, int head_dim, const Pages& index_pages,
                                        const BlockTable& block_table, const int32_t* ctx_lens, int max_ctx_len,
                                        float* scores, int64_t score_stride, cudaStream_t s, IndexKeyFormat keys) {
  if (queries.batch == 0 || max_ctx_len == 0) return cudaSuccess;
  const ScoreParams p{queries.codes, queries.weights, queries.n_q, queries.heads, head_dim, index_pages,
                      block_table,   ctx_lens,        max_ctx_len, scores,        score_stride, keys};
  const dim3 grid(static_cast<unsigned>((max_ctx_len + kScoreThreads - 1) / kScoreThreads),
                  static_cast<unsigned>(queries.batch),
                  static_cast<unsigned>((queries.n_q + kScoreTokens - 1) / kScoreTokens));
  scores_generic_kernel<<<grid, kScoreThreads, static_cast<size_t>(score_smem_bytes(head_dim, queries.heads)), s>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_shift_ctx_lens(const int32_t* ctx_lens, int n, int32_t shift, int32_t* out, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  constexpr int kThreads = 128;
  shift_ctx_lens_kernel<<<(n + kThreads - 1) / kThreads, kThreads, 0, s>>>(ctx_lens, n, shift, out);
  return cudaGetLastError();
}

}  // namespace kestrel::cuda::detail
