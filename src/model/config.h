// Model configuration parsed from a Hugging Face config.json of kimi_linear, deepseek_v32 or kimi_k3.
// Field names follow the real checkpoints; a missing, ill-typed or inconsistent field is an Error naming it.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/cpu/attention.h"

namespace kestrel {

enum class Arch { kimi_linear, deepseek_v32, kimi_k3 };
const char* arch_name(Arch a);              // the model_type spelling
Arch parse_arch(const std::string& model_type);  // Error for anything else

enum class LayerKind { kda, mla };
enum class WeightQuant { none, fp8_block, mxfp4 };

// YaRN settings of `rope_scaling` (the kernels' own parameter struct, so they pass through unchanged).
using YarnConfig = cpu::YarnParams;

struct ModelConfig {
  Arch arch = Arch::kimi_k3;
  std::string architecture;  // architectures[0]
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int num_hidden_layers = 0;
  int64_t intermediate_size = 0;  // dense FFN
  float rms_norm_eps = 1e-6f;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 0;
  // The longest context the config allows: the least of max_position_embeddings, model_max_length, max_seq_len,
  // seq_length and max_sequence_length where present (as vLLM derives it); 0 when none is. context_length_key names
  // the key it came from.
  int64_t context_length = 0;
  std::string context_length_key;
  int64_t bos_token_id = -1;
  int64_t eos_token_id = -1;

  std::vector<LayerKind> layer_kinds;  // per layer (0-based)

  // MLA
  int num_attention_heads = 0;
  int64_t q_lora_rank = 0;  // 0: no q compression (q_proj)
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  bool use_rope = false;  // deepseek_v32: true; kimi: false (mla_use_nope)
  double rope_theta = 10000.0;
  std::optional<YarnConfig> yarn;

  // DSA indexer
  bool has_indexer = false;
  int index_n_heads = 0;
  int index_head_dim = 0;
  int index_topk = 0;

  // KDA
  int kda_num_heads = 0;
  int kda_head_dim = 0;
  int short_conv_kernel_size = 0;
  std::optional<float> kda_gate_lower_bound;

  // FFN
  int first_k_dense_replace = 0;
  int moe_layer_freq = 1;
  int n_routed_experts = 0;
  int num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int n_shared_experts = 0;
  int n_group = 1;
  int topk_group = 1;
  float routed_scaling_factor = 1.0f;
  bool norm_topk_prob = true;
  // Multi-token prediction: layers num_hidden_layers .. + this of the checkpoint (DeepSeek-V3's MTP modules: enorm,
  // hnorm, eh_proj, a decoder layer, shared_head), run only as the `mtp` drafter of speculative decoding.
  int num_nextn_predict_layers = 0;

  // Weight storage
  WeightQuant weight_quant = WeightQuant::none;
  int weight_block_size = 128;  // fp8_block

  // Derived
  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool is_moe_layer(int layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  int num_layers_of(LayerKind k) const;
  float softmax_scale() const;  // (qk_nope + qk_rope)^-1/2, times mscale^2 with YaRN

  static ModelConfig from_json(const nlohmann::json& j);  // Error naming the field
  // config.json with `overrides` merged in first (vLLM's --hf-overrides): objects merge key by key; a key that neither
  // the file nor Kestrel's reader knows is an Error naming it.
  static ModelConfig from_json(const nlohmann::json& j, const nlohmann::json& overrides);
  static ModelConfig load(const std::string& path, const nlohmann::json& overrides = nlohmann::json::object());
  nlohmann::json to_json() const;                          // the HF config.json this config round-trips through
};

}  // namespace kestrel
