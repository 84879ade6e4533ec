#include "model/layers.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/basic.h"
#include "kernels/cpu/kda.h"
#include "model/weights.h"

namespace kestrel {

namespace {
constexpr float kLatentNormEps = 1e-6f;  // q_a_layernorm and kv_a_layernorm in every architecture (MODEL.md)
constexpr float kIndexKeyNormEps = 1e-6f;
constexpr float kL2NormEps = 1e-6f;

Linear load_linear(WeightLoader& w, const std::string& prefix, int64_t out, int64_t in) {
  return Linear{w.linear(prefix, out, in)};
}

float inv_sqrt(int n) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))); }
}  // namespace

void Linear::operator()(const float* x, int64_t T, float* y) const { cpu::linear(x, w.ptr(), y, T, in(), out()); }

// ---------------------------------------------------------------- MLA + indexer

MlaAttention::MlaAttention(const ModelConfig& cfg, WeightLoader& w, const std::string& p, LatentCacheDtype latent)
    : cfg_(cfg), latent_(latent) {
  const int64_t D = cfg.hidden_size, H = cfg.num_attention_heads, C = cfg.kv_lora_rank, R = cfg.qk_rope_head_dim;
  const int64_t qdim = H * cfg.qk_head_dim();
  if (cfg.q_lora_rank) {
    q_a_ = load_linear(w, p + "q_a_proj", cfg.q_lora_rank, D);
    q_a_norm_ = w.get(p + "q_a_layernorm.weight", {cfg.q_lora_rank});
    q_b_ = load_linear(w, p + "q_b_proj", qdim, cfg.q_lora_rank);
  } else {
    q_proj_ = load_linear(w, p + "q_proj", qdim, D);
  }
  kv_a_ = load_linear(w, p + "kv_a_proj_with_mqa", C + R, D);
  kv_a_norm_ = w.get(p + "kv_a_layernorm.weight", {C});
  kv_b_ = w.linear(p + "kv_b_proj", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), C);
  o_proj_ = load_linear(w, p + "o_proj", D, H * cfg.v_head_dim);
  if (w.has(p + "kv_scale")) kv_scale_ = w.get(p + "kv_scale", {}).data[0];
  if (latent_ == LatentCacheDtype::fp8 && cfg.arch == Arch::deepseek_v32 && C % 128)
    fail("--kv-cache-dtype fp8 for deepseek_v32 stores the latent in tiles of 128 values; kv_lora_rank {} is not a "
         "multiple of 128",
         C);
  if (cfg.has_indexer) {
    Indexer ix;
    ix.n_heads = cfg.index_n_heads;
    ix.head_dim = cfg.index_head_dim;
    const int64_t qin = cfg.q_lora_rank ? cfg.q_lora_rank : D;
    ix.wq_b = load_linear(w, p + "indexer.wq_b", int64_t{ix.n_heads} * ix.head_dim, qin);
    ix.wk = load_linear(w, p + "indexer.wk", ix.head_dim, D);
    ix.k_norm_w = w.get(p + "indexer.k_norm.weight", {ix.head_dim});
    ix.k_norm_b = w.get(p + "indexer.k_norm.bias", {ix.head_dim});
    ix.weights_proj = load_linear(w, p + "indexer.weights_proj", ix.n_heads, D);
    indexer_ = std::move(ix);
  }
  if (cfg.use_rope) {
    inv_freq_ = cpu::rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn ? &*cfg.yarn : nullptr);
  }
}

void MlaAttention::write_latent(const float* kv, float* dst) const {
  const int C = cfg_.kv_lora_rank, R = cfg_.qk_rope_head_dim;
  if (latent_ == LatentCacheDtype::auto_fp32) {
    std::copy(kv, kv + C + R, dst);
  } else if (cfg_.arch == Arch::deepseek_v32) {
    // DeepSeek's 656-B layout: latent tiles of 128 with ue8m0 scales, k_pe in bf16.
    uint8_t codes[128];
    for (int t = 0; t < C; t += 128) {
      const float s = quantize_fp8_ue8m0(kv + t, 128, codes);
      dequantize_fp8(codes, 128, s, dst + t);
    }
    for (int i = C; i < C + R; ++i) dst[i] = round_to_bf16(kv[i]);
  } else {
    // Kimi's 576-B layout: every value e4m3 with one per-layer scale.
    for (int i = 0; i < C + R; ++i) {
      const float q = std::clamp(kv[i] / kv_scale_, -kE4m3Max, kE4m3Max);
      dst[i] = e4m3_to_f32(f32_to_e4m3(q)) * kv_scale_;
    }
  }
}

