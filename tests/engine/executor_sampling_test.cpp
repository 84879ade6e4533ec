// The engine with an executor that samples (as the GPU runner does: the logits stay on its device). Here the
// executor runs on the host and chooses tokens with sample_token() from what the engine hands it (each sequence's
// uniform and penalty tokens); every token, log-probability and finish must equal the plain engine's, bit for bit,
// for every sampling option, and steps it cannot sample (kept logits, a fork of n completions, too many logprobs)
// must fall back to the engine's own sampling.
#include <gtest/gtest.h>

#include <cstring>

#include "engine/model_runner.h"
#include "tiny_models.h"

namespace kestrel {
namespace {

using test::random_prompt;
using test::tiny_model;

class HostSamplingRunner : public ModelRunner {
 public:
  HostSamplingRunner(const Model& m, CacheManager& c, int* sampled_steps)
      : ModelRunner(m, c), model_(m), sampled_steps_(sampled_steps) {}
  bool samples(const SamplingParams& p) const override { return p.logprobs <= 3; }
  std::vector<SampledToken> execute_sampled(const StepPlan& plan, std::span<const SampleRow> rows) override {
    const std::vector<float>& logits = execute(plan);
    const int64_t V = model_.config().vocab_size;
    ++*sampled_steps_;
    std::vector<SampledToken> out(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      const SampleRow& r = rows[i];
      EXPECT_LT((r.logits_row + 1) * V, static_cast<int64_t>(logits.size() + 1));
      out[i].token = sample_token(*r.params, logits.data() + r.logits_row * V, V, r.uniform, r.penalties,
                                  r.params->logprobs >= 0 ? &out[i].logprob : nullptr);
    }
    return out;
  }

