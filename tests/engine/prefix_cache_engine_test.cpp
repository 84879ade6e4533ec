// Prefix caching through the engine: a request served from a hit (the whole prompt, the middle of a prompt, the
// second turn of a conversation) gives the logits of the same request from scratch, bit for bit; hits are one
// block (64 tokens) fine; a hit whose KDA checkpoint is missing resumes at the earlier checkpoint; counters.
#include <gtest/gtest.h>

#include "tiny_models.h"

namespace kestrel {
namespace {

using test::generate_alone;
using test::greedy;
using test::random_prompt;
using test::run_checked;
using test::same_bits;
using test::tiny_model;

EngineConfig small_engine() {
  EngineConfig cfg;
  cfg.num_rows = 96;
  cfg.max_model_len = 512;
  cfg.max_num_batched_tokens = 128;
  return cfg;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Runs one request to the end and returns its only completion.
Completion run_one(Engine& e, const std::vector<int32_t>& prompt, int max_tokens) {
  e.add_request(prompt, greedy(max_tokens), 0, /*keep_logits=*/true);
  auto out = run_checked(e);
  return out.at(0).completions.at(0);
}

// The positions a hit skipped have no logits; every position computed must match the request from scratch.
void expect_from_scratch(const Model& m, const std::vector<int32_t>& prompt, const Completion& got, int max_tokens) {
  const test::Generation ref = generate_alone(m, prompt, max_tokens);
  EXPECT_EQ(got.token_ids, ref.tokens);
  const int64_t V = m.config().vocab_size;
  ASSERT_LT(got.logits_first, static_cast<int64_t>(prompt.size()));
  const std::vector<float> tail(ref.logits.begin() + got.logits_first * V, ref.logits.end());
  EXPECT_TRUE(same_bits(got.logits, tail)) << "logits from position " << got.logits_first;
}

class PrefixHit : public ::testing::TestWithParam<bool> {
 protected:
  const Model& model() {
    ModelOptions o;
    o.kda_chunked_prefill = GetParam();
    return tiny_model(Arch::kimi_k3, o);
  }
};

TEST_P(PrefixHit, WholePromptHit) {
  const Model& m = model();
  Engine e(m, small_engine());
  // One block is the hit granularity: 64 tokens with chunked KDA (its chunk), 16 with the recurrence.
  const int64_t B = e.cache_plan().block_size;
  EXPECT_EQ(B, GetParam() ? 64 : 16);
  const auto prompt = random_prompt(200, 1);
  run_one(e, prompt, 4);
  const PrefixCacheCounters before = e.stats().prefix;
  const Completion again = run_one(e, prompt, 4);
  // At most prompt - 1 tokens come from the cache (the last one is computed to get logits): 192 either way.
  EXPECT_EQ(e.stats().prefix.hit_tokens - before.hit_tokens, 192);
  EXPECT_EQ(again.logits_first, 192);
  EXPECT_EQ(e.stats().prefix.checkpoints_used - before.checkpoints_used, 1);
  expect_from_scratch(m, prompt, again, 4);
}

TEST_P(PrefixHit, HitInTheMiddleOfAPrompt) {
  const Model& m = model();
  Engine e(m, small_engine());
  const auto base = random_prompt(150, 2);
  run_one(e, base, 2);
  // Shares 100 tokens with the first prompt: the hit ends at the last block boundary before them (64 or 96).
  const auto prompt = concat(std::vector<int32_t>(base.begin(), base.begin() + 100), random_prompt(90, 3));
  const int64_t hit0 = e.stats().prefix.hit_tokens;
  const Completion got = run_one(e, prompt, 4);
  const int64_t B = e.cache_plan().block_size;
  EXPECT_EQ(e.stats().prefix.hit_tokens - hit0, 100 / B * B);
  expect_from_scratch(m, prompt, got, 4);
}

TEST_P(PrefixHit, SecondTurnOfAConversation) {
  const Model& m = model();
  Engine e(m, small_engine());
  const auto turn1 = random_prompt(100, 4);
  const Completion reply = run_one(e, turn1, 100);  // 200 tokens: three full blocks at the end of the turn
  const auto turn2 = concat(concat(turn1, reply.token_ids), random_prompt(30, 5));
  const int64_t hit0 = e.stats().prefix.hit_tokens;
  const Completion got = run_one(e, turn2, 4);
  // Token by token KDA (the exact mode): the blocks the reply completed are reused too, with the checkpoint taken
  // when its last full block was done. Chunked prefill: blocks holding generated tokens were computed by the
  // recurrence, not as a prefill of the same tokens would, so only the first turn's prompt blocks are reused.
  EXPECT_EQ(e.stats().prefix.hit_tokens - hit0, GetParam() ? 64 : 192);
  expect_from_scratch(m, turn2, got, 4);
}

INSTANTIATE_TEST_SUITE_P(Kda, PrefixHit, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "chunked" : "recurrent"; });

TEST(PrefixCacheEngine, MissingCheckpointResumesAtTheEarlierOne) {
  const Model& m = tiny_model(Arch::kimi_k3);
  EngineConfig cfg = small_engine();
  cfg.checkpoint_interval = 2;  // checkpoints at 128, 256, ...: none at 64 or 192
  Engine e(m, cfg);
  const auto prompt = random_prompt(200, 6);
  run_one(e, prompt, 2);
  EXPECT_EQ(e.cache().prefix_cache().num_cached_blocks(), 3);
  EXPECT_EQ(e.cache().prefix_cache().num_checkpoints(), 1);
  const auto longer = concat(prompt, random_prompt(20, 7));
  const int64_t hit0 = e.stats().prefix.hit_tokens;
  const Completion got = run_one(e, longer, 3);
  // Token rows cover 192 tokens, but the deepest checkpoint ends at 128: resuming at 192 would start KDA from the
  // wrong state.
  EXPECT_EQ(e.stats().prefix.hit_tokens - hit0, 128);
  expect_from_scratch(m, longer, got, 3);
}

TEST(PrefixCacheEngine, AttentionOnlyModelResumesAtCachedTokenRows) {
  const Model& m = tiny_model(Arch::deepseek_v32);
  Engine e(m, small_engine());
  ASSERT_EQ(e.cache_plan().block_size, 16);
  const auto prompt = random_prompt(70, 8);
  run_one(e, prompt, 3);
  const auto next = concat(std::vector<int32_t>(prompt.begin(), prompt.begin() + 40), random_prompt(10, 9));
  const int64_t hit0 = e.stats().prefix.hit_tokens;
  const Completion got = run_one(e, next, 3);
  EXPECT_EQ(e.stats().prefix.hit_tokens - hit0, 32);  // two blocks of 16; no KDA state to wait for
  EXPECT_EQ(e.stats().prefix.checkpoints_taken, 0);
  expect_from_scratch(m, next, got, 3);
}

TEST(PrefixCacheEngine, CountersAndDifferentCacheKeysDoNotShare) {
  const Model& m = tiny_model(Arch::kimi_linear);
  Engine e(m, small_engine());
  const auto prompt = random_prompt(130, 10);
  e.add_request(prompt, greedy(1));
  run_checked(e);
  const PrefixCacheCounters c1 = e.stats().prefix;
  EXPECT_EQ(c1.queries, 1);
  EXPECT_EQ(c1.query_tokens, 130);
  EXPECT_EQ(c1.hit_tokens, 0);
  EXPECT_EQ(c1.checkpoints_taken, 2);  // at 64 and 128
  e.add_request(prompt, greedy(1), 0, false, /*cache_key=*/42);  // another LoRA, say: no sharing
  run_checked(e);
  EXPECT_EQ(e.stats().prefix.hit_tokens, 0);
  e.add_request(prompt, greedy(1));
  run_checked(e);
  const PrefixCacheCounters c3 = e.stats().prefix;
  EXPECT_EQ(c3.queries, 3);
  EXPECT_EQ(c3.hit_tokens, 128);
  EXPECT_EQ(c3.checkpoints_used, 1);
}

TEST(PrefixCacheEngine, DisabledPrefixCachingNeverHits) {
  const Model& m = tiny_model(Arch::kimi_k3);
  EngineConfig cfg = small_engine();
  cfg.enable_prefix_caching = false;
  Engine e(m, cfg);
  const auto prompt = random_prompt(150, 11);
  run_one(e, prompt, 2);
  const Completion again = run_one(e, prompt, 2);
  EXPECT_EQ(e.stats().prefix.hit_tokens, 0);
  EXPECT_EQ(e.stats().prefix.checkpoints_taken, 0);
  EXPECT_EQ(e.cache().pool().num_idle_cached(), 0);
  expect_from_scratch(m, prompt, again, 2);
}

}  // namespace
}  // namespace kestrel
