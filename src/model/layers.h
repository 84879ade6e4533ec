// Layer modules of the three architectures, written once: MLA (with an optional DSA indexer), KDA, dense
// SwiGLU FFN and MoE. Each owns its fp32 weights and the meaning of its per-request state; the math is in the
// reference kernels (kernels/cpu). See docs/reference-numerics.md.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "kernels/cpu/moe.h"
#include "model/config.h"
#include "model/weights.h"

namespace kestrel {

class WeightLoader;
// The GPU backend (src/gpu) reads a loaded model's weights to upload them; it is the one friend of the modules.
struct GpuWeightAccess;

// How the MLA latent is kept in the cache (--kv-cache-dtype) and how index keys are (--index-dtype).
enum class LatentCacheDtype { auto_fp32, fp8, nvfp4 };
enum class IndexKeyDtype { fp8, mxfp4 };

// Bytes per token of one MLA layer's latent entry and index-key entry in the cache (0 for a model without an
// indexer), and of one KDA layer's per-request state when `heads` of its heads live on this GPU. Error for a
// format the architecture does not define.
int64_t latent_entry_bytes(const ModelConfig& cfg, LatentCacheDtype d);
int64_t index_key_entry_bytes(const ModelConfig& cfg, IndexKeyDtype d);
int64_t kda_state_bytes(const ModelConfig& cfg, int heads);

struct Linear {
  Tensor w;  // [out, in]
  bool bf16_inputs = false;  // round the input to bf16 first (ModelOptions::bf16_activations)
  // The weight as stored, when the checkpoint stores it in FP8 and ModelOptions::keep_fp8_weights asks for it
  // (for the GPU engine; w holds the same values, decoded).
  std::optional<Fp8BlockWeight> fp8;
  int64_t out() const { return w.dim(0); }
  int64_t in() const { return w.dim(1); }
  void operator()(const float* x, int64_t T, float* y) const;
};

// The indexer's view of an MXFP4 index key (D values: D/2 packed bytes, D/32 E8M0 block exponents): FP8 codes
// with one power-of-two scale, returned, so that the exact FP8 dot of the indexer scores it. The scale is
// 2^(e_max - 127 - 6) for the largest block exponent e_max: every decoded value e2m1 * 2^(e_b - 127) becomes
// e2m1 * 2^(e_b - e_max + 6) <= 384 < 448, exactly whenever every e_b >= e_max - 14 (else e4m3 rounds it).
float mxfp4_key_as_fp8(const uint8_t* packed, const uint8_t* exponents, int D, uint8_t* codes);

// ---- per-request state, as the kernels see it: plain pages ----
// One MLA layer's pages of one request for one step. Block j of the request (positions [jB, (j+1)B)) is the
// page at base + block_table[j] * row_bytes: B latent entries, then B index-key entries (the key values of all B
// tokens, then their B scales). The engine prepares the block table and the slots; the layer owns the bytes.
struct TokenPages {
  uint8_t* base = nullptr;               // the cache pool + this layer's page offset in a token row
  int64_t row_bytes = 0;
  int block_size = 0;
  const int32_t* block_table = nullptr;  // rows of the blocks covering positions [0, pos0 + T)
  const int64_t* slots = nullptr;        // where each new token goes: row * block_size + offset in the block
  int64_t pos0 = 0;                      // tokens already cached
};

// One KDA layer's state of one request, inside a state row: the recurrent state, then the short-conv histories.
struct KdaStateView {
  float* state = nullptr;                                    // [H, dk, dv]
  float* conv_q = nullptr, *conv_k = nullptr, *conv_v = nullptr;  // [W-1, H*dk] each, oldest input first
};
KdaStateView kda_state_view(const ModelConfig& cfg, uint8_t* at);
// A copy of the state after the token at position - 1 (a block boundary inside the step).
struct KdaCheckpoint {
  int64_t position = 0;
  KdaStateView dst;
};

// A request's context as MLA attention reads it: positions [0, positions) of its pages, decoded.
struct MlaContext {
  int64_t positions = 0;
  std::vector<float> rows;         // [positions, kv_lora_rank + qk_rope_head_dim]: [c ; k_pe]
  std::vector<uint8_t> key_codes;  // [positions, index_head_dim] FP8 codes (with an indexer)
  std::vector<float> key_scales;   // [positions]
};

struct Indexer {
  Linear wq_b, wk, weights_proj;
  Tensor k_norm_w, k_norm_b;
  int n_heads = 0, head_dim = 0;
};

class MlaAttention {
  friend struct GpuWeightAccess;

 public:
  MlaAttention(const ModelConfig& cfg, WeightLoader& w, const std::string& prefix, LatentCacheDtype latent,
               IndexKeyDtype keys = IndexKeyDtype::fp8);
  // Index keys are FP8 unless set otherwise before the first forward (the graph builders construct the layer
  // from the weights; the key format is a cache choice made next to them).
  // x: [T, hidden] normed input of T new tokens at positions pages.pos0 ...; y: [T, hidden]. Writes the new
  // tokens' latent and index-key entries at their slots, then attends over positions [0, pos0 + T).
  void forward(const float* x, int64_t T, const TokenPages& pages, float* y) const;
  // The cached rows [c ; k_pe] of positions [0, n) as attention reads them (decoded): rows [n, C+R].
  void read_latent(const TokenPages& pages, int64_t n, float* rows) const;

