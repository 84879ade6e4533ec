// The backend interface: what a model definition (src/model/model.cpp, one graph per architecture) calls, and what
// each backend implements -- the CPU backend (src/cpu: the fp32 reference, number formats emulated bit exactly) and
// the CUDA backend (src/gpu). A backend owns its weights (in the form it computes with: fp32 on the CPU, the stored
// precision on the GPU), its step workspaces and the per-step activations; the model file holds only handles and
// never sees memory, kernels or devices. docs/architecture.md describes the split.
//
// A step runs in three parts: the backend takes the step's sequences (begin), the model runs its graph over the
// step's tokens as calls on Act handles, and the backend gives back the logits or the sampled tokens. Within a step
// every Act has one row per step token, in an order of the backend's choosing (the CUDA backend runs single
// generated tokens first); what is per sequence -- cache pages, KDA states, positions -- the backend knows from the
// step, so the graph never branches on it.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/stored_tensor.h"

namespace kestrel {

struct StepBatch;
struct ModelOptions;
struct SampleRow;
struct SampledToken;
struct SamplingParams;
struct LoraAdapter;  // model/lora.h

// ---------------------------------------------------------------- handles

// An activation of the current step: every step token's row of `cols` values, starting at column `col` of one of the
// backend's buffers. Valid until the scratch scope that made it ends (end_layer) or, for the step's residual stream,
// until the step ends.
struct Act {
  int32_t buf = -1;
  int64_t col = 0, cols = 0;
  bool valid() const { return buf >= 0; }
  // Columns [first, first + n) of this activation.
  Act slice(int64_t first, int64_t n) const { return Act{buf, col + first, n}; }
};

// Weights the backend holds, by index into its own tables.
struct LinearW {
  int32_t id = -1;
  int64_t out = 0, in = 0;
};
struct VecW {  // norm weights and other small per-channel parameters; fp32 on every backend
  int32_t id = -1;
  int64_t n = 0;
};
struct EmbeddingW {
  int32_t id = -1;
};
struct MlaAttnW {
  int32_t id = -1;
};
struct KdaW {
  int32_t id = -1;
};
struct MoeW {
  int32_t id = -1;
};

// ---------------------------------------------------------------- what the loader hands a backend

// A linear weight [out, in] as stored: plain (bf16/f16/f32 `weight`), FP8 e4m3 codes `weight` with fp32 block scales
// `scales` [ceil(out / block), ceil(in / block)] (weight_scale_inv), or MXFP4 `weight` (packed [out, in / 2]) with
// E8M0 `scales` [out, in / 32].
enum class WeightFormat { plain, fp8_block, mxfp4 };
struct StoredLinear {
  WeightFormat format = WeightFormat::plain;
  StoredTensor weight, scales;
  int64_t out = 0, in = 0;
  int block = 0;  // fp8_block
};

// A routed-expert MoE layer: router [E, D] (+ selection bias [E]), each expert's gate, up [F, D] and down [D, F].
struct MoeSpec {
  StoredTensor router;
  std::optional<StoredTensor> bias;
  std::vector<StoredLinear> gate, up, down;  // one per expert
  int n_experts = 0, top_k = 0, n_group = 1, topk_group = 1;
  bool renormalize = true;
  float scaling = 1.0f;
};

// The cache-side core of a KDA layer: short-conv taps [P, 1, W] of q, k, v; A_log [H]; dt_bias [P]; o_norm [dk].
struct KdaSpec {
  StoredTensor conv_q, conv_k, conv_v, A_log, dt_bias, o_norm;
};

// The cache-side core of an MLA layer: kv_b [H * (dn + dv), C] (absorption and un-absorption), the latent scale,
// and, with DSA, the indexer's weights.
struct MlaAttnSpec {
  StoredLinear kv_b;
  float kv_scale = 1.0f;
  struct Indexer {
    StoredLinear wq_b, wk, weights_proj;
    StoredTensor k_norm_w, k_norm_b;
  };
  std::optional<Indexer> indexer;
};

// Whether a MoE layer's FP8 block-scaled routed experts run in FP8 (activations quantized per 128 columns, as dense
// FP8 linears): hidden and expert widths multiples of 128 and 128 x 128 blocks, the shapes the GPU's expert kernels
// take (DeepSeek-V3.2: 7168 and 2048). Otherwise every backend runs them on their decoded values with bf16 inputs
// (the GPU numerics), so that the backends agree.
bool fp8_experts_stay_fp8(const ModelConfig& cfg);

// ---------------------------------------------------------------- the interface

enum class RopeStyle { interleaved, neox };

// The ops of one step, over its activations (fp32 semantics; the CUDA backend keeps bf16 copies where its products
// take them, the CPU backend rounds as ModelOptions::gpu_numerics says). Every call enqueues or computes at once, as
// the backend does; the graph reads no values back.
class StepOps {
 public:
  virtual ~StepOps() = default;
  // Tokens of the step.
  virtual int64_t tokens() const = 0;

  // Scratch scope: activations made between begin_layer(l) and end_layer(l) die at end_layer. The residual stream is
  // made before the first layer and lives for the step.
  virtual void begin_layer(int layer) = 0;
  virtual void end_layer(int layer) = 0;

