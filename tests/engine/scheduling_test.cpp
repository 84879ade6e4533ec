// Scheduling under pressure: a pool too small for the batch preempts (the newest first) and every request still
// finishes with the outputs it has alone; aborts at random steps leak no row; n > 1 completions share the prompt's
// rows; FCFS and priority order. Row accounting is checked after every step.
#include <gtest/gtest.h>

#include <set>

#include "core/error.h"
#include "tiny_models.h"

namespace kestrel {
namespace {

using test::generate_alone;
using test::greedy;
using test::random_prompt;
using test::run_checked;
using test::same_bits;
using test::tiny_model;

// Prompts just below block boundaries: their sequences need another row a few tokens into decoding.
const std::vector<int> kLengths = {60, 62, 120, 58, 126, 20};

void expect_like_alone(const Model& m, const std::vector<std::vector<int32_t>>& prompts,
                       const std::vector<RequestOutput>& out, int max_tokens) {
  ASSERT_EQ(out.size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    const test::Generation ref = generate_alone(m, prompts[i], max_tokens);
    const Completion& c = out[i].completions.at(0);
    EXPECT_EQ(c.token_ids, ref.tokens) << "request " << i;
    EXPECT_EQ(c.logits_first, 0);
    EXPECT_TRUE(same_bits(c.logits, ref.logits)) << "request " << i;
  }
}

class UnderPressure : public ::testing::TestWithParam<std::tuple<Arch, bool>> {};

TEST_P(UnderPressure, PreemptedRequestsFinishWithTheSameOutputs) {
  const auto [arch, prefix_caching] = GetParam();
  const Model& m = tiny_model(arch);
  const int max_tokens = 30;
  EngineConfig cfg;
  cfg.max_model_len = 256;
  cfg.block_size = 64;
  // Room for one longest sequence and two rows more: far less than the 18 rows the batch holds at once.
  cfg.num_rows = static_cast<int32_t>(plan_cache(m.cache_specs(), {.block_size = 64}).rows_per_request(256) + 2);
  cfg.max_num_batched_tokens = 512;
  cfg.enable_prefix_caching = prefix_caching;
  Engine e(m, cfg);
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < kLengths.size(); ++i) {
    prompts.push_back(random_prompt(kLengths[i], 20 + static_cast<uint32_t>(i)));
    e.add_request(prompts.back(), greedy(max_tokens), 0, true);
  }
  const auto out = run_checked(e);
  EXPECT_GT(e.stats().preemptions, 0);
  expect_like_alone(m, prompts, out, max_tokens);
  EXPECT_EQ(e.cache().pool().num_referenced(), 0);
  e.cache().pool().check_consistency();
}

INSTANTIATE_TEST_SUITE_P(Tiny, UnderPressure,
                         ::testing::Combine(::testing::Values(Arch::kimi_k3, Arch::deepseek_v32),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(arch_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_prefix" : "_noprefix");
                         });

TEST(Scheduling, PreemptsTheNewestRequestFirst) {
  for (SchedulingPolicy policy : {SchedulingPolicy::fcfs, SchedulingPolicy::priority}) {
    EngineConfig cfg;
    cfg.num_rows = 6;  // two sequences of 1 state row + 2 token rows each
    cfg.max_model_len = 256;
    cfg.policy = policy;
    Engine e(tiny_model(Arch::kimi_k3), cfg);
    // Under the priority policy the later request runs first (lower value), so the earlier one is the victim.
    const RequestId a = e.add_request(random_prompt(60, 1), greedy(100), /*priority=*/5);
    const RequestId b = e.add_request(random_prompt(60, 2), greedy(100), /*priority=*/1);
    const RequestId victim = policy == SchedulingPolicy::fcfs ? b : a;
    int steps = 0;
    while (e.stats().preemptions == 0) {
      ASSERT_LT(++steps, 100);
      e.step();
      e.check_accounting();
    }
    ASSERT_EQ(e.scheduler().waiting().size(), 1u);
    EXPECT_EQ(e.scheduler().waiting()[0]->request->id, victim);
    run_checked(e);
  }
}

TEST(Scheduling, FcfsAndPriorityOrder) {
  for (SchedulingPolicy policy : {SchedulingPolicy::fcfs, SchedulingPolicy::priority}) {
    EngineConfig cfg;
    cfg.num_rows = 16;
    cfg.max_model_len = 256;
    cfg.max_num_seqs = 1;
    cfg.policy = policy;
    Engine e(tiny_model(Arch::kimi_linear), cfg);
    const RequestId a = e.add_request(random_prompt(10, 1), greedy(3), 5);
    const RequestId b = e.add_request(random_prompt(10, 2), greedy(3), 1);
    const RequestId c = e.add_request(random_prompt(10, 3), greedy(3), 3);
    std::vector<RequestId> order;
    while (e.has_unfinished()) {
      for (const RequestOutput& r : e.step().finished) order.push_back(r.id);
      EXPECT_LE(e.scheduler().num_running(), 1);
    }
    const std::vector<RequestId> expected =
        policy == SchedulingPolicy::fcfs ? std::vector<RequestId>{a, b, c} : std::vector<RequestId>{b, c, a};
    EXPECT_EQ(order, expected);
  }
}

TEST(Scheduling, AbortAtRandomStepsLeaksNothing) {
  const Model& m = tiny_model(Arch::kimi_k3);
  for (uint32_t seed : {1u, 2u, 3u}) {
    EngineConfig cfg;
    cfg.num_rows = 12;
    cfg.max_model_len = 320;
    cfg.max_num_batched_tokens = 96;
    Engine e(m, cfg);
    std::mt19937 rng(seed);
    std::vector<RequestId> ids;
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < 8; ++i) {
      prompts.push_back(random_prompt(10 + static_cast<int>(rng() % 180), seed * 100 + i));
      SamplingParams p = greedy(15);
      p.n = 1 + static_cast<int>(rng() % 3);
      ids.push_back(e.add_request(prompts.back(), p, 0, true));
    }
    std::set<RequestId> aborted;
    std::vector<RequestOutput> done;
    // Abort one request right away (waiting), the rest at random steps: mid-prefill, decoding, after forks.
    done.push_back(e.abort(ids[7]));
    aborted.insert(ids[7]);
    e.check_accounting();
    while (e.has_unfinished()) {
      if (rng() % 4 == 0) {
        const RequestId id = ids[rng() % ids.size()];
        if (!aborted.count(id) && std::none_of(done.begin(), done.end(), [&](auto& r) { return r.id == id; })) {
          const RequestOutput r = e.abort(id);
          for (const Completion& c : r.completions) EXPECT_EQ(c.finish, FinishReason::abort);
          aborted.insert(id);
        }
      }
      StepOutput o = e.step();
      e.check_accounting();
      for (RequestOutput& r : o.finished) done.push_back(std::move(r));
    }
    EXPECT_EQ(e.cache().pool().num_referenced(), 0);
    e.cache().pool().check_consistency();
    EXPECT_THROW(e.abort(ids[7]), Error);  // gone
    // Requests that were not aborted are untouched by the others' aborts.
    for (const RequestOutput& r : done) {
      if (aborted.count(r.id)) continue;
      const test::Generation ref = generate_alone(m, prompts[r.id], 15);
      for (const Completion& c : r.completions) EXPECT_EQ(c.token_ids, ref.tokens) << "request " << r.id;
    }
  }
}

TEST(Scheduling, CompletionsShareThePromptRows) {
  const Model& m = tiny_model(Arch::kimi_k3);
  EngineConfig cfg;
  cfg.num_rows = 32;
  cfg.max_model_len = 256;
  Engine e(m, cfg);
  const auto prompt = random_prompt(130, 5);
  SamplingParams p = greedy(8);
  p.n = 3;
  e.add_request(prompt, p, 0, true);
  e.step();
  // The first sequence holds 1 state row and 3 token rows (2 full blocks + 10 tokens); each fork shares the 2
  // full blocks and copies the partial block and the state: 2 new rows each.
  EXPECT_EQ(e.cache().pool().num_referenced(), 4 + 2 * 2);
  e.check_accounting();
  const auto out = run_checked(e);
  const test::Generation ref = generate_alone(m, prompt, 8);
  ASSERT_EQ(out[0].completions.size(), 3u);
  for (const Completion& c : out[0].completions) {
    EXPECT_EQ(c.token_ids, ref.tokens) << "completion " << c.index;  // greedy: all equal the request alone
    EXPECT_TRUE(same_bits(c.logits, ref.logits)) << "completion " << c.index;
  }
}

TEST(Scheduling, ForkWithoutRowsRecomputesWithTheSameBits) {
  const Model& m = tiny_model(Arch::kimi_k3);
  EngineConfig cfg;
  cfg.num_rows = 5;  // one sequence at a time
  cfg.max_model_len = 256;
  Engine e(m, cfg);
  const auto prompt = random_prompt(100, 6);
  SamplingParams p = greedy(30);
  p.n = 2;
  e.add_request(prompt, p, 0, true);
  const auto out = run_checked(e);
  const test::Generation ref = generate_alone(m, prompt, 30);
  for (const Completion& c : out[0].completions) {
    EXPECT_EQ(c.token_ids, ref.tokens);
    EXPECT_TRUE(same_bits(c.logits, ref.logits));
  }
}

TEST(Scheduling, SeededSamplingIsTheSameAloneAndInABatch) {
  const Model& m = tiny_model(Arch::kimi_linear);
  EngineConfig cfg;
  cfg.num_rows = 48;
  cfg.max_model_len = 256;
  cfg.max_num_batched_tokens = 64;
  SamplingParams p;
  p.max_tokens = 12;
  p.temperature = 1.5f;
  p.top_k = 50;
  p.seed = 1234;
  p.n = 3;
  p.ignore_eos = true;
  const auto prompt = random_prompt(40, 7);
  Engine alone(m, cfg);
  alone.add_request(prompt, p);
  const auto a = run_checked(alone);
  Engine batch(m, cfg);
  batch.add_request(random_prompt(90, 8), p);
  const RequestId id = batch.add_request(prompt, p);
  batch.add_request(random_prompt(20, 9), p);
  const auto b = run_checked(batch);
  ASSERT_EQ(a[0].completions.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(a[0].completions[i].token_ids, b[id].completions[i].token_ids) << i;
  // Each completion draws from its own stream: at temperature 1.5 over 12 tokens they differ.
  EXPECT_NE(a[0].completions[0].token_ids, a[0].completions[1].token_ids);
  // Completion 0 of n = 3 is the n = 1 request with the same seed.
  SamplingParams one = p;
  one.n = 1;
  Engine single(m, cfg);
  single.add_request(prompt, one);
  EXPECT_EQ(run_checked(single)[0].completions[0].token_ids, a[0].completions[0].token_ids);
}

}  // namespace
}  // namespace kestrel
