// The zero-mismatch RL loop on the CPU, in batch-invariant mode (KDA's recurrence everywhere): 100 steps of
// rollouts (sampled at temperature 1 with their log-probabilities), then scoring of every rolled-out sequence by
// teacher forcing, on tiny models of each architecture. Each phase runs on one of several engines with different
// step budgets (chunk sizes), picked at random, with random batch compositions: prompts repeat across steps and
// within groups (prefix-cache hits), score requests join rollouts still running. The scored log-probability of every generated token equals its rollout log-probability bit for bit, so
// the KL between the sampler and the trainer is exactly 0.0; the loop prints it per step.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <random>

#include "tiny_models.h"

namespace kestrel {
namespace {

using test::random_prompt;
using test::run_checked;
using test::tiny_model;

struct Rollout {
  std::vector<int32_t> prompt, tokens;
  std::vector<float> logprobs;
};

constexpr int kSteps = 100;

class RlLoop : public ::testing::TestWithParam<Arch> {};

TEST_P(RlLoop, ScoringEqualsRolloutBitForBitOverAHundredSteps) {
  ModelOptions o;
  o.kda_chunked_prefill = false;  // --batch-invariant
  const Model& m = tiny_model(GetParam(), o);
  const char* arch = arch_name(GetParam());
  std::mt19937 rng(2024);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };

  std::vector<std::unique_ptr<Engine>> engines;
  for (int64_t budget : {7, 19, 48, 256}) {
    EngineConfig cfg;
    cfg.num_rows = 48;
    cfg.max_model_len = 128;
    cfg.max_num_batched_tokens = budget;
    engines.push_back(std::make_unique<Engine>(m, cfg));
  }
  std::vector<std::vector<int32_t>> prompts;
  for (uint32_t i = 0; i < 8; ++i) prompts.push_back(random_prompt(uniform(2, 32), 500 + i));

  int64_t total_tokens = 0;
  std::vector<Rollout> previous;
  for (int step = 0; step < kSteps; ++step) {
    Engine& rollout_engine = *engines[uniform(0, 3)];
    // Rollouts: a few prompts (some repeated: GRPO groups), n completions each, seeded sampling at temperature 1.
    std::vector<RequestId> ids;
    const int groups = uniform(1, 3);
    for (int g = 0; g < groups; ++g) {
      SamplingParams p;
      p.n = uniform(1, 3);
      p.max_tokens = uniform(1, 8);
      p.temperature = 1.0f;
      p.top_k = uniform(0, 1) ? 0 : 20;
      p.seed = rng();
      p.logprobs = 0;
      p.ignore_eos = true;
      ids.push_back(rollout_engine.add_request(prompts[uniform(0, 7)], p));
    }
    // Score requests of the previous step join the rollouts after a few of their steps (mixed batches). Request ids
    // are per engine.
    std::map<RequestId, RequestOutput> done, scored;
    for (int k = uniform(0, 3); k > 0 && rollout_engine.has_unfinished(); --k)
      for (RequestOutput& out : rollout_engine.step().finished) done.emplace(out.id, std::move(out));
    Engine& score_engine = uniform(0, 1) ? rollout_engine : *engines[uniform(0, 3)];
    std::vector<RequestId> score_ids;
    for (const Rollout& r : previous) {
      std::vector<int32_t> seq = r.prompt;
      seq.insert(seq.end(), r.tokens.begin(), r.tokens.end());
      SamplingParams p;
      p.max_tokens = 0;
      p.prompt_logprobs = 0;
      p.prompt_logprobs_start = static_cast<int64_t>(r.prompt.size());
      score_ids.push_back(score_engine.add_request(seq, p, uniform(-1, 1)));
    }
    for (RequestOutput& out : run_checked(rollout_engine))
      (&rollout_engine == &score_engine && out.completions.empty() ? scored : done).emplace(out.id, std::move(out));
    if (&score_engine != &rollout_engine)
      for (RequestOutput& out : run_checked(score_engine)) scored.emplace(out.id, std::move(out));

    // The previous step's scores against its rollouts.
    int64_t tokens = 0;
    double kl = 0, max_diff = 0;
    for (size_t i = 0; i < previous.size(); ++i) {
      const Rollout& r = previous[i];
      const std::vector<TokenLogprob>& lps = scored.at(score_ids[i]).prompt_logprobs;
      ASSERT_EQ(lps.size(), r.tokens.size()) << arch << " step " << step;
      for (size_t t = 0; t < lps.size(); ++t) {
        ASSERT_EQ(lps[t].token, r.tokens[t]);
        EXPECT_EQ(std::memcmp(&lps[t].logprob, &r.logprobs[t], sizeof(float)), 0)
            << arch << " step " << step << " sequence " << i << " token " << t << ": rollout " << r.logprobs[t]
            << ", scored " << lps[t].logprob;
        const double d = static_cast<double>(r.logprobs[t]) - lps[t].logprob;
        kl += d;  // the k1 estimate of KL(rollout || trainer) over the sampled tokens
        max_diff = std::max(max_diff, std::abs(d));
        ++tokens;
      }
    }
    if (tokens) kl /= static_cast<double>(tokens);
    EXPECT_EQ(kl, 0.0);
    if (step > 0)
      std::printf("[rl-loop] %s step %3d: %2zu sequences, %3lld tokens scored, KL %.1f, max |diff| %.1f\n", arch, step,
                  previous.size(), static_cast<long long>(tokens), kl, max_diff);
    total_tokens += tokens;

    previous.clear();
    for (RequestId id : ids)
      for (const Completion& c : done.at(id).completions) {
        Rollout r{done.at(id).prompt, c.token_ids, {}};
        for (const TokenLogprob& lp : c.logprobs) r.logprobs.push_back(lp.logprob);
        previous.push_back(std::move(r));
      }
  }
  // The loop exercised what it claims to: prompts cut by small budgets, prefix hits.
  int64_t hits = 0, steps = 0, computed = 0;
  for (const auto& e : engines) {
    hits += e->stats().prefix.hit_tokens;
    steps += e->stats().steps;
    computed += e->stats().computed_tokens;
    EXPECT_EQ(e->cache().pool().num_referenced(), 0);
  }
  std::printf("[rl-loop] %s: %d steps, %lld tokens scored, all equal to the rollout bit for bit; %lld engine steps "
              "computed %lld tokens, %lld prefix-hit tokens\n",
              arch, kSteps, static_cast<long long>(total_tokens), static_cast<long long>(steps),
              static_cast<long long>(computed), static_cast<long long>(hits));
  EXPECT_GT(total_tokens, 1000);
  EXPECT_GT(hits, 0);
  EXPECT_GT(engines[0]->stats().steps, 2 * kSteps / 4);  // the 7-token budget cut prompts over several steps
}

INSTANTIATE_TEST_SUITE_P(Tiny, RlLoop, ::testing::Values(Arch::kimi_k3, Arch::kimi_linear, Arch::deepseek_v32),
                         [](const auto& info) { return std::string(arch_name(info.param)); });

}  // namespace
}  // namespace kestrel
