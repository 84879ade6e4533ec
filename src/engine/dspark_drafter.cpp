#include "engine/dspark_drafter.h"

#include <algorithm>

#include "core/error.h"

namespace kestrel {

DsparkDrafter::DsparkDrafter(const Model& target, const SpeculativeConfig& c)
    : probabilistic_(c.draft_sample_method == "probabilistic") {
  KESTREL_CHECK(!c.model.empty(), "--speculative-config: method 'dspark' needs 'model', the drafter's checkpoint "
                                  "directory (make-model --dspark-out writes one)");
  drafter_ = DsparkModel::load(c.model, &target.config());
  const DsparkConfig& d = drafter_->config();
  KESTREL_CHECK(c.num_speculative_tokens <= d.block_size,
                "--speculative-config: 'num_speculative_tokens' {} is beyond the DSpark drafter's dspark_block_size {}",
                c.num_speculative_tokens, d.block_size);
}

void DsparkDrafter::observe(const Sequence& s, int64_t start, int64_t n, const float* hidden) {
  if (n <= 0) return;
  State& st = states_[Key{s.request->id, s.index}];
  const int64_t hd = drafter_->config().head_dim;
  if (st.len == 0 || start < st.offset || start > st.offset + st.len) {
    // A new sequence, or positions before or after what the cache holds: it starts again here.
    st = State{start, 0, {}, {}};
  } else {
    st.len = start - st.offset;  // positions computed again are forgotten
    for (auto& k : st.k) k.resize(static_cast<size_t>(st.len * hd));
    for (auto& v : st.v) v.resize(static_cast<size_t>(st.len * hd));
  }
  drafter_->context(hidden, n, start, st.k, st.v);
  st.len += n;
}

void DsparkDrafter::release(const Sequence& s) { states_.erase(Key{s.request->id, s.index}); }

void DsparkDrafter::propose(Sequence& s, int max_tokens, int64_t vocab, Draft& out) {
  out.tokens.clear();
  out.probs.clear();
  const auto it = states_.find(Key{s.request->id, s.index});
  if (it == states_.end() || max_tokens <= 0) return;
  const State& st = it->second;
  const DsparkConfig& d = drafter_->config();
  const int64_t L = static_cast<int64_t>(s.tokens.size());
  if (st.offset + st.len != L - 1) return;  // the context must end where the last sampled token follows
  // The block: the last sampled token, then the noise token, at positions L - 1, L, ...
  std::vector<int32_t> ids(static_cast<size_t>(d.block_size), d.noise_token_id);
  ids[0] = s.tokens.back();
  base_.resize(static_cast<size_t>(d.block_size * vocab));
  drafter_->block_logits(ids.data(), L - 1, st.k, st.v, st.len, base_.data());
  const SamplingParams& p = s.request->params;
  dspark_draft(*drafter_, base_.data(), vocab, ids[0], std::min(max_tokens, d.block_size),
               probabilistic_ && p.temperature != 0.0f, p, s.sampler, out);
}

void dspark_draft(const DsparkModel& m, float* base, int64_t vocab, int32_t prev, int k, bool sample,
                  const SamplingParams& params, Sampler& sampler, Draft& out) {
  out.tokens.clear();
  out.probs.clear();
  SamplingCandidates cand;
  if (sample) out.probs.assign(static_cast<size_t>(k * vocab), 0.0f);
  for (int i = 0; i < k; ++i) {
    float* logits = base + i * vocab;
    m.add_markov_bias(prev, logits);
    prev = choose_draft(logits, vocab, sample, params, sampler, sample ? out.probs.data() + i * vocab : nullptr, cand);
    out.tokens.push_back(prev);
  }
}

}  // namespace kestrel
