// GPU pieces around MLA attention in the absorbed form that the 576-wide kernels (dsa.h, mla_decode.h) do not
// cover: the FP8 and bf16 latent writers of Kimi's layout for any C + R, a plain fp32 absorbed attention for any
// C + R (the tiny model configurations have C = 64 or 128 and R = 16) over Kimi's FP8, deepseek_v32's FP8, the NVFP4
// or the bf16 latent entry (the only attention deepseek_v32 runs on the GPU at other widths), and the fp32 -> bf16
// row conversion that feeds the tensor-core kernels. CPU references: MlaCore::write_latent
// (src/cpu/mla_core.cpp), cpu::mla_attend_absorbed (src/kernels/cpu/attention.h), f32_to_e4m3 / f32_to_bf16
// (src/core/formats.h).
//
// Pages and block tables are those of dsa.h, with latent rows of C + R bytes (FP8; 2 (C + R) bytes for bf16): page p
// starts at base + p * page_stride (the packed cache's row size, whose first page_size entries are the latent
// entries) and its entry r at r * (entry bytes) from there.
//
// The bf16 entry (--kv-cache-dtype auto: the model's dtype, as vLLM) is C + R bf16 values [c (RMS-normed) ; k_pe (with
// RoPE for deepseek_v32)], 2 (C + R) bytes (1152 at C = 512, R = 64), value = bf16_to_f32(bits). It has no scale:
// kv_scale is not applied to bf16 entries, by the writer or by any reader.
//
// All pointers are device pointers; every call is asynchronous on its stream, allocates nothing and reads no device
// data on the host (CUDA-graph capturable). Argument errors throw kestrel::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/dsa.h"  // Pages, BlockTable

