// Inputs shared by the DSA benchmarks (dsa_decode_bench, dsa_prefill_bench): random index-key and latent pages in
// the layouts the kernels read (src/kernels/cuda/dsa.h), drawn as a small host block and repeated over the pool.
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/formats.h"
#include "kernels/cuda/dsa.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::bench {

constexpr int kDsaPage = 64;  // tokens per page in both DSA benchmarks

// Fills `dst` with copies of a random host block of whole pages (each page valid: codes never NaN).
inline void fill_pages(uint8_t* dst, int64_t pages, int64_t page_bytes, const std::vector<uint8_t>& block) {
  const int64_t block_pages = static_cast<int64_t>(block.size()) / page_bytes;
  cuda::DeviceBuffer<uint8_t> src(block.size());
  src.upload(block.data());
  for (int64_t p = 0; p < pages; p += block_pages) {
    const int64_t n = std::min(block_pages, pages - p);
    KESTREL_CUDA_CHECK(cudaMemcpy(dst + p * page_bytes, src.get(), n * page_bytes, cudaMemcpyDeviceToDevice));
  }
}

// Index-key pages of Gaussian keys: per page 64 x 128 e4m3 codes, then 64 fp32 scales.
inline std::vector<uint8_t> index_key_block(std::mt19937& rng, int pages) {
  std::vector<uint8_t> b(static_cast<size_t>(pages) * kDsaPage * cuda::kIndexKeyBytes);
  std::normal_distribution<float> n(0.0f, 1.0f);
  float x[cuda::kIndexHeadDim];
  for (int p = 0; p < pages; ++p) {
    uint8_t* page = b.data() + static_cast<size_t>(p) * kDsaPage * cuda::kIndexKeyBytes;
    for (int r = 0; r < kDsaPage; ++r) {
      for (float& v : x) v = n(rng);
      const float s = quantize_fp8_ue8m0(x, cuda::kIndexHeadDim, page + r * 128);
      std::memcpy(page + kDsaPage * 128 + 4 * r, &s, 4);
    }
  }
  return b;
}

// Kimi's latent pages: 576 e4m3 codes per row of Gaussian values divided by the layer's kv_scale.
inline std::vector<uint8_t> latent_block(std::mt19937& rng, int pages, float kv_scale) {
  std::vector<uint8_t> b(static_cast<size_t>(pages) * kDsaPage * cuda::kLatentDim);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (uint8_t& c : b) c = f32_to_e4m3(n(rng) / kv_scale);
  return b;
}

// deepseek_v32's entries of Gaussian latent rows, encoded as MlaCore::write_latent does (per tile of 128 codes
// and a ue8m0 scale, then the RoPE part in bf16).
inline std::vector<uint8_t> v32_latent_block(std::mt19937& rng, int pages) {
  constexpr int C = cuda::kLatentValueDim, R = cuda::kLatentDim - C;
  constexpr int E = cuda::kV32LatentEntryBytes;
  std::vector<uint8_t> b(static_cast<size_t>(pages) * kDsaPage * E);
  std::normal_distribution<float> n(0.0f, 1.0f);
  float x[cuda::kLatentDim];
  for (size_t row = 0; row < b.size() / E; ++row) {
    uint8_t* e = b.data() + row * E;
    for (float& v : x) v = n(rng);
    for (int t = 0; t < C / 128; ++t) {
      const float s = quantize_fp8_ue8m0(x + 128 * t, 128, e + 128 * t);
      std::memcpy(e + C + 4 * t, &s, 4);
    }
    for (int i = 0; i < R; ++i) {
      const uint16_t h = f32_to_bf16(x[C + i]);
      std::memcpy(e + C + C / 128 * 4 + 2 * i, &h, 2);
    }
  }
  return b;
}

// bf16 latent entries (SparseMlaEntry::bf16): 576 bf16 values of a Gaussian row, no scale.
inline std::vector<uint8_t> bf16_latent_block(std::mt19937& rng, int pages) {
  std::vector<uint8_t> b(static_cast<size_t>(pages) * kDsaPage * cuda::kBf16LatentEntryBytes);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (size_t i = 0; i < b.size(); i += 2) {
    const uint16_t h = f32_to_bf16(n(rng));
    std::memcpy(&b[i], &h, 2);
  }
  return b;
}

inline int latent_entry_bytes(bool v32) { return v32 ? cuda::kV32LatentEntryBytes : cuda::kLatentDim; }

}  // namespace kestrel::bench
