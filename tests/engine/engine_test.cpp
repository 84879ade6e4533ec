// The engine against the plain forward pass: a batch of mixed-length requests with chunked prefill (a step budget
// smaller than the prompts) gives every request the logits and tokens it gets alone, bit for bit, in every cache
// format and KDA prefill mode; steps respect the budget; generate-style bookkeeping (keep_logits, finish reasons).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

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

struct Case {
  Arch arch;
  LatentCacheDtype latent;
  IndexKeyDtype keys;
  bool chunked;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(arch_name(c.arch)) + "_" + latent_cache_dtype_name(c.latent) +
         (c.keys == IndexKeyDtype::mxfp4 ? "_mxfp4" : "") + (c.chunked ? "" : "_recurrent");
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_name(::testing::TestParamInfo<Case>(c, 0)); }

class BatchEqualsAlone : public ::testing::TestWithParam<Case> {};

TEST_P(BatchEqualsAlone, MixedLengthsWithChunkedPrefill) {
  const Case& c = GetParam();
  ModelOptions opts;
  opts.latent_cache = c.latent;
  opts.index_keys = c.keys;
  opts.kda_chunked_prefill = c.chunked;
  const Model& m = tiny_model(c.arch, opts);
  // Lengths: one token, below a block, across chunk boundaries, a multiple of the chunk, and longer than the budget.
  const std::vector<int> lengths = {1, 23, 64, 97, 150, 200};
  const int max_tokens = 5;
  EngineConfig cfg;
  cfg.num_rows = 64;
  cfg.max_model_len = 512;
  cfg.max_num_batched_tokens = 96;
  Engine e(m, cfg);
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < lengths.size(); ++i) {
    prompts.push_back(random_prompt(lengths[i], 100 + static_cast<uint32_t>(i)));
    e.add_request(prompts.back(), greedy(max_tokens), 0, /*keep_logits=*/true);
  }
  int steps = 0;
  const std::vector<RequestOutput> out = run_checked(e, &steps);
  ASSERT_EQ(out.size(), prompts.size());
  EXPECT_GE(steps, (23 + 64 + 97 + 150 + 200 + 1) / 96);  // the budget really cut the prompts
  for (size_t i = 0; i < prompts.size(); ++i) {
    const test::Generation ref = generate_alone(m, prompts[i], max_tokens);
    const Completion& got = out[i].completions.at(0);
    EXPECT_EQ(got.token_ids, ref.tokens) << "prompt " << i;
    EXPECT_EQ(got.finish, FinishReason::length);
    EXPECT_TRUE(same_bits(got.logits, ref.logits)) << "prompt " << i << " of " << lengths[i] << " tokens";
  }
  EXPECT_EQ(e.cache().pool().num_referenced(), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Tiny, BatchEqualsAlone,
    ::testing::Values(Case{Arch::kimi_k3, LatentCacheDtype::auto_fp32, IndexKeyDtype::fp8, true},
                      Case{Arch::kimi_k3, LatentCacheDtype::fp8, IndexKeyDtype::fp8, true},
                      Case{Arch::kimi_k3, LatentCacheDtype::nvfp4, IndexKeyDtype::mxfp4, true},
                      Case{Arch::kimi_k3, LatentCacheDtype::auto_fp32, IndexKeyDtype::fp8, false},
                      Case{Arch::kimi_linear, LatentCacheDtype::auto_fp32, IndexKeyDtype::fp8, true},
                      Case{Arch::deepseek_v32, LatentCacheDtype::auto_fp32, IndexKeyDtype::fp8, true},
                      Case{Arch::deepseek_v32, LatentCacheDtype::fp8, IndexKeyDtype::mxfp4, true},
                      Case{Arch::deepseek_v32, LatentCacheDtype::bf16, IndexKeyDtype::fp8, true}),
    case_name);

TEST(Engine, StepsStayWithinTheBudgetAndCutPromptsAtChunkMultiples) {
  const Model& m = tiny_model(Arch::kimi_k3);
  ASSERT_EQ(m.prefill_alignment(), 64);
  EngineConfig cfg;
  cfg.num_rows = 64;
  cfg.max_model_len = 512;
  cfg.max_num_batched_tokens = 100;
  Engine e(m, cfg);
  e.add_request(random_prompt(150, 1), greedy(3));
  e.add_request(random_prompt(30, 2), greedy(3));
  // Step 1: 64 of the first prompt (100 rounded down to the chunk); the second prompt's 30 tokens would need the
  // first's remaining 36 budget tokens and fit: 94. Step 2: the first prompt's last 86 tokens, the second decodes.
  StepOutput s1 = e.step();
  EXPECT_EQ(s1.num_tokens, 64 + 30);
  StepOutput s2 = e.step();
  EXPECT_EQ(s2.num_tokens, 86 + 1);
  while (e.has_unfinished()) EXPECT_LE(e.step().num_tokens, 100);
}

