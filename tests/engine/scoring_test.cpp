// Prompt log-probabilities and score-only requests (teacher forcing): every prompt token's log-probability is the
// log-softmax of the plain forward's logits at the position before it, bit for bit, however the prompt was cut,
// batched, preempted or partly served from the prefix cache; positions to score are computed, never taken from the
// cache; a request that only scores generates nothing; invalid combinations are named.
#include <gtest/gtest.h>

#include <cstring>

#include "core/error.h"
#include "tiny_models.h"

namespace kestrel {
namespace {

using test::generate_alone;
using test::greedy;
using test::random_prompt;
using test::run_checked;
using test::tiny_model;

bool same_logprob(const TokenLogprob& a, const TokenLogprob& b) {
  if (a.token != b.token || a.rank != b.rank || a.top.size() != b.top.size()) return false;
  if (std::memcmp(&a.logprob, &b.logprob, sizeof(float)) != 0) return false;
  for (size_t i = 0; i < a.top.size(); ++i)
    if (a.top[i].first != b.top[i].first || std::memcmp(&a.top[i].second, &b.top[i].second, sizeof(float)) != 0)
      return false;
  return true;
}

// What each prompt position from `start` on must get: token_logprob of the plain forward's logits before it.
std::vector<TokenLogprob> expected_prompt_logprobs(const Model& m, const std::vector<int32_t>& prompt, int64_t start,
                                                   int top_n) {
  const int64_t V = m.config().vocab_size;
  const test::Generation ref = generate_alone(m, prompt, 1);
  std::vector<TokenLogprob> out;
  for (int64_t t = start; t < static_cast<int64_t>(prompt.size()); ++t) {
    TokenLogprob lp;
    token_logprob(ref.logits.data() + (t - 1) * V, V, prompt[t], top_n, lp);
    out.push_back(lp);
  }
  return out;
}

void expect_prompt_logprobs(const Model& m, const std::vector<int32_t>& prompt, const RequestOutput& got,
                            int64_t start, int top_n) {
  const std::vector<TokenLogprob> want = expected_prompt_logprobs(m, prompt, start, top_n);
  EXPECT_EQ(got.prompt_logprobs_start, start);
  ASSERT_EQ(got.prompt_logprobs.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_TRUE(same_logprob(got.prompt_logprobs[i], want[i])) << "prompt position " << start + i;
}

SamplingParams scoring(int top_n, int64_t start, int max_tokens) {
  SamplingParams p = greedy(max_tokens);
  p.prompt_logprobs = top_n;
  p.prompt_logprobs_start = start;
  return p;
}

EngineConfig config(int64_t budget) {
  EngineConfig cfg;
  cfg.num_rows = 64;
  cfg.max_model_len = 512;
  cfg.max_num_batched_tokens = budget;
  return cfg;
}

class PromptLogprobs : public ::testing::TestWithParam<Arch> {};

TEST_P(PromptLogprobs, EqualTheLogSoftmaxOfThePlainForwardInABatch) {
  const Model& m = tiny_model(GetParam());
  Engine e(m, config(64));  // the 150-token prompt is cut in three
  const auto a = random_prompt(150, 1), b = random_prompt(37, 2), c = random_prompt(9, 3);
  const RequestId ia = e.add_request(a, scoring(3, 1, 2));
  e.add_request(b, greedy(4));  // a neighbour that does not score
  const RequestId ic = e.add_request(c, scoring(0, 1, 1));
  const auto out = run_checked(e);
  expect_prompt_logprobs(m, a, out[ia], 1, 3);
  expect_prompt_logprobs(m, c, out[ic], 1, 0);
  EXPECT_TRUE(out[1].prompt_logprobs.empty());
  EXPECT_EQ(out[ia].completions.at(0).token_ids, generate_alone(m, a, 2).tokens);
  // The rank of a token is how many have a logit at least as large; the top alternatives are best first.
  const TokenLogprob& first = out[ia].prompt_logprobs[0];
  EXPECT_GE(first.rank, 1);
  ASSERT_EQ(first.top.size(), 3u);
  EXPECT_GE(first.top[0].second, first.top[1].second);
  EXPECT_GE(first.top[0].second, first.logprob);
}

INSTANTIATE_TEST_SUITE_P(Tiny, PromptLogprobs,
                         ::testing::Values(Arch::kimi_k3, Arch::kimi_linear, Arch::deepseek_v32),
                         [](const auto& info) { return std::string(arch_name(info.param)); });

TEST(Scoring, ScoreOnlyRequestGeneratesNothing) {
  const Model& m = tiny_model(Arch::kimi_linear);
  Engine e(m, config(64));
  const auto seq = random_prompt(80, 4);
  e.add_request(seq, scoring(0, 50, 0));
  const auto out = run_checked(e);
  EXPECT_TRUE(out[0].completions.empty());
  expect_prompt_logprobs(m, seq, out[0], 50, 0);
  EXPECT_EQ(e.stats().generated_tokens, 0);
  EXPECT_EQ(e.cache().pool().num_referenced(), 0);
}

TEST(Scoring, ScoredPositionsAreComputedNotTakenFromTheCache) {
  ModelOptions o;
  o.kda_chunked_prefill = false;  // B = 16: hits at every 16 tokens
  const Model& m = tiny_model(Arch::kimi_k3, o);
  Engine e(m, config(64));
  const auto seq = random_prompt(100, 5);
  e.add_request(seq, greedy(1));
  run_checked(e);
  // Scoring from token 1 needs the logits of position 0 on: no hit.
  auto before = e.stats().prefix.hit_tokens;
  e.add_request(seq, scoring(0, 1, 0));
  expect_prompt_logprobs(m, seq, run_checked(e)[0], 1, 0);
  EXPECT_EQ(e.stats().prefix.hit_tokens, before);
  // Scoring from token 70 may resume at the block boundary at or before position 69: 64 tokens hit.
  before = e.stats().prefix.hit_tokens;
  e.add_request(seq, scoring(2, 70, 0));
  expect_prompt_logprobs(m, seq, run_checked(e)[0], 70, 2);
  EXPECT_EQ(e.stats().prefix.hit_tokens - before, 64);
}

TEST(Scoring, PreemptedScoringResumesWithTheSameBits) {
  ModelOptions o;
  o.kda_chunked_prefill = false;
  const Model& m = tiny_model(Arch::deepseek_v32, o);
  EngineConfig cfg = config(24);
  cfg.num_rows = 14;  // too few rows for all three: the newest is preempted and recomputed
  cfg.max_model_len = 160;
  Engine e(m, cfg);
  std::vector<std::vector<int32_t>> seqs;
  for (uint32_t i = 0; i < 3; ++i) {
    seqs.push_back(random_prompt(60 + 10 * static_cast<int>(i), 20 + i));
    e.add_request(seqs.back(), scoring(1, 1, 30));
  }
  const auto out = run_checked(e);
  EXPECT_GT(e.stats().preemptions, 0);
  for (size_t i = 0; i < seqs.size(); ++i) expect_prompt_logprobs(m, seqs[i], out[i], 1, 1);
}

TEST(Scoring, InvalidRequestsAreNamed) {
  const Model& m = tiny_model(Arch::kimi_linear);
  Engine e(m, config(64));
  const auto seq = random_prompt(10, 6);
  auto message = [&](const SamplingParams& p) {
    try {
      e.add_request(seq, p);
    } catch (const Error& err) {
      return std::string(err.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message(greedy(0)).find("max_tokens must be >= 1"), std::string::npos);
  EXPECT_NE(message(scoring(0, 10, 0)).find("prompt_logprobs_start 10"), std::string::npos);
  EXPECT_NE(message(scoring(0, 0, 1)).find("prompt_logprobs_start must be >= 1"), std::string::npos);
  SamplingParams forked = scoring(0, 1, 0);
  forked.n = 2;
  EXPECT_NE(message(forked).find("not n = 2"), std::string::npos);
  EXPECT_NE(message(scoring(-2, 1, 1)).find("prompt_logprobs must be in"), std::string::npos);
  EXPECT_FALSE(e.has_unfinished());
}

TEST(Scoring, ResetPrefixCacheForgetsEveryPrefix) {
  const Model& m = tiny_model(Arch::kimi_k3);
  Engine e(m, config(64));
  const auto seq = random_prompt(150, 7);
  e.add_request(seq, greedy(1));
  EXPECT_FALSE(e.reset_prefix_cache());  // a request is unfinished
  run_checked(e);
  ASSERT_GT(e.cache().pool().num_idle_cached(), 0);
  EXPECT_TRUE(e.reset_prefix_cache());
  EXPECT_EQ(e.cache().pool().num_idle_cached(), 0);
  EXPECT_EQ(e.cache().pool().num_free(), e.cache().pool().num_rows());
  const auto before = e.stats().prefix.hit_tokens;
  e.add_request(seq, greedy(1));
  run_checked(e);
  EXPECT_EQ(e.stats().prefix.hit_tokens, before);
}

}  // namespace
}  // namespace kestrel