std::vector<int32_t> MlaAttention::select(const float* x_t, const float* qr_t, int64_t pos,
                                          const MlaLayerCache& cache) const {
  const Indexer& ix = *indexer_;
  const int Hi = ix.n_heads, Dh = ix.head_dim, R = cfg_.qk_rope_head_dim;
  std::vector<float> q(static_cast<size_t>(Hi) * Dh), wts(Hi);
  ix.wq_b(qr_t, 1, q.data());
  if (cfg_.use_rope) cpu::rope_neox(q.data(), Hi, Dh, R, pos, inv_freq_.data());
  ix.weights_proj(x_t, 1, wts.data());
  std::vector<uint8_t> q_codes(q.size());
  const float c_heads = inv_sqrt(Hi), c_dim = inv_sqrt(Dh);
  for (int j = 0; j < Hi; ++j) {
    cpu::hadamard_inplace(q.data() + j * Dh, Dh);
    const float q_scale = quantize_fp8_ue8m0(q.data() + j * Dh, Dh, q_codes.data() + j * Dh);
    wts[j] = wts[j] * c_heads * q_scale * c_dim;
  }
  const int64_t n = pos + 1;
  std::vector<float> scores(n);
  cpu::indexer_scores(q_codes.data(), wts.data(), Hi, Dh, cache.key_codes.data(), cache.key_scales.data(), n,
                      scores.data());
  const int k = static_cast<int>(std::min<int64_t>(cfg_.index_topk, n));
  std::vector<int32_t> idx(k);
  cpu::topk_indices(scores.data(), n, k, idx.data());
  // Attention is order-independent in exact arithmetic; visiting the rows in position order makes a top-k that
  // selects every causal token bit-identical to dense attention.
  std::sort(idx.begin(), idx.end());
  return idx;
}

void MlaAttention::forward(const float* x, int64_t T, MlaLayerCache& cache, float* y) const {
  const int H = cfg_.num_attention_heads, C = cfg_.kv_lora_rank, R = cfg_.qk_rope_head_dim;
  const int dn = cfg_.qk_nope_head_dim, dv = cfg_.v_head_dim, dq = cfg_.qk_head_dim();
  const int64_t D = cfg_.hidden_size, pos0 = cache.n;

  std::vector<float> q(static_cast<size_t>(T) * H * dq), qr;
  if (q_a_) {
    qr.resize(static_cast<size_t>(T) * cfg_.q_lora_rank);
    std::vector<float> qa(qr.size());
    (*q_a_)(x, T, qa.data());
    cpu::rms_norm(qa.data(), q_a_norm_.ptr(), qr.data(), T, cfg_.q_lora_rank, kLatentNormEps);
    (*q_b_)(qr.data(), T, q.data());
  } else {
    (*q_proj_)(x, T, q.data());
  }
  std::vector<float> kv(static_cast<size_t>(T) * (C + R));
  kv_a_(x, T, kv.data());
  for (int64_t t = 0; t < T; ++t) {
    float* row = kv.data() + t * (C + R);
    cpu::rms_norm(row, kv_a_norm_.ptr(), row, 1, C, kLatentNormEps);
    if (cfg_.use_rope) {
      cpu::rope_interleaved(q.data() + t * H * dq + dn, H, dq, R, pos0 + t, inv_freq_.data());
      cpu::rope_interleaved(row + C, 1, R, R, pos0 + t, inv_freq_.data());
    }
  }

  // Append the new tokens' cache rows (and index keys) before attending: a token attends to itself.
  cache.rows.resize(static_cast<size_t>(pos0 + T) * (C + R));
  for (int64_t t = 0; t < T; ++t) write_latent(kv.data() + t * (C + R), cache.rows.data() + (pos0 + t) * (C + R));
  if (indexer_) {
    const int Dh = indexer_->head_dim;
    cache.key_codes.resize(static_cast<size_t>(pos0 + T) * Dh);
    cache.key_scales.resize(pos0 + T);
    std::vector<float> k(static_cast<size_t>(T) * Dh);
    indexer_->wk(x, T, k.data());
    cpu::layer_norm(k.data(), indexer_->k_norm_w.ptr(), indexer_->k_norm_b.ptr(), k.data(), T, Dh, kIndexKeyNormEps);
    for (int64_t t = 0; t < T; ++t) {
      float* kt = k.data() + t * Dh;
      if (cfg_.use_rope) cpu::rope_neox(kt, 1, Dh, R, pos0 + t, inv_freq_.data());
      cpu::hadamard_inplace(kt, Dh);
      cache.key_scales[pos0 + t] = quantize_fp8_ue8m0(kt, Dh, cache.key_codes.data() + (pos0 + t) * Dh);
    }
  }
  cache.n = pos0 + T;

  const float scale = cfg_.softmax_scale();
  std::vector<float> o(static_cast<size_t>(T) * H * dv);
#pragma omp parallel for schedule(dynamic)
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> q_abs(static_cast<size_t>(H) * (C + R)), obar(static_cast<size_t>(H) * C), lse(H);
    cpu::mla_absorb_query(q.data() + t * H * dq, kv_b_.ptr(), H, dn, dv, C, R, q_abs.data());
    const int64_t pos = pos0 + t;
    if (indexer_) {
      const std::vector<int32_t> idx = select(x + t * D, q_a_ ? qr.data() + t * cfg_.q_lora_rank : x + t * D, pos, cache);
      cpu::mla_attend_absorbed(q_abs.data(), H, C, R, cache.rows.data(), pos + 1, idx.data(),
                               static_cast<int64_t>(idx.size()), scale, obar.data(), lse.data());
    } else {
      cpu::mla_attend_absorbed(q_abs.data(), H, C, R, cache.rows.data(), pos + 1, nullptr, 0, scale, obar.data(),
                               lse.data());
    }
    cpu::mla_unabsorb_output(obar.data(), kv_b_.ptr(), H, dn, dv, C, o.data() + t * H * dv);
  }
  o_proj_(o.data(), T, y);
}

