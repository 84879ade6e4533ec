#include "engine/mtp_drafter.h"

#include <algorithm>

#include "core/error.h"

namespace kestrel {

MtpDrafter::MtpDrafter(const Model& target, const SpeculativeConfig& c) : model_(target) {
  const ModelConfig& cfg = target.config();
  KESTREL_CHECK(cfg.num_nextn_predict_layers > 0,
                "--speculative-config: method 'mtp' needs the checkpoint's multi-token-prediction layer, and this "
                "{} model has none (config.json's num_nextn_predict_layers is {})",
                arch_name(cfg.arch), cfg.num_nextn_predict_layers);
  KESTREL_CHECK(target.has_mtp(), "--speculative-config: method 'mtp': the model was loaded without its MTP layer "
                                  "(LoadOptions::load_mtp)");
  KESTREL_CHECK(c.model.empty(), "--speculative-config: 'model' is not used by method 'mtp' (the MTP layer is the "
                                 "target checkpoint's own), got '{}'", c.model);
  D_ = cfg.hidden_size;
  probabilistic_ = c.draft_sample_method == "probabilistic";
}

void MtpDrafter::observe(const Sequence& s, int64_t start, int64_t n, const float* hidden) {
  if (n <= 0) return;
  const Key key{s.request->id, s.index};
  auto it = states_.find(key);
  if (it == states_.end()) {
    it = states_.emplace(key, State{model_.new_mtp_sequence(), start, start, {}}).first;
  }
  State& st = it->second;
  const int64_t fed_end = st.offset + st.cache.num_tokens;
  const int64_t have_end = st.pending_start + static_cast<int64_t>(st.pending.size()) / D_;
  if (start < st.offset || start > have_end) {
    // Before the cache's first position, or after a gap: the cache starts again here.
    st.offset = start;
    st.cache.num_tokens = 0;
    st.pending_start = start;
    st.pending.clear();
  } else if (start < fed_end) {
    // Positions computed again: the cache forgets them (an MLA cache rolls back by its length).
    st.cache.num_tokens = start - st.offset;
    st.pending_start = start;
    st.pending.clear();
  } else {
    st.pending.resize(static_cast<size_t>((start - st.pending_start) * D_));
  }
  st.pending.insert(st.pending.end(), hidden, hidden + n * D_);
}

void MtpDrafter::release(const Sequence& s) { states_.erase(Key{s.request->id, s.index}); }

void MtpDrafter::propose(Sequence& s, int max_tokens, int64_t vocab, Draft& out) {
  out.tokens.clear();
  out.probs.clear();
  const auto it = states_.find(Key{s.request->id, s.index});
  if (it == states_.end() || max_tokens <= 0) return;
  State& st = it->second;
  const int64_t L = static_cast<int64_t>(s.tokens.size()), last = L - 2;  // the last position with a hidden state
  const int64_t have_end = st.pending_start + static_cast<int64_t>(st.pending.size()) / D_;
  if (last < st.pending_start || have_end <= last) return;  // nothing (or not all) of the target's yet
  // The real positions pending_start..last, each with the token after it.
  const int64_t T = last - st.pending_start + 1;
  std::vector<int32_t> ids(static_cast<size_t>(T));
  std::vector<float> scale(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t p = st.pending_start + t;
    ids[t] = s.tokens[p + 1];
    scale[t] = p == 0 ? 0.0f : 1.0f;
  }
  logits_.resize(static_cast<size_t>(vocab));
  hidden_out_.resize(static_cast<size_t>(T * D_));
  model_.mtp_forward(st.cache, ids.data(), st.pending.data(), scale.data(), T, logits_.data(), hidden_out_.data());
  const bool sample = probabilistic_ && s.request->params.temperature != 0.0f;
  SamplingCandidates cand;
  auto choose = [&] {
    if (sample) out.probs.resize(out.probs.size() + static_cast<size_t>(vocab));
    return choose_draft(logits_.data(), vocab, sample, s.request->params, s.sampler,
                        sample ? out.probs.data() + out.probs.size() - vocab : nullptr, cand);
  };
  out.tokens.push_back(choose());
  std::vector<float> h(hidden_out_.end() - D_, hidden_out_.end());
  const float one = 1.0f;
  for (int j = 1; j < max_tokens; ++j) {
    const int32_t id = out.tokens.back();
    hidden_out_.resize(static_cast<size_t>(D_));
    model_.mtp_forward(st.cache, &id, h.data(), &one, 1, logits_.data(), hidden_out_.data());
    out.tokens.push_back(choose());
    h.assign(hidden_out_.begin(), hidden_out_.end());
  }
  // The cache keeps the real positions before `last`; `last` is fed again next time with what follows (so that a
  // proposal always has the logits of its last real position), the chained positions are overwritten.
  std::vector<float> keep(st.pending.begin() + (T - 1) * D_, st.pending.begin() + T * D_);
  st.cache.num_tokens = last - st.offset;
  st.pending_start = last;
  st.pending = std::move(keep);
}

}  // namespace kestrel
