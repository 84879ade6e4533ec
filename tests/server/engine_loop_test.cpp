// The engine thread: requests in from other threads, tokens out with timestamps; aborts take effect before the
// next step and give every row back; the in-flight bound answers 429; a stopped loop is not alive and answers 503.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>

#include "cpu/cpu_backend.h"
#include "model/make_model.h"
#include "server/api_error.h"
#include "server/engine_loop.h"

namespace kestrel::server {
namespace {

const Model& tiny_model() {
  static const std::unique_ptr<Model> m = [] {
    const std::string dir = std::filesystem::temp_directory_path() /
                            ("kestrel_server_test_" + std::to_string(::getpid()));
    if (!std::filesystem::exists(dir + "/config.json")) make_model(find_preset(Arch::kimi_k3, "tiny"), dir, 3);
    return load_cpu_model(dir);
  }();
  return *m;
}

// Collects a request's events until it is over.
struct Waiter {
  std::mutex mu;
  std::condition_variable cv;
  int notified = 0;
  RequestStream::Notify notify() {
    return [this] {
      std::lock_guard lock(mu);
      ++notified;
      cv.notify_all();
    };
  }
  RequestEvents until_over(RequestStream& r) {
    RequestEvents all;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (true) {
      RequestEvents ev;
      const bool over = r.take(ev);
      for (auto& t : ev.tokens) all.tokens.push_back(t);
      if (ev.finished) all.finished = ev.finished;
      if (ev.error) all.error = ev.error, all.error_status = ev.error_status;
      if (over) return all;
      std::unique_lock lock(mu);
      if (!cv.wait_until(lock, deadline, [&] { return notified > 0; })) ADD_FAILURE() << "no event in 30 s";
      notified = 0;
    }
  }
};

SamplingParams params(int max_tokens, int n = 1) {
  SamplingParams p;
  p.max_tokens = max_tokens;
  p.n = n;
  p.ignore_eos = true;
  p.logprobs = 1;
  return p;
}

TEST(EngineLoop, TokensArriveInOrderWithTimestampsAndLogprobs) {
  EngineLoop loop(std::make_unique<Engine>(tiny_model(), EngineConfig{}), 8);
  loop.start();
  ASSERT_TRUE(loop.alive());
  Waiter w;
  auto r = loop.submit({1, 2, 3, 4}, params(6, 2), 0, w.notify());
  const RequestEvents ev = w.until_over(*r);
  ASSERT_TRUE(ev.finished);
  ASSERT_EQ(ev.tokens.size(), 12u);
  for (int idx = 0; idx < 2; ++idx) {
    const Completion& c = ev.finished->completions[idx];
    std::vector<int32_t> streamed;
    std::vector<float> streamed_logprobs;
    double last = 0;
    for (const TokenRecord& t : ev.tokens)
      if (t.index == idx) {
        streamed.push_back(t.token);
        EXPECT_GE(t.time, last);
        last = t.time;
        ASSERT_TRUE(t.logprob);
        EXPECT_EQ(t.logprob->token, t.token);  // the streamed log-probability is that of the streamed token
        streamed_logprobs.push_back(t.logprob->logprob);
      }
    EXPECT_EQ(streamed, c.token_ids);
    ASSERT_EQ(streamed_logprobs.size(), c.logprobs.size());
    for (size_t k = 0; k < c.logprobs.size(); ++k) EXPECT_EQ(streamed_logprobs[k], c.logprobs[k].logprob);
  }
  EXPECT_GT(r->scheduled_time(), 0);
  EXPECT_GE(r->scheduled_time(), r->arrival_time());
  const EngineSnapshot s = loop.snapshot();
  EXPECT_EQ(s.in_flight, 0);
  EXPECT_EQ(s.kv_cache_usage, 0);
  loop.stop();
  EXPECT_FALSE(loop.alive());
  try {
    loop.submit({1}, params(1), 0, nullptr);
    ADD_FAILURE() << "a stopped loop admitted a request";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 503);
  }
}

TEST(EngineLoop, AbortFreesRowsAndBoundAnswers429) {
  EngineLoop loop(std::make_unique<Engine>(tiny_model(), EngineConfig{}), 2);
  loop.start();
  Waiter w1, w2;
  auto a = loop.submit({5, 6, 7}, params(3000), 0, w1.notify());
  auto b = loop.submit({8, 9}, params(3000), 0, w2.notify());
  try {
    loop.submit({1}, params(1), 0, nullptr);
    ADD_FAILURE() << "a third request fit under a bound of 2";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 429);
  }
  // Wait for a's first token: it holds rows now.
  {
    std::unique_lock lock(w1.mu);
    w1.cv.wait_for(lock, std::chrono::seconds(30), [&] { return w1.notified > 0; });
  }
  loop.abort(a);
  loop.abort(b);
  const RequestEvents ea = w1.until_over(*a), eb = w2.until_over(*b);
  ASSERT_TRUE(ea.finished && eb.finished);
  EXPECT_EQ(ea.finished->completions[0].finish, FinishReason::abort);
  EXPECT_LT(ea.tokens.size(), 3000u);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (loop.snapshot().num_running > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const EngineSnapshot s = loop.snapshot();
  EXPECT_EQ(s.in_flight, 0);
  EXPECT_EQ(s.num_running + s.num_waiting, 0);
  EXPECT_EQ(s.kv_cache_usage, 0);
  Waiter w3;
  auto c = loop.submit({1, 2}, params(2), 0, w3.notify());  // room again
  EXPECT_TRUE(w3.until_over(*c).finished);
}

TEST(EngineLoop, RefusedRequestEndsWithA400) {
  EngineLoop loop(std::make_unique<Engine>(tiny_model(), EngineConfig{}), 4);
  loop.start();
  Waiter w;
  auto r = loop.submit({1, 2}, params(1 << 20), 0, w.notify());  // beyond max_model_len
  const RequestEvents ev = w.until_over(*r);
  EXPECT_FALSE(ev.finished);
  ASSERT_TRUE(ev.error);
  EXPECT_EQ(ev.error_status, 400);
  EXPECT_NE(ev.error->find("max_model_len"), std::string::npos);
  EXPECT_EQ(loop.snapshot().in_flight, 0);
}

}  // namespace
}  // namespace kestrel::server
