// Token sampling from one row of logits, per sequence: penalties, greedy or temperature sampling with top-k,
// top-p and min-p, log-probabilities with top-n alternatives. Each sequence draws from its own random stream,
// advanced once per sampled token, so a seed gives the same tokens alone or in any batch, on every machine.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "grammar/output_constraint.h"

namespace kestrel {

struct SamplingParams {
  int n = 1;                     // completions of the prompt (they share its rows)
  int max_tokens = 16;
  float temperature = 0.0f;      // 0: greedy (ties to the lower id)
  float top_p = 1.0f;
  int top_k = 0;                 // 0: all tokens
  float min_p = 0.0f;            // drop tokens whose probability is below min_p times the largest
  float presence_penalty = 0.0f;   // subtracted once from the logit of every token already generated
  float frequency_penalty = 0.0f;  // subtracted per occurrence among the generated tokens
  float repetition_penalty = 1.0f; // logits of tokens in the prompt or generated: divided by it if > 0, else times
  uint64_t seed = 0;
  int logprobs = -1;             // >= 0: the sampled token's log-probability and that many top alternatives
  // >= 0: the log-probability of every prompt token from position prompt_logprobs_start on (each given the tokens
  // before it: teacher forcing) and that many top alternatives, from the same logits and the same function as the
  // sampled tokens' (token_logprob). The positions scored are computed, never taken from the prefix cache.
  int prompt_logprobs = -1;
  int64_t prompt_logprobs_start = 1;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  // Structured output: each completion's tokens are those its grammar allows (null: unconstrained).
  std::shared_ptr<const grammar::OutputConstraint> constraint;
  // The LoRA adapter the request runs through (Model::load_lora); 0: the base model.
  int32_t lora_id = 0;

  // Error naming the first invalid field. max_tokens may be 0 only with prompt_logprobs (a request that only scores
  // its prompt).
  void validate(int64_t vocab) const;
  bool scores_prompt() const { return prompt_logprobs >= 0; }
};

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
  int64_t rank = 0;  // how many tokens have a logit >= the token's (vLLM's rank; 0: not computed, the GPU sampler)
  std::vector<std::pair<int32_t, float>> top;  // the highest-probability tokens, best first (ties: lower id)
};

// The log-probability of `token` under the model's distribution over one row of raw logits (log-softmax, the sum
// in double), its rank, and the `top_n` most likely tokens. Sampled and scored tokens both take it, so a token
// scored from the logits it was sampled from gets the same bits.
void token_logprob(const float* logits, int64_t vocab, int32_t token, int top_n, TokenLogprob& out);

// A token the penalties apply to: in the prompt (counts for the repetition penalty only, and only when it is on),
// or generated `generated` >= 1 times, or both.
struct PenaltyToken {
  int32_t token = 0;
  int32_t generated = 0;
  bool in_prompt = false;
};

// The choice of one token from one row of logits, given everything a sequence's state contributes: the uniform
// drawn from its stream (used only when temperature != 0), its penalty tokens (distinct) and, with structured
// output, the mask of allowed tokens (bit t of allowed[t / 32]; empty: all): a token outside it is -inf before
// penalties, temperature, top-k, top-p and min-p, so it is never chosen. Sampler::sample is this plus the state; a
// device sampler (kernels/cuda/sampling.h) implements the same function.
int32_t sample_token(const SamplingParams& p, const float* logits, int64_t vocab, double uniform,
                     std::span<const PenaltyToken> penalties, TokenLogprob* logprob,
                     std::span<const uint32_t> allowed = {});

// What sample_token draws from, after the mask, penalties, temperature, top-k, top-p and min-p: greedy_token >= 0
// at temperature 0; otherwise candidates order[0, keep) (by decreasing logit, ties to the lower id) with weights
// prob[i] (relative to the largest, in double) summing to mass. The speculative verifier (spec_decode.h) reads the
// target distribution from here, so it is the distribution the normal sampler draws from.
struct SamplingCandidates {
  int32_t greedy_token = -1;
  std::vector<int32_t> order;
  std::vector<double> prob;
  int64_t keep = 0;
  double mass = 0.0;
  std::vector<float> logits;  // scratch: the masked and penalised logits
};
void sampling_candidates(const SamplingParams& p, const float* logits, int64_t vocab,
                         std::span<const PenaltyToken> penalties, std::span<const uint32_t> allowed,
                         SamplingCandidates& out);
// The token sample_token chooses with this uniform: the first candidate whose cumulative weight passes
// uniform * mass (the last kept one when none does).
int32_t draw_candidate(const SamplingCandidates& c, double uniform);

class Sampler {
 public:
  // stream: the index of the completion among the request's n (each draws from its own stream).
  Sampler(const SamplingParams& p, std::span<const int32_t> prompt, uint64_t stream = 0);
  // Chooses the next token (among `allowed`, when given) and counts it as generated. Log-probabilities, when asked
  // for, are those of the model's distribution (the raw logits, before the mask, penalties and temperature).
  int32_t sample(const float* logits, int64_t vocab, TokenLogprob* logprob = nullptr,
                 std::span<const uint32_t> allowed = {});

  // sample() in parts, for a token chosen elsewhere (on a GPU) by sample_token: the uniform sample() would use (the
  // stream advances only when temperature != 0, as in sample(); otherwise 0 and nothing advances), the penalty
  // tokens, and counting the chosen token.
  double draw_uniform();
  // A uniform in [0, 1) from the stream whatever the temperature (speculative verification's accept tests).
  double draw_uniform_always();
  std::vector<PenaltyToken> penalty_tokens() const;
  void accept(int32_t token) { ++generated_[token]; }
  const SamplingParams& params() const { return p_; }

 private:
  bool penalised() const;
  uint64_t next_random();

  SamplingParams p_;
  uint64_t state_;
  std::unordered_set<int32_t> prompt_tokens_;
  std::unordered_map<int32_t, int> generated_;
};

}  // namespace kestrel
