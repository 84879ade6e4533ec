// The `dspark` drafter (model/dspark.h): per sequence, the draft layers' keys and values of the target's context
// (kept positions only, from the hidden states of dspark_target_layer_ids the engine hands over); per proposal one
// block forward from the last sampled token, then the Markov head position by position: greedy drafts take the
// argmax (point masses); with draft_sample_method probabilistic and a temperature > 0 each draft is drawn from q,
// the request's temperature, top-k, top-p and min-p over the biased logits (vLLM's draft sampling; no penalties),
// with a uniform from the request's own random stream, and q goes to the verifier.
//
// The context cache is the drafter's own (host memory, apart from the engine's pool); rollback truncates it. It
// starts where the target first computed positions for the sequence: after a prefix-cache hit (or a fork) the block
// attends only to what was computed since (drafts of lower quality; the verified output is the same).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "engine/sequence.h"
#include "engine/spec_decode.h"
#include "model/dspark.h"
#include "model/model.h"

namespace kestrel {

// The drafts of one block (what DsparkDrafter::propose does after the block forward): base [block_size, vocab]
// (each row gets its Markov bias in place), prev the last sampled token, k drafts; sample: each drawn from q (the
// params' temperature, top-k, top-p, min-p) with a uniform from `sampler`'s stream, q rows in out.probs; otherwise
// the argmax (point masses).
void dspark_draft(const DsparkModel& m, float* base, int64_t vocab, int32_t prev, int k, bool sample,
                  const SamplingParams& params, Sampler& sampler, Draft& out);

class DsparkDrafter final : public Drafter {
 public:
  // Loads c.model; Error naming the field when it does not fit the target (vocabulary, width, layers) or the config
  // (num_speculative_tokens beyond dspark_block_size).
  DsparkDrafter(const Model& target, const SpeculativeConfig& c);
  std::vector<int> hidden_layers() const override { return drafter_->config().target_layer_ids; }
  void observe(const Sequence& s, int64_t start, int64_t n, const float* hidden) override;
  void release(const Sequence& s) override;
  void propose(Sequence& s, int max_tokens, int64_t vocab, Draft& out) override;

 private:
  using Key = std::pair<RequestId, int>;
  struct State {
    int64_t offset = 0, len = 0;                // context positions offset .. offset + len - 1
    std::vector<std::vector<float>> k, v;       // per draft layer [len, head_dim]
  };
  std::unique_ptr<DsparkModel> drafter_;
  bool probabilistic_;
  std::map<Key, State> states_;
  std::vector<float> base_;
};

}  // namespace kestrel
