// Speculative decoding: greedy output with speculation equals greedy output without it, token for token and
// log-probability bit for bit, for every architecture, with the n-gram drafter and with drafters whose drafts are
// rejected at every position (KDA state slots, prefix-cache hits, preemption); the verifier's output distribution is
// the target's (chi-square over seeded draws, point-mass and full-q drafts); config parsing errors name the field.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <cstdio>
#include <functional>
#include <map>
#include <numeric>
#include <random>

#include "core/error.h"
#include "engine/dspark_drafter.h"
#include "engine/mtp_drafter.h"
#include "engine/spec_decode.h"
#include "model/dspark.h"
#include "model/safetensors.h"
#include "schema_constraint.h"
#include "tiny_models.h"

namespace kestrel {
namespace {

using test::random_prompt;
using test::run_checked;
using test::tiny_model;

// ---------------------------------------------------------------------------------------------------------------
// Engine: speculation changes nothing at temperature 0.

// Drafts from a reference output (the same requests without speculation), made wrong on purpose: the draft at
// position `wrong_at` (cycling over 0..k per call; k: every draft right) is the reference's token + 1, so over a
// run rejections hit every position and full acceptances happen too. all_wrong: every draft is wrong.
class OracleDrafter final : public Drafter {
 public:
  OracleDrafter(std::map<std::vector<int32_t>, std::vector<int32_t>> refs, int k, bool all_wrong)
      : refs_(std::move(refs)), k_(k), all_wrong_(all_wrong) {}
  void propose(Sequence& s, int max_tokens, int64_t vocab, Draft& out) override {
    out.tokens.clear();
    const auto it = refs_.find(s.request->prompt);
    if (it == refs_.end()) return;
    const std::vector<int32_t>& ref = it->second;
    const size_t g = static_cast<size_t>(s.num_generated());
    const int wrong_at = all_wrong_ ? 0 : calls_++ % (k_ + 1);
    for (int i = 0; i < max_tokens && g + i < ref.size(); ++i) {
      const int32_t t = ref[g + i];
      out.tokens.push_back(i == wrong_at ? static_cast<int32_t>((t + 1) % vocab) : t);
    }
  }

