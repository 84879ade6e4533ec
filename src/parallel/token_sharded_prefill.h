// Token-sharded prefill of the MLA layers' attention (PARALLEL.md "Token-sharded prefill") over the ranks of a
// Communicator, inside the model's own forward pass on the CPU backend (StepBatch::mla_runner). What runs where, per
// MLA layer, on each of the W ranks:
// - replicated (every rank, every step token): the projections (the model's graph), and the latent and index-key
//   entries written to the rank's copy of the cache (the cache is replicated, as under TP);
// - first all-to-all: the queries of the rank's heads, [step tokens, own heads] -> [own tokens, all heads];
// - split by token (the 2W-piece causal split): the indexer's queries, scores and top-k, sparse attention in the
//   absorbed form, W_UV;
// - second all-to-all: [own tokens, all heads] -> [step tokens, own heads], then an all-gather of the heads, so that
//   every rank applies o_proj (the model's graph) to the same attention output: the step equals the unsharded step
//   bit for bit.
// Everything outside the MLA layers' attention (embedding, projections, KDA, FFN/MoE, norms, LM head) is the model's
// forward, replicated. This is the oracle of the real multi-GPU engine, which also splits the projections by head.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "cpu/mla_core.h"
#include "model/model.h"
#include "parallel/communicator.h"
#include "parallel/prefill_plan.h"

namespace kestrel::parallel {

// What one rank's attention core ran in one MLA layer, per request of the step.
struct TokenShardWork {
  std::vector<int64_t> query_tokens;  // queries attended
  std::vector<int64_t> causal_work;   // sum over those queries of (position + 1): the keys each one scores
};

// The MlaStepRunner of one rank: runs each MLA layer of a step token-sharded. The requests passed to run() must be
// those of the plan, in order.
class TokenShardedMla : public MlaStepRunner {
 public:
  TokenShardedMla(Communicator& comm, const TokenShardPlan& plan);
  void run(const MlaCore& core, const float* x, const float* qr, const float* q, const float* kv,
           std::span<const MlaStepRequest> requests, float* o) override;
  // One entry per run() call (per MLA layer), in call order.
  const std::vector<TokenShardWork>& work() const { return work_; }

 private:
  Communicator& comm_;
  const TokenShardPlan& plan_;
  std::vector<TokenShardWork> work_;
};

// The plan of a step: one PrefillRequest (start, tokens) per sequence.
TokenShardPlan token_shard_plan(const StepBatch& batch, int world);

// Model::forward of one step on this rank with the MLA layers' attention token-sharded over comm (a model on the CPU
// backend). Every rank passes the same step (token ids, block tables, slots, state rows) over its own copy of the
// cache pool, and gets the same logits. Returns the work of this rank's attention core, one entry per MLA layer.
std::vector<TokenShardWork> token_sharded_forward(Communicator& comm, const Model& model, const StepBatch& batch,
                                                  float* logits);

}  // namespace kestrel::parallel
