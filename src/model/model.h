// A model: its config, the handles of its weights (which a backend holds) and its forward pass, written once for
// every backend (src/model/backend.h). forward() runs the new tokens of a step against each request's rows of a
// packed cache (spec CACHE.md): the backend reads and writes the pages and states at the addresses the step names.
// One graph per architecture family: model/kimi.cpp (kimi_linear, kimi_k3) and model/deepseek_v32.cpp name the
// tensors; the decoder below is the same for all three.
#pragma once
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cache/cache_plan.h"
#include "model/backend.h"
#include "model/cache_formats.h"
#include "model/config.h"

namespace kestrel {

class MlaStepRunner;

// Model::forward's hidden-state entry for the final-normed state (the LM head's input).
inline constexpr int kFinalHidden = -1;  // src/cpu/mla_core.h: the CPU backend's hook for running MLA attention over several ranks

struct ModelOptions {
  LatentCacheDtype latent_cache = LatentCacheDtype::auto_fp32;
  IndexKeyDtype index_keys = IndexKeyDtype::fp8;
  // Prompt tokens run KDA in the chunked form, generated tokens in the recurrent one. false: the recurrence
  // everywhere (the exact-invariance mode: any split of a sequence gives the same bits).
  bool kda_chunked_prefill = true;
  // The CPU backend computes with the GPU's numerics, for testing the CUDA backend against this reference with a
  // tight bound: every linear layer's input rounded to bf16 first as the GPU's bf16 products take it, or quantized to
  // FP8 in groups of 128 (kernels/cpu/fp8_linear.h) for a weight stored in FP8; MLA's absorbed query and attention
  // output in bf16; the MoE router and the DSA indexer stay fp32, as on the GPU. Off: plain fp32.
  bool gpu_numerics = false;
};

// How Model::load finds the weights.
struct LoadOptions {
  // "auto" / "safetensors": the checkpoint's safetensors files; "dummy": random weights of the checkpoint's shapes and
  // stored dtypes, made by the backend from `seed` (only config.json is read).
  std::string load_format = "auto";
  // Merged into config.json before it is read (vLLM's --hf-overrides), e.g. {"num_hidden_layers": 4}. A key that
  // config.json does not have is an error naming it.
  nlohmann::json hf_overrides = nlohmann::json::object();
  uint64_t seed = 0;
  // Cap on the context length, when the config allows more (--max-model-len).
  int64_t max_model_len = 0;
  // Also the checkpoint's multi-token-prediction layer (config num_nextn_predict_layers; the `mtp` drafter of
  // speculative decoding). Without it those tensors are skipped.
  bool load_mtp = false;
};

// A KDA checkpoint to take during a step: the states after the token at `position` - 1, into these state rows
// (laid out as the request's own state rows).
struct CheckpointTarget {
  int64_t position = 0;
  std::span<const int32_t> rows;
};

// One request's part of a step, as the engine prepares it.
struct SequenceStep {
  std::span<const int32_t> ids;          // new tokens, at positions start, start + 1, ...
  int64_t start = 0;
  bool prompt = false;                   // prompt tokens: KDA runs its chunked form (if the model uses it)
  std::span<const int32_t> block_table;  // token rows of the blocks covering [0, start + ids.size())
  std::span<const int64_t> slots;        // where each new token goes: row * B + offset in its block
  std::span<const int32_t> state_rows;   // the request's state rows (CachePlan::state_rows_per_request)
  // Non-decreasing, in (start, start + ids.size()]; multiples of B in a prompt step (a verification step's
  // per-position slots are at every position).
  std::span<const CheckpointTarget> checkpoints;
  int64_t logits_from = 0;               // logits are wanted for new tokens [logits_from, ids.size())
  int32_t lora = 0;                      // the LoRA adapter of the request (Model::load_lora); 0: none
};

// A step over the rows of one cache pool laid out by `plan` (in the backend's memory).
struct StepBatch {
  uint8_t* pool = nullptr;
  const CachePlan* plan = nullptr;
  std::span<const SequenceStep> seqs;
  // The CPU backend runs the MLA layers' attention through this runner when set (token-sharded prefill over
  // simulated ranks, src/parallel); other backends refuse it.
  MlaStepRunner* mla_runner = nullptr;
};

// One request's state outside any engine: its own rows (state rows first, then token rows in block order), laid
// out by the model's own plan. What Model::forward(SequenceState&, ...) runs against (on the CPU backend).
struct SequenceState {
  int64_t num_tokens = 0;
  std::vector<uint8_t> rows;
};

// The weight handles of one decoder layer.
struct MlaLayerWeights {
  std::optional<LinearW> q_a, q_b, q_proj;  // q_a + q_b with q_lora_rank, else q_proj
  VecW q_a_norm;
  LinearW kv_a, o_proj;
  VecW kv_a_norm;
  MlaAttnW attn;
};
struct KdaLayerWeights {
  LinearW qkv;   // [q ; k ; v]
  LinearW fg_a;  // [f_a ; g_a]
  LinearW f_b, b, g_b, o;
  KdaW core;
};
struct FfnWeights {
  LinearW gate_up;  // [gate ; up]
  LinearW down;
};
struct DecoderLayer {
  VecW input_norm, post_norm;
  std::optional<MlaLayerWeights> mla;  // exactly one of mla / kda
  std::optional<KdaLayerWeights> kda;
  std::optional<FfnWeights> dense;     // exactly one of dense / moe (which may add shared experts)
  std::optional<MoeW> moe;
  std::optional<FfnWeights> shared;
};

// A DeepSeek-V3 multi-token-prediction module (checkpoint layer num_hidden_layers): position i's input is
// eh_proj([enorm(embed(token i + 1)) ; hnorm(hidden i)]), then one decoder layer; shared_head's norm and head give
// the logits of token i + 2. embed and head are the module's own copies when the checkpoint stores them, else the
// target's.
struct MtpWeights {
  VecW enorm, hnorm, head_norm;
  LinearW eh_proj;  // [D, 2D]
  EmbeddingW embed;
  LinearW head;
  DecoderLayer block;
};

class WeightLoader;

class Model {
 public:
  // Reads config.json of `dir` (with lo.hf_overrides merged in) and the weights into `backend`: the safetensors
  // checkpoint, every tensor of which must be consumed (tensors of MTP layers beyond num_hidden_layers are skipped;
  // anything else left over is an Error listing them), or dummy weights.
  static std::unique_ptr<Model> load(const std::string& dir, const ModelOptions& opts,
                                     std::unique_ptr<Backend> backend, const LoadOptions& lo = {});