 private:
  std::map<std::vector<int32_t>, std::vector<int32_t>> refs_;
  int k_;
  bool all_wrong_;
  int calls_ = 0;
};

enum class DrafterKind { ngram, oracle, all_wrong };
const char* kind_name(DrafterKind d) {
  return d == DrafterKind::ngram ? "ngram" : d == DrafterKind::oracle ? "oracle" : "allwrong";
}

constexpr int kK = 3;  // drafts per step

SpeculativeConfig ngram_config(int k = kK) {
  SpeculativeConfig c;
  c.method = "ngram";
  c.num_speculative_tokens = k;
  c.prompt_lookup_min = 1;
  c.prompt_lookup_max = 3;
  return c;
}

// Prompts with repeats (so that prompt lookup finds drafts) and without.
std::vector<std::vector<int32_t>> test_prompts() {
  std::vector<std::vector<int32_t>> out;
  for (uint32_t i = 0; i < 3; ++i) {
    const std::vector<int32_t> unit = random_prompt(7 + 3 * static_cast<int>(i), 40 + i);
    std::vector<int32_t> p;
    for (int r = 0; r < 5; ++r) p.insert(p.end(), unit.begin(), unit.end());
    out.push_back(p);
  }
  out.push_back(random_prompt(70, 50));
  return out;
}

// repetition_penalty < 1 favours tokens seen before: a random tiny model then repeats itself, which gives the n-gram
// drafter something to find (and puts penalties into verification).
SamplingParams greedy_with_logprobs(int max_tokens, float repetition_penalty = 1.0f) {
  SamplingParams p = test::greedy(max_tokens);
  p.logprobs = 1;
  p.repetition_penalty = repetition_penalty;
  return p;
}

// Two rounds through one engine: the prompts, then second turns (prompt + completion + more) that hit the prefix
// cache. Returns every completion's tokens and log-probabilities in order.
struct Outputs {
  std::vector<std::vector<int32_t>> prompts, tokens;
  std::vector<std::vector<TokenLogprob>> logprobs;
  EngineStats stats;
};
Outputs run_rounds(const Model& m, EngineConfig cfg, int max_tokens, const std::vector<std::vector<int32_t>>& first,
                   float repetition_penalty) {
  Engine e(m, cfg);
  Outputs r;
  std::vector<std::vector<int32_t>> prompts = first;
  for (int round = 0; round < 2; ++round) {
    for (const auto& p : prompts) e.add_request(p, greedy_with_logprobs(max_tokens, repetition_penalty));
    const std::vector<RequestOutput> out = run_checked(e);
    EXPECT_EQ(out.size(), prompts.size());
    std::vector<std::vector<int32_t>> next;
    for (size_t i = 0; i < out.size(); ++i) {
      const Completion& c = out[i].completions.at(0);
      r.prompts.push_back(prompts[i]);
      r.tokens.push_back(c.token_ids);
      r.logprobs.push_back(c.logprobs);
      std::vector<int32_t> turn = prompts[i];
      turn.insert(turn.end(), c.token_ids.begin(), c.token_ids.end());
      const std::vector<int32_t> more = random_prompt(5, 90 + static_cast<uint32_t>(i));
      turn.insert(turn.end(), more.begin(), more.end());
      next.push_back(turn);
    }
    prompts = next;
  }
  EXPECT_EQ(e.cache().pool().num_referenced(), 0);
  r.stats = e.stats();
  return r;
}

// One round of greedy requests through a fresh engine: every completion's tokens and log-probabilities in order,
// and the engine's counters; the pool is left unreferenced and consistent.
Outputs run_once(const Model& m, const EngineConfig& cfg, const std::vector<std::vector<int32_t>>& prompts,
                 int max_tokens, const std::function<void(size_t, SamplingParams&)>& adjust = {}) {
  Engine e(m, cfg);
  for (size_t i = 0; i < prompts.size(); ++i) {
    SamplingParams p = greedy_with_logprobs(max_tokens);
    if (adjust) adjust(i, p);
    e.add_request(prompts[i], p);
  }
  const std::vector<RequestOutput> out = run_checked(e);
  EXPECT_EQ(e.cache().pool().num_referenced(), 0);
  e.cache().pool().check_consistency();
  Outputs r;
  for (size_t i = 0; i < out.size(); ++i) {
    r.prompts.push_back(prompts[i]);
    r.tokens.push_back(out[i].completions.at(0).token_ids);
    r.logprobs.push_back(out[i].completions.at(0).logprobs);
  }
  r.stats = e.stats();
  return r;
}

void expect_same(const Outputs& spec, const Outputs& plain) {
  ASSERT_EQ(spec.tokens.size(), plain.tokens.size());
  for (size_t i = 0; i < spec.tokens.size(); ++i) {
    EXPECT_EQ(spec.prompts[i], plain.prompts[i]);
    EXPECT_EQ(spec.tokens[i], plain.tokens[i]) << "completion " << i;
    ASSERT_EQ(spec.logprobs[i].size(), plain.logprobs[i].size()) << "completion " << i;
    for (size_t j = 0; j < spec.logprobs[i].size(); ++j) {
      const TokenLogprob &a = spec.logprobs[i][j], &b = plain.logprobs[i][j];
      EXPECT_EQ(a.token, b.token);
      EXPECT_EQ(std::memcmp(&a.logprob, &b.logprob, sizeof(float)), 0)
          << "completion " << i << " token " << j << ": " << a.logprob << " vs " << b.logprob;
      EXPECT_EQ(a.rank, b.rank);
      EXPECT_EQ(a.top, b.top);
    }
  }
}

// The drafter of a kind for the reference outputs of `plain`.
std::shared_ptr<Drafter> drafter_for(DrafterKind kind, const Outputs& plain) {
  if (kind == DrafterKind::ngram) return nullptr;
  std::map<std::vector<int32_t>, std::vector<int32_t>> refs;
  for (size_t i = 0; i < plain.prompts.size(); ++i) refs[plain.prompts[i]] = plain.tokens[i];
  return std::make_shared<OracleDrafter>(std::move(refs), kK, kind == DrafterKind::all_wrong);
}

void expect_spec_counters(const EngineStats& st, DrafterKind kind) {
  const SpecDecodeCounters& s = st.spec;
  ASSERT_EQ(s.accepted_per_pos.size(), static_cast<size_t>(kK));
  EXPECT_GT(s.num_drafts, 0);
  EXPECT_GE(s.num_draft_tokens, s.num_drafts);
  EXPECT_EQ(s.num_accepted_tokens, std::accumulate(s.accepted_per_pos.begin(), s.accepted_per_pos.end(), int64_t{0}));
  for (int i = 1; i < kK; ++i) EXPECT_LE(s.accepted_per_pos[i], s.accepted_per_pos[i - 1]);
  if (kind == DrafterKind::all_wrong) {
    EXPECT_EQ(s.num_accepted_tokens, 0);
  }
  if (kind == DrafterKind::oracle) {
    // Rejections at every position and full acceptances: some drafts accepted at each position, fewer than drafted.
    for (int i = 0; i < kK; ++i) EXPECT_GT(s.accepted_per_pos[i], 0) << "position " << i;
    EXPECT_LT(s.accepted_per_pos[0], s.num_drafts);
  }
  if (kind == DrafterKind::ngram) {
    EXPECT_GT(s.num_accepted_tokens, 0);  // the repeated prompts continue their loops
  }
}

class SpecGreedy : public ::testing::TestWithParam<std::tuple<Arch, bool, DrafterKind>> {};

TEST_P(SpecGreedy, EqualsGreedyWithoutSpeculation) {
  const auto [arch, chunked, kind] = GetParam();
  ModelOptions o;
  o.kda_chunked_prefill = chunked;
  const Model& m = tiny_model(arch, o);
  EngineConfig cfg;
  cfg.max_model_len = 256;
  cfg.block_size = chunked ? 64 : 16;  // recurrent: verification steps cross many block boundaries
  cfg.max_num_batched_tokens = 256;
  const int max_tokens = 24;
  const float rp = kind == DrafterKind::ngram ? 0.05f : 1.0f;
  const Outputs plain = run_rounds(m, cfg, max_tokens, test_prompts(), rp);
  EngineConfig sc = cfg;
  sc.speculative = ngram_config();
  sc.drafter = drafter_for(kind, plain);
  const Outputs spec = run_rounds(m, sc, max_tokens, test_prompts(), rp);
  expect_same(spec, plain);
  expect_spec_counters(spec.stats, kind);
  // The second round hit the prefix cache (in the recurrent mode, up to blocks that verification steps computed).
  EXPECT_GT(spec.stats.prefix.hit_tokens, 0);
  EXPECT_EQ(spec.stats.prefix.hit_tokens, plain.stats.prefix.hit_tokens);
  // Fewer steps than tokens: speculation did something (the all-wrong drafter accepts nothing).
  if (kind != DrafterKind::all_wrong) {
    EXPECT_LT(spec.stats.steps, plain.stats.steps);
  }
}

INSTANTIATE_TEST_SUITE_P(Tiny, SpecGreedy,
                         ::testing::Combine(::testing::Values(Arch::kimi_k3, Arch::kimi_linear, Arch::deepseek_v32),
                                            ::testing::Bool(),
                                            ::testing::Values(DrafterKind::ngram, DrafterKind::oracle,
                                                              DrafterKind::all_wrong)),
                         [](const auto& info) {
                           return std::string(arch_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_chunked_" : "_recurrent_") +
                                  kind_name(std::get<2>(info.param));
                         });

// A pool too small for the batch: sequences are preempted (drafts dropped, slots returned) and recomputed, and the
// outputs are still those without speculation.
class SpecPressure : public ::testing::TestWithParam<std::tuple<Arch, DrafterKind>> {};

TEST_P(SpecPressure, PreemptedRequestsFinishWithTheSameOutputs) {
  const auto [arch, kind] = GetParam();
  const Model& m = tiny_model(arch);
  EngineConfig cfg;
  cfg.max_model_len = 256;
  cfg.block_size = 64;
  cfg.num_rows = static_cast<int32_t>(plan_cache(m.cache_specs(), {.block_size = 64}).rows_per_request(256) + 2);
  cfg.max_num_batched_tokens = 512;
  const int max_tokens = 30;
  std::vector<std::vector<int32_t>> prompts;
  const std::vector<int> lengths = {60, 62, 120, 58, 126, 20};
  for (size_t i = 0; i < lengths.size(); ++i) prompts.push_back(random_prompt(lengths[i], 20 + static_cast<uint32_t>(i)));
  const Outputs plain = run_once(m, cfg, prompts, max_tokens);
  EngineConfig sc = cfg;
  sc.speculative = ngram_config();
  sc.drafter = drafter_for(kind, plain);
  const Outputs spec = run_once(m, sc, prompts, max_tokens);
  const EngineStats& spec_stats = spec.stats;
  EXPECT_GT(spec_stats.preemptions, 0);
  EXPECT_GT(spec_stats.spec.num_drafts, 0);
  expect_same(spec, plain);
  // Against the plain forward pass as well.
  for (size_t i = 0; i < prompts.size(); ++i)
    EXPECT_EQ(spec.tokens[i], test::generate_alone(m, prompts[i], max_tokens).tokens) << "request " << i;
}

INSTANTIATE_TEST_SUITE_P(Tiny, SpecPressure,
                         ::testing::Combine(::testing::Values(Arch::kimi_k3, Arch::kimi_linear, Arch::deepseek_v32),
                                            ::testing::Values(DrafterKind::oracle, DrafterKind::all_wrong)),
                         [](const auto& info) {
                           return std::string(arch_name(std::get<0>(info.param))) + "_" +
                                  kind_name(std::get<1>(info.param));
                         });

// A budget of a few tokens per step shared by several decoding sequences (drafts cut to what is left, or dropped
// when a sequence gets no part of the step) and a pool so small that state slots are often unavailable and
// sequences are preempted: the outputs are still those without speculation, with the rows accounted every step.
class SpecTight : public ::testing::TestWithParam<Arch> {};

TEST_P(SpecTight, SmallBudgetAndPoolKeepTheOutputs) {
  const Arch arch = GetParam();
  ModelOptions o;
  o.kda_chunked_prefill = false;  // the recurrence everywhere: prompts may be cut anywhere, budgets below 64
  const Model& m = tiny_model(arch, o);
  EngineConfig cfg;
  cfg.max_model_len = 96;  // the longest request has 61 + 20 tokens
  cfg.block_size = 16;
  cfg.max_num_batched_tokens = 7;
  const CachePlan plan = plan_cache(m.cache_specs(), {.block_size = 16});
  cfg.num_rows = static_cast<int32_t>(plan.rows_per_request(96) + 1);
  const int max_tokens = 20;
  std::vector<std::vector<int32_t>> prompts;
  for (uint32_t i = 0; i < 5; ++i) prompts.push_back(random_prompt(9 + 13 * static_cast<int>(i), 60 + i));
  const Outputs plain = run_once(m, cfg, prompts, max_tokens);
  EngineConfig sc = cfg;
  sc.speculative = ngram_config();
  sc.drafter = drafter_for(DrafterKind::oracle, plain);
  const Outputs spec = run_once(m, sc, prompts, max_tokens);
  const EngineStats& spec_stats = spec.stats;
  expect_same(spec, plain);
  EXPECT_GT(spec_stats.spec.num_accepted_tokens, 0);
  EXPECT_GT(spec_stats.preemptions, 0);
  // Drafts were cut: fewer draft tokens than k per draft on average.
  EXPECT_LT(spec_stats.spec.num_draft_tokens, kK * spec_stats.spec.num_drafts);
}

INSTANTIATE_TEST_SUITE_P(Tiny, SpecTight, ::testing::Values(Arch::kimi_k3, Arch::kimi_linear, Arch::deepseek_v32),
                         [](const auto& info) { return std::string(arch_name(info.param)); });

// n > 1 completions fork from the prompt's rows and then verify drafts each with its own state slots; a scoring
// request (prompt log-probabilities) and a request with kept logits (which never drafts) share the steps.
TEST(SpecMixed, ForksScoringAndKeptLogitsAlongside) {
  const Model& m = tiny_model(Arch::kimi_k3);
  EngineConfig cfg;
  cfg.max_model_len = 256;
  const std::vector<std::vector<int32_t>> prompts = test_prompts();
  auto run = [&](const EngineConfig& c, EngineStats* st) {
    Engine e(m, c);
    SamplingParams two = greedy_with_logprobs(20);
    two.n = 2;
    e.add_request(prompts[0], two);
    SamplingParams scored = greedy_with_logprobs(20);
    scored.prompt_logprobs = 2;
    e.add_request(prompts[1], scored);
    e.add_request(prompts[2], greedy_with_logprobs(20), 0, /*keep_logits=*/true);
    std::vector<RequestOutput> out = run_checked(e);
    EXPECT_EQ(e.cache().pool().num_referenced(), 0);
    *st = e.stats();
    return out;
  };
  EngineStats plain_stats, spec_stats;
  const std::vector<RequestOutput> plain = run(cfg, &plain_stats);
  std::map<std::vector<int32_t>, std::vector<int32_t>> refs;
  for (const RequestOutput& r : plain) refs[r.prompt] = r.completions.at(0).token_ids;
  EngineConfig sc = cfg;
  sc.speculative = ngram_config();
  sc.drafter = std::make_shared<OracleDrafter>(refs, kK, false);
  const std::vector<RequestOutput> spec = run(sc, &spec_stats);
  EXPECT_GT(spec_stats.spec.num_accepted_tokens, 0);
  ASSERT_EQ(spec.size(), plain.size());
  for (size_t i = 0; i < spec.size(); ++i) {
    ASSERT_EQ(spec[i].completions.size(), plain[i].completions.size());
    for (size_t c = 0; c < spec[i].completions.size(); ++c) {
      const Completion &a = spec[i].completions[c], &b = plain[i].completions[c];
      EXPECT_EQ(a.token_ids, b.token_ids) << "request " << i << " completion " << c;
      ASSERT_EQ(a.logprobs.size(), b.logprobs.size());
      for (size_t j = 0; j < a.logprobs.size(); ++j)
        EXPECT_EQ(std::memcmp(&a.logprobs[j].logprob, &b.logprobs[j].logprob, sizeof(float)), 0);
      EXPECT_TRUE(test::same_bits(a.logits, b.logits));
    }
    ASSERT_EQ(spec[i].prompt_logprobs.size(), plain[i].prompt_logprobs.size());
    for (size_t j = 0; j < spec[i].prompt_logprobs.size(); ++j)
      EXPECT_EQ(spec[i].prompt_logprobs[j].logprob, plain[i].prompt_logprobs[j].logprob);
  }
  EXPECT_EQ(spec[0].completions.size(), 2u);
  EXPECT_FALSE(spec[2].completions.at(0).logits.empty());
}

// Synthetic acceptance (a benchmark option) keeps drafts at the configured rates whatever the target says.
TEST(SpecSynthetic, ForcedAcceptanceRates) {
  const Model& m = tiny_model(Arch::kimi_linear);
  EngineConfig cfg;
  cfg.max_model_len = 256;
  auto run = [&](std::vector<double> rates) {
    EngineConfig c = cfg;
    c.speculative = ngram_config();
    c.speculative->rejection_sample_method = "synthetic";
    c.speculative->synthetic_acceptance_rates = std::move(rates);
    Engine e(m, c);
    // repetition_penalty < 1 makes the tiny model repeat itself: enough n-gram drafts that every rate is seen.
    for (const auto& p : test_prompts()) e.add_request(p, greedy_with_logprobs(60, 0.05f));
    run_checked(e);
    return e.stats().spec;
  };
  const SpecDecodeCounters all = run({1.0, 1.0, 1.0}), none = run({0.0, 0.0, 0.0}), half = run({0.5, 0.25, 0.125});
  EXPECT_GT(all.num_drafts, 0);
  EXPECT_EQ(all.num_accepted_tokens, all.num_draft_tokens);
  EXPECT_GT(none.num_drafts, 0);
  EXPECT_EQ(none.num_accepted_tokens, 0);
  ASSERT_GE(half.num_drafts, 20);  // the chance that a rate of 0.5 then accepts nothing is below 1e-6
  EXPECT_GT(half.num_accepted_tokens, 0) << half.num_drafts << " drafts, " << half.num_draft_tokens << " tokens";
  EXPECT_LT(half.num_accepted_tokens, half.num_draft_tokens);
}

// Temperature > 0 through the engine: every request finishes with its max_tokens, rows all returned; the same seed
// gives the same tokens in two runs (verification draws only from each request's own stream).
TEST(SpecSampling, SeededRunsRepeat) {
  const Model& m = tiny_model(Arch::kimi_k3);
  EngineConfig cfg;
  cfg.max_model_len = 256;
  cfg.speculative = ngram_config();
  auto run = [&] {
    Engine e(m, cfg);
    for (const auto& p : test_prompts()) {
      SamplingParams s = test::greedy(20);
      s.temperature = 0.8f;
      s.top_p = 0.95f;
      s.seed = 11;
      e.add_request(p, s);
    }
    std::vector<std::vector<int32_t>> out;
    for (const RequestOutput& r : run_checked(e)) out.push_back(r.completions.at(0).token_ids);
    EXPECT_EQ(e.cache().pool().num_referenced(), 0);
    return out;
  };
  const auto a = run(), b = run();
  EXPECT_EQ(a, b);
  for (const auto& t : a) EXPECT_EQ(t.size(), 20u);
}

// ---------------------------------------------------------------------------------------------------------------
// Structured output with drafts: drafts are checked against each request's grammar (verification samples every
// position from the grammar's mask after the drafts before it; a draft outside the grammar is rejected, one that
// ends it ends the step's tokens, and the automaton is left at the kept tokens). Greedy output equals greedy output
// without speculation, token for token and log-prob bit for bit, with drafts right, wrong (mostly outside the
// grammar) at every position in turn, all wrong, and from prompt lookup.
class SpecGrammar : public ::testing::TestWithParam<std::tuple<Arch, DrafterKind>> {};

TEST_P(SpecGrammar, EqualsGreedyWithoutSpeculation) {
  const auto [arch, kind] = GetParam();
  const Model& m = tiny_model(arch);
  EngineConfig cfg;
  cfg.max_model_len = 512;
  auto constrained = [&](size_t i, SamplingParams& p) {
    p.constraint = test::schema_constraint(m, i % 2 == 0);
    if (kind == DrafterKind::ngram) p.repetition_penalty = 0.05f;
  };
  const Outputs plain = run_once(m, cfg, test_prompts(), 200, constrained);
  int ended = 0;
  for (const auto& t : plain.tokens) ended += t.back() == test::kEos;
  EXPECT_GT(ended, 0) << "no completion reached the grammar's end";
  EngineConfig sc = cfg;
  sc.speculative = ngram_config();
  sc.drafter = drafter_for(kind, plain);
  const Outputs spec = run_once(m, sc, test_prompts(), 200, constrained);
  expect_same(spec, plain);
  EXPECT_GT(spec.stats.spec.num_drafts, 0);
  if (kind == DrafterKind::oracle) EXPECT_GT(spec.stats.spec.num_accepted_tokens, 0);
  if (kind == DrafterKind::all_wrong) EXPECT_EQ(spec.stats.spec.num_accepted_tokens, 0);
}

INSTANTIATE_TEST_SUITE_P(Tiny, SpecGrammar,
                         ::testing::Combine(::testing::Values(Arch::kimi_k3, Arch::kimi_linear, Arch::deepseek_v32),
                                            ::testing::Values(DrafterKind::ngram, DrafterKind::oracle,
                                                              DrafterKind::all_wrong)),
                         [](const auto& info) {
                           return std::string(arch_name(std::get<0>(info.param))) + "_" +
                                  kind_name(std::get<1>(info.param));
                         });

TEST(SpecGrammar, DraftMasksStopAtTheFirstDraftOutsideTheGrammar) {
  const Model& m = tiny_model(Arch::kimi_k3);
  grammar::OutputMatcher g(test::schema_constraint(m, false));
  const std::vector<int32_t> ok = test::tiny_tokenizer().encode(R"({"name": "ab")");
  ASSERT_GE(ok.size(), 2u);
  std::vector<int32_t> drafts = ok;
  drafts.push_back(test::tiny_tokenizer().encode("]").at(0));  // not after a string value
  drafts.push_back(ok[0]);
  const std::vector<std::vector<uint32_t>> masks = grammar_draft_masks(g, drafts);
  ASSERT_EQ(masks.size(), ok.size() + 1);  // positions 0..|ok|: the last one is the bad draft's, rejected for sure
  EXPECT_EQ(g.num_accepted(), 0);          // the matcher is where it was
  auto allows = [](const std::vector<uint32_t>& w, int32_t t) { return (w[t >> 5] >> (t & 31) & 1) != 0; };
  for (size_t j = 0; j < ok.size(); ++j) EXPECT_TRUE(allows(masks[j], drafts[j])) << "position " << j;
  EXPECT_FALSE(allows(masks[ok.size()], drafts[ok.size()]));
  EXPECT_EQ(grammar_draft_prefix(g, drafts), ok.size() + 1);
  EXPECT_EQ(g.num_accepted(), 0);
  // A draft that ends the grammar: nothing after it is verified.
  const std::vector<int32_t> whole = test::tiny_tokenizer().encode(R"({"name": "a", "n": 1, "ok": true})");
  std::vector<int32_t> ending = whole;
  ending.push_back(test::kEos);
  ending.push_back(ok[0]);
  EXPECT_EQ(grammar_draft_masks(g, ending).size(), whole.size() + 1);
  EXPECT_EQ(grammar_draft_prefix(g, ending), whole.size() + 1);
  EXPECT_EQ(g.num_accepted(), 0);
}

// The verifier's output distribution: chi-square against the target.

constexpr int kV = 6;

// The target's logits after token `prev` (a fixed table).
std::vector<float> target_logits(int prev) {
  static const std::vector<float> table = [] {
    std::mt19937 rng(123);
    std::normal_distribution<float> n(0.0f, 1.2f);
    std::vector<float> t(kV * kV);
    for (float& x : t) x = n(rng);
    return t;
  }();
  return std::vector<float>(table.begin() + prev * kV, table.begin() + (prev + 1) * kV);
}

// A grammar over the kV tokens for the distribution tests: after token `prev`, token t is allowed when
// (t + prev) % 3 != 0.
bool grammar_allows(int prev, int t) { return (t + prev) % 3 != 0; }
std::vector<uint32_t> grammar_mask(int prev) {
  uint32_t w = 0;
  for (int t = 0; t < kV; ++t)
    if (grammar_allows(prev, t)) w |= 1u << t;
  return {w};
}

// The target distribution written out independently of the sampler: softmax at temperature 1 (over the tokens the
// grammar allows, with `grammar`), the smallest head (by decreasing probability, ties to the lower id) whose mass
// reaches top_p, renormalised.
std::vector<double> target_probs(int prev, double top_p, bool grammar = false) {
  const std::vector<float> l = target_logits(prev);
  std::vector<double> p(kV);
  double z = 0.0;
  const double mx = *std::max_element(l.begin(), l.end());
  for (int i = 0; i < kV; ++i) z += p[i] = grammar && !grammar_allows(prev, i) ? 0.0 : std::exp(l[i] - mx);
  for (double& x : p) x /= z;
  std::vector<int> order(kV);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  std::vector<double> out(kV, 0.0);
  double cum = 0.0, kept = 0.0;
  for (int i = 0; i < kV; ++i) {
    kept += out[order[i]] = p[order[i]];
    cum += p[order[i]];
    if (cum >= top_p) break;
  }
  for (double& x : out) x /= kept;
  return out;
}

// The draft model's distribution after `prev` (full support, unlike the target's).
std::vector<float> draft_q(int prev) {
  std::vector<float> q(kV);
  float z = 0.0f;
  for (int i = 0; i < kV; ++i) z += q[i] = 1.0f + static_cast<float>((i * 7 + prev * 3) % 5);
  for (float& x : q) x /= z;
  return q;
}

enum class Drafts { point_mass, full_q };

// The first two tokens generated after token 0 by speculative decoding with k = 3 drafts per step; `synthetic`
// accepts every draft (a broken verifier: the negative control).
std::pair<int, int> spec_two_tokens(uint64_t seed, Drafts drafts, bool synthetic, std::mt19937_64& draft_rng,
                                    bool grammar = false) {
  SamplingParams sp;
  sp.temperature = 1.0f;
  sp.top_p = 0.95f;
  sp.seed = seed;
  sp.max_tokens = 100;
  const std::vector<int32_t> prompt = {0};
  Sampler sampler(sp, prompt);
  std::vector<int32_t> out;
  int prev = 0;
  const std::vector<double> all_accept(3, 1.0);
  while (out.size() < 2) {
    std::vector<int32_t> d;
    std::vector<float> q;
    int p = prev;
    for (int i = 0; i < 3; ++i) {
      int t;
      if (drafts == Drafts::point_mass) {
        t = (p * 5 + 1 + i) % kV;  // some fixed guess: sometimes outside the target's top-p set
      } else {
        const std::vector<float> qi = draft_q(p);
        std::discrete_distribution<int> dist(qi.begin(), qi.end());
        t = dist(draft_rng);
        q.insert(q.end(), qi.begin(), qi.end());
      }
      d.push_back(t);
      p = t;
    }
    std::vector<float> logits;
    int ctx = prev;
    for (int i = 0; i <= 3; ++i) {
      const std::vector<float> l = target_logits(ctx);
      logits.insert(logits.end(), l.begin(), l.end());
      if (i < 3) ctx = d[i];
    }
    VerifyOptions opt;
    opt.synthetic = synthetic;
    opt.synthetic_rates = all_accept;
    // With the grammar: the masks of the positions up to the first draft outside it (as grammar_draft_masks).
    std::vector<std::vector<uint32_t>> masks;
    if (grammar) {
      int g = prev;
      masks.push_back(grammar_mask(g));
      for (int i = 0; i < 3 && grammar_allows(g, d[i]); ++i) masks.push_back(grammar_mask(g = d[i]));
      opt.masks = masks;
    }
    const VerifyResult r = verify_draft(sampler, logits.data(), kV, d, q, false, opt);
    EXPECT_EQ(r.tokens.size(), static_cast<size_t>(r.accepted + 1));
    for (int i = 0; i < r.accepted; ++i) EXPECT_EQ(r.tokens[i], d[i]);
    out.insert(out.end(), r.tokens.begin(), r.tokens.end());
    prev = out.back();
  }
  return {out[0], out[1]};
}

// Pearson's chi-square of the joint counts of the first two tokens against p(x1 | 0) p(x2 | x1), over the cells of
// positive probability (a token of probability 0 is a failure by itself), and its degrees of freedom.
std::pair<double, int> chi_square(Drafts drafts, bool synthetic, int draws, bool grammar = false) {
  std::vector<int64_t> counts(kV * kV, 0);
  std::mt19937_64 draft_rng(99);
  for (int i = 0; i < draws; ++i) {
    const auto [a, b] = spec_two_tokens(1000 + static_cast<uint64_t>(i), drafts, synthetic, draft_rng, grammar);
    ++counts[a * kV + b];
  }
  const std::vector<double> p0 = target_probs(0, 0.95, grammar);
  double chi = 0.0;
  int cells = 0;
  int64_t impossible = 0;
  for (int a = 0; a < kV; ++a) {
    const std::vector<double> p1 = target_probs(a, 0.95, grammar);
    for (int b = 0; b < kV; ++b) {
      const double e = draws * p0[a] * p1[b];
      const double n = static_cast<double>(counts[a * kV + b]);
      if (e == 0.0) {
        impossible += counts[a * kV + b];
        continue;
      }
      chi += (n - e) * (n - e) / e;
      ++cells;
    }
  }
  if (impossible > 0) return {std::numeric_limits<double>::infinity(), cells - 1};
  return {chi, cells - 1};
}

// The chi-square critical value at significance 0.001 (Wilson-Hilferty: z_0.999 = 3.0902).
double critical_001(int df) {
  const double a = 2.0 / (9.0 * df);
  return df * std::pow(1.0 - a + 3.0902 * std::sqrt(a), 3.0);
}

constexpr int kDraws = 40000;

TEST(SpecDistribution, PointMassDraftsMatchTheTarget) {
  const auto [chi, df] = chi_square(Drafts::point_mass, false, kDraws);
  EXPECT_GE(df, 3);
  std::printf("chi-square %.2f, %d degrees of freedom, critical value at 0.001: %.2f\n", chi, df, critical_001(df));
  EXPECT_LT(chi, critical_001(df)) << "df " << df;
}

TEST(SpecDistribution, FullQDraftsMatchTheTarget) {
  const auto [chi, df] = chi_square(Drafts::full_q, false, kDraws);
  EXPECT_GE(df, 3);
  std::printf("chi-square %.2f, %d degrees of freedom, critical value at 0.001: %.2f\n", chi, df, critical_001(df));
  EXPECT_LT(chi, critical_001(df)) << "df " << df;
}

// The negative control: accepting every draft (synthetic rate 1) is not the target's distribution, and the test sees it.
TEST(SpecDistribution, DraftsUnderAGrammarMatchTheMaskedTarget) {
  // Drafts outside the grammar are rejected for sure; every position samples from the grammar's mask.
  for (Drafts d : {Drafts::point_mass, Drafts::full_q}) {
    const auto [chi, df] = chi_square(d, false, kDraws, true);
    EXPECT_GE(df, 3);
    std::printf("grammar, %s drafts: chi-square %.2f, %d degrees of freedom, critical value at 0.001: %.2f\n",
                d == Drafts::point_mass ? "point-mass" : "full-q", chi, df, critical_001(df));
    EXPECT_LT(chi, critical_001(df)) << "df " << df;
  }
}

TEST(SpecDistribution, AcceptingEverythingFailsTheTest) {
  for (Drafts d : {Drafts::point_mass, Drafts::full_q}) {
    const auto [chi, df] = chi_square(d, true, kDraws);
    std::printf("accept-all chi-square %.2f, critical value at 0.001: %.2f\n", chi, critical_001(df));
    EXPECT_GT(chi, critical_001(df));
  }
}

// Greedy verification: the target's argmax at every position; drafts kept while they agree.
TEST(SpecVerify, GreedyKeepsTheAgreeingPrefix) {
  SamplingParams sp;
  sp.max_tokens = 10;
  const std::vector<int32_t> prompt = {0};
  std::vector<float> logits;
  std::vector<int32_t> argmax;
  for (int i = 0; i < 4; ++i) {
    const std::vector<float> l = target_logits(i);
    logits.insert(logits.end(), l.begin(), l.end());
    argmax.push_back(static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin()));
  }
  for (int wrong = 0; wrong <= 3; ++wrong) {
    std::vector<int32_t> d(argmax.begin(), argmax.begin() + 3);
    if (wrong < 3) d[wrong] = (d[wrong] + 1) % kV;
    Sampler s(sp, prompt);
    const VerifyResult r = verify_draft(s, logits.data(), kV, d, {}, true);
    EXPECT_EQ(r.accepted, wrong);
    ASSERT_EQ(r.tokens.size(), static_cast<size_t>(wrong + 1));
    for (int i = 0; i <= wrong; ++i) EXPECT_EQ(r.tokens[i], argmax[i]);
    ASSERT_EQ(r.logprobs.size(), r.tokens.size());
    TokenLogprob lp;
    token_logprob(logits.data() + wrong * kV, kV, argmax[wrong], 0, lp);
    EXPECT_EQ(r.logprobs.back().logprob, lp.logprob);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Drafter and config.

TEST(Ngram, LongestMatchLatestOccurrence) {
  std::vector<int32_t> out;
  NgramDrafter::lookup(std::vector<int32_t>{1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3}, 1, 3, 2, out);
  EXPECT_EQ(out, (std::vector<int32_t>{4, 5}));  // "1 2 3" last seen before "4 5"
  NgramDrafter::lookup(std::vector<int32_t>{7, 8, 7}, 1, 3, 5, out);
  EXPECT_EQ(out, (std::vector<int32_t>{8, 7}));  // "7" followed by "8 7"
  NgramDrafter::lookup(std::vector<int32_t>{1, 2, 3, 4}, 1, 3, 5, out);
  EXPECT_TRUE(out.empty());
  NgramDrafter::lookup(std::vector<int32_t>{5, 6, 1, 6}, 2, 3, 5, out);
  EXPECT_TRUE(out.empty());  // only 1-gram matches, below prompt_lookup_min
}

void expect_error(const std::string& json, const std::string& words) {
  try {
    parse_speculative_config(json);
    ADD_FAILURE() << "no error for " << json;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(SpecConfig, ParsesAndNamesTheFieldInErrors) {
  const SpeculativeConfig c = parse_speculative_config(
      R"({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2})");
  EXPECT_EQ(c.num_speculative_tokens, 4);
  EXPECT_EQ(c.prompt_lookup_min, 2);
  EXPECT_EQ(c.prompt_lookup_max, 3);
  EXPECT_EQ(parse_speculative_config(R"({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})")
                .prompt_lookup_min,
            3);
  const SpeculativeConfig s = parse_speculative_config(
      R"({"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
          "synthetic_acceptance_length": 2.5})");
  ASSERT_EQ(s.synthetic_acceptance_rates.size(), 3u);
  EXPECT_NEAR(1.0 + s.synthetic_acceptance_rates[0] + s.synthetic_acceptance_rates[1] + s.synthetic_acceptance_rates[2],
              2.5, 1e-9);

  expect_error("{method: ngram}", "not valid JSON");
  expect_error("[1, 2]", "must be a JSON object");
  expect_error(R"({"num_speculative_tokens": 3})", "'method' is missing");
  expect_error(R"({"method": "eagle", "num_speculative_tokens": 3})", "'method' 'eagle' is not one of");
  expect_error(R"({"method": "ngram", "num_speculative_tokens": 3, "foo": 1})", "unknown field 'foo'");
  expect_error(R"({"method": "ngram", "num_speculative_tokens": "3"})", "'num_speculative_tokens' must be an integer");
  expect_error(R"({"method": "ngram", "num_speculative_tokens": 2.5})", "'num_speculative_tokens' must be an integer");
  expect_error(R"({"method": 3, "num_speculative_tokens": 3})", "'method' must be a string");
  expect_error(R"({"method": "ngram", "num_speculative_tokens": 0})", "'num_speculative_tokens' must be in [1, 32]");
  expect_error(R"({"method": "ngram", "num_speculative_tokens": 33})", "'num_speculative_tokens' must be in [1, 32]");
  expect_error(R"({"method": "ngram"})", "'num_speculative_tokens' is missing");
  expect_error(R"({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2})",
               "'prompt_lookup_max' (2) must be >= 'prompt_lookup_min' (4)");
  expect_error(R"({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0})",
               "'prompt_lookup_min' must be >= 1");
  expect_error(R"({"method": "ngram", "num_speculative_tokens": 3, "draft_sample_method": "top"})",
               "'draft_sample_method' 'top'");
  expect_error(R"({"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "block"})",
               "'rejection_sample_method' 'block'");
  expect_error(R"({"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"})",
               "synthetic needs 'synthetic_acceptance_rate'");
  expect_error(R"({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
                   "synthetic_acceptance_rates": [0.5, 0.7]})",
               "'synthetic_acceptance_rates' must not increase");
  expect_error(R"({"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
                   "synthetic_acceptance_rates": [0.5]})",
               "'synthetic_acceptance_rates' has 1 entries");
  expect_error(R"({"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance_rate": 0.5})",
               "need 'rejection_sample_method' synthetic");
  expect_error(R"({"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
                   "synthetic_acceptance_rate": 1.5})",
               "'synthetic_acceptance_rate' 1.5 is not in [0, 1]");
}

