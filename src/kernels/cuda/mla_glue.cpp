#include "kernels/cuda/mla_glue.h"

#include <climits>
#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "kernels/cuda/fp4_cache.h"
#include "kernels/cuda/runtime.h"
#include "kernels/cuda/v32_glue.h"

namespace kestrel::cuda {

namespace {

// The kernels put one CTA per token or row on the grid's x dimension.
constexpr int64_t kMaxGridX = INT_MAX;
// mla_attend_generic puts the head groups on the grid's y dimension.
constexpr int kMaxGridY = 65535;

void check_latent_pages(const char* fn, const Pages& pages, int64_t width) {
  KESTREL_CHECK(pages.base != nullptr && pages.page_size > 0, "{}: pages need a base and a positive page size, got {}",
                fn, pages.page_size);
  KESTREL_CHECK(pages.page_stride >= int64_t{pages.page_size} * width,
                "{}: a page stride of {} bytes cannot hold {} latent entries of {} bytes", fn, pages.page_stride,
                pages.page_size, width);
}

// bf16 entries are read and written as 16-bit words.
void check_bf16_alignment(const char* fn, const Pages& pages) {
  KESTREL_CHECK(reinterpret_cast<uintptr_t>(pages.base) % 2 == 0 && pages.page_stride % 2 == 0,
                "{}: bf16 latent pages need a 2-byte aligned base and an even page stride, got stride {}", fn,
                pages.page_stride);
}

}  // namespace

void mla_latent_write_fp8(const float* kv, int64_t ldkv, int64_t T, int C, int R, float kv_scale, const int64_t* slots,
                          const Pages& pages, cudaStream_t s) {
  constexpr const char* fn = "mla_latent_write_fp8";
  KESTREL_CHECK(C > 0 && R >= 0, "{}: bad latent shape C={} R={}", fn, C, R);
  KESTREL_CHECK(T >= 0 && T <= kMaxGridX, "{}: T = {} outside [0, {}]", fn, T, kMaxGridX);
  KESTREL_CHECK(ldkv >= int64_t{C} + R, "{}: ldkv {} is shorter than a latent row of {} values", fn, ldkv, C + R);
  KESTREL_CHECK(std::isfinite(kv_scale) && kv_scale > 0.0f, "{}: kv_scale must be finite and positive, got {}", fn,
                kv_scale);
  if (T == 0) return;
  KESTREL_CHECK(kv != nullptr && slots != nullptr, "{}: kv and slots must be set", fn);
  check_latent_pages(fn, pages, C + R);
  KESTREL_CUDA_CHECK(detail::launch_mla_latent_write_fp8(kv, ldkv, T, C, R, kv_scale, slots, pages, s));
}

void mla_latent_write_bf16(const float* kv, int64_t ldkv, int64_t T, int C, int R, const int64_t* slots,
                           const Pages& pages, cudaStream_t s) {
  constexpr const char* fn = "mla_latent_write_bf16";
  KESTREL_CHECK(C > 0 && R >= 0, "{}: bad latent shape C={} R={}", fn, C, R);
  KESTREL_CHECK(T >= 0 && T <= kMaxGridX, "{}: T = {} outside [0, {}]", fn, T, kMaxGridX);
  KESTREL_CHECK(ldkv >= int64_t{C} + R, "{}: ldkv {} is shorter than a latent row of {} values", fn, ldkv, C + R);
  if (T == 0) return;
  KESTREL_CHECK(kv != nullptr && slots != nullptr, "{}: kv and slots must be set", fn);
  check_latent_pages(fn, pages, bf16_latent_entry_bytes(C, R));
  check_bf16_alignment(fn, pages);
  KESTREL_CUDA_CHECK(detail::launch_mla_latent_write_bf16(kv, ldkv, T, C, R, slots, pages, s));
}

void mla_attend_generic(const float* q_abs, int64_t rows, int H, int C, int R, const int32_t* row_req,
                        const int32_t* row_pos, const Pages& pages, const BlockTable& block_table, float kv_scale,
                        float softmax_scale, const int32_t* indices, int k, float* out, float* lse, cudaStream_t s) {
  mla_attend_generic(q_abs, rows, H, C, R, LatentEntry::kimi_fp8, row_req, row_pos, pages, block_table, kv_scale,
                     softmax_scale, indices, k, out, lse, s);
}

void mla_attend_generic(const float* q_abs, int64_t rows, int H, int C, int R, LatentEntry entry,
                        const int32_t* row_req, const int32_t* row_pos, const Pages& pages,
                        const BlockTable& block_table, float kv_scale, float softmax_scale, const int32_t* indices,
                        int k, float* out, float* lse, cudaStream_t s) {
  constexpr const char* fn = "mla_attend_generic";
  KESTREL_CHECK(H > 0 && C > 0 && R >= 0, "{}: bad shape H={} C={} R={}", fn, H, C, R);
  KESTREL_CHECK(entry == LatentEntry::kimi_fp8 || entry == LatentEntry::v32_fp8 || entry == LatentEntry::nvfp4 ||
                    entry == LatentEntry::bf16,
                "{}: unknown latent entry layout", fn);
  KESTREL_CHECK(entry != LatentEntry::v32_fp8 || (C % 128 == 0 && R % 2 == 0),
                "{}: deepseek_v32 latent entries need C a multiple of 128 and R even, got C={} R={}", fn, C, R);
  KESTREL_CHECK(H <= kMaxGridY * kGenericHeadsPerCta, "{}: H = {} heads, at most {}", fn, H,
                kMaxGridY * kGenericHeadsPerCta);
  KESTREL_CHECK(C + R <= kMaxGenericLatentWidth, "{}: latent rows of C + R = {} values, at most {} are supported", fn,
                C + R, kMaxGenericLatentWidth);
  KESTREL_CHECK(rows >= 0 && rows <= kMaxGridX, "{}: rows = {} outside [0, {}]", fn, rows, kMaxGridX);
  KESTREL_CHECK(std::isfinite(kv_scale) && kv_scale > 0.0f, "{}: kv_scale must be finite and positive, got {}", fn,
                kv_scale);
  KESTREL_CHECK(std::isfinite(softmax_scale), "{}: softmax_scale must be finite, got {}", fn, softmax_scale);
  KESTREL_CHECK(indices == nullptr || k >= 0, "{}: k = {} with indices", fn, k);
  if (rows == 0) return;
  KESTREL_CHECK(q_abs != nullptr && row_req != nullptr && row_pos != nullptr && out != nullptr && lse != nullptr,
                "{}: q_abs, row_req, row_pos, out and lse must be set", fn);
  KESTREL_CHECK(block_table.pages != nullptr && block_table.stride > 0,
                "{}: the block table needs pages and a positive stride, got stride {}", fn, block_table.stride);
  if (entry == LatentEntry::v32_fp8) {
    check_latent_pages(fn, pages, v32_latent_entry_bytes(C, R));
    KESTREL_CHECK(reinterpret_cast<uintptr_t>(pages.base) % 4 == 0 && pages.page_stride % 4 == 0,
                  "{}: deepseek_v32 latent pages need a 4-byte aligned base and page stride, got stride {}", fn,
                  pages.page_stride);
  } else if (entry == LatentEntry::nvfp4) {
    check_latent_pages(fn, pages, static_cast<int>(latent_format_bytes(LatentFormat::nvfp4, C, R)));
  } else if (entry == LatentEntry::bf16) {
    check_latent_pages(fn, pages, bf16_latent_entry_bytes(C, R));
    check_bf16_alignment(fn, pages);
  } else {
    check_latent_pages(fn, pages, C + R);
  }
  KESTREL_CUDA_CHECK(detail::launch_mla_attend_generic(q_abs, rows, H, C, R, entry, row_req, row_pos, pages,
                                                       block_table, kv_scale, softmax_scale, indices, k, out, lse, s));
}

void to_bf16_rows(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* y, int64_t ldy, cudaStream_t s) {
  constexpr const char* fn = "to_bf16_rows";
  KESTREL_CHECK(rows >= 0 && rows <= kMaxGridX && cols >= 0, "{}: bad shape {} x {}", fn, rows, cols);
  KESTREL_CHECK(ldx >= cols && ldy >= cols, "{}: leading dimensions {} (x) and {} (y) must be >= cols = {}", fn, ldx,
                ldy, cols);
  if (rows == 0 || cols == 0) return;
  KESTREL_CHECK(x != nullptr && y != nullptr, "{}: x and y must be set", fn);
  KESTREL_CUDA_CHECK(detail::launch_to_bf16_rows(x, ldx, rows, cols, y, ldy, s));
}

}  // namespace kestrel::cuda
