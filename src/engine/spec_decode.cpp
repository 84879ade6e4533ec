#include "engine/spec_decode.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/dspark_drafter.h"
#include "engine/mtp_drafter.h"
#include "engine/sequence.h"

namespace kestrel {

namespace {

constexpr const char* kFields =
    "method, model, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, draft_sample_method, "
    "rejection_sample_method, synthetic_acceptance_rate, synthetic_acceptance_rates, synthetic_acceptance_length";

int get_int(const nlohmann::json& v, const char* field) {
  KESTREL_CHECK(v.is_number_integer(), "--speculative-config: '{}' must be an integer, got {}", field, v.dump());
  const int64_t x = v.get<int64_t>();
  KESTREL_CHECK(x >= INT32_MIN && x <= INT32_MAX, "--speculative-config: '{}' = {} is out of range", field, x);
  return static_cast<int>(x);
}
std::string get_string(const nlohmann::json& v, const char* field) {
  KESTREL_CHECK(v.is_string(), "--speculative-config: '{}' must be a string, got {}", field, v.dump());
  return v.get<std::string>();
}
double get_number(const nlohmann::json& v, const char* field) {
  KESTREL_CHECK(v.is_number(), "--speculative-config: '{}' must be a number, got {}", field, v.dump());
  return v.get<double>();
}

// Per-position rates c^(i+1), i < k, whose mean is r (c by bisection: the mean grows with c).
std::vector<double> rates_of_mean(double r, int k) {
  auto mean = [&](double c) {
    double s = 0.0, x = 1.0;
    for (int i = 0; i < k; ++i) s += x *= c;
    return s / k;
  };
  double lo = 0.0, hi = 1.0;
  for (int it = 0; it < 100; ++it) {
    const double mid = 0.5 * (lo + hi);
    (mean(mid) < r ? lo : hi) = mid;
  }
  std::vector<double> out(static_cast<size_t>(k));
  double x = 1.0;
  for (int i = 0; i < k; ++i) out[static_cast<size_t>(i)] = x *= (r >= 1.0 ? 1.0 : r <= 0.0 ? 0.0 : hi);
  return out;
}

}  // namespace

void validate_speculative_config(SpeculativeConfig& c) {
  KESTREL_CHECK(c.method == "ngram" || c.method == "mtp" || c.method == "dspark",
                "--speculative-config: 'method' '{}' is not one of ngram, mtp, dspark", c.method);
  KESTREL_CHECK(c.num_speculative_tokens >= 1 && c.num_speculative_tokens <= kMaxSpeculativeTokens,
                "--speculative-config: 'num_speculative_tokens' must be in [1, {}], got {}", kMaxSpeculativeTokens,
                c.num_speculative_tokens);
  KESTREL_CHECK(c.prompt_lookup_min >= 1, "--speculative-config: 'prompt_lookup_min' must be >= 1, got {}",
                c.prompt_lookup_min);
  KESTREL_CHECK(c.prompt_lookup_max >= c.prompt_lookup_min,
                "--speculative-config: 'prompt_lookup_max' ({}) must be >= 'prompt_lookup_min' ({})",
                c.prompt_lookup_max, c.prompt_lookup_min);
  KESTREL_CHECK(c.draft_sample_method == "greedy" || c.draft_sample_method == "probabilistic",
                "--speculative-config: 'draft_sample_method' '{}' is not one of greedy, probabilistic",
                c.draft_sample_method);
  KESTREL_CHECK(c.rejection_sample_method == "standard" || c.rejection_sample_method == "synthetic",
                "--speculative-config: 'rejection_sample_method' '{}' is not one of standard, synthetic",
                c.rejection_sample_method);
  const bool synthetic = c.rejection_sample_method == "synthetic";
  KESTREL_CHECK(synthetic || c.synthetic_acceptance_rates.empty(),
                "--speculative-config: 'synthetic_acceptance_rate(s)' need 'rejection_sample_method' synthetic");
  if (synthetic) {
    KESTREL_CHECK(!c.synthetic_acceptance_rates.empty(),
                  "--speculative-config: 'rejection_sample_method' synthetic needs 'synthetic_acceptance_rate', "
                  "'synthetic_acceptance_rates' or 'synthetic_acceptance_length'");
    KESTREL_CHECK(static_cast<int>(c.synthetic_acceptance_rates.size()) == c.num_speculative_tokens,
                  "--speculative-config: 'synthetic_acceptance_rates' has {} entries, 'num_speculative_tokens' is {}",
                  c.synthetic_acceptance_rates.size(), c.num_speculative_tokens);
    for (size_t i = 0; i < c.synthetic_acceptance_rates.size(); ++i) {
      const double r = c.synthetic_acceptance_rates[i];
      KESTREL_CHECK(r >= 0.0 && r <= 1.0, "--speculative-config: 'synthetic_acceptance_rates'[{}] = {} is not in [0, 1]",
                    i, r);
      KESTREL_CHECK(i == 0 || r <= c.synthetic_acceptance_rates[i - 1],
                    "--speculative-config: 'synthetic_acceptance_rates' must not increase (entry {}: {} > {})", i, r,
                    c.synthetic_acceptance_rates[i - 1]);
    }
  }
}

SpeculativeConfig parse_speculative_config(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    fail("--speculative-config is not valid JSON: {}", e.what());
  }
  KESTREL_CHECK(j.is_object(), "--speculative-config must be a JSON object, got {}", j.dump());
  SpeculativeConfig c;
  bool has_min = false, has_max = false;
  std::optional<double> rate, length;
  std::vector<double> rates;
  KESTREL_CHECK(j.contains("method"), "--speculative-config: 'method' is missing (ngram, mtp or dspark)");
  KESTREL_CHECK(j.contains("num_speculative_tokens"), "--speculative-config: 'num_speculative_tokens' is missing");
  for (const auto& [key, v] : j.items()) {
    if (key == "method") c.method = get_string(v, "method");
    else if (key == "model") c.model = v.is_null() ? "" : get_string(v, "model");
    else if (key == "num_speculative_tokens") c.num_speculative_tokens = get_int(v, "num_speculative_tokens");
    else if (key == "prompt_lookup_min") c.prompt_lookup_min = get_int(v, "prompt_lookup_min"), has_min = true;
    else if (key == "prompt_lookup_max") c.prompt_lookup_max = get_int(v, "prompt_lookup_max"), has_max = true;
    else if (key == "draft_sample_method") c.draft_sample_method = get_string(v, "draft_sample_method");
    else if (key == "rejection_sample_method") c.rejection_sample_method = get_string(v, "rejection_sample_method");
    else if (key == "synthetic_acceptance_rate") rate = get_number(v, "synthetic_acceptance_rate");
    else if (key == "synthetic_acceptance_length") length = get_number(v, "synthetic_acceptance_length");
    else if (key == "synthetic_acceptance_rates") {
      KESTREL_CHECK(v.is_array(), "--speculative-config: 'synthetic_acceptance_rates' must be an array of numbers, "
                                  "got {}", v.dump());
      for (const auto& x : v) rates.push_back(get_number(x, "synthetic_acceptance_rates"));
    } else {
      fail("--speculative-config: unknown field '{}' (known: {})", key, kFields);
    }
  }
  // As vLLM: one n-gram bound given is the other's too; neither: 5.
  if (has_min && !has_max) c.prompt_lookup_max = c.prompt_lookup_min;
  if (has_max && !has_min) c.prompt_lookup_min = c.prompt_lookup_max;
  KESTREL_CHECK(int{rate.has_value()} + int{length.has_value()} + int{!rates.empty()} <= 1,
                "--speculative-config: give one of 'synthetic_acceptance_rate', 'synthetic_acceptance_rates', "
                "'synthetic_acceptance_length'");
  if (c.num_speculative_tokens >= 1 && c.num_speculative_tokens <= kMaxSpeculativeTokens) {
    const int k = c.num_speculative_tokens;
    if (rate) {
      KESTREL_CHECK(*rate >= 0.0 && *rate <= 1.0, "--speculative-config: 'synthetic_acceptance_rate' {} is not in "
                                                  "[0, 1]", *rate);
      rates = rates_of_mean(*rate, k);
    }
    if (length) {
      KESTREL_CHECK(*length >= 1.0 && *length <= k + 1.0,
                    "--speculative-config: 'synthetic_acceptance_length' {} is not in [1, num_speculative_tokens + 1 "
                    "= {}]", *length, k + 1);
      rates = rates_of_mean((*length - 1.0) / k, k);
    }
  }
  c.synthetic_acceptance_rates = std::move(rates);
  validate_speculative_config(c);
  return c;
}

