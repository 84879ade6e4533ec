// The DSA indexer of one MLA layer on the GPU: everything between the layer's normed input and the positions its
// sparse attention reads. Keys: wk(x) -> LayerNorm(k_norm, eps 1e-6) -> [RoPE] -> Hadamard -> ue8m0 FP8 into the key
// page (MlaCore::write_cache, src/cpu/mla_core.cpp). Selection: q = wq_b(qr) per head -> [RoPE] -> Hadamard -> per-head ue8m0 FP8
// (codes and q_scale); w_j = weights_proj(x)_j * H_I^-1/2 * q_scale_j * D^-1/2; exact indexer scores over the cached keys; the
// top index_topk positions, ascending (MlaCore::select). [RoPE]: with the model's use_rope (deepseek_v32), NeoX
// RoPE on the first qk_rope_head_dim values of the key and of each query head, at the token's position, from the
// inverse frequencies cpu::rope_inv_freq gives for the config (MlaCore's table: the same call); fp32, the CPU's
// values up to a last-place difference of cos / sin (kernels/cuda/v32_glue.h).
//
// Numerics. The three projections and the LayerNorm are fp32 (kernels/cuda/linear_f32.h, ops.h) but not in the CPU's
// summation order, so their outputs may differ from the CPU's by fp32 rounding; from there on everything is bit for
// bit the CPU: the Hadamard, the FP8 codes and scales, the folded weights, the scores (exact dots) and the top-k
// (same tie rule). A value that lands near an FP8 rounding midpoint, or two near-tied scores, can therefore still
// make the GPU's selection differ from the CPU's by a position.
//
// Kernels. D = 128: index_key_write, and index_scores_decode (exact) when H_I is 32 or 64 (dsa.h); otherwise the
// generic kernels of dsa_generic.h. MXFP4 keys (--index-dtype mxfp4): index_key_write_mxfp4 (fp4_cache.h) writes
// them (Hadamard, then mxfp4_encode instead of the FP8 quantisation), and index_scores_generic reads them as the FP8
// codes and scale of mxfp4_key_as_fp8, so their scores too are the CPU's bit for bit. Top-k: topk_decode. Single-token requests with consecutive request indices run
// as one decode batch (n_q = 1); a request of several tokens runs as one batch of n_q = its tokens, in chunks of at
// most score_rows() rows.
//
// Memory. Weights: 4 * (H_I * D * q_in + D * hidden + 2 * D + H_I * hidden) bytes per layer (fp32), q_in =
// q_lora_rank or hidden. Workspace, shared by every layer that is built with workspace() of the first: per token of
// max_tokens, 4 * D (keys) + 5 * H_I * D (queries and codes) + 8 * H_I (weights) bytes; the scores, score_rows() *
// max_model_len * 4 bytes with score_rows() = min(max_tokens, max(1, 256 MiB / (4 * max_model_len))), and
// topk_decode's scratch (a few MiB at most). With H_I = 32, D = 128, max_tokens = 2048 and max_model_len = 128K:
// about 42 MiB + 256 MiB + the top-k scratch.
//
// CUDA graphs. Both calls allocate nothing and read no device data on the host. select() with graph_safe (the
// default) sizes the single-token requests' kernels for max_model_len, so a graph captured from a step whose
// requests all have one token is right when replayed with any contexts (ctx_lens and block_table are read on the
// device); a request of several tokens is sized from its host-side ctx_len, so such a step must not be replayed.
// Deterministic: no atomics in any floating-point sum.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "gpu/device_arena.h"
#include "kernels/cuda/dsa.h"
#include "model/cache_formats.h"
#include "model/config.h"

