// Token-sharded prefill of the MLA layers (PARALLEL.md "Token-sharded prefill") over the ranks of a Communicator,
// inside the model's own forward pass. What runs where, per MLA layer, on each of the W ranks:
// - replicated (every rank, every step token): the latent and index-key entries written to the rank's copy of the
//   cache (the cache is replicated, as under TP) and the query latent qr (q_a_proj + norm);
// - split by head: the query projection (q_b_proj rows of the rank's heads, RoPE);
// - first all-to-all: [step tokens, own heads] -> [own tokens, all heads];
// - split by token (the 2W-piece causal split): the indexer's queries, scores and top-k, sparse attention in the
//   absorbed form, W_UV;
// - second all-to-all: [own tokens, all heads] -> [step tokens, own heads];
// - the output projection, replicated or split by head (OutputProjection).
// Everything outside the MLA layers (embedding, KDA, FFN/MoE, norms, LM head) is the model's forward, replicated.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "model/model.h"
#include "parallel/communicator.h"
#include "parallel/prefill_plan.h"

namespace kestrel::parallel {

enum class OutputProjection {
  // The head-sharded outputs are all-gathered and every rank applies all of o_proj: each output element is the
  // same dot product as in the unsharded layer, so the step equals the unsharded step bit for bit.
  replicated,
  // Each rank applies the o_proj columns of its heads and the partial results are summed with all_reduce_sum
  // (tensor parallelism): equal to the unsharded layer up to fp32 rounding of the split sums.
  head_split,
};

// What one rank's attention core ran in one MLA layer, per request of the step.
struct TokenShardWork {
  std::vector<int64_t> query_tokens;  // queries attended
  std::vector<int64_t> causal_work;   // sum over those queries of (position + 1): the keys each one scores
};

// The MlaStepRunner of one rank: runs each MLA layer of a step token-sharded. The requests passed to run() must be
// those of the plan, in order.
class TokenShardedMla : public MlaStepRunner {
 public:
  TokenShardedMla(Communicator& comm, const TokenShardPlan& plan, OutputProjection output);
  void run(const MlaAttention& layer, const float* x, std::span<const MlaStepRequest> requests, float* y) override;
  // One entry per run() call (per MLA layer), in call order.
  const std::vector<TokenShardWork>& work() const { return work_; }

 private:
  Communicator& comm_;
  const TokenShardPlan& plan_;
  OutputProjection output_;
  std::vector<TokenShardWork> work_;
};

// The plan of a step: one PrefillRequest (start, tokens) per sequence.
TokenShardPlan token_shard_plan(const StepBatch& batch, int world);

// Model::forward of one step on this rank with the MLA layers token-sharded over comm. Every rank passes the same
// step (token ids, block tables, slots, state rows) over its own copy of the cache pool, and gets the same logits.
// Returns the work of this rank's attention core, one entry per MLA layer.
std::vector<TokenShardWork> token_sharded_forward(Communicator& comm, const Model& model, const StepBatch& batch,
                                                  float* logits,
                                                  OutputProjection output = OutputProjection::replicated);

}  // namespace kestrel::parallel
