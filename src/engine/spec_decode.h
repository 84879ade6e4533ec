// Speculative decoding on the engine's loop: a drafter proposes up to k tokens after a sequence's last one, the
// target computes all k + 1 positions in one step (KDA keeps the state after every position in per-position slots,
// engine/scheduler.h), and the verifier here keeps the longest prefix the target's distribution accepts, plus one
// token of its own. Verification is token-level rejection sampling (Leviathan et al., Chen et al.) on the request's
// own random stream: the output distribution is the target's, and at temperature 0 the output is the target's
// greedy output token for token (with the same log-probabilities: they are taken from the same logits).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "grammar/output_constraint.h"

namespace kestrel {

struct Sequence;

// --speculative-config (vLLM's field names). Only what is built is accepted; dspark is a known method that is
// refused when an engine is made (make_drafter) until its drafter is built.
struct SpeculativeConfig {
  std::string method = "ngram";          // ngram | mtp | dspark
  std::string model;                     // the drafter's checkpoint (dspark; ngram and mtp take none)
  int num_speculative_tokens = 0;        // k: drafts per step, 1..kMaxSpeculativeTokens
  int prompt_lookup_min = 5, prompt_lookup_max = 5;  // ngram: the n-gram lengths tried, longest first
  std::string draft_sample_method = "greedy";        // greedy | probabilistic (drafts sampled from q, q verified)
  std::string rejection_sample_method = "standard";  // standard (lossless) | synthetic (forced acceptance)
  // synthetic: the probability that the first i + 1 drafts are all accepted, per position i (non-increasing), as
  // vLLM's synthetic_acceptance_rates; synthetic_acceptance_rate r gives rates c^(i+1) with mean r.
  std::vector<double> synthetic_acceptance_rates;
};
inline constexpr int kMaxSpeculativeTokens = 32;

// Parses and validates the JSON of --speculative-config; an Error names the offending field (bad JSON, an unknown
// field or method, a wrong type, a value out of range).
SpeculativeConfig parse_speculative_config(const std::string& json);
// The JSON's method-independent checks on a config built in code (the same errors).
void validate_speculative_config(SpeculativeConfig& c);

// Drafts for one sequence: tokens d_1..d_m (m <= the asked number) and, for a probabilistic drafter, the
// distribution q_i each was sampled from ([m, vocab], rows summing to 1); empty probs: point masses (q_i is one-hot
// at d_i, as an n-gram's drafts).
struct Draft {
  std::vector<int32_t> tokens;
  std::vector<float> probs;
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  // Proposes at most max_tokens drafts to follow s.tokens (the prompt and the tokens generated so far). A drafter
  // that samples its drafts draws from s's own random stream (s.sampler), so that a seed reproduces them.
  virtual void propose(Sequence& s, int max_tokens, int64_t vocab, Draft& out) = 0;
  // A drafter conditioned on the target's hidden states (MTP, DSpark) names them (Model::forward's layers: kFinalHidden
  // or a decoder layer's output; empty: none). The engine then hands it, after every step, those hidden states
  // [n, layers * hidden_size] of the n positions start... of s that the step computed and kept (rejected drafts'
  // positions left out). A start before what it was given last means the positions from start on were computed
  // again (preemption, rejected drafts).
  virtual std::vector<int> hidden_layers() const { return {}; }
  virtual void observe(const Sequence& s, int64_t start, int64_t n, const float* hidden);
  // s finished or was aborted: what the drafter keeps for it can go.
  virtual void release(const Sequence&) {}
};

// Prompt lookup: the longest n-gram (n from max down to min) ending the sequence that occurred before in it; the
// tokens that followed its latest earlier occurrence are the drafts.
class NgramDrafter final : public Drafter {
 public:
  NgramDrafter(int min_n, int max_n) : min_n_(min_n), max_n_(max_n) {}
  void propose(Sequence& s, int max_tokens, int64_t vocab, Draft& out) override;
  static void lookup(std::span<const int32_t> tokens, int min_n, int max_n, int max_tokens,
                     std::vector<int32_t>& out);

