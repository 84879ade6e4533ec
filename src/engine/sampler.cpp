#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace kestrel {

namespace {
// std::max_element's answer (the first largest value), about three times faster on long rows: the largest value
// through eight independent running maxima (no index to carry, no dependency chain), then the first position
// holding it. A row with a NaN, where the two passes need not agree, takes std::max_element itself.
int32_t first_max(const float* x, int64_t n) {
  float m[8];
  for (int j = 0; j < 8; ++j) m[j] = x[0];
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) m[j] = m[j] < x[i + j] ? x[i + j] : m[j];
  for (; i < n; ++i) m[0] = m[0] < x[i] ? x[i] : m[0];
  float best = m[0];
  for (int j = 1; j < 8; ++j) best = best < m[j] ? m[j] : best;
  for (int64_t k = 0; k < n; ++k)
    if (x[k] == best) return static_cast<int32_t>(k);
  return static_cast<int32_t>(std::max_element(x, x + n) - x);
}
}  // namespace

void SamplingParams::validate(int64_t vocab) const {
  KESTREL_CHECK(n >= 1, "n must be >= 1, got {}", n);
  KESTREL_CHECK(max_tokens >= 1 || (max_tokens == 0 && scores_prompt()),
                "max_tokens must be >= 1 (0 only for a request that scores its prompt), got {}", max_tokens);
  KESTREL_CHECK(max_tokens >= 1 || n == 1, "a request that only scores its prompt has one sequence, not n = {}", n);
  KESTREL_CHECK(temperature >= 0.0f && std::isfinite(temperature), "temperature must be >= 0, got {}", temperature);
  KESTREL_CHECK(top_p > 0.0f && top_p <= 1.0f, "top_p must be in (0, 1], got {}", top_p);
  KESTREL_CHECK(top_k >= 0, "top_k must be >= 0 (0: off), got {}", top_k);
  KESTREL_CHECK(min_p >= 0.0f && min_p <= 1.0f, "min_p must be in [0, 1], got {}", min_p);
  KESTREL_CHECK(std::isfinite(presence_penalty) && std::isfinite(frequency_penalty),
                "presence and frequency penalties must be finite");
  KESTREL_CHECK(repetition_penalty > 0.0f && std::isfinite(repetition_penalty),
                "repetition_penalty must be > 0, got {}", repetition_penalty);
  KESTREL_CHECK(logprobs >= -1 && logprobs <= vocab, "logprobs must be in [0, {}] (or -1: none), got {}", vocab,
                logprobs);
  KESTREL_CHECK(prompt_logprobs >= -1 && prompt_logprobs <= vocab,
                "prompt_logprobs must be in [0, {}] (or -1: none), got {}", vocab, prompt_logprobs);
  KESTREL_CHECK(prompt_logprobs_start >= 1, "prompt_logprobs_start must be >= 1 (the first token has no context), got {}",
                prompt_logprobs_start);
  for (int32_t t : stop_token_ids)
    KESTREL_CHECK(t >= 0 && t < vocab, "stop token id {} is outside the vocabulary (0..{})", t, vocab - 1);
  if (constraint)
    KESTREL_CHECK(constraint->grammar && constraint->grammar->vocab_size() == vocab,
                  "the structured-output grammar was compiled for a vocabulary of {} ids, the model has {}",
                  constraint->grammar ? constraint->grammar->vocab_size() : 0, vocab);
}

namespace {

// splitmix64's output function: a bijection of 64-bit words that spreads every input bit over the output.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

// The stream's start is a mix of the seed and the stream index, so that neighbouring seeds (or completions) start at
// unrelated points: a start linear in the seed with the stream's own increment made seed s + 1 draw seed s's
// stream shifted by one.
Sampler::Sampler(const SamplingParams& p, std::span<const int32_t> prompt, uint64_t stream)
    : p_(p), state_(mix64(mix64(p.seed ^ 0x632BE59BD9B4E019ull) + stream * 0xD1B54A32D192ED03ull)) {
  if (p.repetition_penalty != 1.0f) prompt_tokens_.insert(prompt.begin(), prompt.end());
}

bool Sampler::penalised() const {
  return p_.presence_penalty != 0.0f || p_.frequency_penalty != 0.0f || p_.repetition_penalty != 1.0f;
}

// splitmix64: one step of the stream.
uint64_t Sampler::next_random() { return mix64(state_ += 0x9E3779B97F4A7C15ull); }

void token_logprob(const float* raw, int64_t vocab, int32_t token, int top_n, TokenLogprob& out) {
  const float mx = *std::max_element(raw, raw + vocab);
  double total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) total += std::exp(static_cast<double>(raw[i]) - mx);
  const double lse = mx + std::log(total);
  out.token = token;
  out.logprob = static_cast<float>(raw[token] - lse);
  out.rank = std::count_if(raw, raw + vocab, [&](float l) { return l >= raw[token]; });
  out.top.clear();
  if (top_n > 0) {
    std::vector<int32_t> ids(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + top_n, ids.end(),
                      [&](int32_t a, int32_t b) { return raw[a] > raw[b] || (raw[a] == raw[b] && a < b); });
    for (int i = 0; i < top_n; ++i) out.top.emplace_back(ids[i], static_cast<float>(raw[ids[i]] - lse));
  }
}