void NgramDrafter::lookup(std::span<const int32_t> t, int min_n, int max_n, int max_tokens,
                          std::vector<int32_t>& out) {
  out.clear();
  const int64_t L = static_cast<int64_t>(t.size());
  if (max_tokens <= 0) return;
  for (int64_t n = std::min<int64_t>(max_n, L - 1); n >= min_n; --n) {
    const auto suffix = t.subspan(L - n, n);
    // The latest earlier occurrence with at least one token after it.
    for (int64_t j = L - n - 1; j >= 0; --j) {
      if (!std::equal(suffix.begin(), suffix.end(), t.begin() + j)) continue;
      const int64_t from = j + n, to = std::min<int64_t>(from + max_tokens, L);
      out.assign(t.begin() + from, t.begin() + to);
      return;
    }
  }
}

void NgramDrafter::propose(Sequence& s, int max_tokens, int64_t, Draft& out) {
  out.probs.clear();
  lookup(s.tokens, min_n_, max_n_, max_tokens, out.tokens);
}

int32_t choose_draft(const float* logits, int64_t vocab, bool sample, const SamplingParams& params, Sampler& sampler,
                     float* q_row, SamplingCandidates& cand) {
  if (!sample) return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  SamplingParams dp = params;
  dp.presence_penalty = dp.frequency_penalty = 0.0f;
  dp.repetition_penalty = 1.0f;
  sampling_candidates(dp, logits, vocab, {}, {}, cand);
  const int32_t tok = draw_candidate(cand, sampler.draw_uniform_always());
  std::fill_n(q_row, vocab, 0.0f);
  for (int64_t j = 0; j < cand.keep; ++j) q_row[cand.order[j]] = static_cast<float>(cand.prob[j] / cand.mass);
  return tok;
}