// ---------------------------------------------------------------- KDA

KdaMixer::KdaMixer(const ModelConfig& cfg, WeightLoader& w, const std::string& p) : cfg_(cfg) {
  const int64_t D = cfg.hidden_size, H = cfg.kda_num_heads, dk = cfg.kda_head_dim, P = H * dk;
  const int64_t Wc = cfg.short_conv_kernel_size;
  q_ = load_linear(w, p + "q_proj", P, D);
  k_ = load_linear(w, p + "k_proj", P, D);
  v_ = load_linear(w, p + "v_proj", P, D);
  conv_q_ = w.get(p + "q_conv1d.weight", {P, 1, Wc});
  conv_k_ = w.get(p + "k_conv1d.weight", {P, 1, Wc});
  conv_v_ = w.get(p + "v_conv1d.weight", {P, 1, Wc});
  // The gate and output-gate bottlenecks have rank head_dim (128 in the released checkpoints).
  f_a_ = load_linear(w, p + "f_a_proj", dk, D);
  f_b_ = load_linear(w, p + "f_b_proj", P, dk);
  dt_bias_ = w.get(p + "dt_bias", {P});
  A_log_ = w.get(p + "A_log", {1, 1, H, 1});
  b_ = load_linear(w, p + "b_proj", H, D);
  g_a_ = load_linear(w, p + "g_a_proj", dk, D);
  g_b_ = load_linear(w, p + "g_b_proj", P, dk);
  o_norm_ = w.get(p + "o_norm.weight", {dk});
  o_ = load_linear(w, p + "o_proj", D, P);
}

KdaLayerState KdaMixer::new_state() const {
  const size_t H = cfg_.kda_num_heads, dk = cfg_.kda_head_dim, hist = (cfg_.short_conv_kernel_size - 1) * H * dk;
  KdaLayerState s;
  s.state.assign(H * dk * dk, 0.0f);
  s.conv_q.assign(hist, 0.0f);
  s.conv_k.assign(hist, 0.0f);
  s.conv_v.assign(hist, 0.0f);
  return s;
}

void KdaMixer::forward(const float* x, int64_t T, int64_t pos0, KdaLayerState& st, bool chunked, float* y) const {
  const int H = cfg_.kda_num_heads, dk = cfg_.kda_head_dim, Wc = cfg_.short_conv_kernel_size;
  const int64_t P = int64_t{H} * dk, n = T * P;
  std::vector<float> raw(n), q(n), k(n), v(n);
  q_(x, T, raw.data());
  cpu::short_conv_silu(raw.data(), T, P, conv_q_.ptr(), Wc, st.conv_q.data(), q.data());
  k_(x, T, raw.data());
  cpu::short_conv_silu(raw.data(), T, P, conv_k_.ptr(), Wc, st.conv_k.data(), k.data());
  v_(x, T, raw.data());
  cpu::short_conv_silu(raw.data(), T, P, conv_v_.ptr(), Wc, st.conv_v.data(), v.data());
  cpu::l2_normalize_rows(q.data(), T * H, dk, kL2NormEps);
  cpu::l2_normalize_rows(k.data(), T * H, dk, kL2NormEps);

  std::vector<float> low(static_cast<size_t>(T) * dk), g(n), beta(static_cast<size_t>(T) * H);
  f_a_(x, T, low.data());
  f_b_(low.data(), T, raw.data());
  cpu::kda_gate(raw.data(), T, H, dk, A_log_.ptr(), dt_bias_.ptr(), cfg_.kda_gate_lower_bound, g.data());
  b_(x, T, beta.data());
  for (float& b : beta) b = cpu::sigmoid(b);

  std::vector<float> o(n);
  const float scale = inv_sqrt(dk);
  if (chunked && T > 1)
    cpu::kda_chunked(q.data(), k.data(), v.data(), g.data(), beta.data(), T, H, dk, dk, scale, st.state.data(),
                     o.data(), pos0);
  else
    cpu::kda_recurrent(q.data(), k.data(), v.data(), g.data(), beta.data(), T, H, dk, dk, scale, st.state.data(),
                       o.data());

  g_a_(x, T, low.data());
  g_b_(low.data(), T, raw.data());
  cpu::kda_gated_rmsnorm(o.data(), raw.data(), o_norm_.ptr(), T, H, dk, cfg_.rms_norm_eps, q.data());
  o_(q.data(), T, y);
}