// ---------------------------------------------------------------------------------------------------------------
// The mtp drafter: DeepSeek-V3.2's own MTP layer (make-model writes one for the tiny deepseek_v32 model).

const Model& tiny_mtp_model() {
  static const std::unique_ptr<Model> m = [] {
    LoadOptions lo;
    lo.load_mtp = true;
    return load_cpu_model(test::tiny_dir(Arch::deepseek_v32), {}, lo);
  }();
  return *m;
}

SpeculativeConfig mtp_config(int k = kK) {
  SpeculativeConfig c;
  c.method = "mtp";
  c.num_speculative_tokens = k;
  return c;
}

// What the MTP layer drafts for `tokens` computed from scratch: the target's hidden states of positions 0..L-2 in
// one prompt pass, the MTP layer over all of them in a fresh cache, then chained on its own drafts.
std::vector<int32_t> mtp_drafts_from_scratch(const Model& m, const std::vector<int32_t>& tokens, int k) {
  const int64_t V = m.config().vocab_size, D = m.config().hidden_size, T = static_cast<int64_t>(tokens.size()) - 1;
  SequenceState target = m.new_sequence();
  std::vector<float> logits(static_cast<size_t>(T * V)), hidden(static_cast<size_t>(T * D));
  m.forward(target, tokens.data(), T, logits.data(), false, 0, hidden.data());
  SequenceState mtp = m.new_mtp_sequence();
  std::vector<float> scale(static_cast<size_t>(T), 1.0f), out(static_cast<size_t>(T * D)), lg(static_cast<size_t>(V));
  scale[0] = 0.0f;
  m.mtp_forward(mtp, tokens.data() + 1, hidden.data(), scale.data(), T, lg.data(), out.data());
  std::vector<int32_t> drafts;
  std::vector<float> h(out.end() - D, out.end());
  for (int j = 0; j < k; ++j) {
    drafts.push_back(static_cast<int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin()));
    if (j + 1 == k) break;
    const float one = 1.0f;
    m.mtp_forward(mtp, &drafts.back(), h.data(), &one, 1, lg.data(), out.data());
    h.assign(out.begin(), out.begin() + D);
  }
  return drafts;
}

