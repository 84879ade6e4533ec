// Kimi Linear and Kimi K3 layers: KDA or NoPE MLA (+ DSA indexer for kimi_k3) mixers, a dense SwiGLU FFN for the
// first `first_k_dense_replace` layers and `block_sparse_moe` (experts w1 = gate, w3 = up, w2 = down) after.
#include <cmath>
#include <string>

#include "model/model.h"
#include "model/weights.h"

namespace kestrel {

namespace {

KdaLayerWeights load_kda_weights(const ModelConfig& cfg, WeightLoader& w, Backend& b, const std::string& p) {
  const int64_t D = cfg.hidden_size, H = cfg.kda_num_heads, dk = cfg.kda_head_dim, P = H * dk;
  const int64_t Wc = cfg.short_conv_kernel_size;
  auto linear = [&](const std::string& name, int64_t out, int64_t in) {
    const StoredLinear l = w.linear(p + name, out, in);
    return b.add_linear(std::span(&l, 1));
  };
  KdaLayerWeights k;
  const StoredLinear qkv[3] = {w.linear(p + "q_proj", P, D), w.linear(p + "k_proj", P, D),
                               w.linear(p + "v_proj", P, D)};
  k.qkv = b.add_linear(qkv);
  // The gate and output-gate bottlenecks have rank head_dim (128 in the released checkpoints).
  const StoredLinear fg[2] = {w.linear(p + "f_a_proj", dk, D), w.linear(p + "g_a_proj", dk, D)};
  k.fg_a = b.add_linear(fg);
  k.f_b = linear("f_b_proj", P, dk);
  k.b = linear("b_proj", H, D);
  k.g_b = linear("g_b_proj", P, dk);
  k.o = linear("o_proj", D, P);
  const Init conv{1.0f / std::sqrt(static_cast<float>(Wc)), 0.0f};
  KdaSpec s;
  s.conv_q = w.tensor(p + "q_conv1d.weight", {P, 1, Wc}, conv);
  s.conv_k = w.tensor(p + "k_conv1d.weight", {P, 1, Wc}, conv);
  s.conv_v = w.tensor(p + "v_conv1d.weight", {P, 1, Wc}, conv);
  // A = exp(A_log) spread over [1, 16] as in Kimi Linear's initialisation.
  s.A_log = w.tensor(p + "A_log", {1, 1, H, 1}, {0.8f, 1.386f}, DType::F32);
  s.dt_bias = w.tensor(p + "dt_bias", {P}, {0.5f, 0.0f}, DType::F32);
  s.o_norm = w.tensor(p + "o_norm.weight", {dk}, {0.05f, 1.0f});
  k.core = b.add_kda(s);
  return k;
}

}  // namespace

DecoderLayer load_kimi_layer(const ModelConfig& cfg, WeightLoader& w, Backend& b, int layer) {
  static const char* const kDense[3] = {"gate_proj", "up_proj", "down_proj"};
  static const char* const kExperts[3] = {"w1", "w3", "w2"};
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const Init norm{0.05f, 1.0f};
  DecoderLayer out;
  out.input_norm = b.add_vector(w.tensor(p + "input_layernorm.weight", {cfg.hidden_size}, norm));
  out.post_norm = b.add_vector(w.tensor(p + "post_attention_layernorm.weight", {cfg.hidden_size}, norm));
  if (cfg.layer_kinds[layer] == LayerKind::kda)
    out.kda = load_kda_weights(cfg, w, b, p + "self_attn.");
  else
    out.mla = load_mla_weights(cfg, w, b, p + "self_attn.");
  if (cfg.is_moe_layer(layer)) {
    out.moe = load_moe_weights(cfg, w, b, p + "block_sparse_moe.", kExperts);
    if (cfg.n_shared_experts > 0)
      out.shared = load_ffn_weights(w, b, p + "block_sparse_moe.shared_experts.", kDense, cfg.hidden_size,
                                    cfg.moe_intermediate_size * cfg.n_shared_experts);
  } else {
    out.dense = load_ffn_weights(w, b, p + "mlp.", kDense, cfg.hidden_size, cfg.intermediate_size);
  }
  return out;
}

}  // namespace kestrel