 private:
  const Model& model_;
  int* sampled_steps_;
};

std::vector<SamplingParams> every_option() {
  std::vector<SamplingParams> v;
  auto add = [&](auto&& f) {
    SamplingParams p;
    p.max_tokens = 12;
    p.ignore_eos = true;
    p.seed = 100 + v.size();
    f(p);
    v.push_back(p);
  };
  add([](SamplingParams&) {});  // greedy
  add([](SamplingParams& p) { p.temperature = 0.8f; });
  add([](SamplingParams& p) { p.temperature = 1.2f, p.top_p = 0.7f; });
  add([](SamplingParams& p) { p.temperature = 1.0f, p.top_k = 5, p.min_p = 0.05f; });
  add([](SamplingParams& p) { p.temperature = 0.9f, p.presence_penalty = 0.5f, p.frequency_penalty = 0.3f; });
  add([](SamplingParams& p) { p.temperature = 0.7f, p.repetition_penalty = 1.3f; });
  add([](SamplingParams& p) { p.repetition_penalty = 0.8f, p.frequency_penalty = -0.2f; });  // greedy, penalised
  add([](SamplingParams& p) { p.temperature = 1.0f, p.logprobs = 3; });
  add([](SamplingParams& p) { p.temperature = 1.0f, p.logprobs = 7; });  // beyond the executor: the engine samples
  add([](SamplingParams& p) { p.temperature = 1.0f, p.n = 3; });          // forks: its first step on the engine
  return v;
}

std::vector<RequestOutput> run(const Model& m, bool executor_samples, int* sampled_steps, size_t first, size_t last,
                               int keep_logits_of) {
  EngineConfig cfg;
  cfg.max_num_batched_tokens = 96;
  if (executor_samples) {
    cfg.executor = [sampled_steps](const Model& model, CacheManager& cache) -> std::unique_ptr<StepExecutor> {
      return std::make_unique<HostSamplingRunner>(model, cache, sampled_steps);
    };
    cfg.executor_on_host_pool = true;
  }
  Engine e(m, cfg);
  const std::vector<SamplingParams> params = every_option();
  for (size_t i = first; i < last; ++i)
    e.add_request(random_prompt(30 + 17 * static_cast<int>(i), 40 + static_cast<uint32_t>(i)), params[i], 0,
                  /*keep_logits=*/static_cast<int>(i) == keep_logits_of);
  return e.run_to_completion();
}

void expect_same(const std::vector<RequestOutput>& plain, const std::vector<RequestOutput>& got) {
  ASSERT_EQ(plain.size(), got.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_EQ(plain[i].completions.size(), got[i].completions.size()) << "request " << i;
    for (size_t c = 0; c < plain[i].completions.size(); ++c) {
      const Completion& a = plain[i].completions[c];
      const Completion& b = got[i].completions[c];
      EXPECT_EQ(a.token_ids, b.token_ids) << "request " << i << " completion " << c;
      EXPECT_EQ(a.finish, b.finish) << "request " << i;
      ASSERT_EQ(a.logprobs.size(), b.logprobs.size()) << "request " << i;
      for (size_t t = 0; t < a.logprobs.size(); ++t) {
        EXPECT_EQ(a.logprobs[t].token, b.logprobs[t].token);
        EXPECT_EQ(std::memcmp(&a.logprobs[t].logprob, &b.logprobs[t].logprob, sizeof(float)), 0);
        EXPECT_EQ(a.logprobs[t].top, b.logprobs[t].top);
      }
    }
  }
}

// Requests 0-7: every option the executor takes; every step's tokens come from it.
TEST(ExecutorSampling, SameTokensAndLogprobsAsTheEngine) {
  const Model& m = tiny_model(Arch::kimi_linear);
  int sampled_steps = 0;
  const std::vector<RequestOutput> plain = run(m, false, &sampled_steps, 0, 8, -1);
  ASSERT_EQ(sampled_steps, 0);
  const std::vector<RequestOutput> got = run(m, true, &sampled_steps, 0, 8, -1);
  EXPECT_GE(sampled_steps, 12) << "every step that samples goes through the executor (12 tokens each)";
  expect_same(plain, got);
}

// With a request the executor cannot sample (kept logits, 7 logprobs, a fork of 3), those steps fall back to the
// engine's sampling and the results are still the plain engine's.
TEST(ExecutorSampling, StepsItCannotSampleFallBack) {
  const Model& m = tiny_model(Arch::kimi_linear);
  int sampled_steps = 0;
  const std::vector<RequestOutput> plain = run(m, false, &sampled_steps, 0, 10, 2);
  const std::vector<RequestOutput> got = run(m, true, &sampled_steps, 0, 10, 2);
  expect_same(plain, got);
}

// Scoring among requests the executor samples: a score-only request whose scored rows all came in earlier chunks
// ends on the engine (never sampled by the executor), and its log-probabilities are the plain engine's.
TEST(ExecutorSampling, ScoringRequestsEndOnTheEngine) {
  const Model& m = tiny_model(Arch::kimi_linear);
  auto run_scoring = [&](bool executor_samples, int* steps) {
    EngineConfig cfg;
    cfg.max_num_batched_tokens = 64;
    if (executor_samples) {
      cfg.executor = [steps](const Model& model, CacheManager& cache) -> std::unique_ptr<StepExecutor> {
        return std::make_unique<HostSamplingRunner>(model, cache, steps);
      };
      cfg.executor_on_host_pool = true;
    }
    Engine e(m, cfg);
    SamplingParams sample = every_option()[1];
    SamplingParams score;
    score.max_tokens = 0;
    score.prompt_logprobs = 1;
    // 129 tokens: chunks [0, 64), [64, 128), [128, 129); the last token's log-probability comes from row 127, so
    // the last chunk computes nothing to score.
    score.prompt_logprobs_start = 100;
    e.add_request(random_prompt(40, 1), sample);
    e.add_request(random_prompt(129, 2), score);
    auto out = e.run_to_completion();
    EXPECT_EQ(e.stats().generated_tokens, sample.max_tokens);  // the score-only request generated nothing
    return out;
  };
  int steps = 0;
  const auto plain = run_scoring(false, &steps);
  const auto got = run_scoring(true, &steps);
  EXPECT_GT(steps, 0);
  expect_same(plain, got);
  ASSERT_EQ(got[1].completions.size(), 0u);
  ASSERT_EQ(got[1].prompt_logprobs.size(), 29u);
  for (size_t i = 0; i < 29; ++i)
    EXPECT_EQ(std::memcmp(&plain[1].prompt_logprobs[i].logprob, &got[1].prompt_logprobs[i].logprob, sizeof(float)), 0);
}

}  // namespace
}  // namespace kestrel
