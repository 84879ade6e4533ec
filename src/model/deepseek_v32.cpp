// DeepSeek-V3.2 layers: MLA with YaRN RoPE and the DSA indexer on every layer, dense SwiGLU for the first
// `first_k_dense_replace` layers, then `mlp` MoE with grouped routing (experts gate_proj/up_proj/down_proj).
#include <string>

#include "model/model.h"
#include "model/weights.h"

namespace kestrel {

DecoderLayer load_deepseek_v32_layer(const ModelConfig& cfg, WeightLoader& w, Backend& b, int layer) {
  static const char* const kNames[3] = {"gate_proj", "up_proj", "down_proj"};
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const Init norm{0.05f, 1.0f};
  DecoderLayer out;
  out.input_norm = b.add_vector(w.tensor(p + "input_layernorm.weight", {cfg.hidden_size}, norm));
  out.post_norm = b.add_vector(w.tensor(p + "post_attention_layernorm.weight", {cfg.hidden_size}, norm));
  out.mla = load_mla_weights(cfg, w, b, p + "self_attn.");
  if (cfg.is_moe_layer(layer)) {
    out.moe = load_moe_weights(cfg, w, b, p + "mlp.", kNames);
    if (cfg.n_shared_experts > 0)
      out.shared = load_ffn_weights(w, b, p + "mlp.shared_experts.", kNames, cfg.hidden_size,
                                    cfg.moe_intermediate_size * cfg.n_shared_experts);
  } else {
    out.dense = load_ffn_weights(w, b, p + "mlp.", kNames, cfg.hidden_size, cfg.intermediate_size);
  }
  return out;
}

}  // namespace kestrel
