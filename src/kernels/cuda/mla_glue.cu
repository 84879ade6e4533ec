// Kernels of mla_glue.h. All are plain CUDA with fp32 math; the host checks live in mla_glue.cpp.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "kernels/cuda/fp4_cache.cuh"
#include "kernels/cuda/fp4_cache.h"
#include "kernels/cuda/mla_glue.h"
#include "kernels/cuda/v32_glue.h"

namespace kestrel::cuda::detail {
namespace {

constexpr float kE4m3MaxFinite = 448.0f;
constexpr uint8_t kE4m3NaN = 0x7F;

// ---------------------------------------------------------------- latent writer

// As MlaCore::write_latent: e4m3(clamp(v / kv_scale, -448, 448)) with a correctly rounded division. The clamp
// passes NaN through (std::clamp does) and f32_to_e4m3 maps every NaN to 0x7F, whatever its sign; the hardware
// conversion keeps the sign, hence the explicit case.
__device__ __forceinline__ uint8_t scaled_e4m3(float v, float kv_scale) {
  const float x = __fdiv_rn(v, kv_scale);
  if (isnan(x)) return kE4m3NaN;
  const float clamped = x < -kE4m3MaxFinite ? -kE4m3MaxFinite : (kE4m3MaxFinite < x ? kE4m3MaxFinite : x);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(clamped, __NV_SATFINITE, __NV_E4M3));
}

constexpr int kWriteThreads = 128;

// As f32_to_bf16: round to nearest even by integer addition; a NaN keeps its sign and high payload and is made quiet.
__device__ __forceinline__ uint16_t bf16_bits(float x) {
  const uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// One CTA per token.
__global__ __launch_bounds__(kWriteThreads) void latent_write_fp8_kernel(const float* kv, int64_t ldkv, int C, int R,
                                                                          float kv_scale, const int64_t* slots,
                                                                          Pages pages) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  const int width = C + R;
  const int64_t page = slot / pages.page_size, row = slot % pages.page_size;
  uint8_t* entry = pages.base + page * pages.page_stride + row * width;
  const float* x = kv + t * ldkv;
  for (int i = threadIdx.x; i < width; i += kWriteThreads) entry[i] = scaled_e4m3(x[i], kv_scale);
}

// One CTA per token: the bf16 entry, no scale.
__global__ __launch_bounds__(kWriteThreads) void latent_write_bf16_kernel(const float* kv, int64_t ldkv, int C, int R,
                                                                           const int64_t* slots, Pages pages) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  const int width = C + R;
  const int64_t page = slot / pages.page_size, row = slot % pages.page_size;
  uint16_t* entry = reinterpret_cast<uint16_t*>(pages.base + page * pages.page_stride + row * 2 * width);
  const float* x = kv + t * ldkv;
  for (int i = threadIdx.x; i < width; i += kWriteThreads) entry[i] = bf16_bits(x[i]);
}

// ---------------------------------------------------------------- generic absorbed attention

constexpr int kAttendThreads = 128;
constexpr int kAttendWarps = kAttendThreads / 32;
constexpr int kTile = 32;          // positions per online-softmax step: one per lane in the softmax update
constexpr int kHeadsPerCta = kGenericHeadsPerCta;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct AttendParams {
  const float* q_abs;
  int H, C, R;
  int64_t entry_bytes;  // bytes from one latent entry of a page to the next
  const int32_t* row_req;
  const int32_t* row_pos;
  Pages pages;
  BlockTable bt;
  float kv_scale;
  float softmax_scale;
  const int32_t* indices;
  int k;
  float* out;
  float* lse;
};

// The value the CPU reference reads back: fp32(e4m3 value * kv_scale). e4m3 -> f16 is exact.
__device__ __forceinline__ float dequant(uint8_t code, float kv_scale) {
  const __half h(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3));
  return __fmul_rn(__half2float(h), kv_scale);
}

// Value i (< C + R) of a cached latent entry as MlaCore::read_latent decodes it.
template <LatentEntry kEntry>
__device__ __forceinline__ float latent_value(const uint8_t* entry, int i, int C, float kv_scale) {
  if constexpr (kEntry == LatentEntry::kimi_fp8) {
    return dequant(entry[i], kv_scale);
  } else if constexpr (kEntry == LatentEntry::nvfp4) {
    return fp4::nvfp4_latent_value(entry, i, C, kv_scale);
  } else if constexpr (kEntry == LatentEntry::bf16) {
    return __uint_as_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(entry)[i]) << 16);
  } else {
    // [C codes ; C / 128 fp32 tile scales ; R bf16]: the scales and the tail are aligned (v32_glue.h).
    if (i < C) return dequant(entry[i], reinterpret_cast<const float*>(entry + C)[i / 128]);
    const uint16_t b = reinterpret_cast<const uint16_t*>(entry + C + C / 32)[i - C];
    return __uint_as_float(static_cast<uint32_t>(b) << 16);
  }
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xFFFFFFFFu, x, off);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, off));
  return x;
}

