// Structured output in the engine: each constrained completion's tokens are allowed by its grammar at every step
// (so its text is valid), the grammar's end ends the completion, forks start from the grammar's start, and an
// executor that samples on its device but does not apply token masks leaves constrained steps to the host sampler,
// while one that applies them gets each row's mask and gives the host's tokens.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "engine/model_runner.h"
#include "schema_constraint.h"

namespace kestrel {
namespace {

using test::kEos;
using test::random_prompt;
using test::tiny_model;

// The completion's text is an object of the schema.
void expect_valid(const Completion& c, const std::string& where) {
  const text::Tokenizer& tok = test::tiny_tokenizer();
  ASSERT_EQ(c.finish, FinishReason::stop) << where;
  ASSERT_FALSE(c.token_ids.empty());
  EXPECT_EQ(c.token_ids.back(), kEos) << where;
  const std::vector<int32_t> body(c.token_ids.begin(), c.token_ids.end() - 1);
  const std::string text = tok.decode(body);
  const auto j = nlohmann::json::parse(text, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << where << ": " << text;
  ASSERT_TRUE(j.is_object()) << text;
  ASSERT_TRUE(j.contains("name") && j["name"].is_string() && j["name"].get<std::string>().size() <= 6 * 4) << text;
  ASSERT_TRUE(j.contains("n") && j["n"].is_number_integer()) << text;
  EXPECT_GE(j["n"].get<int>(), -5) << text;
  EXPECT_LE(j["n"].get<int>(), 40) << text;
  ASSERT_TRUE(j.contains("ok") && j["ok"].is_boolean()) << text;
  for (const auto& [k, v] : j.items()) EXPECT_TRUE(k == "name" || k == "n" || k == "ok" || k == "tags") << text;
  if (j.contains("tags")) {
    EXPECT_LE(j["tags"].size(), 2u) << text;
    for (const auto& t : j["tags"]) EXPECT_TRUE(t == "a" || t == "b") << text;
  }
}

std::vector<SamplingParams> params_set(const Model& m) {
  std::vector<SamplingParams> v;
  for (int i = 0; i < 6; ++i) {
    SamplingParams p;
    p.max_tokens = 200;
    p.temperature = i == 0 ? 0.0f : 0.6f + 0.2f * static_cast<float>(i);
    p.top_k = i == 3 ? 20 : 0;
    p.top_p = i == 4 ? 0.9f : 1.0f;
    p.seed = 1000 + static_cast<uint64_t>(i);
    p.n = i == 5 ? 3 : 1;             // forks: each child starts from the grammar's start
    p.ignore_eos = i == 2;            // the grammar's end still ends the completion
    p.logprobs = i == 1 ? 2 : -1;
    p.constraint = test::schema_constraint(m, i % 2 == 0);
    v.push_back(p);
  }
  return v;
}

TEST(StructuredOutput, EveryCompletionIsValid) {
  const Model& m = tiny_model(Arch::kimi_k3);
  EngineConfig cfg;
  Engine e(m, cfg);
  const auto params = params_set(m);
  for (size_t i = 0; i < params.size(); ++i) e.add_request(random_prompt(20 + 9 * static_cast<int>(i), 3 + i), params[i]);
  // One unconstrained request in the same batches.
  SamplingParams free;
  free.max_tokens = 30;
  free.ignore_eos = true;
  e.add_request(random_prompt(25, 99), free);
  const auto out = e.run_to_completion();
  ASSERT_EQ(out.size(), params.size() + 1);
  for (size_t i = 0; i < params.size(); ++i)
    for (const Completion& c : out[i].completions) expect_valid(c, "request " + std::to_string(i));
  EXPECT_EQ(out.back().completions[0].token_ids.size(), 30u);
  e.check_accounting();
}

// An executor that samples (as the GPU runner) with sample_token; `masks`: whether it applies token masks.
class SamplingExecutor : public ModelRunner {
 public:
  SamplingExecutor(const Model& m, CacheManager& c, bool masks, int* constrained_rows, int* calls)
      : ModelRunner(m, c), model_(m), masks_(masks), constrained_rows_(constrained_rows), calls_(calls) {}
  bool samples(const SamplingParams&) const override { return true; }
  bool applies_token_masks() const override { return masks_; }
  std::vector<SampledToken> execute_sampled(const StepPlan& plan, std::span<const SampleRow> rows) override {
    const std::vector<float>& logits = execute(plan);
    const int64_t V = model_.config().vocab_size;
    ++*calls_;
    std::vector<SampledToken> out(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      const SampleRow& r = rows[i];
      if (r.params->constraint) {
        ++*constrained_rows_;
        EXPECT_TRUE(masks_) << "a constrained row reached an executor that does not apply masks";
        EXPECT_EQ(static_cast<int64_t>(r.token_mask.size()), (V + 31) / 32);
      } else {
        EXPECT_TRUE(r.token_mask.empty());
      }
      out[i].token = sample_token(*r.params, logits.data() + r.logits_row * V, V, r.uniform, r.penalties,
                                  r.params->logprobs >= 0 ? &out[i].logprob : nullptr, r.token_mask);
    }
    return out;
  }

 private:
  const Model& model_;
  bool masks_;
  int *constrained_rows_, *calls_;
};

std::vector<RequestOutput> run(const Model& m, int executor, int* constrained_rows, int* calls) {
  EngineConfig cfg;
  if (executor > 0) {
    cfg.executor = [=](const Model& model, CacheManager& cache) -> std::unique_ptr<StepExecutor> {
      return std::make_unique<SamplingExecutor>(model, cache, executor == 2, constrained_rows, calls);
    };
    cfg.executor_on_host_pool = true;
  }
  Engine e(m, cfg);
  auto params = params_set(m);
  params.pop_back();  // no fork: a fork's first step always samples on the host
  for (SamplingParams& p : params) p.logprobs = -1;
  for (size_t i = 0; i < params.size(); ++i) e.add_request(random_prompt(20 + 9 * static_cast<int>(i), 3 + i), params[i]);
  SamplingParams free;  // outlives the constrained requests: its last steps sample on the executor
  free.max_tokens = 250;
  free.temperature = 1.0f;
  free.seed = 5;
  free.ignore_eos = true;
  e.add_request(random_prompt(25, 99), free);
  return e.run_to_completion();
}

void expect_same(const std::vector<RequestOutput>& a, const std::vector<RequestOutput>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t c = 0; c < a[i].completions.size(); ++c) {
      EXPECT_EQ(a[i].completions[c].token_ids, b[i].completions[c].token_ids) << "request " << i;
      EXPECT_EQ(a[i].completions[c].finish, b[i].completions[c].finish) << "request " << i;
    }
}

TEST(StructuredOutput, ExecutorWithoutMasksLeavesConstrainedStepsToTheHost) {
  const Model& m = tiny_model(Arch::kimi_k3);
  int constrained = 0, calls = 0;
  const auto plain = run(m, 0, &constrained, &calls);
  const auto got = run(m, 1, &constrained, &calls);
  expect_same(plain, got);
  EXPECT_EQ(constrained, 0);
  EXPECT_GT(calls, 0) << "steps with only the unconstrained request still sample on the executor";
  for (size_t i = 0; i + 1 < got.size(); ++i) expect_valid(got[i].completions[0], "request " + std::to_string(i));
}

TEST(StructuredOutput, ExecutorWithMasksGetsEveryRowsMask) {
  const Model& m = tiny_model(Arch::kimi_k3);
  int constrained = 0, calls = 0;
  const auto plain = run(m, 0, &constrained, &calls);
  const auto got = run(m, 2, &constrained, &calls);
  expect_same(plain, got);
  EXPECT_GT(constrained, 20);
}

}  // namespace
}  // namespace kestrel