namespace kestrel::cuda {

// Largest latent row width C + R that mla_attend_generic accepts.
constexpr int kMaxGenericLatentWidth = 1024;

// Writes T new latent rows into their cache slots in Kimi's FP8 layout (C + R e4m3 codes per token, one per-layer
// scale): code = f32_to_e4m3(clamp(v / kv_scale, -448, 448)) bit for bit as MlaCore::write_latent (fp8, kimi);
// a NaN value gives the code 0x7F as there. kv: [T, ldkv] fp32 rows whose first C + R values are
// [c (already RMS-normed) ; k_pe]. slots[t] (device int64) = page * page_size + row; the entry goes to
// pages.base + page * pages.page_stride + row * (C + R). A negative slot skips token t.
void mla_latent_write_fp8(const float* kv, int64_t ldkv, int64_t T, int C, int R, float kv_scale, const int64_t* slots,
                          const Pages& pages, cudaStream_t s);

// Bytes of one bf16 latent entry: C + R bf16 values.
constexpr int64_t bf16_latent_entry_bytes(int C, int R) { return 2 * (int64_t{C} + R); }

// Writes T new latent rows into their cache slots as bf16 entries (C + R values per token, no scale): value i of
// token t = f32_to_bf16(kv[t * ldkv + i]) bit for bit (round to nearest even, a carry into the exponent overflowing to
// inf; a NaN keeps its sign and high payload and is made quiet). kv_scale is not applied to bf16 entries. kv: [T,
// ldkv] fp32 rows whose first C + R values are [c (already RMS-normed) ; k_pe]. slots[t] (device int64) = page *
// page_size + row; the entry goes to pages.base + page * pages.page_stride + row * bf16_latent_entry_bytes(C, R). A
// negative slot skips token t. pages.base and pages.page_stride 2-byte aligned.
void mla_latent_write_bf16(const float* kv, int64_t ldkv, int64_t T, int C, int R, const int64_t* slots,
                           const Pages& pages, cudaStream_t s);

// How mla_attend_generic reads a latent entry: the layouts of MlaCore::write_latent.
enum class LatentEntry {
  kimi_fp8,  // C + R e4m3 codes (the layout above); value = fp32(code * kv_scale)
  v32_fp8,   // deepseek_v32 (v32_glue.h): C e4m3 codes in tiles of 128, one fp32 scale per tile, then the R-value
             // tail in bf16, v32_latent_entry_bytes(C, R) bytes; value = fp32(code * tile scale) for c and the bf16
             // value for k_pe, as MlaCore::read_latent; kv_scale is not applied. C a multiple of 128, R even,
             // pages 4-byte aligned.
  nvfp4,     // Kimi's NVFP4 entry (fp4_cache.h: latent_format_bytes(LatentFormat::nvfp4, C, R) bytes); each value as
             // read_latent decodes it: e2m1 * fp32(e4m3 block scale * kv_scale), the tail code * kv_scale. The FP8-only
             // tensor-core kernels (dsa.h, mla_decode.h) do not read it: this is its attention on the GPU.
  bf16,      // the bf16 entry (mla_latent_write_bf16): C + R bf16 values, bf16_latent_entry_bytes(C, R) bytes; value =
             // bf16_to_f32(bits); kv_scale is not applied. Pages 2-byte aligned.
};

// Generic absorbed attention for any C, R (C + R <= kMaxGenericLatentWidth), one query row per token and every head:
// q_abs: [rows, H, C + R] fp32 ([W_UK^T q_nope ; q_pe] per head). Row q belongs to request row_req[q] and sits at
// position row_pos[q] (device int32 arrays); it attends to positions 0..row_pos[q] of that request, whose latents
// live in FP8 rows (C + R codes, value = code * kv_scale) at pages.base + block_table.pages[req * block_table.stride +
// p / page_size] * page_stride + (p % page_size) * (C + R). Optionally (indices != nullptr) only the positions listed
// in indices[q * k .. q * k + k), in that order (entries < 0 or > row_pos[q] skipped, an entry listed twice counts
// twice; a row with none gives out = 0, lse = -inf).
// out: [rows, H, C] fp32 = softmax-weighted sum of the rows' c parts (times kv_scale); lse [rows, H] natural log;
// scores = (q_abs . row) * softmax_scale, the row dequantised first (fp32(code * kv_scale)), as the CPU reference
// sees it. fp32 math with an online softmax over tiles of 32 positions: the same function as
// cpu::mla_attend_absorbed on the dequantised rows, up to fp32 rounding of the different summation order.
// One CTA per (row, group of 8 heads) walks the row's whole context (no split over CTAs): meant for short contexts
// and small models; the 576-wide kernels are the fast path.
void mla_attend_generic(const float* q_abs, int64_t rows, int H, int C, int R, const int32_t* row_req,
                        const int32_t* row_pos, const Pages& pages, const BlockTable& block_table, float kv_scale,
                        float softmax_scale, const int32_t* indices, int k, float* out, float* lse, cudaStream_t s);
// The same over latent entries of the given layout (the function above is entry = LatentEntry::kimi_fp8): entry r of
// a page at r * (its entry bytes) from the page start; the scores and outputs use each value as `entry` decodes it
// (kv_scale still has to be finite and positive where the entry ignores it: v32_fp8, bf16).
void mla_attend_generic(const float* q_abs, int64_t rows, int H, int C, int R, LatentEntry entry,
                        const int32_t* row_req, const int32_t* row_pos, const Pages& pages,
                        const BlockTable& block_table, float kv_scale, float softmax_scale, const int32_t* indices,
                        int k, float* out, float* lse, cudaStream_t s);

// fp32 -> bf16 with a row pitch change, to feed the 576-wide tensor-core kernels: y[r, j] = bf16(x[r, j]) for
// r < rows, j < cols (bit for bit f32_to_bf16: round to nearest even, NaN kept quiet with its sign); x leading dim
// ldx, y leading dim ldy (elements). Other elements of y are not written.
void to_bf16_rows(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* y, int64_t ldy, cudaStream_t s);

// Heads per CTA of mla_attend_generic (each loaded latent row serves this many heads).
constexpr int kGenericHeadsPerCta = 8;

// Kernel launchers behind the functions above (mla_glue.cu), called once the arguments are checked (mla_glue.cpp).
namespace detail {
cudaError_t launch_mla_latent_write_fp8(const float* kv, int64_t ldkv, int64_t T, int C, int R, float kv_scale,
                                        const int64_t* slots, const Pages& pages, cudaStream_t s);
cudaError_t launch_mla_latent_write_bf16(const float* kv, int64_t ldkv, int64_t T, int C, int R, const int64_t* slots,
                                         const Pages& pages, cudaStream_t s);
cudaError_t launch_mla_attend_generic(const float* q_abs, int64_t rows, int H, int C, int R, LatentEntry entry,
                                      const int32_t* row_req, const int32_t* row_pos, const Pages& pages,
                                      const BlockTable& block_table, float kv_scale, float softmax_scale,
                                      const int32_t* indices, int k, float* out, float* lse, cudaStream_t s);
cudaError_t launch_to_bf16_rows(const float* x, int64_t ldx, int64_t rows, int64_t cols, uint16_t* y, int64_t ldy,
                                cudaStream_t s);
}  // namespace detail

}  // namespace kestrel::cuda