// A drafter of the engine's (MTP, DSpark) with every proposal recorded (the tokens it drafted after, and the
// drafts); with an oracle, the oracle's drafts are verified instead (rejections at every position in turn, full
// acceptances too), while the drafter still follows every kept position: its rollback is exercised at every depth.
class RecordingDrafter final : public Drafter {
 public:
  RecordingDrafter(std::unique_ptr<Drafter> inner, std::shared_ptr<Drafter> oracle = nullptr)
      : inner_(std::move(inner)), oracle_(std::move(oracle)) {}
  std::vector<int> hidden_layers() const override { return inner_->hidden_layers(); }
  void observe(const Sequence& s, int64_t start, int64_t n, const float* hidden) override {
    inner_->observe(s, start, n, hidden);
  }
  void release(const Sequence& s) override { inner_->release(s); }
  void propose(Sequence& s, int max_tokens, int64_t vocab, Draft& out) override {
    inner_->propose(s, max_tokens, vocab, out);
    if (!out.tokens.empty()) records.push_back({s.tokens, out.tokens});
    if (oracle_) oracle_->propose(s, max_tokens, vocab, out);
  }
  std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> records;

 private:
  std::unique_ptr<Drafter> inner_;
  std::shared_ptr<Drafter> oracle_;
};

// Greedy output with MTP drafts equals the output without speculation, over two rounds (prefix-cache hits: the MTP
// cache then starts at the first computed position), and the drafts are the MTP layer's (random weights: nearly
// every draft is rejected, at the first position or later).
TEST(SpecMtp, GreedyEqualsGreedyWithoutSpeculation) {
  const Model& m = tiny_mtp_model();
  EngineConfig cfg;
  cfg.max_model_len = 256;
  cfg.block_size = 16;
  cfg.max_num_batched_tokens = 256;
  const Outputs plain = run_rounds(m, cfg, 24, test_prompts(), 1.0f);
  EngineConfig sc = cfg;
  sc.speculative = mtp_config();
  const Outputs spec = run_rounds(m, sc, 24, test_prompts(), 1.0f);
  expect_same(spec, plain);
  EXPECT_GT(spec.stats.spec.num_drafts, 0);
  EXPECT_GT(spec.stats.spec.num_draft_tokens, spec.stats.spec.num_drafts);
  EXPECT_GT(spec.stats.prefix.hit_tokens, 0);
}

