// Layer modules of the three architectures, written once: MLA (with an optional DSA indexer), KDA, dense
// SwiGLU FFN and MoE. Each owns its fp32 weights and the meaning of its per-request state; the math is in the
// reference kernels (kernels/cpu). See docs/reference-numerics.md.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "kernels/cpu/moe.h"
#include "model/config.h"

namespace kestrel {

class WeightLoader;

// How the MLA latent is kept in the per-request cache (--kv-cache-dtype).
enum class LatentCacheDtype { auto_fp32, fp8 };

struct Linear {
  Tensor w;  // [out, in]
  int64_t out() const { return w.dim(0); }
  int64_t in() const { return w.dim(1); }
  void operator()(const float* x, int64_t T, float* y) const;
};

// ---- per-request state ----
struct MlaLayerCache {
  int64_t n = 0;                   // cached tokens
  std::vector<float> rows;         // [n, C+R]: [c ; k_pe], as attention reads them (after any FP8 rounding)
  std::vector<uint8_t> key_codes;  // [n, D] indexer keys, e4m3
  std::vector<float> key_scales;   // [n]
};
struct KdaLayerState {
  std::vector<float> state;                   // [H, dk, dv]
  std::vector<float> conv_q, conv_k, conv_v;  // [W-1, H*dk] short-conv histories
};

struct Indexer {
  Linear wq_b, wk, weights_proj;
  Tensor k_norm_w, k_norm_b;
  int n_heads = 0, head_dim = 0;
};

class MlaAttention {
 public:
  MlaAttention(const ModelConfig& cfg, WeightLoader& w, const std::string& prefix, LatentCacheDtype latent);
  // x: [T, hidden] normed input of T new tokens at positions cache.n .. cache.n+T-1; y: [T, hidden].
  void forward(const float* x, int64_t T, MlaLayerCache& cache, float* y) const;
  const std::optional<Indexer>& indexer() const { return indexer_; }

 private:
  void write_latent(const float* kv_row, float* dst) const;
  std::vector<int32_t> select(const float* x_t, const float* qr_t, int64_t pos, const MlaLayerCache& cache) const;

  const ModelConfig& cfg_;
  LatentCacheDtype latent_;
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
 public:
  KdaMixer(const ModelConfig& cfg, WeightLoader& w, const std::string& prefix);
  // chunked: prefill of T > 1 tokens in the chunked form (else token by token); y: [T, hidden].
  void forward(const float* x, int64_t T, int64_t pos0, KdaLayerState& st, bool chunked, float* y) const;
  KdaLayerState new_state() const;

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

FeedForward load_ffn(WeightLoader& w, const std::string& prefix, const char* const names[3], int64_t hidden,
                     int64_t width);

}  // namespace kestrel
