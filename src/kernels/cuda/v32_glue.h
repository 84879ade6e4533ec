// GPU pieces that deepseek_v32's MLA and DSA indexer need beyond Kimi's: RoPE as the CPU reference applies it, and
// the writer of deepseek_v32's FP8 latent entry (the generic attention of mla_glue.h reads it: LatentEntry::v32_fp8).
// CPU references: cpu::rope_interleaved / cpu::rope_neox (src/kernels/cpu/attention.h) and MlaCore::write_latent
// (src/cpu/mla_core.cpp, fp8 for deepseek_v32) over quantize_fp8_ue8m0 and f32_to_bf16 (src/core/formats.h).
//
// All pointers are device pointers; every call is asynchronous on its stream, allocates nothing and reads no device
// data on the host (CUDA-graph capturable). Argument errors throw kestrel::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/dsa.h"  // Pages

namespace kestrel::cuda {

enum class RopeStyle {
  interleaved,  // pairs (x[2i], x[2i+1]): MLA's query rope part and the latent's k_pe
  neox,         // pairs (x[i], x[i + dim/2]): the DSA indexer's query and key (their first dim values)
};

// Largest rotary dimension rope_rows takes.
constexpr int kMaxRopeDim = 1024;

// RoPE in place on `rows` rows of x: row t's vectors x + t * ldx + v * vec_stride (v < n_vec), each rotated over its
// first dim values at position positions[t] (device int32, >= 0), as cpu::rope_interleaved / cpu::rope_neox do with
// the table inv_freq (device fp32 [dim / 2], the one cpu::rope_inv_freq computed): angle_i = fp32(pos) * inv_freq[i]
// in fp32; then x' = a * cos - b * sin, y' = a * sin + b * cos, each product and the sum rounded separately in fp32
// (no fused multiply-add, as the CPU reference is built). cos and sin of the fp32 angle are evaluated in double and
// rounded to fp32 once -- the nearest fp32 value, which is what the CPU's std::cos / std::sin (glibc's cosf / sinf,
// correctly rounded in all but rare cases) give -- so the output is the CPU's bit for bit except where the two
// rounded cos / sin differ in the last place (then by about 1e-7 relative). dim even and <= kMaxRopeDim; n_vec >= 1;
// vec_stride >= dim when n_vec > 1; ldx >= (n_vec - 1) * vec_stride + dim.
void rope_rows(float* x, int64_t rows, int64_t ldx, int n_vec, int64_t vec_stride, int dim, RopeStyle style,
               const int32_t* positions, const float* inv_freq, cudaStream_t s);

// deepseek_v32's FP8 latent entry (--kv-cache-dtype fp8): C e4m3 codes in tiles of 128 values, then one fp32 scale
// per tile (C / 128 of them), then the R-value RoPE tail k_pe in bf16: C + 4 C / 128 + 2 R bytes (656 at C = 512,
// R = 64). C a multiple of 128.
constexpr int64_t v32_latent_entry_bytes(int C, int R) { return int64_t{C} + int64_t{C} / 128 * 4 + int64_t{R} * 2; }

// Writes T new latent rows into their cache slots in deepseek_v32's layout, bit for bit as MlaCore::write_latent:
// each tile's codes and scale are quantize_fp8_ue8m0 of its 128 values (amax floored at 1e-4, scale the power of two
// at or above amax / 448, codes e4m3(v / scale) with saturation), the tail f32_to_bf16 (round to nearest even, NaN
// kept quiet with its sign). The CPU reference throws on a non-finite latent value; a kernel cannot, so a tile holding
// one gets NaN codes (0x7F) and a NaN scale: every value read from it is NaN. kv: [T, ldkv] fp32 rows whose first
// C + R values are [c (RMS-normed) ; k_pe (RoPE applied)]. slots[t] (device int64) = page * page_size + row; the entry
// goes to pages.base + page * pages.page_stride + row * v32_latent_entry_bytes(C, R). A negative slot skips token t.
// pages.base and pages.page_stride 4-byte aligned (the scales are fp32 words); R even.
void mla_latent_write_v32(const float* kv, int64_t ldkv, int64_t T, int C, int R, const int64_t* slots,
                          const Pages& pages, cudaStream_t s);

// Kernel launchers behind the functions above (v32_glue.cu), called once the arguments are checked (v32_glue.cpp).
namespace detail {
cudaError_t launch_rope_rows(float* x, int64_t rows, int64_t ldx, int n_vec, int64_t vec_stride, int dim,
                             RopeStyle style, const int32_t* positions, const float* inv_freq, cudaStream_t s);
cudaError_t launch_mla_latent_write_v32(const float* kv, int64_t ldkv, int64_t T, int C, int R, const int64_t* slots,
                                        const Pages& pages, cudaStream_t s);
}  // namespace detail

}  // namespace kestrel::cuda