// The same under preemption (SpecPressure's pool): recomputed positions roll the MTP cache back.
TEST(SpecMtp, PreemptedRequestsFinishWithTheSameOutputs) {
  const Model& m = tiny_mtp_model();
  EngineConfig cfg;
  cfg.max_model_len = 256;
  cfg.block_size = 64;
  cfg.num_rows = static_cast<int32_t>(plan_cache(m.cache_specs(), {.block_size = 64}).rows_per_request(256) + 2);
  cfg.max_num_batched_tokens = 512;
  std::vector<std::vector<int32_t>> prompts;
  const std::vector<int> lengths = {60, 62, 120, 58, 126, 20};
  for (size_t i = 0; i < lengths.size(); ++i) prompts.push_back(random_prompt(lengths[i], 20 + static_cast<uint32_t>(i)));
  const Outputs plain = run_once(m, cfg, prompts, 30);
  EngineConfig sc = cfg;
  sc.speculative = mtp_config();
  const Outputs spec = run_once(m, sc, prompts, 30);
  EXPECT_GT(spec.stats.preemptions, 0);
  EXPECT_GT(spec.stats.spec.num_drafts, 0);
  expect_same(spec, plain);
}

// Without prefix caching the MTP cache always starts at position 0, so each proposal must be what the MTP layer
// drafts from scratch for the same tokens: the incremental cache (one position behind the target, chained positions
// overwritten, rollback after rejections and preemption) changes no draft. Drafts of the real MTP layer are also
// verified: greedy output unchanged.
TEST(SpecMtpDrafts, IncrementalDraftsEqualDraftsFromScratch) {
  const Model& m = tiny_mtp_model();
  EngineConfig cfg;
  cfg.max_model_len = 128;
  cfg.block_size = 16;
  cfg.enable_prefix_caching = false;
  cfg.max_num_batched_tokens = 64;
  cfg.num_rows = static_cast<int32_t>(plan_cache(m.cache_specs(), {.block_size = 16}).rows_per_request(128) + 1);
  std::vector<std::vector<int32_t>> prompts;
  for (uint32_t i = 0; i < 4; ++i) prompts.push_back(random_prompt(20 + 17 * static_cast<int>(i), 70 + i));
  const Outputs plain = run_once(m, cfg, prompts, 16);
  for (const bool oracle : {false, true}) {
    EngineConfig sc = cfg;
    sc.speculative = mtp_config();
    auto rec = std::make_shared<RecordingDrafter>(std::make_unique<MtpDrafter>(m, *sc.speculative),
                                                  oracle ? drafter_for(DrafterKind::oracle, plain) : nullptr);
    sc.drafter = rec;
    const Outputs spec = run_once(m, sc, prompts, 16);
    expect_same(spec, plain);
    EXPECT_GT(spec.stats.preemptions, 0);
    if (oracle) expect_spec_counters(spec.stats, DrafterKind::oracle);  // accepted at every position, rejected too
    ASSERT_GT(rec->records.size(), 20u);
    for (const auto& [tokens, drafts] : rec->records)
      EXPECT_EQ(drafts, mtp_drafts_from_scratch(m, tokens, static_cast<int>(drafts.size())))
          << "after " << tokens.size() << " tokens";
  }
}

