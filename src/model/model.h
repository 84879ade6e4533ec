// A loaded model: embedding, decoder layers (KDA or MLA mixer; dense or MoE FFN), final norm, LM head.
// forward() runs new tokens of one sequence against that sequence's state (prefill: many tokens; decode: one).
#pragma once
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "model/config.h"
#include "model/layers.h"

namespace kestrel {

struct ModelOptions {
  LatentCacheDtype latent_cache = LatentCacheDtype::auto_fp32;
  bool kda_chunked_prefill = true;  // false: token-by-token recurrence everywhere (the exact-invariance mode)
};

// Per-request state of every layer, in plain CPU buffers.
struct SequenceState {
  int64_t num_tokens = 0;
  std::vector<MlaLayerCache> mla;  // one per layer; used by MLA layers
  std::vector<KdaLayerState> kda;  // one per layer; used by KDA layers
};

struct DecoderLayer {
  Tensor input_norm, post_norm;
  std::unique_ptr<MlaAttention> mla;  // exactly one of mla / kda
  std::unique_ptr<KdaMixer> kda;
  std::unique_ptr<FeedForward> dense;  // exactly one of dense / moe
  std::unique_ptr<MoE> moe;
};

class Model {
 public:
  // Loads config.json and the safetensors checkpoint of `dir`; every tensor must be consumed (tensors of extra
  // MTP layers beyond num_hidden_layers are skipped), otherwise an Error lists the unexpected ones.
  static std::unique_ptr<Model> load(const std::string& dir, const ModelOptions& opts = {});

  const ModelConfig& config() const { return cfg_; }
  SequenceState new_sequence() const;
  // Feeds T tokens at positions seq.num_tokens...; writes logits [T, vocab] for every position, or only for the
  // last one (logits [1, vocab]) when last_only.
  void forward(SequenceState& seq, const int32_t* ids, int64_t T, float* logits, bool last_only = false) const;

  std::vector<DecoderLayer>& layers() { return layers_; }

 private:
  ModelConfig cfg_;
  ModelOptions opts_;
  Tensor embed_, final_norm_, lm_head_;
  std::vector<DecoderLayer> layers_;
};

// One graph builder per architecture family: which tensors make up layer `layer`.
// model/kimi.cpp serves kimi_linear and kimi_k3 (kimi_k3 is kimi_linear plus the DSA indexer, which the MLA module
// adds when the config has one); model/deepseek_v32.cpp serves deepseek_v32.
DecoderLayer load_kimi_layer(const ModelConfig& cfg, WeightLoader& w, int layer, const ModelOptions& opts);
DecoderLayer load_deepseek_v32_layer(const ModelConfig& cfg, WeightLoader& w, int layer, const ModelOptions& opts);

}  // namespace kestrel