void Drafter::observe(const Sequence&, int64_t, int64_t, const float*) {
  fail("this drafter does not take the target's hidden states");
}

std::unique_ptr<Drafter> make_drafter(const SpeculativeConfig& c, const Model& target) {
  if (c.method == "ngram") return std::make_unique<NgramDrafter>(c.prompt_lookup_min, c.prompt_lookup_max);
  if (c.method == "mtp") return std::make_unique<MtpDrafter>(target, c);
  KESTREL_CHECK(c.method == "dspark", "--speculative-config: 'method' '{}' is not one of ngram, mtp, dspark", c.method);
  return std::make_unique<DsparkDrafter>(target, c);
}

VerifyResult verify_draft(Sampler& s, const float* logits, int64_t V, std::span<const int32_t> drafts,
                          std::span<const float> q, bool want_logprobs, const VerifyOptions& opt) {
  const SamplingParams& p = s.params();
  const int64_t k = static_cast<int64_t>(drafts.size());
  KESTREL_CHECK(q.empty() || static_cast<int64_t>(q.size()) == k * V, "draft probabilities of {} values for {} x {}",
                q.size(), k, V);
  KESTREL_CHECK(!opt.synthetic || static_cast<int64_t>(opt.synthetic_rates.size()) >= k,
                "synthetic verification needs a rate for each of {} positions", k);
  KESTREL_CHECK(opt.masks.size() <= static_cast<size_t>(k) + 1, "{} grammar masks for {} drafts", opt.masks.size(), k);
  // Positions 0..last may be sampled: with a grammar, the ones it has masks for.
  const int64_t last = opt.masks.empty() ? k : static_cast<int64_t>(opt.masks.size()) - 1;
  auto mask_of = [&](int64_t row) -> std::span<const uint32_t> {
    if (opt.masks.empty()) return {};
    KESTREL_CHECK(row <= last, "verification reached position {} past the grammar's masks", row);
    return opt.masks[static_cast<size_t>(row)];
  };
  auto allowed = [&](int64_t row, int32_t t) {
    const std::span<const uint32_t> m = mask_of(row);
    return m.empty() || (m[static_cast<size_t>(t >> 5)] >> (t & 31) & 1) != 0;
  };
  VerifyResult r;
  SamplingCandidates c;
  auto emit = [&](int64_t row, int32_t token) {
    s.accept(token);
    r.tokens.push_back(token);
    if (want_logprobs) {
      r.logprobs.emplace_back();
      token_logprob(logits + row * V, V, token, p.logprobs, r.logprobs.back());
    }
  };
  // The normal sampler's choice from row i (sample_token: the same uniform, penalties and candidates).
  auto normal = [&](int64_t row) {
    const double u = s.draw_uniform();
    sampling_candidates(p, logits + row * V, V, s.penalty_tokens(), mask_of(row), c);
    return draw_candidate(c, u);
  };
  // An accepted draft that ended the grammar ends the step's tokens: nothing may follow it.
  auto ended = [&](int64_t i) { return !opt.masks.empty() && i + 1 > last; };
  for (int64_t i = 0; i < k; ++i) {
    const int32_t d = drafts[static_cast<size_t>(i)];
    KESTREL_CHECK(d >= 0 && d < V, "draft token {} is outside the vocabulary (0..{})", d, V - 1);
    if (opt.synthetic) {
      const double prev = i ? opt.synthetic_rates[static_cast<size_t>(i - 1)] : 1.0;
      const double cond = prev > 0.0 ? opt.synthetic_rates[static_cast<size_t>(i)] / prev : 0.0;
      if (s.draw_uniform_always() < cond && allowed(i, d)) {
        emit(i, d);
        ++r.accepted;
        if (ended(i)) return r;
        continue;
      }
      emit(i, normal(i));
      return r;
    }
    if (p.temperature == 0.0f) {
      // Greedy: the target's token; the draft stands while it agrees.
      const int32_t t = normal(i);
      emit(i, t);
      if (t != d) return r;
      ++r.accepted;
      if (ended(i)) return r;
      continue;
    }
    sampling_candidates(p, logits + i * V, V, s.penalty_tokens(), mask_of(i), c);
    const float* qi = q.empty() ? nullptr : q.data() + i * V;
    auto q_of = [&](int32_t t) -> double { return qi ? static_cast<double>(qi[t]) : (t == d ? 1.0 : 0.0); };
    double p_d = 0.0;
    for (int64_t j = 0; j < c.keep; ++j)
      if (c.order[static_cast<size_t>(j)] == d) p_d = c.prob[static_cast<size_t>(j)] / c.mass;
    const double q_d = q_of(d);
    const double u = s.draw_uniform_always();
    if (q_d > 0.0 && u * q_d < p_d) {
      emit(i, d);
      ++r.accepted;
      if (ended(i)) return r;
      continue;
    }
    // Rejected: draw from the residual max(0, p - q), normalised (tokens outside the candidates have p = 0).
    std::vector<double> res(static_cast<size_t>(c.keep));
    double total = 0.0;
    for (int64_t j = 0; j < c.keep; ++j)
      total += res[static_cast<size_t>(j)] =
          std::max(0.0, c.prob[static_cast<size_t>(j)] / c.mass - q_of(c.order[static_cast<size_t>(j)]));
    const double u2 = s.draw_uniform_always();
    int32_t t = -1;
    if (total > 0.0) {
      double cum = 0.0;
      for (int64_t j = 0; j < c.keep && t < 0; ++j) {
        cum += res[static_cast<size_t>(j)];
        if (u2 * total < cum) t = c.order[static_cast<size_t>(j)];
      }
      for (int64_t j = c.keep - 1; t < 0 && j >= 0; --j)  // rounding: the last candidate with residual mass
        if (res[static_cast<size_t>(j)] > 0.0) t = c.order[static_cast<size_t>(j)];
    } else {
      t = draw_candidate(c, u2);  // p == q up to rounding (a rejection has probability ~0): p itself
    }
    emit(i, t);
    return r;
  }
  emit(k, normal(k));  // every draft accepted: the bonus token
  return r;
}

std::vector<std::vector<uint32_t>> grammar_draft_masks(grammar::OutputMatcher& m, std::span<const int32_t> drafts) {
  std::vector<std::vector<uint32_t>> masks;
  int advanced = 0;
  for (size_t j = 0;; ++j) {
    masks.emplace_back(static_cast<size_t>(m.mask_words()));
    m.fill_mask(masks.back());
    if (j == drafts.size() || !m.accept_token(drafts[j])) break;  // outside the grammar: rejected for sure
    ++advanced;
    if (m.terminated()) break;  // the grammar ended with this draft
  }
  m.rollback(advanced);
  return masks;
}

size_t grammar_draft_prefix(grammar::OutputMatcher& m, std::span<const int32_t> drafts) {
  size_t n = 0;
  int advanced = 0;
  while (n < drafts.size()) {
    const bool ok = m.accept_token(drafts[n++]);
    if (!ok) break;
    ++advanced;
    if (m.terminated()) break;
  }
  m.rollback(advanced);
  return n;
}

}  // namespace kestrel