  const ModelConfig& config() const { return cfg_; }
  const ModelOptions& options() const { return opts_; }
  Backend& backend() const { return *backend_; }
  // Bytes of the weights as the checkpoint stores them (for dummy weights: as a checkpoint of them would).
  size_t stored_weight_bytes() const { return stored_bytes_; }
  // What each layer keeps in the cache, per GPU, with `tp` GPUs sharing the KDA heads.
  std::vector<LayerCacheSpec> cache_specs(int tp = 1) const;
  // Prompt positions at which a prefill may be cut (and resumed) without changing a bit: the KDA chunk (64) when
  // prompts run KDA chunked, else 1.
  int prefill_alignment() const;

  // Runs one step of several requests together. logits: [sum of wanted positions, vocab], requests in order. The
  // result for a request does not depend on the others in the batch (on the CPU backend bit for bit).
  // hidden: when set, every step token's hidden states [step tokens, layers.size() * hidden_size] (the drafters'
  // input; the CPU backend only): for each entry l of `layers` the residual stream after decoder layer l, or for
  // kFinalHidden the final-normed state the LM head takes; no layers: kFinalHidden alone.
  void forward(const StepBatch& batch, float* logits, float* hidden = nullptr, std::span<const int> layers = {}) const;
  // The same step with the backend choosing each wanted row's token (Backend::samples_rows).
  void forward_sampled(const StepBatch& batch, std::span<const SampleRow> rows, std::vector<SampledToken>& out) const;
  // The graph of one step over a backend's ops: what forward() hands the backend.
  void graph(StepOps& ops, float* hidden = nullptr, std::span<const int> layers = {}) const;

  // The MTP layer (LoadOptions::load_mtp), run by the `mtp` drafter over a cache of its own: one MLA layer's rows per
  // sequence, laid out by mtp_plan() (a SequenceState apart from the engine's pool).
  bool has_mtp() const { return mtp_.has_value(); }
  SequenceState new_mtp_sequence() const;
  // T positions at mtp.num_tokens...: position i takes ids[i] (the token after it), hidden [T, D] (the target's
  // final-normed hidden state there, or the MTP's own output for a chained draft) and embed_scale[i] (0 masks the
  // token embedding, as vLLM does at position 0). Writes the last position's logits [vocab] and every position's
  // output hidden state [T, D] (before shared_head's norm).
  void mtp_forward(SequenceState& mtp, const int32_t* ids, const float* hidden, const float* embed_scale, int64_t T,
                   float* logits, float* hidden_out) const;

