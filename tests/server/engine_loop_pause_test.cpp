// Pausing the engine loop for an RL weight update (vLLM's /pause modes): abort ends what runs, wait lets it finish,
// keep freezes it and resume continues it with the same tokens; submissions made while paused wait, not fail, and
// run after resume; clear_cache empties the prefix cache; a queued request that is aborted ends at once.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <thread>

#include "cpu/cpu_backend.h"
#include "model/make_model.h"
#include "server/engine_loop.h"

namespace kestrel::server {
namespace {

const Model& tiny_model() {
  static const std::unique_ptr<Model> m = [] {
    const std::string dir = std::filesystem::temp_directory_path() /
                            ("kestrel_pause_test_" + std::to_string(::getpid()));
    if (!std::filesystem::exists(dir + "/config.json")) make_model(find_preset(Arch::kimi_linear, "tiny"), dir, 3);
    return load_cpu_model(dir);
  }();
  return *m;
}

SamplingParams greedy(int max_tokens) {
  SamplingParams p;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

// Polls `done` every millisecond for at most 30 s.
template <typename F>
bool eventually(F done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Every event of a request until it is over.
RequestEvents drain(RequestStream& r) {
  RequestEvents all;
  EXPECT_TRUE(eventually([&] {
    RequestEvents ev;
    const bool over = r.take(ev);
    for (auto& t : ev.tokens) all.tokens.push_back(t);
    if (ev.finished) all.finished = ev.finished;
    return over;
  }));
  return all;
}

std::vector<int32_t> tokens_of(const RequestEvents& ev) {
  std::vector<int32_t> out;
  for (const TokenRecord& t : ev.tokens) out.push_back(t.token);
  return out;
}

std::unique_ptr<EngineLoop> started_loop() {
  EngineConfig cfg;
  cfg.max_num_batched_tokens = 64;
  auto loop = std::make_unique<EngineLoop>(std::make_unique<Engine>(tiny_model(), cfg), 16);
  loop->start();
  return loop;
}

TEST(EngineLoopPause, AbortEndsWhatRunsAndHoldsNewSubmissionsUntilResume) {
  auto loop = started_loop();
  auto running = loop->submit(std::vector<int32_t>(40, 5), greedy(400), 0, nullptr);
  ASSERT_TRUE(eventually([&] { return running->scheduled_time() > 0; }));
  std::atomic<bool> settled{false};
  loop->pause(PauseMode::abort, true, [&] { settled = true; });
  EXPECT_TRUE(loop->paused());
  ASSERT_TRUE(eventually([&] { return settled.load(); }));
  EXPECT_TRUE(loop->pause_settled());
  const RequestEvents aborted = drain(*running);
  ASSERT_TRUE(aborted.finished);
  EXPECT_EQ(aborted.finished->completions.at(0).finish, FinishReason::abort);
  EXPECT_LT(aborted.tokens.size(), 400u);

  auto queued = loop->submit({1, 2, 3}, greedy(3), 0, nullptr);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  RequestEvents none;
  EXPECT_FALSE(queued->take(none));
  EXPECT_TRUE(none.tokens.empty());
  EXPECT_EQ(loop->snapshot().in_flight, 1);
  loop->resume();
  EXPECT_FALSE(loop->paused());
  const RequestEvents after = drain(*queued);
  ASSERT_TRUE(after.finished);
  EXPECT_EQ(after.tokens.size(), 3u);
  loop->stop();
}

TEST(EngineLoopPause, WaitLetsRunningRequestsFinish) {
  auto loop = started_loop();
  auto running = loop->submit({7, 8, 9}, greedy(30), 0, nullptr);
  ASSERT_TRUE(eventually([&] { return running->scheduled_time() > 0; }));
  std::atomic<bool> settled{false};
  loop->pause(PauseMode::wait, false, [&] { settled = true; });
  const RequestEvents done = drain(*running);
  ASSERT_TRUE(done.finished);
  EXPECT_EQ(done.finished->completions.at(0).finish, FinishReason::length);
  EXPECT_EQ(done.tokens.size(), 30u);
  ASSERT_TRUE(eventually([&] { return settled.load(); }));
  loop->resume();
  loop->stop();
}

TEST(EngineLoopPause, KeepFreezesAndResumeContinuesWithTheSameTokens) {
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6};
  auto reference = started_loop();
  const std::vector<int32_t> want = tokens_of(drain(*reference->submit(prompt, greedy(60), 0, nullptr)));
  reference->stop();

  auto loop = started_loop();
  auto r = loop->submit(prompt, greedy(60), 0, nullptr);
  RequestEvents got;
  ASSERT_TRUE(eventually([&] {
    RequestEvents ev;
    r->take(ev);
    for (auto& t : ev.tokens) got.tokens.push_back(t);
    return !got.tokens.empty();
  }));
  std::atomic<bool> settled{false};
  loop->pause(PauseMode::keep, true, [&] { settled = true; });
  ASSERT_TRUE(eventually([&] { return settled.load(); }));
  // Frozen: whatever the step in progress produced arrives, then nothing more.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  RequestEvents ev;
  r->take(ev);
  for (auto& t : ev.tokens) got.tokens.push_back(t);
  const size_t frozen_at = got.tokens.size();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  RequestEvents later;
  EXPECT_FALSE(r->take(later));
  EXPECT_TRUE(later.tokens.empty());
  EXPECT_LT(frozen_at, 60u);
  EXPECT_EQ(loop->snapshot().num_running, 1);
  loop->resume();
  const RequestEvents rest = drain(*r);
  for (auto& t : rest.tokens) got.tokens.push_back(t);
  EXPECT_EQ(tokens_of(got), want);
  loop->stop();
}

TEST(EngineLoopPause, ClearCacheEmptiesThePrefixCache) {
  auto loop = started_loop();
  const std::vector<int32_t> prompt(150, 11);
  drain(*loop->submit(prompt, greedy(1), 0, nullptr));
  ASSERT_TRUE(eventually([&] { return loop->snapshot().prefix.blocks_registered > 0; }));
  std::atomic<bool> settled{false};
  loop->pause(PauseMode::wait, true, [&] { settled = true; });
  ASSERT_TRUE(eventually([&] { return settled.load(); }));
  loop->resume();
  auto again = loop->submit(prompt, greedy(1), 0, nullptr);
  drain(*again);
  EXPECT_EQ(again->cached_tokens(), 0);
  // Without clearing, the same prompt hits.
  auto third = loop->submit(prompt, greedy(1), 0, nullptr);
  drain(*third);
  EXPECT_GT(third->cached_tokens(), 0);
  loop->stop();
}

TEST(EngineLoopPause, AbortOfAQueuedRequestEndsItAtOnce) {
  auto loop = started_loop();
  loop->pause(PauseMode::keep, false, nullptr);
  auto queued = loop->submit({1, 2}, greedy(2), 0, nullptr);
  loop->abort(queued);
  const RequestEvents ev = drain(*queued);
  EXPECT_FALSE(ev.finished);
  EXPECT_TRUE(ev.tokens.empty());
  EXPECT_TRUE(eventually([&] { return loop->snapshot().in_flight == 0; }));
  loop->resume();
  loop->stop();
}

}  // namespace
}  // namespace kestrel::server
