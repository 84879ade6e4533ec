// Kernels of fp4_cache.h: the NVFP4 latent writer and the MXFP4 index-key writer, plain CUDA over the device
// functions of fp4_cache.cuh. The host checks live in fp4_cache.cpp.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/fp4_cache.cuh"
#include "kernels/cuda/fp4_cache.h"
#include "kernels/cuda/quant_device.cuh"

namespace kestrel::cuda::detail {
namespace {

using fp4::kE4m3NaN;
using fp4::kE8m0NaN;
using fp4::kMxfp4Block;
using fp4::kNvfp4Block;

constexpr float kE4m3MaxFinite = 448.0f;
constexpr float kE2m1MaxFinite = 6.0f;

// ---------------------------------------------------------------- NVFP4 latent

constexpr int kLatentThreads = 64;

// One CTA per token: thread i encodes blocks i, i + 64, ... of 16 latent values (nvfp4_encode), then tail values
// i, i + 64, ... (the e4m3 codes of write_latent's tail).
__global__ __launch_bounds__(kLatentThreads) void latent_write_nvfp4_kernel(const float* __restrict__ kv, int64_t ldkv,
                                                                            int C, int R, float kv_scale,
                                                                            const int64_t* __restrict__ slots,
                                                                            Pages pages) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  const int64_t entry_bytes = C / 2 + C / kNvfp4Block + R;
  const int64_t page = slot / pages.page_size, row = slot % pages.page_size;
  uint8_t* entry = pages.base + page * pages.page_stride + row * entry_bytes;
  uint8_t* scales = entry + C / 2;
  const float* x = kv + t * ldkv;
  const float block_scale_unit = __fmul_rn(kE2m1MaxFinite, kv_scale);
  for (int b = threadIdx.x; b < C / kNvfp4Block; b += kLatentThreads) {
    const float* v = x + b * kNvfp4Block;
    float amax = 0.0f;
    bool finite = true;
#pragma unroll
    for (int i = 0; i < kNvfp4Block; ++i) {
      finite = finite && isfinite(v[i]);
      amax = fmaxf(amax, fabsf(v[i]));
    }
    uint8_t* packed = entry + b * (kNvfp4Block / 2);
    if (!finite) {  // the CPU throws; a NaN block scale makes all 16 values NaN
      scales[b] = kE4m3NaN;
      for (int j = 0; j < kNvfp4Block / 2; ++j) packed[j] = 0;
      continue;
    }
    const uint8_t scale_code = fp4::e4m3_code(__fdiv_rn(amax, block_scale_unit));
    scales[b] = scale_code;
    const float block_scale = __fmul_rn(fp4::e4m3_value(scale_code), kv_scale);
#pragma unroll
    for (int j = 0; j < kNvfp4Block / 2; ++j) {
      uint32_t lo = 0, hi = 0;
      if (block_scale != 0.0f) {
        lo = fp4::e2m1_code(__fdiv_rn(v[2 * j], block_scale));
        hi = fp4::e2m1_code(__fdiv_rn(v[2 * j + 1], block_scale));
      }
      packed[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
  uint8_t* tail = scales + C / kNvfp4Block;
  for (int i = threadIdx.x; i < R; i += kLatentThreads) {
    // e4m3(clamp(v / kv_scale, -448, 448)): the clamp passes NaN through, which e4m3_code maps to 0x7F.
    const float y = __fdiv_rn(x[C + i], kv_scale);
    tail[i] = fp4::e4m3_code(y < -kE4m3MaxFinite ? -kE4m3MaxFinite : (kE4m3MaxFinite < y ? kE4m3MaxFinite : y));
  }
}

// ---------------------------------------------------------------- MXFP4 index keys

constexpr int kKeyWarps = 8;
constexpr int kKeyThreads = kKeyWarps * 32;

// One warp per key: the Hadamard rotation of cpu::hadamard_inplace in shared memory (the butterflies of one stage
// touch disjoint pairs, each by one lane, so a stage is the CPU's stage whatever lane does which pair), then
// mxfp4_encode block by block.
__global__ __launch_bounds__(kKeyThreads) void key_write_mxfp4_kernel(const float* __restrict__ keys, int64_t T, int D,
                                                                      float dim_norm,
                                                                      const int64_t* __restrict__ slots, Pages pages) {
  extern __shared__ float key_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kKeyWarps + warp;
  if (t >= T) return;  // whole warps only: no CTA-wide barrier below
  const int64_t slot = slots[t];
  if (slot < 0) return;
  float* buf = key_smem + warp * D;
  quant::hadamard_butterflies_warp(keys + t * D, D, buf);
  bool finite = true;
  for (int i = lane; i < D; i += 32) {
    const float v = __fmul_rn(buf[i], dim_norm);
    buf[i] = v;
    finite = finite && isfinite(v);
  }
  finite = __all_sync(0xFFFFFFFFu, finite);
  __syncwarp();

  const int64_t page = slot / pages.page_size, row = slot % pages.page_size;
  uint8_t* page_base = pages.base + page * pages.page_stride;
  uint8_t* packed = page_base + row * (D / 2);
  uint8_t* exponents = page_base + int64_t{pages.page_size} * (D / 2) + row * (D / kMxfp4Block);
  if (!finite) {  // the CPU throws; the E8M0 NaN marks the key (fp4_cache.h)
    for (int i = lane; i < D / 2; i += 32) packed[i] = 0;
    for (int b = lane; b < D / kMxfp4Block; b += 32) exponents[b] = kE8m0NaN;
    return;
  }
  for (int b = 0; b < D / kMxfp4Block; ++b)
    fp4::mxfp4_encode_block_warp(buf[b * kMxfp4Block + lane], packed + b * (kMxfp4Block / 2), exponents + b);
}

}  // namespace

cudaError_t launch_mla_latent_write_nvfp4(const float* kv, int64_t ldkv, int64_t T, int C, int R, float kv_scale,
                                          const int64_t* slots, const Pages& pages, cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  latent_write_nvfp4_kernel<<<static_cast<unsigned>(T), kLatentThreads, 0, s>>>(kv, ldkv, C, R, kv_scale, slots,
                                                                                 pages);
  return cudaGetLastError();
}

cudaError_t launch_index_key_write_mxfp4(const float* keys, int64_t T, int head_dim, float dim_norm,
                                         const int64_t* slots, const Pages& index_pages, cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((T + kKeyWarps - 1) / kKeyWarps);
  const size_t smem = size_t{kKeyWarps} * head_dim * sizeof(float);
  key_write_mxfp4_kernel<<<blocks, kKeyThreads, smem, s>>>(keys, T, head_dim, dim_norm, slots, index_pages);
  return cudaGetLastError();
}

}  // namespace kestrel::cuda::detail
