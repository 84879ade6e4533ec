// The weights of the layer kinds both architecture families share, by their Hugging Face names: MLA (with the DSA
// indexer when the config has one), a SwiGLU FFN, a MoE. The dummy initialisations are make-model's.
#include <cmath>
#include <string>

#include "model/model.h"
#include "model/weights.h"

namespace kestrel {

namespace {
const Init kNorm{0.05f, 1.0f};
const Init kBias{0.05f, 0.0f};
float inv_sqrt(int64_t n) { return 1.0f / std::sqrt(static_cast<float>(n)); }
}  // namespace

MlaLayerWeights load_mla_weights(const ModelConfig& cfg, WeightLoader& w, Backend& b, const std::string& p) {
  const int64_t D = cfg.hidden_size, H = cfg.num_attention_heads, C = cfg.kv_lora_rank, R = cfg.qk_rope_head_dim;
  const int64_t qdim = H * cfg.qk_head_dim();
  auto linear = [&](const std::string& name, int64_t out, int64_t in) {
    const StoredLinear l = w.linear(p + name, out, in);
    return b.add_linear(std::span(&l, 1));
  };
  MlaLayerWeights m;
  if (cfg.q_lora_rank) {
    m.q_a = linear("q_a_proj", cfg.q_lora_rank, D);
    m.q_a_norm = b.add_vector(w.tensor(p + "q_a_layernorm.weight", {cfg.q_lora_rank}, kNorm));
    m.q_b = linear("q_b_proj", qdim, cfg.q_lora_rank);
  } else {
    m.q_proj = linear("q_proj", qdim, D);
  }
  m.kv_a = linear("kv_a_proj_with_mqa", C + R, D);
  m.kv_a_norm = b.add_vector(w.tensor(p + "kv_a_layernorm.weight", {C}, kNorm));
  m.o_proj = linear("o_proj", D, H * cfg.v_head_dim);
  MlaAttnSpec a;
  a.kv_b = w.linear(p + "kv_b_proj", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), C);
  if (const auto s = w.optional_tensor(p + "kv_scale", {}, {}, DType::F32, false))
    a.kv_scale = decode_to_f32(s->dtype, s->bytes, s->name).at(0);
  if (cfg.has_indexer) {
    const int64_t Hi = cfg.index_n_heads, Dh = cfg.index_head_dim, qin = cfg.q_lora_rank ? cfg.q_lora_rank : D;
    MlaAttnSpec::Indexer ix;
    ix.wq_b = w.linear(p + "indexer.wq_b", Hi * Dh, qin);
    ix.wk = w.linear(p + "indexer.wk", Dh, D);
    ix.k_norm_w = w.tensor(p + "indexer.k_norm.weight", {Dh}, kNorm);
    ix.k_norm_b = w.tensor(p + "indexer.k_norm.bias", {Dh}, kBias);
    ix.weights_proj = w.linear(p + "indexer.weights_proj", Hi, D, Quant::none);
    a.indexer = std::move(ix);
  }
  m.attn = b.add_mla_attention(a);
  return m;
}

FfnWeights load_ffn_weights(WeightLoader& w, Backend& b, const std::string& p, const char* const names[3],
                            int64_t hidden, int64_t width) {
  const StoredLinear gate_up[2] = {w.linear(p + names[0], width, hidden), w.linear(p + names[1], width, hidden)};
  const StoredLinear down = w.linear(p + names[2], hidden, width);
  return FfnWeights{b.add_linear(gate_up), b.add_linear(std::span(&down, 1))};
}

MoeW load_moe_weights(const ModelConfig& cfg, WeightLoader& w, Backend& b, const std::string& p,
                      const char* const expert_names[3]) {
  const int64_t D = cfg.hidden_size, E = cfg.n_routed_experts, F = cfg.moe_intermediate_size;
  MoeSpec s;
  s.n_experts = cfg.n_routed_experts;
  s.top_k = cfg.num_experts_per_tok;
  s.n_group = cfg.n_group;
  s.topk_group = cfg.topk_group;
  s.renormalize = cfg.norm_topk_prob;
  s.scaling = cfg.routed_scaling_factor;
  s.router = w.tensor(p + "gate.weight", {E, D}, {inv_sqrt(D), 0.0f});
  s.bias = w.optional_tensor(p + "gate.e_score_correction_bias", {E}, kBias, DType::F32, true);
  for (int64_t e = 0; e < E; ++e) {
    const std::string q = p + "experts." + std::to_string(e) + ".";
    s.gate.push_back(w.linear(q + expert_names[0], F, D, Quant::expert));
    s.up.push_back(w.linear(q + expert_names[1], F, D, Quant::expert));
    s.down.push_back(w.linear(q + expert_names[2], D, F, Quant::expert));
  }
  return b.add_moe(s);
}

}  // namespace kestrel
