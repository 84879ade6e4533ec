// Kimi Linear and Kimi K3 layers: KDA or NoPE MLA (+ DSA indexer for kimi_k3) mixers, a dense SwiGLU FFN for the
// first `first_k_dense_replace` layers and `block_sparse_moe` (experts w1 = gate, w3 = up, w2 = down) after.
#include <string>

#include "model/model.h"
#include "model/weights.h"

namespace kestrel {

DecoderLayer load_kimi_layer(const ModelConfig& cfg, WeightLoader& w, int layer, const ModelOptions& opts) {
  static const char* const kDense[3] = {"gate_proj", "up_proj", "down_proj"};
  static const char* const kExperts[3] = {"w1", "w3", "w2"};
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  DecoderLayer out;
  out.input_norm = w.get(p + "input_layernorm.weight", {cfg.hidden_size});
  out.post_norm = w.get(p + "post_attention_layernorm.weight", {cfg.hidden_size});
  if (cfg.layer_kinds[layer] == LayerKind::kda)
    out.kda = std::make_unique<KdaMixer>(cfg, w, p + "self_attn.");
  else
    out.mla = std::make_unique<MlaAttention>(cfg, w, p + "self_attn.", opts.latent_cache, opts.index_keys);
  if (cfg.is_moe_layer(layer))
    out.moe = std::make_unique<MoE>(cfg, w, p + "block_sparse_moe.", kExperts);
  else
    out.dense = std::make_unique<FeedForward>(load_ffn(w, p + "mlp.", kDense, cfg.hidden_size, cfg.intermediate_size));
  return out;
}

}  // namespace kestrel
