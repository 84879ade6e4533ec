// The sampler on hand-worked logits: greedy ties, top-k / top-p / min-p cut-offs, penalties, log-probabilities
// with top-n alternatives, seeded streams (reproducible, independent per completion) and a frequency check of
// sampling against the softmax with a stated bound.
#include <gtest/gtest.h>

#include <set>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "core/error.h"
#include "engine/sampler.h"

namespace kestrel {
namespace {

SamplingParams params(float temperature = 0.0f) {
  SamplingParams p;
  p.temperature = temperature;
  return p;
}

TEST(Sampler, GreedyTakesTheLowestIdAmongTies) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
  Sampler s(params(), {});
  EXPECT_EQ(s.sample(logits.data(), 4), 1);
}

// The greedy token is std::max_element's (the first largest logit) on random rows of every length, with many
// ties, signed zeros, and NaNs in the middle or first (where max_element keeps the NaN's position).
TEST(Sampler, GreedyIsTheFirstLargestLikeMaxElement) {
  std::mt19937 rng(9);
  SamplingParams p;
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t V = 1 + static_cast<int64_t>(rng() % 300);
    std::vector<float> row(static_cast<size_t>(V));
    for (float& x : row) x = static_cast<float>(static_cast<int>(rng() % 7) - 3);  // few values: many ties
    if (trial % 5 == 1) row[rng() % V] = -0.0f, row[rng() % V] = 0.0f;
    if (trial % 7 == 2) row[rng() % V] = std::nanf("");
    if (trial % 11 == 3) row[0] = std::nanf("");
    const int32_t want = static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
    EXPECT_EQ(sample_token(p, row.data(), V, 0.0, {}, nullptr), want) << "trial " << trial;
  }
}

TEST(Sampler, TopKOneAndTinyTopPAreGreedy) {
  const std::vector<float> logits = {0.1f, 0.3f, 0.2f, 0.25f};
  for (uint64_t seed = 0; seed < 20; ++seed) {
    SamplingParams k = params(1.0f);
    k.top_k = 1;
    k.seed = seed;
    EXPECT_EQ(Sampler(k, {}).sample(logits.data(), 4), 1);
    SamplingParams p = params(1.0f);
    p.top_p = 0.01f;
    p.seed = seed;
    EXPECT_EQ(Sampler(p, {}).sample(logits.data(), 4), 1);
  }
}

// Probabilities at temperature 1 of logits ln(4), ln(3), ln(2), ln(1): 0.4, 0.3, 0.2, 0.1.
const std::vector<float> kLogits = {std::log(4.0f), std::log(3.0f), std::log(2.0f), 0.0f};

std::map<int32_t, int> histogram(const SamplingParams& p, int draws) {
  Sampler s(p, {});
  std::map<int32_t, int> h;
  for (int i = 0; i < draws; ++i) ++h[s.sample(kLogits.data(), 4)];
  return h;
}

TEST(Sampler, FrequenciesFollowTheSoftmax) {
  SamplingParams p = params(1.0f);
  p.seed = 3;
  const int n = 20000;
  const auto h = histogram(p, n);
  const double expected[4] = {0.4, 0.3, 0.2, 0.1};
  // Binomial standard deviation sqrt(p(1-p)/n) <= 0.0035; allow 5 of them.
  for (int t = 0; t < 4; ++t) EXPECT_NEAR(h.count(t) ? h.at(t) / double(n) : 0.0, expected[t], 0.0175) << t;
}

TEST(Sampler, CutOffsKeepTheExpectedTokens) {
  SamplingParams k = params(1.0f);
  k.top_k = 2;  // 0.4, 0.3 renormalised: 4/7, 3/7
  auto h = histogram(k, 4000);
  EXPECT_EQ(h.size(), 2u);
  EXPECT_NEAR(h[0] / 4000.0, 4.0 / 7.0, 0.04);
  SamplingParams p = params(1.0f);
  p.top_p = 0.75f;  // 0.4 + 0.3 = 0.7 < 0.75 <= 0.9: three tokens
  EXPECT_EQ(histogram(p, 4000).size(), 3u);
  p.top_p = 0.7f;  // exactly reached by two
  EXPECT_EQ(histogram(p, 4000).size(), 2u);
  SamplingParams m = params(1.0f);
  m.min_p = 0.45f;  // keep p >= 0.18: three tokens
  EXPECT_EQ(histogram(m, 4000).size(), 3u);
  m.min_p = 0.55f;  // keep p >= 0.22: two
  EXPECT_EQ(histogram(m, 4000).size(), 2u);
  // A low temperature sharpens: at T = 0.1 the second token has weight (3/4)^10 = 0.056 of the first.
  SamplingParams t = params(0.1f);
  t.seed = 5;
  auto ht = histogram(t, 4000);
  EXPECT_NEAR(ht[0] / 4000.0, 1.0 / (1.0 + std::pow(0.75, 10) + std::pow(0.5, 10) + std::pow(0.25, 10)), 0.02);
}

