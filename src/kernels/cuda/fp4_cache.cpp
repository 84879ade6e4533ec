#include "kernels/cuda/fp4_cache.h"

#include <climits>
#include <cmath>

#include "core/error.h"
#include "kernels/cuda/dsa_generic.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {

namespace {

constexpr int64_t kMaxGridX = INT_MAX;                  // the latent writer: one CTA per token
constexpr int64_t kMaxKeys = int64_t{INT_MAX} * 8;      // the key writer: 8 keys per CTA on the grid's x
constexpr int kNvfp4Block = 16, kMxfp4Block = 32;

bool power_of_two(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

// fp32(n^-1/2), computed as cpu::hadamard_inplace does (in double, rounded once).
float inv_sqrt(int n) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))); }

void check_pages(const char* fn, const Pages& pages, int64_t entry_bytes, const char* what) {
  KESTREL_CHECK(pages.base != nullptr && pages.page_size > 0, "{}: pages need a base and a positive page size, got {}",
                fn, pages.page_size);
  KESTREL_CHECK(pages.page_stride >= int64_t{pages.page_size} * entry_bytes,
                "{}: a page stride of {} bytes cannot hold {} {} of {} bytes", fn, pages.page_stride, pages.page_size,
                what, entry_bytes);
}

}  // namespace

int64_t latent_format_bytes(LatentFormat format, int C, int R) {
  KESTREL_CHECK(C > 0 && R >= 0, "latent_format_bytes: bad latent shape C={} R={}", C, R);
  if (format == LatentFormat::fp8) return int64_t{C} + R;
  KESTREL_CHECK(C % kNvfp4Block == 0, "an NVFP4 latent needs C divisible by {}, got {}", kNvfp4Block, C);
  return int64_t{C} / 2 + C / kNvfp4Block + R;
}

void mla_latent_write_nvfp4(const float* kv, int64_t ldkv, int64_t T, int C, int R, float kv_scale,
                            const int64_t* slots, const Pages& pages, cudaStream_t s) {
  constexpr const char* fn = "mla_latent_write_nvfp4";
  KESTREL_CHECK(C > 0 && C % kNvfp4Block == 0 && R >= 0, "{}: bad latent shape C={} R={} (C a positive multiple of {})",
                fn, C, R, kNvfp4Block);
  KESTREL_CHECK(T >= 0 && T <= kMaxGridX, "{}: T = {} outside [0, {}]", fn, T, kMaxGridX);
  KESTREL_CHECK(ldkv >= int64_t{C} + R, "{}: ldkv {} is shorter than a latent row of {} values", fn, ldkv, C + R);
  // As nvfp4_encode: the largest block scale, 448 * kv_scale, must be finite.
  KESTREL_CHECK(std::isfinite(kv_scale) && kv_scale > 0.0f && std::isfinite(448.0f * kv_scale),
                "{}: kv_scale must be finite, > 0 and at most FLT_MAX / 448, got {}", fn, kv_scale);
  if (T == 0) return;
  KESTREL_CHECK(kv != nullptr && slots != nullptr, "{}: kv and slots must be set", fn);
  check_pages(fn, pages, latent_format_bytes(LatentFormat::nvfp4, C, R), "latent entries");
  KESTREL_CUDA_CHECK(detail::launch_mla_latent_write_nvfp4(kv, ldkv, T, C, R, kv_scale, slots, pages, s));
}

void index_key_write_mxfp4(const float* keys, int64_t T, int head_dim, const int64_t* slots,
                           const Pages& index_pages, cudaStream_t s) {
  constexpr const char* fn = "index_key_write_mxfp4";
  KESTREL_CHECK(power_of_two(head_dim) && head_dim >= kMxfp4Block && head_dim <= kMaxGenericIndexPrepDim,
                "{}: head_dim must be a power of two in [{}, {}], got {}", fn, kMxfp4Block, kMaxGenericIndexPrepDim,
                head_dim);
  KESTREL_CHECK(T >= 0 && T <= kMaxKeys, "{}: T = {} outside [0, {}]", fn, T, kMaxKeys);
  if (T == 0) return;
  KESTREL_CHECK(keys != nullptr && slots != nullptr, "{}: keys and slots must be set", fn);
  check_pages(fn, index_pages, head_dim / 2 + head_dim / kMxfp4Block, "MXFP4 keys");
  KESTREL_CUDA_CHECK(
      detail::launch_index_key_write_mxfp4(keys, T, head_dim, inv_sqrt(head_dim), slots, index_pages, s));
}

}  // namespace kestrel::cuda