void sampling_candidates(const SamplingParams& p_, const float* raw, int64_t vocab,
                         std::span<const PenaltyToken> penalties, std::span<const uint32_t> allowed,
                         SamplingCandidates& c) {
  std::vector<float>& penalised_logits = c.logits;
  penalised_logits.clear();
  const float* logits = raw;
  if (!allowed.empty()) {
    KESTREL_CHECK(static_cast<int64_t>(allowed.size()) * 32 >= vocab, "a token mask of {} words for {} logits",
                  allowed.size(), vocab);
    penalised_logits.assign(raw, raw + vocab);
    bool any = false;
    for (int64_t t = 0; t < vocab; ++t) {
      const bool ok = allowed[static_cast<size_t>(t >> 5)] >> (t & 31) & 1;
      if (!ok) penalised_logits[static_cast<size_t>(t)] = -std::numeric_limits<float>::infinity();
      any = any || ok;
    }
    KESTREL_CHECK(any, "the token mask allows no token");
    logits = penalised_logits.data();
  }
  if (p_.presence_penalty != 0.0f || p_.frequency_penalty != 0.0f || p_.repetition_penalty != 1.0f) {
    if (penalised_logits.empty()) penalised_logits.assign(raw, raw + vocab);
    const float r = p_.repetition_penalty;
    // Each token once (the list is distinct): repetition for tokens of the prompt or generated, then frequency and
    // presence for generated ones; each token's operations are independent of the others'.
    if (r != 1.0f)
      for (const PenaltyToken& t : penalties) {
        float& l = penalised_logits[t.token];
        l = l > 0.0f ? l / r : l * r;
      }
    for (const PenaltyToken& t : penalties)
      if (t.generated > 0)
        penalised_logits[t.token] -= p_.frequency_penalty * static_cast<float>(t.generated) + p_.presence_penalty;
    logits = penalised_logits.data();
  }
  c.greedy_token = -1;
  c.order.clear();
  c.prob.clear();
  c.keep = 0;
  c.mass = 0.0;
  if (p_.temperature == 0.0f) {
    c.greedy_token = first_max(logits, vocab);
    return;
  }
  // Candidates by decreasing logit (ties: lower id); probabilities in double relative to the largest.
  std::vector<int32_t>& order = c.order;
  order.resize(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  auto better = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  int64_t keep = vocab;
  if (p_.top_k > 0 && p_.top_k < vocab) {
    keep = p_.top_k;
    std::partial_sort(order.begin(), order.begin() + keep, order.end(), better);
  } else {
    std::sort(order.begin(), order.end(), better);
  }
  const double top = logits[order[0]];
  std::vector<double>& prob = c.prob;
  prob.resize(static_cast<size_t>(keep));
  double kept = 0.0;
  for (int64_t i = 0; i < keep; ++i) kept += prob[i] = std::exp((logits[order[i]] - top) / p_.temperature);
  if (p_.top_p < 1.0f) {
    // The smallest head of the (top-k) candidates whose renormalised mass reaches top_p.
    double cum = 0.0;
    for (int64_t i = 0; i < keep; ++i) {
      cum += prob[i] / kept;
      if (cum >= p_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  if (p_.min_p > 0.0f) {
    const double floor = p_.min_p * prob[0];
    int64_t i = 1;
    while (i < keep && prob[i] >= floor) ++i;
    keep = i;
  }
  // Masked-out candidates (probability 0) are never the fallback of a draw that passes every cumulative sum.
  if (!allowed.empty())
    while (keep > 1 && prob[static_cast<size_t>(keep - 1)] == 0.0) --keep;
  double mass = 0.0;
  for (int64_t i = 0; i < keep; ++i) mass += prob[i];
  c.keep = keep;
  c.mass = mass;
}

int32_t draw_candidate(const SamplingCandidates& c, double uniform) {
  if (c.greedy_token >= 0) return c.greedy_token;
  const double u = uniform * c.mass;
  double cum = 0.0;
  for (int64_t i = 0; i < c.keep; ++i) {
    cum += c.prob[i];
    if (u < cum) return c.order[i];
  }
  return c.order[c.keep - 1];
}

int32_t sample_token(const SamplingParams& p_, const float* raw, int64_t vocab, double uniform,
                     std::span<const PenaltyToken> penalties, TokenLogprob* logprob, std::span<const uint32_t> allowed) {
  SamplingCandidates c;
  sampling_candidates(p_, raw, vocab, penalties, allowed, c);
  const int32_t token = draw_candidate(c, uniform);
  if (logprob) token_logprob(raw, vocab, token, p_.logprobs, *logprob);
  return token;
}


double Sampler::draw_uniform() {
  if (p_.temperature == 0.0f) return 0.0;
  return draw_uniform_always();
}

double Sampler::draw_uniform_always() {
  return static_cast<double>(next_random() >> 11) * (1.0 / 9007199254740992.0);
}

std::vector<PenaltyToken> Sampler::penalty_tokens() const {
  std::vector<PenaltyToken> out;
  if (!penalised()) return out;
  for (int32_t t : prompt_tokens_) {
    const auto g = generated_.find(t);
    out.push_back({t, g == generated_.end() ? 0 : g->second, true});
  }
  for (const auto& [t, count] : generated_)
    if (!prompt_tokens_.count(t)) out.push_back({t, count, false});
  return out;
}

int32_t Sampler::sample(const float* logits, int64_t vocab, TokenLogprob* logprob, std::span<const uint32_t> allowed) {
  const double u = draw_uniform();
  const int32_t token = sample_token(p_, logits, vocab, u, penalty_tokens(), logprob, allowed);
  accept(token);
  return token;
}

}  // namespace kestrel