namespace kestrel::gpu {

// One request's rows of a step, in the order the GPU engine lays tokens out (requests back to back).
struct IndexerRequest {
  int64_t first_token = 0;
  int64_t tokens = 0;
  int64_t ctx_len = 0;  // start + tokens
  int32_t req = 0;      // index into the block table / ctx table
};

// The step buffers of the indexer (projections, codes, scores, top-k scratch), sized once; one set serves every
// layer because the layers run one after another on one stream.
struct DsaIndexerWorkspace;

// The indexer's weights in GPU memory, fp32 (the projections feed FP8 quantisation and a top-k, so they follow the
// reference as closely as fp32 allows): wq_b [H_I * D, q_in], wk [D, hidden], k_norm weight and bias [D],
// weights_proj [H_I, hidden].
struct DsaIndexerWeights {
  const float *wq_b = nullptr, *wk = nullptr, *k_norm_w = nullptr, *k_norm_b = nullptr, *weights_proj = nullptr;
};

class DsaIndexerGpu {
 public:
  // keys: the cache's index-key format. Error (named) for what is not implemented: a head dimension that is not a
  // power of two in [4, 256] ([32, 256] with MXFP4 keys; or H_I * D > 8192 off the D = 128, FP8-key fast path), or a
  // RoPE dimension larger than the head's.
  DsaIndexerGpu(const DsaIndexerWeights& w, const ModelConfig& cfg, IndexKeyDtype keys, DeviceArena& arena);
  // Takes the step workspace for steps of up to max_tokens tokens, max_seqs requests and max_model_len context from
  // the arena (Error for a max_model_len past int32 or past what topk_decode holds on this device), or shares
  // `workspace` (from workspace() of another layer's indexer of the same model). Before the first write_keys.
  void make_workspace(int64_t max_tokens, int max_seqs, int64_t max_model_len, DeviceArena& arena);
  void share_workspace(std::shared_ptr<DsaIndexerWorkspace> workspace);
  ~DsaIndexerGpu();
  DsaIndexerGpu(const DsaIndexerGpu&) = delete;
  DsaIndexerGpu& operator=(const DsaIndexerGpu&) = delete;
  DsaIndexerGpu(DsaIndexerGpu&&) noexcept;
  DsaIndexerGpu& operator=(DsaIndexerGpu&&) noexcept;

  // The new tokens' index keys into their slots. x: fp32 normed layer input [N, hidden]; slots [N] (device int64,
  // page * page_size + row, negative: skip); key_pages: the layer's index-key pages (the packed cache: base = pool +
  // page_offset + page_size * latent_bytes, page_stride = row bytes, page_size = B; a page holds B keys of D codes
  // then B fp32 scales). positions [N] (device int32): each token's position, for RoPE (not read without it).
  // N <= max_tokens.
  void write_keys(const float* x, int64_t N, const int64_t* slots, const int32_t* positions,
                  const kestrel::cuda::Pages& key_pages, cudaStream_t s);
  // For every token row t of the step: the top-k positions (k = cfg.index_topk) among 0..pos_t of its request by
  // the indexer's scores, ascending, -1 padded; pos_t = ctx_len - tokens + i for the request's i-th row. x as above,
  // qr: fp32 query latent [N, q_lora_rank] (x itself when the model has no q_lora_rank); positions as write_keys
  // (equal to each row's pos_t). requests: host list (the
  // requests of the step, in token order, back to back from token 0, covering all N rows; tokens >= 1, tokens <=
  // ctx_len <= max_model_len); ctx_lens: device int32 per request index (IndexerRequest::req), equal to the
  // requests' ctx_len; block_table: the step's block table (rows indexed by req). indices: device int32
  // [N, index_topk]. The new tokens' keys must have been written (write_keys) before: a token selects itself.
  // graph_safe: see the file comment; false sizes the single-token requests' kernels for their own contexts
  // (faster for short contexts, not for replay).
  void select(const float* x, const float* qr, int64_t N, const int32_t* positions,
              std::span<const IndexerRequest> requests, const int32_t* ctx_lens, const kestrel::cuda::Pages& key_pages,
              const kestrel::cuda::BlockTable& block_table, int32_t* indices, cudaStream_t s,
              bool graph_safe = true);
  int top_k() const;

  std::shared_ptr<DsaIndexerWorkspace> workspace() const { return ws_; }
  int64_t score_rows() const;     // rows of scores computed per launch (see the file comment)
  size_t weight_bytes() const { return weight_bytes_; }
  size_t workspace_bytes() const;  // of the shared workspace, counted once

 private:
  // Scores and top-k of `batch` requests of n_q rows each, starting at token row t0 and request index req0.
  void score_rows_of(int64_t t0, int batch, int n_q, int32_t req0, const int32_t* ctx_lens, int max_ctx,
                     const kestrel::cuda::Pages& key_pages, const kestrel::cuda::BlockTable& block_table,
                     int32_t* indices, cudaStream_t s);

  int heads_ = 0, dim_ = 0, top_k_ = 0;
  int rope_dim_ = 0;                  // 0: no RoPE
  const float* inv_freq_ = nullptr;   // [rope_dim_ / 2] with RoPE
  IndexKeyDtype keys_ = IndexKeyDtype::fp8;
  int64_t hidden_ = 0, q_in_ = 0;
  const float *wq_b_ = nullptr, *wk_ = nullptr, *k_norm_w_ = nullptr, *k_norm_b_ = nullptr, *w_proj_ = nullptr;
  size_t weight_bytes_ = 0;
  std::shared_ptr<DsaIndexerWorkspace> ws_;
};

}  // namespace kestrel::gpu
