// Kernels of v32_glue.h: plain CUDA, every fp32 operation that the CPU reference rounds separately spelled out
// (__fmul_rn and friends) so that nvcc's contraction into fused multiply-adds cannot change a rounding. The host
// checks live in v32_glue.cpp.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/quant_device.cuh"
#include "kernels/cuda/v32_glue.h"

namespace kestrel::cuda::detail {
namespace {

// ---------------------------------------------------------------- RoPE

constexpr int kRopeThreads = 128;

// One CTA per row: the row's cos / sin table first (dim / 2 angles), then every (vector, pair) of the row.
__global__ __launch_bounds__(kRopeThreads) void rope_rows_kernel(float* __restrict__ x, int64_t ldx, int n_vec,
                                                                 int64_t vec_stride, int dim, bool neox,
                                                                 const int32_t* __restrict__ positions,
                                                                 const float* __restrict__ inv_freq) {
  __shared__ float cos_s[kMaxRopeDim / 2], sin_s[kMaxRopeDim / 2];
  const int64_t t = blockIdx.x;
  const int half = dim / 2;
  // As the CPU: fp32(pos) * f_i rounded to fp32; then cos / sin of that fp32 angle, rounded to fp32 once.
  const float p = __int2float_rn(positions[t]);
  for (int i = threadIdx.x; i < half; i += kRopeThreads) {
    const float angle = __fmul_rn(p, inv_freq[i]);
    double s = 0.0, c = 0.0;
    sincos(static_cast<double>(angle), &s, &c);
    cos_s[i] = __double2float_rn(c);
    sin_s[i] = __double2float_rn(s);
  }
  __syncthreads();
  float* row = x + t * ldx;
  const int64_t pairs = int64_t{n_vec} * half;
  for (int64_t j = threadIdx.x; j < pairs; j += kRopeThreads) {
    const int64_t v = j / half;
    const int i = static_cast<int>(j % half);
    float* xv = row + v * vec_stride;
    const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    const float a = xv[ia], b = xv[ib], c = cos_s[i], s = sin_s[i];
    xv[ia] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    xv[ib] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
  }
}

// ---------------------------------------------------------------- deepseek_v32 latent writer

constexpr int kWriteWarps = 4;
constexpr int kWriteThreads = kWriteWarps * 32;
constexpr int kTile = 128;                // latent values per scale
constexpr int kPerLane = kTile / 32;      // values of a tile per lane
constexpr uint8_t kE4m3NaN = 0x7F;
constexpr float kInvE4m3Max = 1.0f / 448.0f;  // fp32(1/448), as quantize_fp8_ue8m0 multiplies by it
constexpr float kAmaxFloor = 1e-4f;

// As f32_to_bf16: round to nearest even by integer addition; a NaN keeps its sign and high payload and is made quiet.
__device__ __forceinline__ uint16_t bf16_bits(float x) {
  const uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// One CTA per token: warp w quantises tiles w, w + 4, ... (lane l holds values l, l + 32, l + 64, l + 96 of the
// tile), then every thread writes tail values.
__global__ __launch_bounds__(kWriteThreads) void latent_write_v32_kernel(const float* __restrict__ kv, int64_t ldkv,
                                                                         int C, int R,
                                                                         const int64_t* __restrict__ slots,
                                                                         Pages pages) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  const int64_t entry_bytes = v32_latent_entry_bytes(C, R);
  const int64_t page = slot / pages.page_size, row = slot % pages.page_size;
  uint8_t* entry = pages.base + page * pages.page_stride + row * entry_bytes;
  float* scales = reinterpret_cast<float*>(entry + C);  // 4-byte aligned: base, stride and entry_bytes are
  uint16_t* tail = reinterpret_cast<uint16_t*>(entry + C + C / kTile * 4);
  const float* x = kv + t * ldkv;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;

  for (int tile = warp; tile < C / kTile; tile += kWriteWarps) {
    const float* xt = x + tile * kTile;
    float v[kPerLane];
    bool finite = true;
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      v[k] = xt[lane + 32 * k];
      finite = finite && isfinite(v[k]);
      amax = fmaxf(amax, fabsf(v[k]));
    }
    finite = __all_sync(0xFFFFFFFFu, finite);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    uint8_t* codes = entry + tile * kTile;
    if (!finite) {
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) codes[lane + 32 * k] = kE4m3NaN;
      if (lane == 0) scales[tile] = __uint_as_float(0x7FC00000u);
      continue;
    }
    // s is a power of two, so v / s is exact; the saturating conversion is the CPU's clamp to +-448.
    const float s = quant::round_up_pow2(__fmul_rn(fmaxf(amax, kAmaxFloor), kInvE4m3Max));
#pragma unroll
    for (int k = 0; k < kPerLane; ++k)
      codes[lane + 32 * k] =
          static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(v[k], s), __NV_SATFINITE, __NV_E4M3));
    if (lane == 0) scales[tile] = s;
  }
  for (int i = static_cast<int>(threadIdx.x); i < R; i += kWriteThreads) tail[i] = bf16_bits(x[C + i]);
}

}  // namespace

cudaError_t launch_rope_rows(float* x, int64_t rows, int64_t ldx, int n_vec, int64_t vec_stride, int dim,
                             RopeStyle style, const int32_t* positions, const float* inv_freq, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  rope_rows_kernel<<<static_cast<unsigned>(rows), kRopeThreads, 0, s>>>(x, ldx, n_vec, vec_stride, dim,
                                                                       style == RopeStyle::neox, positions, inv_freq);
  return cudaGetLastError();
}

cudaError_t launch_mla_latent_write_v32(const float* kv, int64_t ldkv, int64_t T, int C, int R, const int64_t* slots,
                                        const Pages& pages, cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  latent_write_v32_kernel<<<static_cast<unsigned>(T), kWriteThreads, 0, s>>>(kv, ldkv, C, R, slots, pages);
  return cudaGetLastError();
}

}  // namespace kestrel::cuda::detail