TEST(SpecMtpDrafts, ModelsWithoutAnMtpLayerAndBadConfigsAreErrors) {
  auto expect_error = [](const std::function<void()>& f, const std::string& words) {
    try {
      f();
      ADD_FAILURE() << "no error; expected: " << words;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  EngineConfig cfg;
  cfg.max_model_len = 256;
  cfg.speculative = mtp_config();
  // kimi_k3 checkpoints have no MTP layer: loading it is refused, as is an engine over a model loaded without it.
  LoadOptions lo;
  lo.load_mtp = true;
  expect_error([&] { load_cpu_model(test::tiny_dir(Arch::kimi_k3), {}, lo); },
               "config.json's num_nextn_predict_layers is 0 (kimi_k3 checkpoints define none)");
  expect_error([&] { Engine e(tiny_model(Arch::kimi_k3), cfg); }, "num_nextn_predict_layers is 0");
  expect_error([&] { Engine e(tiny_model(Arch::deepseek_v32), cfg); }, "loaded without its MTP layer");
  EngineConfig c2 = cfg;
  c2.speculative->model = "elsewhere";
  expect_error([&] { Engine e(tiny_mtp_model(), c2); }, "'model' is not used by method 'mtp'");
}

// Seeded sampled requests with probabilistic MTP drafts repeat exactly (drafts drawn from each request's stream).
TEST(SpecMtpDrafts, ProbabilisticDraftsRepeatWithASeed) {
  const Model& m = tiny_mtp_model();
  EngineConfig cfg;
  cfg.max_model_len = 256;
  cfg.speculative = mtp_config();
  cfg.speculative->draft_sample_method = "probabilistic";
  auto run = [&] {
    Engine e(m, cfg);
    for (uint32_t i = 0; i < 3; ++i) {
      SamplingParams p;
      p.temperature = 1.0f;
      p.top_p = 0.95f;
      p.seed = 3 + i;
      p.max_tokens = 20;
      e.add_request(random_prompt(30, 60 + i), p);
    }
    std::vector<std::vector<int32_t>> out;
    for (const RequestOutput& r : run_checked(e)) out.push_back(r.completions.at(0).token_ids);
    return std::make_pair(out, e.stats().spec);
  };
  const auto [a, sa] = run();
  const auto [b, sb] = run();
  EXPECT_EQ(a, b);
  EXPECT_GT(sa.num_drafts, 0);
  EXPECT_EQ(sa.num_accepted_tokens, sb.num_accepted_tokens);
}

// ---------------------------------------------------------------------------------------------------------------
// The dspark drafter: a make-model DSpark drafter over each tiny model's last layers.

std::string tiny_dspark_dir(Arch arch) {
  static test::TempDirs made;
  static std::map<Arch, std::string> dirs;
  auto& d = dirs[arch];
  if (d.empty()) {
    d = std::filesystem::temp_directory_path() /
        ("kestrel_dspark_test_" + std::string(arch_name(arch)) + "_" + std::to_string(::getpid()));
    write_dspark_drafter(d, test::tiny_dir(arch), 11, 4);
    made.dirs.push_back(d);
  }
  return d;
}

SpeculativeConfig dspark_config(Arch arch, const std::string& sample = "greedy", int k = kK) {
  SpeculativeConfig c;
  c.method = "dspark";
  c.model = tiny_dspark_dir(arch);
  c.num_speculative_tokens = k;
  c.draft_sample_method = sample;
  return c;
}

class SpecDspark : public ::testing::TestWithParam<std::tuple<Arch, bool>> {};

// Greedy output with DSpark drafts (greedy and probabilistic draft sampling) equals the output without speculation,
// over two rounds (prefix-cache hits) and under preemption (SpecPressure's pool).
TEST_P(SpecDspark, GreedyEqualsGreedyWithoutSpeculation) {
  const auto [arch, chunked] = GetParam();
  ModelOptions o;
  o.kda_chunked_prefill = chunked;
  const Model& m = tiny_model(arch, o);
  EngineConfig cfg;
  cfg.max_model_len = 256;
  cfg.block_size = chunked ? 64 : 16;
  cfg.max_num_batched_tokens = 256;
  const Outputs plain = run_rounds(m, cfg, 24, test_prompts(), 1.0f);
  for (const char* sample : {"greedy", "probabilistic"}) {
    EngineConfig sc = cfg;
    sc.speculative = dspark_config(arch, sample);
    const Outputs spec = run_rounds(m, sc, 24, test_prompts(), 1.0f);
    expect_same(spec, plain);
    EXPECT_GT(spec.stats.spec.num_drafts, 0) << sample;
    EXPECT_GT(spec.stats.spec.num_draft_tokens, spec.stats.spec.num_drafts) << sample;  // blocks of several drafts
    EXPECT_GT(spec.stats.prefix.hit_tokens, 0);
  }
}

TEST_P(SpecDspark, PreemptedRequestsFinishWithTheSameOutputs) {
  const auto [arch, chunked] = GetParam();
  ModelOptions o;
  o.kda_chunked_prefill = chunked;
  const Model& m = tiny_model(arch, o);
  EngineConfig cfg;
  cfg.max_model_len = 256;
  cfg.block_size = 64;
  cfg.num_rows = static_cast<int32_t>(plan_cache(m.cache_specs(), {.block_size = 64}).rows_per_request(256) + 2);
  cfg.max_num_batched_tokens = 512;
  std::vector<std::vector<int32_t>> prompts;
  const std::vector<int> lengths = {60, 62, 120, 58, 126, 20};
  for (size_t i = 0; i < lengths.size(); ++i) prompts.push_back(random_prompt(lengths[i], 20 + static_cast<uint32_t>(i)));
  const Outputs plain = run_once(m, cfg, prompts, 30);
  EngineConfig sc = cfg;
  sc.speculative = dspark_config(arch);
  const Outputs spec = run_once(m, sc, prompts, 30);
  EXPECT_GT(spec.stats.preemptions, 0);
  EXPECT_GT(spec.stats.spec.num_drafts, 0);
  expect_same(spec, plain);
}

INSTANTIATE_TEST_SUITE_P(Tiny, SpecDspark,
                         ::testing::Combine(::testing::Values(Arch::kimi_k3, Arch::kimi_linear, Arch::deepseek_v32),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(arch_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_chunked" : "_recurrent");
                         });

// Seeded sampled requests with probabilistic DSpark drafts repeat exactly (the drafts draw from each request's own
// stream), and speculation accepted some of them.
TEST(SpecDsparkSampling, SeededRunsRepeat) {
  const Model& m = tiny_model(Arch::kimi_k3);
  EngineConfig cfg;
  cfg.max_model_len = 256;
  cfg.speculative = dspark_config(Arch::kimi_k3, "probabilistic");
  auto run = [&] {
    Engine e(m, cfg);
    for (uint32_t i = 0; i < 3; ++i) {
      SamplingParams p;
      p.temperature = 1.0f;
      p.top_p = 0.95f;
      p.seed = 7 + i;
      p.max_tokens = 20;
      e.add_request(random_prompt(30, 80 + i), p);
    }
    std::vector<std::vector<int32_t>> out;
    for (const RequestOutput& r : run_checked(e)) out.push_back(r.completions.at(0).token_ids);
    return std::make_pair(out, e.stats().spec);
  };
  const auto [a, sa] = run();
  const auto [b, sb] = run();
  EXPECT_EQ(a, b);
  EXPECT_GT(sa.num_drafts, 0);
  EXPECT_EQ(sa.num_accepted_tokens, sb.num_accepted_tokens);
}

// The output distribution with probabilistic DSpark drafts: a drafter of the 6-token vocabulary, its blocks drawn
// by dspark_draft (Markov head, q at temperature 1 and top-p 0.95, the request's stream), verified against the fixed
// target table: the first two tokens' joint distribution passes the chi-square test.
TEST(SpecDistribution, DsparkProbabilisticDraftsMatchTheTarget) {
  DsparkConfig c;
  c.vocab_size = kV;
  c.hidden_size = 8;
  c.intermediate_size = 16;
  c.num_attention_heads = 2;
  c.head_dim = 4;
  c.block_size = 3;
  c.markov_rank = 4;
  c.target_layer_ids = {0};
  c.noise_token_id = kV - 1;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto f32 = [&](int64_t rows, int64_t cols) {
    TensorData t{DType::F32, {rows, cols}, std::vector<uint8_t>(static_cast<size_t>(rows * cols * 4))};
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float x = nd(rng);
      std::memcpy(t.bytes.data() + 4 * i, &x, 4);
    }
    return t;
  };
  const std::string dir = std::filesystem::temp_directory_path() / ("kestrel_dspark_v6_" + std::to_string(::getpid()));
  write_dspark_drafter(dir, c, f32(kV, 8), f32(kV, 8), 3);
  const std::unique_ptr<DsparkModel> m = DsparkModel::load(dir);
  std::filesystem::remove_all(dir);
  std::vector<float> hidden(8);
  for (float& x : hidden) x = nd(rng);
  std::vector<std::vector<float>> k, v;
  m->context(hidden.data(), 1, 0, k, v);
  auto two_tokens = [&](uint64_t seed) {
    SamplingParams sp;
    sp.temperature = 1.0f;
    sp.top_p = 0.95f;
    sp.seed = seed;
    sp.max_tokens = 100;
    const std::vector<int32_t> prompt = {0};
    Sampler sampler(sp, prompt);
    std::vector<int32_t> out;
    int32_t prev = 0;
    std::vector<float> base(static_cast<size_t>(3 * kV));
    Draft d;
    while (out.size() < 2) {
      const std::vector<int32_t> ids = {prev, kV - 1, kV - 1};
      m->block_logits(ids.data(), 1 + static_cast<int64_t>(out.size()), k, v, 1, base.data());
      dspark_draft(*m, base.data(), kV, prev, 3, true, sp, sampler, d);
      EXPECT_EQ(d.probs.size(), static_cast<size_t>(3 * kV));
      std::vector<float> logits;
      int ctx = prev;
      for (int i = 0; i <= 3; ++i) {
        const std::vector<float> l = target_logits(ctx);
        logits.insert(logits.end(), l.begin(), l.end());
        if (i < 3) ctx = d.tokens[i];
      }
      const VerifyResult r = verify_draft(sampler, logits.data(), kV, d.tokens, d.probs, false);
      out.insert(out.end(), r.tokens.begin(), r.tokens.end());
      prev = out.back();
    }
    return std::make_pair(out[0], out[1]);
  };
  std::vector<int64_t> counts(kV * kV, 0);
  for (int i = 0; i < kDraws; ++i) {
    const auto [a, b] = two_tokens(5000 + static_cast<uint64_t>(i));
    ++counts[a * kV + b];
  }
  const std::vector<double> p0 = target_probs(0, 0.95);
  double chi = 0.0;
  int cells = 0;
  for (int a = 0; a < kV; ++a) {
    const std::vector<double> p1 = target_probs(a, 0.95);
    for (int b = 0; b < kV; ++b) {
      const double e = kDraws * p0[a] * p1[b];
      const double n = static_cast<double>(counts[a * kV + b]);
      if (e == 0.0) {
        EXPECT_EQ(n, 0.0) << "a token outside the target's top-p set: " << a << " " << b;
        continue;
      }
      chi += (n - e) * (n - e) / e;
      ++cells;
    }
  }
  std::printf("DSpark chi-square %.2f, %d degrees of freedom, critical value at 0.001: %.2f\n", chi, cells - 1,
              critical_001(cells - 1));
  EXPECT_GE(cells - 1, 3);
  EXPECT_LT(chi, critical_001(cells - 1));
}

// What the DSpark drafter drafts (greedy) for `tokens` from scratch: the target's hidden states of the drafter's
// layers for positions 0..L-2 in one pass, the whole context, one block.
std::vector<int32_t> dspark_drafts_from_scratch(const Model& m, const DsparkModel& d, const std::vector<int32_t>& tokens,
                                                int k) {
  const DsparkConfig& c = d.config();
  const int64_t V = m.config().vocab_size, D = m.config().hidden_size, T = static_cast<int64_t>(tokens.size()) - 1;
  const int64_t nL = static_cast<int64_t>(c.target_layer_ids.size());
  SequenceState target = m.new_sequence();
  std::vector<float> logits(static_cast<size_t>(T * V)), hidden(static_cast<size_t>(T * nL * D));
  m.forward(target, tokens.data(), T, logits.data(), false, 0, hidden.data(), c.target_layer_ids);
  std::vector<std::vector<float>> kc, vc;
  d.context(hidden.data(), T, 0, kc, vc);
  std::vector<int32_t> ids(static_cast<size_t>(c.block_size), c.noise_token_id);
  ids[0] = tokens.back();
  std::vector<float> base(static_cast<size_t>(c.block_size * V));
  d.block_logits(ids.data(), T, kc, vc, T, base.data());
  SamplingParams p;
  Sampler unused(p, tokens);
  Draft out;
  dspark_draft(d, base.data(), V, tokens.back(), k, false, p, unused, out);
  return out.tokens;
}

// Without prefix caching (and with KDA's recurrence everywhere, so that any split of a sequence gives the same
// hidden states), each DSpark proposal is what the drafter drafts from scratch for the same tokens: its context
// cache (extended by every step's kept positions, rolled back after rejections at every depth and after preemption)
// changes no draft.
class SpecDsparkDrafts : public ::testing::TestWithParam<Arch> {};

TEST_P(SpecDsparkDrafts, IncrementalDraftsEqualDraftsFromScratch) {
  const Arch arch = GetParam();
  ModelOptions o;  // not chunked KDA prefill: a one-pass recomputation would give other bits
  o.kda_chunked_prefill = false;
  const Model& m = tiny_model(arch, o);
  const std::unique_ptr<DsparkModel> d = DsparkModel::load(tiny_dspark_dir(arch));
  std::vector<std::vector<int32_t>> prompts;
  for (uint32_t i = 0; i < 4; ++i) prompts.push_back(random_prompt(20 + 17 * static_cast<int>(i), 70 + i));
  const CachePlan plan = plan_cache(m.cache_specs(), {.block_size = 16});
  // A pool with room for the KDA state slots of full blocks of drafts (acceptance at every depth), and one too
  // small for every sequence at once (preemption; drafts cut where slots are missing).
  for (const bool tight : {false, true}) {
    EngineConfig cfg;
    cfg.max_model_len = 128;
    cfg.block_size = 16;
    cfg.enable_prefix_caching = false;
    cfg.max_num_batched_tokens = 64;
    cfg.num_rows = static_cast<int32_t>(plan.rows_per_request(128) +
                                        (tight ? 1 : 4 * kK * plan.state_rows_per_request + 4));
    const Outputs plain = run_once(m, cfg, prompts, 16);
    EngineConfig sc = cfg;
    sc.speculative = dspark_config(arch);
    auto rec = std::make_shared<RecordingDrafter>(std::make_unique<DsparkDrafter>(m, *sc.speculative),
                                                  drafter_for(DrafterKind::oracle, plain));
    sc.drafter = rec;
    const Outputs spec = run_once(m, sc, prompts, 16);
    expect_same(spec, plain);
    if (tight) EXPECT_GT(spec.stats.preemptions, 0);
    else expect_spec_counters(spec.stats, DrafterKind::oracle);
    ASSERT_GT(rec->records.size(), 20u);
    for (const auto& [tokens, drafts] : rec->records)
      EXPECT_EQ(drafts, dspark_drafts_from_scratch(m, *d, tokens, static_cast<int>(drafts.size())))
          << "after " << tokens.size() << " tokens" << (tight ? " (tight pool)" : "");
  }
}

INSTANTIATE_TEST_SUITE_P(Tiny, SpecDsparkDrafts, ::testing::Values(Arch::kimi_k3, Arch::kimi_linear, Arch::deepseek_v32),
                         [](const auto& info) { return std::string(arch_name(info.param)); });

TEST(SpecDsparkConfig, MismatchedDraftersAndBadConfigsAreErrorsNamingTheField) {
  auto expect_error = [](const std::function<void()>& f, const std::string& words) {
    try {
      f();
      ADD_FAILURE() << "no error; expected: " << words;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  EngineConfig cfg;
  cfg.max_model_len = 256;
  // A drafter made for kimi_k3's 6 layers (it reads layers 3..5) on deepseek_v32's 3.
  cfg.speculative = dspark_config(Arch::kimi_k3);
  expect_error([&] { Engine e(tiny_model(Arch::deepseek_v32), cfg); }, "'dspark_target_layer_ids' names layer 3");
  // A vocabulary that is not the target's.
  const std::string dir = std::filesystem::temp_directory_path() / ("kestrel_dspark_bad_" + std::to_string(::getpid()));
  std::filesystem::copy(tiny_dspark_dir(Arch::kimi_k3), dir, std::filesystem::copy_options::recursive);
  auto edit = [&](const std::function<void(nlohmann::json&)>& f) {
    nlohmann::json j = nlohmann::json::parse(std::ifstream(tiny_dspark_dir(Arch::kimi_k3) + "/config.json"));
    f(j);
    std::ofstream(dir + "/config.json") << j.dump();
  };
  cfg.speculative->model = dir;
  edit([](nlohmann::json& j) {
    j["vocab_size"] = 4000;
    j["dspark_noise_token_id"] = 0;
  });
  expect_error([&] { Engine e(tiny_model(Arch::kimi_k3), cfg); }, "'vocab_size' 4000 does not match the target's vocabulary of 4096");
  edit([](nlohmann::json& j) { j.erase("dspark_markov_rank"); });
  expect_error([&] { Engine e(tiny_model(Arch::kimi_k3), cfg); }, "missing field 'dspark_markov_rank'");
  edit([](nlohmann::json& j) { j["model_type"] = "kimi_k3"; });
  expect_error([&] { Engine e(tiny_model(Arch::kimi_k3), cfg); }, "field 'model_type' must be \"dspark\"");
  edit([](nlohmann::json& j) { j["dspark_noise_token_id"] = 5000; });
  expect_error([&] { Engine e(tiny_model(Arch::kimi_k3), cfg); }, "'dspark_noise_token_id' 5000 is outside the vocabulary");
  std::filesystem::remove_all(dir);
  cfg.speculative = dspark_config(Arch::kimi_k3, "greedy", 5);
  expect_error([&] { Engine e(tiny_model(Arch::kimi_k3), cfg); },
               "'num_speculative_tokens' 5 is beyond the DSpark drafter's dspark_block_size 4");
  cfg.speculative = dspark_config(Arch::kimi_k3);
  cfg.speculative->model = "";
  expect_error([&] { Engine e(tiny_model(Arch::kimi_k3), cfg); }, "method 'dspark' needs 'model'");
  cfg.speculative->model = "/nonexistent/drafter";
  expect_error([&] { Engine e(tiny_model(Arch::kimi_k3), cfg); }, "cannot open /nonexistent/drafter/config.json");
}

}  // namespace
}  // namespace kestrel
