// The CPU backend's MLA attention (the cache side of an MLA layer, with the DSA indexer when the model has one): the
// reference of every GPU attention kernel. It owns the layer's kv_b and indexer weights (fp32) and the meaning of the
// latent and index-key bytes in the cache (docs/reference-numerics.md).
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "model/cache_formats.h"
#include "model/config.h"

namespace kestrel {

// One MLA layer's pages of one request for one step. Block j of the request (positions [jB, (j+1)B)) is the page at
// base + block_table[j] * row_bytes: B latent entries, then B index-key entries (the key values of all B tokens, then
// their B scales). The engine prepares the block table and the slots; the layer owns the bytes.
struct TokenPages {
  uint8_t* base = nullptr;               // the cache pool + this layer's page offset in a token row
  int64_t row_bytes = 0;
  int block_size = 0;
  const int32_t* block_table = nullptr;  // rows of the blocks covering positions [0, pos0 + T)
  const int64_t* slots = nullptr;        // where each new token goes: row * block_size + offset in the block
  int64_t pos0 = 0;                      // tokens already cached
};

// A request's context as attention reads it: positions [0, positions) of its pages, decoded.
struct MlaContext {
  int64_t positions = 0;
  std::vector<float> rows;         // [positions, kv_lora_rank + qk_rope_head_dim]: [c ; k_pe]
  std::vector<uint8_t> key_codes;  // [positions, index_head_dim] FP8 codes (with an indexer)
  std::vector<float> key_scales;   // [positions]
};

// The indexer's view of an MXFP4 index key (D values: D/2 packed bytes, D/32 E8M0 block exponents): FP8 codes with
// one power-of-two scale, returned, so that the exact FP8 dot of the indexer scores it. The scale is
// 2^(e_max - 127 - 6) for the largest block exponent e_max: every decoded value e2m1 * 2^(e_b - 127) becomes
// e2m1 * 2^(e_b - e_max + 6) <= 384 < 448, exactly whenever every e_b >= e_max - 14 (else e4m3 rounds it).
float mxfp4_key_as_fp8(const uint8_t* packed, const uint8_t* exponents, int D, uint8_t* codes);

struct MlaIndexerWeights {
  Tensor wq_b, wk, weights_proj;  // fp32 [Hi * Dh, q_in], [Dh, D], [Hi, D]
  Tensor k_norm_w, k_norm_b;
};

class MlaCore {
 public:
  // kv_b: fp32 [H * (dn + dv), C]. gpu_numerics: q_nope enters the absorption and the attention output the
  // un-absorption rounded to bf16, as on the GPU (the indexer stays fp32).
  MlaCore(const ModelConfig& cfg, Tensor kv_b, float kv_scale, std::optional<MlaIndexerWeights> indexer,
          LatentCacheDtype latent, IndexKeyDtype keys, bool gpu_numerics);

  // T new tokens at positions pages.pos0...: x [T, D] the normed input, qr [T, q_lora_rank] the normed query latent
  // (null without q_lora_rank), q [T, H * dq] the queries (RoPE applied), kv [T, C + R] the normed latent (RoPE
  // applied) -> o [T, H * dv]. Writes the new tokens' latent and index-key entries at their slots, then attends over
  // positions [0, pos0 + T). Rows are contiguous.
  void forward(const float* x, const float* qr, const float* q, const float* kv, int64_t T, const TokenPages& pages,
               float* o) const;

  // The phases of forward(), for runners that spread a step over ranks (src/parallel). forward() is exactly
  // write_cache; read_context of [0, pos0 + T); attend for each token. Every output element of each phase is computed
  // on its own (one token's attention), so any split of the tokens gives the same bits.
  void write_cache(const float* x, const float* kv, int64_t T, const TokenPages& pages) const;
  void read_context(const TokenPages& pages, int64_t n, MlaContext& ctx) const;
  // The cached rows [c ; k_pe] of positions [0, n) as attention reads them (decoded): rows [n, C+R].
  void read_latent(const TokenPages& pages, int64_t n, float* rows) const;
  // One query token at position pos < ctx.positions, every head: q_t [H, dq], x_t its normed input, qr_t its query
  // latent (ignored without q_lora_rank). Selects with the indexer (if any), attends in the absorbed form and applies
  // W_UV: o_t [H, dv].
  void attend(const float* q_t, const float* x_t, const float* qr_t, int64_t pos, const MlaContext& ctx,
              float* o_t) const;

  const ModelConfig& config() const { return cfg_; }
  bool has_indexer() const { return indexer_.has_value(); }
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
  Tensor kv_b_;
  float kv_scale_ = 1.0f;
  std::optional<MlaIndexerWeights> indexer_;
  LatentCacheDtype latent_;
  IndexKeyDtype keys_;
  bool gpu_numerics_ = false;
  int64_t latent_bytes_ = 0, index_key_bytes_ = 0;
  std::vector<float> inv_freq_;
};

// One request's part of an MLA layer's step: its pages (pages.pos0 = its cached positions) and its new tokens.
struct MlaStepRequest {
  TokenPages pages;
  int64_t tokens = 0;
};

// Runs an MLA layer's attention for all requests of a step at once, in place of MlaCore::forward per request. The
// token-sharded prefill of src/parallel implements it over W ranks; the model knows nothing of ranks. Rows of x, qr,
// q, kv and o as MlaCore::forward's, requests back to back in the order of `requests`.
class MlaStepRunner {
 public:
  virtual ~MlaStepRunner() = default;
  virtual void run(const MlaCore& core, const float* x, const float* qr, const float* q, const float* kv,
                   std::span<const MlaStepRequest> requests, float* o) = 0;
};

}  // namespace kestrel
