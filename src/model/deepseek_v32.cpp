// DeepSeek-V3.2 layers: MLA with YaRN RoPE and the DSA indexer on every layer, dense SwiGLU for the first
// `first_k_dense_replace` layers, then `mlp` MoE with grouped routing (experts gate_proj/up_proj/down_proj).
#include <string>

#include "model/model.h"
#include "model/weights.h"

namespace kestrel {

DecoderLayer load_deepseek_v32_layer(const ModelConfig& cfg, WeightLoader& w, int layer, const ModelOptions& opts) {
  static const char* const kNames[3] = {"gate_proj", "up_proj", "down_proj"};
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  DecoderLayer out;
  out.input_norm = w.get(p + "input_layernorm.weight", {cfg.hidden_size});
  out.post_norm = w.get(p + "post_attention_layernorm.weight", {cfg.hidden_size});
  out.mla = std::make_unique<MlaAttention>(cfg, w, p + "self_attn.", opts.latent_cache, opts.index_keys);
  if (cfg.is_moe_layer(layer))
    out.moe = std::make_unique<MoE>(cfg, w, p + "mlp.", kNames);
  else
    out.dense = std::make_unique<FeedForward>(load_ffn(w, p + "mlp.", kNames, cfg.hidden_size, cfg.intermediate_size));
  return out;
}

}  // namespace kestrel