  // The phases of forward(), for runners that spread a step over ranks (src/parallel). forward() is exactly
  // write_cache; project_queries over every head; read_context of [0, pos0 + T); attend for each token;
  // project_output over every head. Every output element of each phase is computed on its own (one dot product,
  // or one token's attention), so any split of tokens or heads gives the same bits.
  //
  // The new tokens' latent and index-key entries, written at their slots.
  void write_cache(const float* x, int64_t T, const TokenPages& pages) const;
  // Queries of T tokens at positions pos0...: q [T, head_end - head_begin, qk_head_dim] for heads
  // [head_begin, head_end), RoPE applied; with q_lora_rank also the query latent qr [T, q_lora_rank] (the indexer's
  // input), which does not depend on the heads; qr is not touched without q_lora_rank.
  void project_queries(const float* x, int64_t T, int64_t pos0, int head_begin, int head_end, float* q,
                       float* qr) const;
  void read_context(const TokenPages& pages, int64_t n, MlaContext& ctx) const;
  // One query token at position pos < ctx.positions, every head: q_t [H, qk_head_dim] from project_queries, x_t
  // its normed input, qr_t its query latent (ignored without q_lora_rank). Selects with the indexer (if any),
  // attends in the absorbed form and applies W_UV: o_t [H, v_head_dim].
  void attend(const float* q_t, const float* x_t, const float* qr_t, int64_t pos, const MlaContext& ctx,
              float* o_t) const;
  // o_proj restricted to the columns of heads [head_begin, head_end): o [T, (head_end - head_begin) * v_head_dim],
  // y [T, hidden]. Over every head this is o_proj; summed over a partition of the heads it equals o_proj up to
  // fp32 rounding (the tensor-parallel output projection).
  void project_output(const float* o, int64_t T, int head_begin, int head_end, float* y) const;

  const ModelConfig& config() const { return cfg_; }
  const std::optional<Indexer>& indexer() const { return indexer_; }
  int64_t latent_bytes() const { return latent_bytes_; }        // per token
  int64_t index_key_bytes() const { return index_key_bytes_; }  // per token, 0 without an indexer

 private:
  void write_latent(const float* kv_row, uint8_t* entry) const;
  void write_index_key(const float* k, const TokenPages& pages, int64_t slot) const;
  // Index keys of positions [0, n) as FP8 codes [n, D] and scales [n], the form the indexer scores.
  void read_index_keys(const TokenPages& pages, int64_t n, uint8_t* codes, float* scales) const;
  std::vector<int32_t> select(const float* x_t, const float* qr_t, int64_t pos, const uint8_t* key_codes,
                              const float* key_scales) const;

  const ModelConfig& cfg_;
  bool bf16_ = false;  // ModelOptions::bf16_activations
  LatentCacheDtype latent_;
  IndexKeyDtype keys_;
  int64_t latent_bytes_ = 0, index_key_bytes_ = 0;
  std::optional<Linear> q_a_, q_b_;  // with q_lora_rank
  std::optional<Linear> q_proj_;     // without
  Tensor q_a_norm_;
  Linear kv_a_, o_proj_;
  Tensor kv_a_norm_, kv_b_;
  float kv_scale_ = 1.0f;
  std::optional<Indexer> indexer_;
  std::vector<float> inv_freq_;
};

class KdaMixer {
  friend struct GpuWeightAccess;

 public:
  KdaMixer(const ModelConfig& cfg, WeightLoader& w, const std::string& prefix);
  // T new tokens at positions pos0 ...; y: [T, hidden]. chunked: the chunked (WY) form with chunks at absolute
  // multiples of 64, else the token-by-token recurrence. Checkpoints (positions in (pos0, pos0 + T], ascending)
  // receive copies of the state and conv histories; in the chunked form their positions must be multiples of
  // checkpoint_every, itself a multiple of the chunk.
  void forward(const float* x, int64_t T, int64_t pos0, const KdaStateView& st, bool chunked,
               std::span<const KdaCheckpoint> checkpoints, int64_t checkpoint_every, float* y) const;

 private:
  const ModelConfig& cfg_;
  Linear q_, k_, v_, f_a_, f_b_, b_, g_a_, g_b_, o_;
  Tensor conv_q_, conv_k_, conv_v_, A_log_, dt_bias_, o_norm_;
};

struct FeedForward {
  Linear gate, up, down;
  void forward(const float* x, int64_t T, float* y) const;
};

class MoE {
  friend struct GpuWeightAccess;

 public:
  // expert_names: {gate, up, down} suffixes of experts.{e}.<name> (kimi: w1/w3/w2; deepseek: *_proj).
  MoE(const ModelConfig& cfg, WeightLoader& w, const std::string& prefix, const char* const expert_names[3]);
  void forward(const float* x, int64_t T, float* y) const;

 private:
  cpu::MoeRouting routing_;
  Tensor router_, bias_;
  std::vector<FeedForward> experts_;
  std::optional<FeedForward> shared_;
};

// keep_fp8: whether the linears keep FP8-stored codes and scales when the loader's keep_fp8 asks for them (the MoE's
// routed experts do not: the GPU's expert kernels do not take FP8).
FeedForward load_ffn(WeightLoader& w, const std::string& prefix, const char* const names[3], int64_t hidden,
                     int64_t width, bool keep_fp8 = true);

}  // namespace kestrel
