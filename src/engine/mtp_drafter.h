// The `mtp` drafter: the target checkpoint's own multi-token-prediction layer (DeepSeek-V3's MTP module, config
// num_nextn_predict_layers; Model::mtp_forward), conditioned on the target's final-normed hidden states, which the
// engine hands over after every step (Drafter::observe).
//
// Its attention cache is a pool of its own, apart from the engine's packed cache: per sequence one MLA layer's rows
// (a SequenceState of Model::new_mtp_sequence). MTP position p takes the token at p + 1 and the target's hidden
// state at p, so the cache follows the sequence one position behind the target; speculative positions (a chained
// draft's own input) are written past the real ones and overwritten by the next step. Rollback is a shorter length.
// The cache starts where the target first computed positions for this sequence: after a prefix-cache hit (or a fork
// of n > 1 completions) the MTP layer attends only to the positions computed since (a draft of lower quality; the
// verified output is the same).
#pragma once
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "engine/sequence.h"
#include "engine/spec_decode.h"
#include "model/model.h"

namespace kestrel {

class MtpDrafter final : public Drafter {
 public:
  // Error when the target has no MTP layer loaded (naming config.json's num_nextn_predict_layers) or the config asks
  // for what this drafter does not do.
  MtpDrafter(const Model& target, const SpeculativeConfig& c);
  std::vector<int> hidden_layers() const override { return {kFinalHidden}; }
  void observe(const Sequence& s, int64_t start, int64_t n, const float* hidden) override;
  void release(const Sequence& s) override;
  // d_1 from the MTP layer at the last computed position, d_j (j > 1) from the layer run again on d_(j-1) and its own
  // previous output hidden state (vLLM's chaining of one MTP layer); each the argmax, or with draft_sample_method
  // probabilistic and a temperature > 0 drawn from q (choose_draft).
  void propose(Sequence& s, int max_tokens, int64_t vocab, Draft& out) override;

 private:
  using Key = std::pair<RequestId, int>;
  struct State {
    SequenceState cache;    // num_tokens: MTP positions fed, from target position `offset` on
    int64_t offset = 0;
    int64_t pending_start = 0;  // == offset + cache.num_tokens: hidden states not yet fed, from this position on
    std::vector<float> pending;
  };
  const Model& model_;
  int64_t D_;
  bool probabilistic_ = false;
  std::map<Key, State> states_;
  std::vector<float> logits_, hidden_out_;
};

}  // namespace kestrel