// ---------------------------------------------------------------- FFN

void FeedForward::forward(const float* x, int64_t T, float* y) const {
  const int64_t F = gate.out();
  std::vector<float> g(static_cast<size_t>(T) * F), u(g.size());
  gate(x, T, g.data());
  up(x, T, u.data());
  cpu::swiglu(g.data(), u.data(), g.data(), static_cast<int64_t>(g.size()));
  down(g.data(), T, y);
}

FeedForward load_ffn(WeightLoader& w, const std::string& p, const char* const names[3], int64_t hidden,
                     int64_t width) {
  return FeedForward{load_linear(w, p + names[0], width, hidden), load_linear(w, p + names[1], width, hidden),
                     load_linear(w, p + names[2], hidden, width)};
}

MoE::MoE(const ModelConfig& cfg, WeightLoader& w, const std::string& p, const char* const expert_names[3]) {
  const int64_t D = cfg.hidden_size, E = cfg.n_routed_experts;
  routing_ = cpu::MoeRouting{cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group,
                             cfg.topk_group,       cfg.norm_topk_prob,      cfg.routed_scaling_factor};
  router_ = w.get(p + "gate.weight", {E, D});
  if (w.has(p + "gate.e_score_correction_bias")) bias_ = w.get(p + "gate.e_score_correction_bias", {E});
  experts_.reserve(E);
  for (int64_t e = 0; e < E; ++e)
    experts_.push_back(load_ffn(w, p + "experts." + std::to_string(e) + ".", expert_names, D, cfg.moe_intermediate_size));
  if (cfg.n_shared_experts > 0) {
    static const char* const kSharedNames[3] = {"gate_proj", "up_proj", "down_proj"};
    shared_ = load_ffn(w, p + "shared_experts.", kSharedNames, D, cfg.moe_intermediate_size * cfg.n_shared_experts);
  }
}

void MoE::forward(const float* x, int64_t T, float* y) const {
  const int64_t D = router_.dim(1);
  const int E = routing_.n_experts, K = routing_.top_k;
  std::vector<float> logits(static_cast<size_t>(T) * E), weights(static_cast<size_t>(T) * K);
  std::vector<int32_t> ids(static_cast<size_t>(T) * K);
  cpu::linear(x, router_.ptr(), logits.data(), T, D, E);
  for (int64_t t = 0; t < T; ++t)
    cpu::moe_route(logits.data() + t * E, bias_.empty() ? nullptr : bias_.ptr(), routing_, ids.data() + t * K,
                   weights.data() + t * K);

  // Run each expert once over the tokens routed to it; keep every (token, slot) output separately so that each
  // token sums its experts in its own rank order, independent of the batch.
  std::vector<float> slot_out(static_cast<size_t>(T) * K * D);
  for (int e = 0; e < E; ++e) {
    std::vector<int64_t> slots;
    for (int64_t i = 0; i < T * K; ++i)
      if (ids[i] == e) slots.push_back(i);
    if (slots.empty()) continue;
    const int64_t M = static_cast<int64_t>(slots.size());
    std::vector<float> xin(static_cast<size_t>(M) * D), out(static_cast<size_t>(M) * D);
    for (int64_t m = 0; m < M; ++m) std::copy_n(x + (slots[m] / K) * D, D, xin.data() + m * D);
    experts_[e].forward(xin.data(), M, out.data());
    for (int64_t m = 0; m < M; ++m) std::copy_n(out.data() + m * D, D, slot_out.data() + slots[m] * D);
  }
  std::vector<float> shared;
  if (shared_) {
    shared.resize(static_cast<size_t>(T) * D);
    shared_->forward(x, T, shared.data());
  }
  for (int64_t t = 0; t < T; ++t) {
    float* yt = y + t * D;
    std::fill_n(yt, D, 0.0f);
    for (int s = 0; s < K; ++s) {
      const float wgt = weights[t * K + s];
      const float* o = slot_out.data() + (t * K + s) * D;
      for (int64_t i = 0; i < D; ++i) yt[i] += wgt * o[i];
    }
    if (shared_)
      for (int64_t i = 0; i < D; ++i) yt[i] += shared[t * D + i];
  }
}

}  // namespace kestrel