TEST(Sampler, PenaltiesChangeTheGreedyChoice) {
  // Repetition penalty 2 on a prompt token: its logit 3 becomes 1.5 < 2; a negative logit is multiplied instead.
  const std::vector<float> logits = {3.0f, 2.0f, -1.0f};
  SamplingParams r = params();
  r.repetition_penalty = 2.0f;
  const std::vector<int32_t> prompt = {0};
  EXPECT_EQ(Sampler(r, prompt).sample(logits.data(), 3), 1);
  const std::vector<float> negative = {-1.0f, -1.5f, -3.0f};
  EXPECT_EQ(Sampler(r, prompt).sample(negative.data(), 3), 1);  // -1 * 2 = -2 < -1.5
  // Frequency penalty 0.6 per occurrence among generated tokens: after token 0 twice, 3 - 1.2 = 1.8 < 2.
  SamplingParams f = params();
  f.frequency_penalty = 0.6f;
  Sampler sf(f, {});
  EXPECT_EQ(sf.sample(logits.data(), 3), 0);  // 3
  EXPECT_EQ(sf.sample(logits.data(), 3), 0);  // 3 - 0.6 = 2.4
  EXPECT_EQ(sf.sample(logits.data(), 3), 1);  // 3 - 1.2 = 1.8
  // Presence penalty 1.5 counts once, however often a token came: 3 - 1.5 = 1.5 < 2 after the first token, then
  // token 1 drops to 2 - 1.5 = 0.5 and token 0 stays at 1.5 for good.
  SamplingParams pr = params();
  pr.presence_penalty = 1.5f;
  Sampler sp(pr, {});
  EXPECT_EQ(sp.sample(logits.data(), 3), 0);
  EXPECT_EQ(sp.sample(logits.data(), 3), 1);
  EXPECT_EQ(sp.sample(logits.data(), 3), 0);
  EXPECT_EQ(sp.sample(logits.data(), 3), 0);
}

TEST(Sampler, LogprobsOfTheModelDistribution) {
  SamplingParams p = params();
  p.logprobs = 2;
  p.repetition_penalty = 4.0f;  // changes the choice, not the reported log-probabilities
  TokenLogprob lp;
  const std::vector<int32_t> prompt = {0};
  const int32_t tok = Sampler(p, prompt).sample(kLogits.data(), 4, &lp);
  EXPECT_EQ(tok, 1);  // ln 4 / 4 = 0.35 < ln 3
  EXPECT_EQ(lp.token, 1);
  EXPECT_NEAR(lp.logprob, std::log(0.3), 1e-6);
  ASSERT_EQ(lp.top.size(), 2u);
  EXPECT_EQ(lp.top[0].first, 0);
  EXPECT_NEAR(lp.top[0].second, std::log(0.4), 1e-6);
  EXPECT_EQ(lp.top[1].first, 1);
  EXPECT_NEAR(lp.top[1].second, std::log(0.3), 1e-6);
}

TEST(Sampler, SeededStreamsAreReproducibleAndIndependent) {
  SamplingParams p = params(1.0f);
  p.seed = 42;
  auto draw = [&](uint64_t stream) {
    Sampler s(p, {}, stream);
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.sample(kLogits.data(), 4));
    return out;
  };
  EXPECT_EQ(draw(0), draw(0));
  EXPECT_NE(draw(0), draw(1));
  SamplingParams q = p;
  q.seed = 43;
  Sampler other(q, {});
  std::vector<int32_t> out;
  for (int i = 0; i < 64; ++i) out.push_back(other.sample(kLogits.data(), 4));
  EXPECT_NE(out, draw(0));
}

TEST(Sampler, NeighbouringSeedsAndStreamsShareNoDraws) {
  // A start linear in the seed with the stream's own increment made seed s + 1 draw seed s's uniforms shifted by
  // one. No uniform of one stream may appear among the first draws of a neighbouring seed's or completion's.
  auto uniforms = [](uint64_t seed, uint64_t stream) {
    SamplingParams p = params(1.0f);
    p.seed = seed;
    Sampler s(p, {}, stream);
    std::set<double> out;
    for (int i = 0; i < 32; ++i) out.insert(s.draw_uniform());
    return out;
  };
  for (uint64_t seed = 0; seed < 200; ++seed) {
    const std::set<double> a = uniforms(seed, 0);
    for (const std::set<double>& b : {uniforms(seed + 1, 0), uniforms(seed, 1), uniforms(seed + 1, 1)})
      for (double u : b) EXPECT_EQ(a.count(u), 0u) << "seed " << seed << " shares the draw " << u;
  }
}

TEST(Sampler, InvalidParametersAreNamed) {
  auto expect_error = [](SamplingParams p, const std::string& needle) {
    try {
      p.validate(100);
      FAIL() << "expected an error about " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  SamplingParams p;
  p.top_p = 1.5f;
  expect_error(p, "top_p");
  p = {};
  p.top_k = -1;
  expect_error(p, "top_k");
  p = {};
  p.min_p = 2.0f;
  expect_error(p, "min_p");
  p = {};
  p.repetition_penalty = 0.0f;
  expect_error(p, "repetition_penalty");
  p = {};
  p.n = 0;
  expect_error(p, "n must");
  p = {};
  p.max_tokens = 0;
  expect_error(p, "max_tokens");
  p = {};
  p.logprobs = 101;
  expect_error(p, "logprobs");
  p = {};
  p.stop_token_ids = {100};
  expect_error(p, "stop token");
  p = {};
  p.temperature = -1.0f;
  expect_error(p, "temperature");
}

}  // namespace
}  // namespace kestrel