TEST(Engine, BudgetBelowTheChunkIsRejected) {
  EngineConfig cfg;
  cfg.num_rows = 16;
  cfg.max_model_len = 256;
  cfg.max_num_batched_tokens = 32;
  EXPECT_THROW(Engine(tiny_model(Arch::kimi_k3), cfg), Error);
  cfg.max_num_batched_tokens = 32;
  Engine ds(tiny_model(Arch::deepseek_v32), cfg);  // no KDA: prompts may be cut anywhere
  EXPECT_EQ(ds.cache_plan().block_size, 16);
}

TEST(Engine, StopTokenAndEosEndACompletion) {
  const Model& m = tiny_model(Arch::kimi_linear);
  const auto prompt = random_prompt(12, 9);
  const test::Generation ref = generate_alone(m, prompt, 6);
  EngineConfig cfg;
  cfg.num_rows = 16;
  cfg.max_model_len = 256;
  Engine e(m, cfg);
  SamplingParams stop = greedy(6);
  stop.stop_token_ids = {ref.tokens[2]};
  e.add_request(prompt, stop);
  SamplingParams eos = greedy(6);
  eos.ignore_eos = false;
  e.add_request({static_cast<int32_t>(m.config().eos_token_id)}, eos);
  const auto out = run_checked(e);
  const auto first_stop = std::find(ref.tokens.begin(), ref.tokens.end(), ref.tokens[2]);
  EXPECT_EQ(out[0].completions[0].token_ids, std::vector<int32_t>(ref.tokens.begin(), first_stop + 1));
  EXPECT_EQ(out[0].completions[0].finish, FinishReason::stop);
  const auto& c = out[1].completions[0];
  const bool stopped_at_eos = !c.token_ids.empty() && c.token_ids.back() == m.config().eos_token_id;
  EXPECT_EQ(c.finish, stopped_at_eos ? FinishReason::stop : FinishReason::length);
  if (!stopped_at_eos) {
    EXPECT_EQ(c.token_ids.size(), 6u);
  }
}

TEST(Engine, RequestsThatCanNeverRunAreRejected) {
  const Model& m = tiny_model(Arch::kimi_k3);
  EngineConfig cfg;
  cfg.num_rows = 6;  // 1 state row + 5 token rows of 64: 320 tokens
  cfg.max_model_len = 256;
  Engine e(m, cfg);
  try {
    e.add_request(random_prompt(250, 3), greedy(10));
    FAIL() << "expected a rejection";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("max_model_len 256"), std::string::npos) << err.what();
  }
  EXPECT_THROW(e.add_request({}, greedy(1)), Error);
  EXPECT_THROW(e.add_request({static_cast<int32_t>(m.config().vocab_size)}, greedy(1)), Error);  // no such token
  SamplingParams bad = greedy(1);
  bad.top_p = 0.0f;
  EXPECT_THROW(e.add_request({1}, bad), Error);
  EXPECT_FALSE(e.has_unfinished());
  // The cache is checked against an explicit max_model_len at start-up, naming what would fit.
  cfg.max_model_len = 512;
  try {
    Engine too_small(m, cfg);
    FAIL() << "expected a start-up error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("at most 320"), std::string::npos) << err.what();
  }
  // Without one, max_model_len is what the cache holds.
  cfg.max_model_len = 0;
  EXPECT_EQ(Engine(m, cfg).max_model_len(), 320);
}

// A model with no attention layer (the tiny kimi_linear model cut after its two KDA layers; the checkpoint's later
// layers are skipped as extra layers) keeps no token rows: its tokens have no slots, and the engine still gives every
// request what it gets alone.
TEST(Engine, ModelWithoutAttentionLayers) {
  namespace fs = std::filesystem;
  const std::string src = test::tiny_dir(Arch::kimi_linear);
  const std::string dir = src + "_kda_only";
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(src))
    if (e.path().filename() != "config.json")
      fs::copy_file(e.path(), dir / e.path().filename(), fs::copy_options::overwrite_existing);
  std::ifstream in(src + "/config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  j["num_hidden_layers"] = 2;
  j["linear_attn_config"]["full_attn_layers"] = nlohmann::json::array();
  j["linear_attn_config"]["kda_layers"] = {1, 2};
  std::ofstream(dir + "/config.json") << j.dump(2);
  const auto m = load_cpu_model(dir);
  fs::remove_all(dir);
  ASSERT_EQ(m->config().num_layers_of(LayerKind::mla), 0);

  EngineConfig cfg;
  cfg.max_num_batched_tokens = 128;
  Engine e(*m, cfg);
  EXPECT_EQ(e.cache_plan().num_token_layers, 0);
  const std::vector<std::vector<int32_t>> prompts = {random_prompt(150, 1), random_prompt(5, 2)};
  for (const auto& p : prompts) e.add_request(p, greedy(6), 0, /*keep_logits=*/true);
  const std::vector<RequestOutput> out = run_checked(e);
  ASSERT_EQ(out.size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    const test::Generation ref = generate_alone(*m, prompts[i], 6);
    EXPECT_EQ(out[i].completions.at(0).token_ids, ref.tokens) << "request " << i;
    EXPECT_TRUE(same_bits(out[i].completions.at(0).logits, ref.logits)) << "request " << i;
  }
}

}  // namespace
}  // namespace kestrel