// One CTA per (query row, group of kHeadsPerCta heads), walking the row's candidates in tiles of kTile:
//   1. the tile's row addresses (null for a skipped candidate),
//   2. scores: warp w takes candidates w, w + 4, ...; lanes split the C + R terms, each lane keeps one partial dot per
//      head, and a butterfly sums them,
//   3. online softmax: warp w takes heads w, w + 4, one candidate per lane: new running max, rescale factor,
//      probabilities and running normaliser,
//   4. values: thread i owns value columns i, i + 128, ... (KC of them) of every head, rescales its accumulators and
//      adds the tile's probability-weighted rows in candidate order.
// KC * kAttendThreads >= C.
template <int KC, LatentEntry kEntry>
__global__ __launch_bounds__(kAttendThreads, 1) void attend_generic_kernel(AttendParams p) {
  __shared__ float q_s[kHeadsPerCta * kMaxGenericLatentWidth];
  __shared__ float prob_s[kHeadsPerCta][kTile];  // scores, then probabilities
  __shared__ const uint8_t* row_s[kTile];
  __shared__ float max_s[kHeadsPerCta], sum_s[kHeadsPerCta], alpha_s[kHeadsPerCta];

  const int64_t q = blockIdx.x;
  const int h0 = static_cast<int>(blockIdx.y) * kHeadsPerCta;
  const int nh = min(kHeadsPerCta, p.H - h0);
  const int width = p.C + p.R;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;

  const float* q_src = p.q_abs + (q * p.H + h0) * width;
  for (int i = tid; i < nh * width; i += kAttendThreads) q_s[i] = q_src[i];
  if (tid < kHeadsPerCta) {
    max_s[tid] = kNegInf;
    sum_s[tid] = 0.0f;
  }
  const int req = p.row_req[q], pos = p.row_pos[q];
  const int64_t n = p.indices != nullptr ? p.k : int64_t{pos} + 1;
  const int32_t* row_indices = p.indices != nullptr ? p.indices + q * p.k : nullptr;
  const int32_t* pages_of_req = p.bt.pages + static_cast<int64_t>(req) * p.bt.stride;

  float acc[kHeadsPerCta][KC];
#pragma unroll
  for (int h = 0; h < kHeadsPerCta; ++h)
#pragma unroll
    for (int c = 0; c < KC; ++c) acc[h][c] = 0.0f;

  for (int64_t tile = 0; tile < n; tile += kTile) {
    __syncthreads();  // the previous tile's row_s / prob_s are no longer read
    if (tid < kTile) {
      const int64_t j = tile + tid;
      const uint8_t* row = nullptr;
      if (j < n) {
        const int64_t position = row_indices != nullptr ? int64_t{row_indices[j]} : j;
        if (position >= 0 && position <= pos) {
          const int64_t page = pages_of_req[position / p.pages.page_size];
          row = p.pages.base + page * p.pages.page_stride + (position % p.pages.page_size) * p.entry_bytes;
        }
      }
      row_s[tid] = row;
    }
    __syncthreads();

    for (int j = warp; j < kTile; j += kAttendWarps) {
      const uint8_t* row = row_s[j];
      if (row == nullptr) {
        if (lane < kHeadsPerCta) prob_s[lane][j] = kNegInf;
        continue;
      }
      float dot[kHeadsPerCta];
#pragma unroll
      for (int h = 0; h < kHeadsPerCta; ++h) dot[h] = 0.0f;
      for (int i = lane; i < width; i += 32) {
        const float v = latent_value<kEntry>(row, i, p.C, p.kv_scale);
#pragma unroll
        for (int h = 0; h < kHeadsPerCta; ++h)
          if (h < nh) dot[h] = fmaf(q_s[h * width + i], v, dot[h]);
      }
#pragma unroll
      for (int h = 0; h < kHeadsPerCta; ++h) {
        if (h < nh) {
          const float s = warp_sum(dot[h]);
          if (lane == 0) prob_s[h][j] = s * p.softmax_scale;
        }
      }
    }
    __syncthreads();

    for (int h = warp; h < nh; h += kAttendWarps) {
      const float s = prob_s[h][lane];
      const float old_max = max_s[h];
      const float new_max = fmaxf(old_max, warp_max(s));
      // Until a valid candidate is seen the running max is -inf: nothing to weigh and nothing to rescale.
      const bool any = new_max != kNegInf;
      const float e = any ? expf(s - new_max) : 0.0f;
      const float alpha = any ? expf(old_max - new_max) : 1.0f;
      const float tile_sum = warp_sum(e);
      prob_s[h][lane] = e;
      __syncwarp();  // every lane has read max_s[h] and sum_s[h]
      if (lane == 0) {
        alpha_s[h] = alpha;
        max_s[h] = new_max;
        sum_s[h] = fmaf(sum_s[h], alpha, tile_sum);
      }
    }
    __syncthreads();

#pragma unroll
    for (int h = 0; h < kHeadsPerCta; ++h) {
      const float alpha = h < nh ? alpha_s[h] : 1.0f;
#pragma unroll
      for (int c = 0; c < KC; ++c) acc[h][c] *= alpha;
    }
    for (int j = 0; j < kTile; ++j) {
      const uint8_t* row = row_s[j];
      if (row == nullptr) continue;
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        const int col = tid + c * kAttendThreads;
        if (col < p.C) {
          const float v = latent_value<kEntry>(row, col, p.C, p.kv_scale);
#pragma unroll
          for (int h = 0; h < kHeadsPerCta; ++h)
            if (h < nh) acc[h][c] = fmaf(prob_s[h][j], v, acc[h][c]);
        }
      }
    }
  }
  __syncthreads();  // max_s / sum_s of a row without candidates were set before the loop