  SequenceState new_sequence() const;
  // Feeds T tokens at positions seq.num_tokens...; a call with T > 1 is a prompt, a single token a generated one.
  // Writes logits [T, vocab] for every position, or only for the last one (logits [1, vocab]) when last_only.
  // With lora != 0, through that adapter.
  // hidden, layers: as forward(StepBatch)'s, [T, layers * hidden_size].
  void forward(SequenceState& seq, const int32_t* ids, int64_t T, float* logits, bool last_only = false,
               int32_t lora = 0, float* hidden = nullptr, std::span<const int> layers = {}) const;

  // LoRA adapters, by id > 0 (a request's SamplingParams::lora_id): load_lora hands the adapter to the backend (which
  // checks it against the layers) and replaces the weights an id had (the RL weight sync between steps).
  void load_lora(int32_t id, const LoraAdapter& adapter);
  void unload_lora(int32_t id);
  bool has_lora(int32_t id) const { return lora_keys_.count(id) > 0; }
  // A value that changes with every load of adapter `id` (0 for none): requests mix it into their prefix-cache key,
  // so that cached prefixes are shared only by requests of the same adapter weights.
  uint64_t lora_key(int32_t id) const;

  const std::vector<DecoderLayer>& layers() const { return layers_; }

 private:
  Act mla_mixer(StepOps& b, const MlaLayerWeights& w, int layer, Act x) const;
  Act kda_mixer(StepOps& b, const KdaLayerWeights& w, int layer, Act x) const;
  Act ffn(StepOps& b, const FfnWeights& w, Act x) const;
  void load_mtp(WeightLoader& w);
  // One decoder layer on the residual stream h (its cache side: layer `layer` of the step's plan).
  void decoder_layer(StepOps& b, const DecoderLayer& L, int layer, Act h) const;
  // Error naming what is wrong with a step (the plan against the layers, each sequence's tables and tokens).
  void check_step(const StepBatch& batch) const;

  ModelConfig cfg_;
  ModelOptions opts_;
  std::unique_ptr<Backend> backend_;
  CachePlan sequence_plan_;  // the layout of a SequenceState
  size_t stored_bytes_ = 0;
  EmbeddingW embed_;
  LinearW lm_head_;
  VecW final_norm_;
  std::vector<DecoderLayer> layers_;
  std::optional<MtpWeights> mtp_;
  CachePlan mtp_plan_;
  std::map<int32_t, uint64_t> lora_keys_;
  uint64_t lora_loads_ = 0;
};

// What each layer of `cfg` keeps in the cache in the formats of `opts`, per GPU with `tp` GPUs sharing KDA heads.
std::vector<LayerCacheSpec> model_cache_specs(const ModelConfig& cfg, const ModelOptions& opts, int tp);

// config.json of `dir` with `overrides` merged in (each key must exist in the file; nested objects merge key by key).
ModelConfig load_model_config(const std::string& dir, const nlohmann::json& overrides = nlohmann::json::object());

// One graph builder per architecture family: the weights of layer `layer`.
// model/kimi.cpp serves kimi_linear and kimi_k3 (kimi_k3 is kimi_linear plus the DSA indexer, which the MLA weights
// gain when the config has one); model/deepseek_v32.cpp serves deepseek_v32.
DecoderLayer load_kimi_layer(const ModelConfig& cfg, WeightLoader& w, Backend& b, int layer);
DecoderLayer load_deepseek_v32_layer(const ModelConfig& cfg, WeightLoader& w, Backend& b, int layer);
// Shared by both: an MLA layer's weights under `prefix` (self_attn.), a SwiGLU FFN's, a MoE's.
MlaLayerWeights load_mla_weights(const ModelConfig& cfg, WeightLoader& w, Backend& b, const std::string& prefix);
FfnWeights load_ffn_weights(WeightLoader& w, Backend& b, const std::string& prefix, const char* const names[3],
                            int64_t hidden, int64_t width);
MoeW load_moe_weights(const ModelConfig& cfg, WeightLoader& w, Backend& b, const std::string& prefix,
                      const char* const expert_names[3]);

}  // namespace kestrel
