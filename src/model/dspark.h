// A DSpark drafter (method `dspark` of speculative decoding): a parallel block drafter in the structure of vLLM's
// DSpark proposer and DeepSeek's DeepSpec. One forward over a block of dspark_block_size positions -- the target's
// last sampled token, then dspark_noise_token_id at the following positions -- attends to the target's context
// (the hidden states of layers dspark_target_layer_ids, concatenated, projected by main_proj and normed by
// main_norm, then through each draft layer's own key and value projections) and to the whole block, and gives base
// logits for every block position; a Markov head then adds, position by position, a low-rank bias
// markov_w2 . markov_w1[previous token] before each draft is chosen (DSparkDrafter in engine/dspark_drafter.h).
//
// The checkpoint: config.json (model_type "dspark") and safetensors with vLLM's DSpark names -- embed.weight,
// head.weight, mtp.0.main_proj.weight, mtp.0.main_norm.weight, per draft layer i mtp.i.attn_norm.weight,
// mtp.i.attn.{wq,wk,wv,wo}.weight, mtp.i.ffn_norm.weight, mtp.i.ffn.{w1,w2,w3}.weight (SwiGLU: gate, down, up), and
// on the last layer mtp.L.norm.weight and mtp.L.markov_head.markov_w{1,2}.weight. The draft layers are plain
// pre-norm decoder layers (multi-query attention with RoPE over the whole head, one key/value head, SwiGLU), not
// DeepSeek-V4's (hyper-connections, attention sinks, a sliding window, MoE); a confidence head
// (mtp.L.confidence_head.proj.weight) is read and not used, as in vLLM (confidence-scheduled verification is out of
// scope). There are as many draft layers as target layers in dspark_target_layer_ids. The CPU computes it in fp32.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kestrel {

struct ModelConfig;

struct DsparkConfig {
  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0;
  int num_attention_heads = 0, head_dim = 0;
  float rms_norm_eps = 1e-6f;
  double rope_theta = 10000.0;
  int block_size = 0;    // dspark_block_size
  int markov_rank = 0;   // dspark_markov_rank
  std::vector<int> target_layer_ids;  // dspark_target_layer_ids: one draft layer each
  int32_t noise_token_id = 0;         // dspark_noise_token_id
  // Error naming the field ("<dir>/config.json: 'x' ...").
  static DsparkConfig from_json(const nlohmann::json& j, const std::string& where);
  nlohmann::json to_json() const;
};

class DsparkModel {
 public:
  // Reads dir/config.json (checked against `target` first when given: check_dspark_against) and the safetensors;
  // every tensor must be there with its shape, and no other.
  static std::unique_ptr<DsparkModel> load(const std::string& dir, const ModelConfig* target = nullptr);
  const DsparkConfig& config() const { return cfg_; }
  int num_layers() const { return static_cast<int>(layers_.size()); }

  // The context of n target positions p0, p0 + 1, ...: hidden [n, targets * D] (the target layers' outputs,
  // concatenated) -> per draft layer its keys and values [n, head_dim] each (RoPE at the positions), appended to k[l]
  // and v[l].
  void context(const float* hidden, int64_t n, int64_t p0, std::vector<std::vector<float>>& k,
               std::vector<std::vector<float>>& v) const;
  // The block forward: ids [block_size] at positions p0..., every position attending to the ctx context rows of
  // k / v and to the whole block -> base logits [block_size, vocab].
  void block_logits(const int32_t* ids, int64_t p0, const std::vector<std::vector<float>>& k,
                    const std::vector<std::vector<float>>& v, int64_t ctx, float* logits) const;
  // logits [vocab] += markov_w2 . markov_w1[prev].
  void add_markov_bias(int32_t prev, float* logits) const;

 private:
  struct Layer {
    std::vector<float> attn_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3;
  };
  DsparkConfig cfg_;
  std::vector<float> embed_, head_, main_proj_, main_norm_, norm_, markov_w1_, markov_w2_, inv_freq_;
  std::vector<Layer> layers_;
};

// Checks a drafter against the target it drafts for: vocabulary and width equal, target layers inside the target,
// the noise token inside the vocabulary. Errors name the drafter's field.
void check_dspark_against(const DsparkConfig& d, const ModelConfig& target, const std::string& where);

// `make-model --dspark-out`: a random DSpark drafter for the target checkpoint in target_dir (its vocabulary and
// width; embed and head copied from the target's, as vLLM shares them; target layers: the last min(3, layers)).
void write_dspark_drafter(const std::string& out, const std::string& target_dir, uint64_t seed, int block_size = 5);
// The same for a config of one's own, with the embed and head tensors given ([vocab, hidden] each).
struct TensorData;
void write_dspark_drafter(const std::string& out, const DsparkConfig& c, const TensorData& embed,
                          const TensorData& head, uint64_t seed);

}  // namespace kestrel
