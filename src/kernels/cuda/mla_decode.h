// Dense MLA decode on the GPU, absorbed form (shared/spec/dsa_mla.md §1.7): every query row attends to every
// cached latent row of its request, 0 .. ctx_len - 1 (causally for speculative tokens), over the paged latent
// cache. Same function as kestrel::cpu::mla_attend_absorbed over the dequantised rows (src/kernels/cpu/attention.h);
// docs/mla-kernels.md explains the kernel and its numerics.
//
// Pages and block tables are those of the DSA kernels (kernels/cuda/dsa.h): page p of the latent starts at
// base + p * page_stride and holds page_size (a power of two) consecutive rows of one request; request r's
// position t lives in page block_table[r * stride + t / page_size], row t % page_size. A row is [c (512) ; k_pe (64)]
// in one of two formats (LatentDtype).
//
// Decode rows: `batch` requests with n_q query tokens each; ctx_lens[r] counts request r's tokens including the
// n_q new ones (whose latents are written first); query token i attends to positions 0 .. ctx_lens[r] - n_q + i.
// Query row q = r * n_q + i indexes q_abs, out and lse.
//
// All pointers are device pointers; the call is asynchronous on `stream`. Argument errors throw kestrel::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/dsa.h"

namespace kestrel::cuda {

enum class LatentDtype {
  fp8_e4m3,  // Kimi's 576-byte rows: 576 e4m3 codes; a cached value is code * kv_scale (one scale per layer)
  // 1152-byte rows: 576 bf16 values; a cached value is value * kv_scale. The engine's bf16 latent (mla_glue.h:
  // mla_latent_write_bf16, --kv-cache-dtype auto) has no scale: bf16 entries are read with kv_scale = 1, which makes
  // the value bf16_to_f32(bits) as the other readers of the entry (mla_attend_generic, sparse_mla_decode) take it.
  bf16,
};

// Bytes of one latent row.
constexpr int latent_row_bytes(LatentDtype dtype) { return dtype == LatentDtype::bf16 ? 2 * kLatentDim : kLatentDim; }

struct MlaDecodeArgs {
  const uint16_t* q_abs = nullptr;  // [batch * n_q, heads, 576] bf16 bits: [W_UK^T q_nope ; q_pe], 16-byte aligned
  int batch = 0;
  int n_q = 1;
  int heads = 0;                      // >= 1; the (token, head) rows are processed in groups of 64
  const int32_t* ctx_lens = nullptr;  // [batch]; n_q <= ctx_lens[r] <= max_ctx_len
  int max_ctx_len = 0;                // sizes the split of the context over CTAs; longer lengths are cut to it
  LatentDtype latent_dtype = LatentDtype::fp8_e4m3;
  Pages latent_pages;
  BlockTable block_table;
  float kv_scale = 1.0f;
  float softmax_scale = 0.0f;  // scores are (q . row) * softmax_scale
  float* out = nullptr;        // [batch * n_q, heads, 512] fp32, 8-byte aligned
  float* lse = nullptr;        // [batch * n_q, heads] fp32, natural log
};

// Device scratch that mla_decode needs for these shapes on the current device (0 when the context is not split).
size_t mla_decode_workspace_bytes(int batch, int n_q, int heads, int max_ctx_len);

// out[q, h] = sum_t p_t c_t * kv_scale over the positions t the row attends to, p = softmax((q_abs[q, h] . row_t) *
// kv_scale * softmax_scale), lse[q, h] = log sum_t exp(score_t). Tensor-core products with fp32 accumulation: the
// query in f16 with a power-of-two scale per row (fp8_e4m3: the codes convert to f16 exactly) or in bf16 (bf16
// rows), the probabilities rounded to that type for the value product, the normaliser summed unrounded. Bound
// against cpu::mla_attend_absorbed on the same bf16 query and the dequantised rows (docs/mla-kernels.md, tested):
// |out - ref| <= 2^-10 (fp8_e4m3) or 2^-8 (bf16) * max |value| over the row's attended positions (+ 1e-6),
// |lse - ref| <= 1e-4 (1 + |ref|).
void mla_decode(const MlaDecodeArgs& args, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace kestrel::cuda
