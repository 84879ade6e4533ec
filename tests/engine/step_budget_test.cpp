// The prompt share of a step (engine/step_cost.h, SchedulerConfig::max_itl_factor and long_prefill_token_threshold):
// the cost model's predictions from observed steps, and the engine under a synthetic step time (EngineConfig::
// step_seconds): a long prompt arriving beside running decodes is spread over steps that each keep the decodes'
// step time within the factor, every decoding request gets its token in every step, and the outputs equal those of
// the engine without a prompt share, bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>

#include "core/error.h"
#include "engine/step_cost.h"
#include "tiny_models.h"

namespace kestrel {
namespace {

using test::greedy;
using test::random_prompt;
using test::same_bits;
using test::tiny_model;

TEST(StepCostModel, PredictsFromObservedSteps) {
  StepCostModel m;
  EXPECT_LT(m.decode_seconds(8), 0);
  EXPECT_EQ(m.prompt_allowance(8, 2.0), -1);  // nothing measured: no limit
  m.observe(8, 0, 1.0);                       // the first step of a bucket pays one-time costs: skipped
  EXPECT_LT(m.decode_seconds(8), 0);
  m.observe(8, 0, 0.010);
  EXPECT_DOUBLE_EQ(m.decode_seconds(8), 0.010);
  m.observe(8, 0, 0.014);  // exponential mean: 0.010 + 0.25 * 0.004
  EXPECT_DOUBLE_EQ(m.decode_seconds(8), 0.011);
  EXPECT_DOUBLE_EQ(m.decode_seconds(5), 0.011);   // 5-8 share a bucket
  EXPECT_DOUBLE_EQ(m.decode_seconds(64), 0.011);  // the nearest measured bucket
  EXPECT_TRUE(m.knows_decode(5));
  EXPECT_FALSE(m.knows_decode(64));
  EXPECT_EQ(m.prompt_allowance(8, 2.0), -1);      // the prompt tokens' cost is not known yet

  // Steps of prompt tokens only teach an upper bound of the per-token cost (their fixed part included); the first
  // one counts.
  m.observe(0, 1000, 0.050);
  EXPECT_DOUBLE_EQ(m.prompt_token_seconds(), 5e-5);
  m.observe(0, 1000, 0.050);
  EXPECT_DOUBLE_EQ(m.prompt_token_seconds(), 5e-5);
  m.observe(0, 10, 5.0);  // too few prompt tokens to teach anything
  EXPECT_DOUBLE_EQ(m.prompt_token_seconds(), 5e-5);
  // Steps with both replace it: their time less the decodes' prediction, per prompt token.
  m.observe(8, 500, 0.011 + 500 * 4e-5);
  EXPECT_NEAR(m.prompt_token_seconds(), 4e-5, 1e-15);
  m.observe(8, 500, 0.011 + 500 * 6e-5);  // exponential mean: 4e-5 + 0.25 * 2e-5
  EXPECT_NEAR(m.prompt_token_seconds(), 4.5e-5, 1e-15);
  m.observe(8, 500, 0.011 + 500 * 3e-5);  // 4.5e-5 - 0.25 * 1.5e-5
  EXPECT_NEAR(m.prompt_token_seconds(), 4.125e-5, 1e-15);
  EXPECT_NEAR(static_cast<double>(m.prompt_allowance(8, 2.0)), 0.011 / 4.125e-5, 1.0);
  EXPECT_NEAR(static_cast<double>(m.prompt_allowance(8, 3.0)), 2 * 0.011 / 4.125e-5, 1.0);
  EXPECT_EQ(m.prompt_allowance(8, 0.0), -1);  // off
  EXPECT_EQ(m.prompt_allowance(0, 2.0), -1);  // no decodes: no limit
  // Bad measurements are ignored.
  m.observe(8, 0, std::nan(""));
  m.observe(8, 0, -1);
  EXPECT_DOUBLE_EQ(m.decode_seconds(8), 0.011);
}

struct StepRecord {
  int64_t decode_rows = 0, prompt_tokens = 0, allowance = -1;
};

// A step's time on a pretend GPU: 10 ms plus 0.1 ms per decode row plus 40 us per prompt token.
double synthetic_seconds(int64_t decode_rows, int64_t prompt_tokens) {
  return 0.010 + 1e-4 * static_cast<double>(decode_rows) + 4e-5 * static_cast<double>(prompt_tokens);
}

struct BudgetRun {
  std::vector<RequestOutput> out;
  std::vector<StepRecord> steps;
  std::map<RequestId, std::vector<int>> token_steps;  // the steps in which each request got a token
};

// Eight short requests decode while two long prompts arrive (at steps 3 and 40).
void two_long_prompts(Engine& e, int step) {
  if (step == 0)
    for (uint32_t i = 0; i < 8; ++i) e.add_request(random_prompt(40, 100 + i), greedy(80), 0, true);
  if (step == 3 || step == 40) e.add_request(random_prompt(1500, 7 + static_cast<uint32_t>(step)), greedy(8), 0, true);
}

BudgetRun run_with(Arch arch, double factor, int64_t threshold,
                   const std::function<void(Engine&, int)>& arrivals = two_long_prompts) {
  const Model& m = tiny_model(arch);
  EngineConfig cfg;
  cfg.max_model_len = 2048;
  cfg.cache_bytes = int64_t{64} << 20;
  cfg.max_num_batched_tokens = 2048;
  cfg.max_itl_factor = factor;
  cfg.long_prefill_token_threshold = threshold;
  BudgetRun run;
  const Engine* engine = nullptr;
  cfg.step_seconds = [&](const StepPlan& plan, double) {
    StepRecord r;
    for (const ScheduledSequence& x : plan.seqs) {
      if (x.count == 1) ++r.decode_rows;
      else r.prompt_tokens += x.count;
    }
    r.allowance = engine->scheduler().last_prompt_allowance();
    run.steps.push_back(r);
    return synthetic_seconds(r.decode_rows, r.prompt_tokens);
  };
  Engine e(m, cfg);
  engine = &e;
  int step = 0;
  arrivals(e, step);
  while (e.has_unfinished()) {
    if (step > 0) arrivals(e, step);
    StepOutput o = e.step();
    e.check_accounting();
    for (const TokenEvent& t : o.tokens) run.token_steps[t.request].push_back(step);
    for (RequestOutput& r : o.finished) run.out.push_back(std::move(r));
    ++step;
  }
  std::sort(run.out.begin(), run.out.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  return run;
}

void expect_same_outputs(const BudgetRun& a, const BudgetRun& b) {
  ASSERT_EQ(a.out.size(), b.out.size());
  for (size_t i = 0; i < a.out.size(); ++i) {
    const Completion& x = a.out[i].completions.at(0);
    const Completion& y = b.out[i].completions.at(0);
    EXPECT_EQ(x.token_ids, y.token_ids) << "request " << i;
    EXPECT_TRUE(same_bits(x.logits, y.logits)) << "request " << i;
  }
}

class StepBudget : public ::testing::TestWithParam<Arch> {};

TEST_P(StepBudget, LongPromptsBesideDecodesKeepTheDecodesStepTime) {
  const Arch arch = GetParam();
  const double factor = 2.0;
  const BudgetRun plain = run_with(arch, 0, 0);
  const BudgetRun kept = run_with(arch, factor, 0);
  expect_same_outputs(plain, kept);

  const int64_t floor_tokens = std::max<int64_t>(kMinPromptChunk, tiny_model(arch).prefill_alignment());
  int limited = 0;
  for (size_t s = 0; s < kept.steps.size(); ++s) {
    const StepRecord& r = kept.steps[s];
    if (r.decode_rows == 0) continue;
    // With decodes there is always a limit: none while their step time is not measured, else the prediction's.
    ASSERT_GE(r.allowance, 0) << "step " << s;
    if (r.allowance == 0) {
      EXPECT_EQ(r.prompt_tokens, 0) << "step " << s;
      continue;
    }
    EXPECT_GE(r.allowance, floor_tokens) << "step " << s;
    EXPECT_LE(r.prompt_tokens, r.allowance) << "step " << s;
    if (r.prompt_tokens > 0) {
      ++limited;
      // Every step that had a prediction stays within the factor of the decodes' own time, up to the floor chunk
      // (the predictions start from an overestimate: the short prompts' step of prompt tokens only).
      EXPECT_LE(synthetic_seconds(r.decode_rows, r.prompt_tokens),
                factor * synthetic_seconds(r.decode_rows, 0) + 4e-5 * static_cast<double>(floor_tokens))
          << "step " << s;
    }
  }
  EXPECT_GT(limited, 4);
  // The second long prompt arrives when the cost is known: it takes about 1500 / 270 steps, the first decoders
  // keep getting a token in every step, and without the prompt share it runs in one step.
  const RequestId second = 9;
  ASSERT_EQ(kept.token_steps.count(second), 1u);
  ASSERT_EQ(plain.token_steps.count(second), 1u);
  EXPECT_EQ(plain.token_steps.at(second).front(), 40);
  EXPECT_GE(kept.token_steps.at(second).front(), 40 + 1500 / 270);
  for (RequestId r = 0; r < 8; ++r) {
    const std::vector<int>& steps = kept.token_steps.at(r);
    for (size_t i = 1; i < steps.size(); ++i) EXPECT_EQ(steps[i], steps[i - 1] + 1) << "request " << r;
  }
}

TEST_P(StepBudget, ArrivalsAtOnceMeasureTheDecodesBeforePromptsJoinThem) {
  // Twenty requests of 300 tokens at once: more prompt than one step's budget, so the first decodes start while
  // prompts wait. Their step time is not known yet: they run alone (twice per bucket of rows) before any prompt
  // joins them, instead of waiting behind whole-budget prompt steps.
  const Arch arch = GetParam();
  auto at_once = [](Engine& e, int step) {
    if (step == 0)
      for (uint32_t i = 0; i < 20; ++i) e.add_request(random_prompt(300, 300 + i), greedy(24), 0, true);
  };
  const BudgetRun plain = run_with(arch, 0, 0, at_once);
  const BudgetRun kept = run_with(arch, 2.0, 0, at_once);
  expect_same_outputs(plain, kept);
  size_t first = 0;
  while (first < kept.steps.size() && kept.steps[first].decode_rows == 0) ++first;
  ASSERT_LT(first + 1, kept.steps.size());
  EXPECT_EQ(kept.steps[first].prompt_tokens, 0);
  EXPECT_EQ(kept.steps[first + 1].prompt_tokens, 0);
  // Without the factor the same step carries prompts beside the decodes.
  ASSERT_EQ(plain.steps[first].decode_rows, kept.steps[first].decode_rows);
  EXPECT_GT(plain.steps[first].prompt_tokens, 0);
  for (size_t s = first; s < kept.steps.size(); ++s) {
    const StepRecord& r = kept.steps[s];
    if (r.decode_rows == 0) continue;
    ASSERT_GE(r.allowance, 0) << "step " << s;
    EXPECT_LE(r.prompt_tokens, r.allowance) << "step " << s;
  }
}

TEST_P(StepBudget, LongPrefillTokenThresholdCapsEachRequestsChunk) {
  const Arch arch = GetParam();
  const int64_t align = tiny_model(arch).prefill_alignment();
  const int64_t threshold = std::max<int64_t>(align, 256 / align * align);
  const BudgetRun plain = run_with(arch, 0, 0);
  const BudgetRun capped = run_with(arch, 0, threshold);
  expect_same_outputs(plain, capped);
  int64_t most = 0;
  for (const StepRecord& r : capped.steps) most = std::max(most, r.prompt_tokens);
  // One long prompt at a time is in its prompt: no step computes more of it than the threshold (the first step's
  // eight short prompts are 40 tokens each).
  EXPECT_LE(most, std::max<int64_t>(threshold, 8 * 40));
  EXPECT_GE(capped.token_steps.at(9).front(), 40 + (1500 + threshold - 1) / threshold - 1);
}

INSTANTIATE_TEST_SUITE_P(Tiny, StepBudget, ::testing::Values(Arch::kimi_k3, Arch::kimi_linear, Arch::deepseek_v32),
                         [](const auto& info) { return std::string(arch_name(info.param)); });

TEST(StepBudget, BadValuesAreErrors) {
  const Model& m = tiny_model(Arch::kimi_k3);
  EngineConfig cfg;
  cfg.max_itl_factor = 0.5;
  EXPECT_THROW(Engine(m, cfg), Error);
  cfg.max_itl_factor = 0;
  cfg.long_prefill_token_threshold = -1;
  EXPECT_THROW(Engine(m, cfg), Error);
}

}  // namespace
}  // namespace kestrel