#pragma unroll
  for (int h = 0; h < kHeadsPerCta; ++h) {
    if (h < nh) {
      const float denom = sum_s[h];
      float* out = p.out + (q * p.H + h0 + h) * p.C;
#pragma unroll
      for (int c = 0; c < KC; ++c) {
        const int col = tid + c * kAttendThreads;
        if (col < p.C) out[col] = denom > 0.0f ? acc[h][c] / denom : 0.0f;
      }
    }
  }
  if (tid < nh) {
    const float denom = sum_s[tid];
    p.lse[q * p.H + h0 + tid] = denom > 0.0f ? max_s[tid] + logf(denom) : kNegInf;
  }
}

// ---------------------------------------------------------------- fp32 -> bf16 rows

constexpr int kBf16Threads = 256;

// One CTA per row.
__global__ __launch_bounds__(kBf16Threads) void to_bf16_rows_kernel(const float* x, int64_t ldx, int64_t cols,
                                                                     uint16_t* y, int64_t ldy) {
  const int64_t r = blockIdx.x;
  const float* xr = x + r * ldx;
  uint16_t* yr = y + r * ldy;
  for (int64_t j = threadIdx.x; j < cols; j += kBf16Threads) yr[j] = bf16_bits(xr[j]);
}

template <LatentEntry kEntry>
void launch_attend_generic(const AttendParams& p, int64_t rows, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>((p.H + kHeadsPerCta - 1) / kHeadsPerCta));
  const int chunks = (p.C + kAttendThreads - 1) / kAttendThreads;
  if (chunks <= 1) {
    attend_generic_kernel<1, kEntry><<<grid, kAttendThreads, 0, s>>>(p);
  } else if (chunks <= 2) {
    attend_generic_kernel<2, kEntry><<<grid, kAttendThreads, 0, s>>>(p);
  } else if (chunks <= 4) {
    attend_generic_kernel<4, kEntry><<<grid, kAttendThreads, 0, s>>>(p);
  } else {
    attend_generic_kernel<8, kEntry><<<grid, kAttendThreads, 0, s>>>(p);
  }
}

}  // namespace

cudaError_t launch_mla_latent_write_fp8(const float* kv, int64_t ldkv, int64_t T, int C, int R, float kv_scale,
                                        const int64_t* slots, const Pages& pages, cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  latent_write_fp8_kernel<<<static_cast<unsigned>(T), kWriteThreads, 0, s>>>(kv, ldkv, C, R, kv_scale, slots, pages);
  return cudaGetLastError();
}

cudaError_t launch_mla_latent_write_bf16(const float* kv, int64_t ldkv, int64_t T, int C, int R, const int64_t* slots,
                                         const Pages& pages, cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  latent_write_bf16_kernel<<<static_cast<unsigned>(T), kWriteThreads, 0, s>>>(kv, ldkv, C, R, slots, pages);
  return cudaGetLastError();
}

cudaError_t launch_mla_attend_generic(const float* q_abs, int64_t rows, int H, int C, int R, LatentEntry entry,
                                      const int32_t* row_req, const int32_t* row_pos, const Pages& pages,
                                      const BlockTable& block_table, float kv_scale, float softmax_scale,
                                      const int32_t* indices, int k, float* out, float* lse, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  const int64_t entry_bytes = entry == LatentEntry::v32_fp8 ? v32_latent_entry_bytes(C, R)
                              : entry == LatentEntry::nvfp4  ? latent_format_bytes(LatentFormat::nvfp4, C, R)
                              : entry == LatentEntry::bf16   ? bf16_latent_entry_bytes(C, R)
                                                             : int64_t{C} + R;
  const AttendParams p{q_abs, H, C, R, entry_bytes, row_req, row_pos, pages, block_table, kv_scale, softmax_scale,
                       indices, k, out, lse};
  if (entry == LatentEntry::v32_fp8)
    launch_attend_generic<LatentEntry::v32_fp8>(p, rows, s);
  else if (entry == LatentEntry::nvfp4)
    launch_attend_generic<LatentEntry::nvfp4>(p, rows, s);
  else if (entry == LatentEntry::bf16)
    launch_attend_generic<LatentEntry::bf16>(p, rows, s);
  else
    launch_attend_generic<LatentEntry::kimi_fp8>(p, rows, s);
  return cudaGetLastError();
}

cudaError_t launch_to_bf16_rows(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* y, int64_t ldy,
                                cudaStream_t s) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  to_bf16_rows_kernel<<<static_cast<unsigned>(rows), kBf16Threads, 0, s>>>(x, ldx, cols, y, ldy);
  return cudaGetLastError();
}

}  // namespace kestrel::cuda::detail