  virtual Act embed(EmbeddingW table) = 0;  // [N, D]: the rows of the step's token ids
  virtual Act rms_norm(Act x, VecW w, float eps) = 0;
  virtual void rms_norm_inplace(Act x, VecW w, float eps) = 0;
  virtual Act linear(LinearW w, Act x) = 0;
  virtual void add(Act h, Act y) = 0;  // h += y
  // RoPE on `heads` groups of `head_stride` columns of x: columns [offset, offset + dim) of each group rotate by the
  // token's position (the model's frequency table, YaRN included).
  virtual void rope(Act x, int heads, int64_t head_stride, int64_t offset, int dim, RopeStyle style) = 0;
  // gu [N, 2F] (gate ; up) -> silu(gate) * up [N, F].
  virtual Act swiglu(Act gu) = 0;
  // The routed experts of a MoE layer, router included (fp32): [N, D] -> [N, D].
  virtual Act moe(MoeW w, Act x) = 0;
  // KDA's cache side for layer `layer`: the raw projections qkv [N, 3P] (q ; k ; v before their short
  // convolutions), f [N, P] (the forget gate's pre-activation), beta [N, H] (b_proj's output, a logit) and g [N, P]
  // (the output gate) -> the gated, normed output [N, P] (o_proj's input). Reads and advances each request's state
  // and conv histories, and writes the checkpoints the step asks for.
  virtual Act kda(KdaW w, int layer, Act qkv, Act f, Act beta, Act g) = 0;
  // MLA's cache side for layer `layer`: x [N, D] the layer's normed input (the indexer's keys and head weights), qr
  // [N, q_lora_rank] the normed query latent (the indexer's query input; invalid without q_lora_rank, when x is), q
  // [N, H * (dn + dr)] the queries with RoPE applied, kv [N, C + R] the normed latent with RoPE applied. Writes the
  // new tokens' latent (and index keys), selects (DSA) and attends in the absorbed form -> [N, H * dv] (o_proj's
  // input).
  virtual Act mla_attention(MlaAttnW w, int layer, Act x, Act qr, Act q, Act kv) = 0;
  // The final norm and the LM head over the rows whose logits the step wants: the step's result.
  virtual void logits(Act h, VecW final_norm, LinearW head) = 0;

  // Drafters (speculative decoding on the CPU reference; other backends refuse them): an activation whose rows the
  // host gives ([N, cols], step order), each row of x scaled by its own factor, and every row t of x copied to the host at dst + t * row_stride.
  virtual Act host_rows(std::span<const float> rows, int64_t cols);
  virtual void scale_rows(Act x, std::span<const float> factors);
  virtual void copy_out(Act x, float* dst, int64_t row_stride);
};

// What a step hands back: its logits in host memory, or the tokens the backend sampled.
struct StepResults {
  float* logits = nullptr;                   // [wanted rows, vocab], sequences in the step's order
  std::span<const SampleRow> sample;         // or: the rows to sample (Backend::samples_rows)
  std::vector<SampledToken>* sampled = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;  // "cpu", "cuda": logs and traces

  // -- Set-up, in this order: configure, the weights (while the model loads), finalize_weights.
  virtual void configure(const ModelConfig& cfg, const ModelOptions& opts) = 0;
  virtual EmbeddingW add_embedding(const StoredTensor& table) = 0;  // [V, D]
  // The embedding table as the LM head's weight (tie_word_embeddings): the same memory.
  virtual LinearW tied_head(EmbeddingW table) = 0;
  // One weight whose rows are the parts' rows in order (one product computes several projections of one input).
  virtual LinearW add_linear(std::span<const StoredLinear> parts) = 0;
  virtual VecW add_vector(const StoredTensor& t) = 0;
  virtual MlaAttnW add_mla_attention(const MlaAttnSpec& spec) = 0;
  virtual KdaW add_kda(const KdaSpec& spec) = 0;
  virtual MoeW add_moe(const MoeSpec& spec) = 0;
  // Every weight is in: uploads still in flight finish here.
  virtual void finalize_weights() = 0;

  // -- LoRA adapters (model/lora.h): a step's sequence with SequenceStep::lora = id adds scale * B (A x) to each
  // linear layer the adapter names. load_lora checks every module against the model's layers (Error naming the
  // adapter's file and tensor) and replaces the adapter `id` had, if any; a backend without LoRA refuses it, and
  // refuses a step with an adapter.
  virtual void load_lora(int32_t id, const LoraAdapter& adapter);
  virtual void unload_lora(int32_t /*id*/) {}

  // -- One step: the backend takes the step's sequences, runs `graph` over its ops (unless it replays a recording of
  // it: the CUDA backend replays CUDA graphs for steps of single generated tokens) and hands back `results`.
  virtual void run_step(const StepBatch& batch, const std::function<void(StepOps&)>& graph,
                        const StepResults& results) = 0;
  // Whether run_step can sample rows with these parameters itself; false: the engine samples from the logits.
  virtual bool samples_rows(const SamplingParams&) const { return false; }

  // Bytes of weights and of workspaces the backend holds (the start-up log).
  virtual size_t weight_bytes() const = 0;
  virtual size_t workspace_bytes() const = 0;
};

}  // namespace kestrel
