// A loaded model: embedding, decoder layers (KDA or MLA mixer; dense or MoE FFN), final norm, LM head.
// forward() runs the new tokens of a step against each request's rows of a packed cache (spec CACHE.md): the
// layers read and write plain pages and states at the addresses the step names, and never see rows.
#pragma once
#include <memory>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "cache/cache_plan.h"
#include "model/config.h"
#include "model/layers.h"

namespace kestrel {

struct ModelOptions {
  LatentCacheDtype latent_cache = LatentCacheDtype::auto_fp32;
  IndexKeyDtype index_keys = IndexKeyDtype::fp8;
  // Prompt tokens run KDA in the chunked form, generated tokens in the recurrent one. false: the recurrence
  // everywhere (the exact-invariance mode: any split of a sequence gives the same bits).
  bool kda_chunked_prefill = true;
  // The GPU backend's numerics, for testing it against this reference with a tight bound: every linear layer's
  // input (and MLA's absorbed query and attention output, and the LM head's input) rounded to bf16 first, as the
  // GPU's bf16 GEMMs take them; the MoE router and the DSA indexer stay fp32, as on the GPU. Off: plain fp32.
  bool bf16_activations = false;
  // For a checkpoint with FP8 block-scaled linear weights (WeightQuant::fp8_block): keep the codes and scales of
  // the linears the GPU engine runs as bf16 GEMMs (attention projections, dense and shared-expert FFNs) next to
  // their fp32 weights, so that the GPU streams them in FP8 at small batches (src/kernels/cuda/gemm_fp8.h). One
  // byte per such weight more host memory; the CPU's numerics do not change.
  bool keep_fp8_weights = false;
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
  std::span<const CheckpointTarget> checkpoints;  // ascending, in (start, start + ids.size()], multiples of B
  int64_t logits_from = 0;               // logits are wanted for new tokens [logits_from, ids.size())
};

// A step over the rows of one cache pool laid out by `plan`.
struct StepBatch {
  uint8_t* pool = nullptr;
  const CachePlan* plan = nullptr;
  std::span<const SequenceStep> seqs;
};

// One request's state outside any engine: its own rows (state rows first, then token rows in block order), laid
// out by the model's own plan. What Model::forward(SequenceState&, ...) runs against.
struct SequenceState {
  int64_t num_tokens = 0;
  std::vector<uint8_t> rows;
};

// One request's part of an MLA layer's step: its pages (pages.pos0 = its cached positions) and its new tokens.
struct MlaStepRequest {
  TokenPages pages;
  int64_t tokens = 0;
};

// Runs an MLA layer for all requests of a step at once, in place of MlaAttention::forward per request. The
// token-sharded prefill of src/parallel implements it over W ranks; the model knows nothing of ranks.
class MlaStepRunner {
 public:
  virtual ~MlaStepRunner() = default;
  // x: [N, hidden] normed input of the step's tokens, requests back to back in the order of `requests`;
  // y: [N, hidden]. Must write and read the pages as MlaAttention::forward does.
  virtual void run(const MlaAttention& layer, const float* x, std::span<const MlaStepRequest> requests,
                   float* y) = 0;
};

struct DecoderLayer {
  Tensor input_norm, post_norm;
  std::unique_ptr<MlaAttention> mla;  // exactly one of mla / kda
  std::unique_ptr<KdaMixer> kda;
  std::unique_ptr<FeedForward> dense;  // exactly one of dense / moe
  std::unique_ptr<MoE> moe;
};

class Model {
  friend struct GpuWeightAccess;

 public:
  // Loads config.json and the safetensors checkpoint of `dir`; every tensor must be consumed (tensors of extra
  // MTP layers beyond num_hidden_layers are skipped), otherwise an Error lists the unexpected ones.
  static std::unique_ptr<Model> load(const std::string& dir, const ModelOptions& opts = {});

  const ModelConfig& config() const { return cfg_; }
  const ModelOptions& options() const { return opts_; }
  // What each layer keeps in the cache, per GPU, with `tp` GPUs sharing the KDA heads.
  std::vector<LayerCacheSpec> cache_specs(int tp = 1) const;
  // Prompt positions at which a prefill may be cut (and resumed) without changing a bit: the KDA chunk (64) when
  // prompts run KDA chunked, else 1.
  int prefill_alignment() const;

  // Runs one step of several requests together: every token through the dense parts at once, each request's
  // tokens through its own attention pages and KDA states. logits: [sum of wanted positions, vocab], requests in
  // order. The result for a request does not depend on the others in the batch. With an `mla` runner, the MLA
  // layers run through it.
  void forward(const StepBatch& batch, float* logits, MlaStepRunner* mla = nullptr) const;

  SequenceState new_sequence() const;
  // Feeds T tokens at positions seq.num_tokens...; a call with T > 1 is a prompt, a single token a generated one.
  // Writes logits [T, vocab] for every position, or only for the last one (logits [1, vocab]) when last_only.
  void forward(SequenceState& seq, const int32_t* ids, int64_t T, float* logits, bool last_only = false) const;

  std::vector<DecoderLayer>& layers() { return layers_; }
  const std::vector<DecoderLayer>& layers() const { return layers_; }

 private:
  ModelConfig cfg_;
  ModelOptions opts_;
  CachePlan sequence_plan_;  // the layout of a SequenceState
  Tensor embed_, final_norm_, lm_head_;
  std::vector<DecoderLayer> layers_;
};

// What each layer of `cfg` keeps in the cache in the formats of `opts`, per GPU with `tp` GPUs sharing KDA heads.
std::vector<LayerCacheSpec> model_cache_specs(const ModelConfig& cfg, const ModelOptions& opts, int tp);

// One graph builder per architecture family: which tensors make up layer `layer`.
// model/kimi.cpp serves kimi_linear and kimi_k3 (kimi_k3 is kimi_linear plus the DSA indexer, which the MLA module
// adds when the config has one); model/deepseek_v32.cpp serves deepseek_v32.
DecoderLayer load_kimi_layer(const ModelConfig& cfg, WeightLoader& w, int layer, const ModelOptions& opts);
DecoderLayer load_deepseek_v32_layer(const ModelConfig& cfg, WeightLoader& w, int layer, const ModelOptions& opts);

}  // namespace kestrel
