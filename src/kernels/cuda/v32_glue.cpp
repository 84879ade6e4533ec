#include "kernels/cuda/v32_glue.h"

#include <climits>
#include <cstdint>

#include "core/error.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {

namespace {
// Both kernels put one CTA per row or token on the grid's x dimension.
constexpr int64_t kMaxGridX = INT_MAX;
}  // namespace

void rope_rows(float* x, int64_t rows, int64_t ldx, int n_vec, int64_t vec_stride, int dim, RopeStyle style,
               const int32_t* positions, const float* inv_freq, cudaStream_t s) {
  constexpr const char* fn = "rope_rows";
  KESTREL_CHECK(dim > 0 && dim % 2 == 0 && dim <= kMaxRopeDim, "{}: dim must be even and in [2, {}], got {}", fn,
                kMaxRopeDim, dim);
  KESTREL_CHECK(n_vec >= 1, "{}: n_vec must be positive, got {}", fn, n_vec);
  KESTREL_CHECK(n_vec == 1 || vec_stride >= dim, "{}: vector stride {} is smaller than dim {}", fn, vec_stride, dim);
  KESTREL_CHECK(ldx >= int64_t{n_vec - 1} * vec_stride + dim, "{}: ldx {} is shorter than {} vectors of stride {}", fn,
                ldx, n_vec, vec_stride);
  KESTREL_CHECK(style == RopeStyle::interleaved || style == RopeStyle::neox, "{}: unknown RoPE style", fn);
  KESTREL_CHECK(rows >= 0 && rows <= kMaxGridX, "{}: rows = {} outside [0, {}]", fn, rows, kMaxGridX);
  if (rows == 0) return;
  KESTREL_CHECK(x != nullptr && positions != nullptr && inv_freq != nullptr, "{}: x, positions and inv_freq must be set",
                fn);
  KESTREL_CUDA_CHECK(detail::launch_rope_rows(x, rows, ldx, n_vec, vec_stride, dim, style, positions, inv_freq, s));
}

void mla_latent_write_v32(const float* kv, int64_t ldkv, int64_t T, int C, int R, const int64_t* slots,
                          const Pages& pages, cudaStream_t s) {
  constexpr const char* fn = "mla_latent_write_v32";
  KESTREL_CHECK(C > 0 && C % 128 == 0 && R >= 0 && R % 2 == 0,
                "{}: the latent needs C a positive multiple of 128 and R even, got C={} R={}", fn, C, R);
  KESTREL_CHECK(T >= 0 && T <= kMaxGridX, "{}: T = {} outside [0, {}]", fn, T, kMaxGridX);
  KESTREL_CHECK(ldkv >= int64_t{C} + R, "{}: ldkv {} is shorter than a latent row of {} values", fn, ldkv, C + R);
  if (T == 0) return;
  KESTREL_CHECK(kv != nullptr && slots != nullptr, "{}: kv and slots must be set", fn);
  const int64_t entry = v32_latent_entry_bytes(C, R);
  KESTREL_CHECK(pages.base != nullptr && pages.page_size > 0, "{}: pages need a base and a positive page size, got {}",
                fn, pages.page_size);
  KESTREL_CHECK(pages.page_stride >= int64_t{pages.page_size} * entry,
                "{}: a page stride of {} bytes cannot hold {} latent entries of {} bytes", fn, pages.page_stride,
                pages.page_size, entry);
  KESTREL_CHECK(reinterpret_cast<uintptr_t>(pages.base) % 4 == 0 && pages.page_stride % 4 == 0,
                "{}: pages need a 4-byte aligned base and page stride (the tile scales are fp32), got stride {}", fn,
                pages.page_stride);
  KESTREL_CUDA_CHECK(detail::launch_mla_latent_write_v32(kv, ldkv, T, C, R, slots, pages, s));
}

}  // namespace kestrel::cuda