 private:
  int min_n_, max_n_;
};

// One draft from a drafter's logits [vocab] (MTP, DSpark): the argmax (ties to the lower id), or with `sample` a draw
// from q -- the request's temperature, top-k, top-p and min-p over these logits, no penalties (vLLM's draft
// sampling) -- with a uniform from `sampler`'s stream (the request's own), q written to q_row [vocab].
int32_t choose_draft(const float* logits, int64_t vocab, bool sample, const SamplingParams& params, Sampler& sampler,
                     float* q_row, SamplingCandidates& scratch);

class Model;

// The drafter of a config for `target`: ngram; mtp (the target's own MTP layer, engine/mtp_drafter.h: the model must
// have been loaded with it); dspark is refused (not built yet).
std::unique_ptr<Drafter> make_drafter(const SpeculativeConfig& c, const Model& target);

struct VerifyOptions {
  bool synthetic = false;                     // rejection_sample_method synthetic
  std::span<const double> synthetic_rates;    // per position: P(first i + 1 accepted)
  // Structured output: the grammar's allowed tokens (bit t of words[t / 32]) at positions 0..n-1 of the step, each
  // after the drafts before it (grammar_draft_masks). Fewer than k + 1: the last position's draft is outside the
  // grammar (rejected for sure) or ends it (nothing follows it once accepted). Empty: no grammar.
  std::span<const std::vector<uint32_t>> masks;
};

// What verification chose for one sequence: the accepted drafts d_1..d_a, then one token of the target's (the
// recovered token at the first rejection, or the bonus token after all k), each with its log-probability when
// asked for; `accepted` = a.
struct VerifyResult {
  int accepted = 0;
  std::vector<int32_t> tokens;           // a + 1 tokens
  std::vector<TokenLogprob> logprobs;    // a + 1 entries when want_logprobs
};

// Verifies drafts against the target's logits [k + 1, vocab] (row i: the distribution of the token after d_i; row
// 0 follows the sequence's last token). q: [k, vocab] draft distributions, or empty (point masses). Draws from and
// advances `sampler` (its stream and its penalty counts) as the tokens are chosen, in order:
//  - temperature 0: each position's token is the normal sampler's choice; the drafts are kept while they equal it.
//  - otherwise, for position i: accept d_i when u < p_i(d_i) / q_i(d_i) (u from the stream), where p_i is the
//    distribution the normal sampler draws from (penalties, temperature, top-k, top-p, min-p); at the first
//    rejection the token is drawn from norm(max(0, p_i - q_i)); after k acceptances the bonus token is the normal
//    sampler's draw from row k.
//  - synthetic: d_i is accepted with the configured conditional rate, whatever the target says (a benchmark of
//    acceptance lengths, not lossless); the token after the accepted ones is the normal sampler's.
VerifyResult verify_draft(Sampler& sampler, const float* logits, int64_t vocab, std::span<const int32_t> drafts,
                          std::span<const float> q, bool want_logprobs, const VerifyOptions& opt = {});

// Structured output with drafts. The masks of the positions a verification step can sample (VerifyOptions::masks):
// position j's after drafts 0..j-1, up to the first draft outside the grammar or the draft that ends it. The matcher
// is left as it was.
std::vector<std::vector<uint32_t>> grammar_draft_masks(grammar::OutputMatcher& m, std::span<const int32_t> drafts);
// How many drafts are worth verifying: through the first one outside the grammar (which is rejected for sure) or
// the one that ends it. Cutting there changes no result, also for drafts sampled with their q. The matcher is left
// as it was.
size_t grammar_draft_prefix(grammar::OutputMatcher& m, std::span<const int32_t> drafts);

// Counters with vLLM's meanings (vllm:spec_decode_*): drafts = verification steps of a sequence with >= 1 draft.
struct SpecDecodeCounters {
  int64_t num_drafts = 0, num_draft_tokens = 0, num_accepted_tokens = 0;
  std::vector<int64_t> accepted_per_pos;  // [k]: how often the draft at position i was accepted
  // 1 + accepted / drafts (the bonus or recovered token included); 0 with no drafts.
  double mean_acceptance_length() const {
    return num_drafts ? 1.0 + static_cast<double>(num_accepted_tokens) / static_cast<double>(num_drafts) : 0.0;
  }
};

}  // namespace kestrel
