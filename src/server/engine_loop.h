// The engine thread: one loop of admit submissions -> apply aborts -> Engine::step() -> hand out tokens, for all
// HTTP threads. It only timestamps events; everything built from them (text, histograms) happens on the HTTP side.
// Requests reach it through a bounded queue (overload answers 429), and an abort takes effect before the next step,
// so a client that goes away has its rows back within one step.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/engine.h"

namespace kestrel::server {

// Seconds on the steady clock.
double now_seconds();

struct TokenRecord {
  int index = 0;  // which of the request's n completions
  int32_t token = 0;
  std::optional<TokenLogprob> logprob;
  double time = 0;
};

// What arrived for a request since the HTTP side last looked.
struct RequestEvents {
  std::vector<TokenRecord> tokens;
  std::optional<RequestOutput> finished;  // the request ended (finish reasons per completion)
  std::optional<std::string> error;       // the engine refused it (status 400) or failed / stopped (503)
  int error_status = 0;
  double finish_time = 0;
};

// One request's channel between the engine thread and the HTTP side.
class RequestStream {
 public:
  using Notify = std::function<void()>;
  RequestStream(std::vector<int32_t> prompt, SamplingParams params, int priority, Notify notify)
      : prompt_(std::move(prompt)), params_(std::move(params)), priority_(priority), notify_(std::move(notify)) {}

  // Moves out what arrived; true when the request is over (finished or failed) and nothing more will come.
  bool take(RequestEvents& into);
  double arrival_time() const { return arrival_; }
  // When the engine first scheduled it (0 while it waits).
  double scheduled_time() const { return scheduled_.load(); }
  // Prompt tokens its first admission found in the prefix cache.
  int64_t cached_tokens() const { return cached_tokens_.load(); }
  const SamplingParams& params() const { return params_; }
  int64_t prompt_len() const { return static_cast<int64_t>(prompt_.size()); }

 private:
  friend class EngineLoop;
  void push(std::vector<TokenRecord>&& tokens);
  void end(std::optional<RequestOutput> out, std::optional<std::string> error, int error_status, double time);

  std::vector<int32_t> prompt_;
  SamplingParams params_;
  int priority_;
  Notify notify_;
  double arrival_ = 0;
  std::atomic<double> scheduled_{0};
  std::atomic<int64_t> cached_tokens_{0};
  RequestId id_ = -1;  // engine thread only

  std::mutex mu_;
  RequestEvents pending_;
  bool over_ = false;
};

// Bounds of kestrel:iteration_tokens_total (tokens one engine step computed), vLLM's.
inline const std::vector<double>& iteration_token_bounds() {
  static const std::vector<double> b = {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384};
  return b;
}

struct EngineSnapshot {
  // Tokens per engine step: counts per bucket of iteration_token_bounds() (the last is beyond them), sum, steps.
  std::vector<uint64_t> iteration_tokens = std::vector<uint64_t>(iteration_token_bounds().size() + 1, 0);
  double iteration_tokens_sum = 0;
  int num_running = 0, num_waiting = 0;
  int64_t in_flight = 0;       // submitted and not yet over
  double kv_cache_usage = 0;   // fraction of cache rows held by sequences
  PrefixCacheCounters prefix;
  int64_t steps = 0, preemptions = 0;
  SpecDecodeCounters spec;  // accepted_per_pos empty: no speculative decoding
  // The LoRA adapters of the running and of the waiting sequences (distinct ids, ascending; 0, the base model, left
  // out): kestrel:lora_requests_info.
  std::vector<int32_t> running_loras, waiting_loras;
};

// How /pause treats the requests in flight (vLLM's modes): abort ends them (finish reason abort), wait lets them
// finish, keep freezes them where they are until resume.
enum class PauseMode { abort, wait, keep };

// Work the engine thread runs between two steps (a LoRA adapter's load or unload, which must not race a step). `fn`
// gets the LoRA ids of every request the loop holds (admitted or still queued) and returns an error, or nothing.
// When the loop stops or fails first, the task ends with status 503.
struct EngineTask {
  struct Failure {
    int status = 400;
    std::string message;
  };
  std::function<std::optional<Failure>(const std::vector<int32_t>& loras_in_use)> fn;
  std::function<void()> notify;  // called (on the engine thread) once done
  std::optional<Failure> failure;
  std::atomic<bool> done{false};
};

class EngineLoop {
 public:
  // max_in_flight: requests submitted and not over, beyond which submit() answers 429.
  EngineLoop(std::unique_ptr<Engine> engine, int64_t max_in_flight);
  ~EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  void start();
  // Aborts what is left and joins the thread.
  void stop();

  // Queues a request. ApiError 429 when the queue is full, 503 when the loop does not admit (draining or dead).
  std::shared_ptr<RequestStream> submit(std::vector<int32_t> prompt, SamplingParams params, int priority,
                                        RequestStream::Notify notify);
  // Ends a request before the next step (no-op when it is over already).
  void abort(const std::shared_ptr<RequestStream>& r);

  // Stops generation for an RL weight update (vLLM's /pause): requests in flight are treated as `mode` says, and new
  // submissions wait (queued, not refused) until resume(). With clear_cache (modes abort and wait) the prefix cache
  // is emptied once nothing runs. `settled` is called, on the engine thread, when the pause has taken effect.
  void pause(PauseMode mode, bool clear_cache, std::function<void()> settled);
  void resume();
  bool paused() const;
  // The last pause has taken effect (its requests aborted, finished or frozen; its cache cleared).
  bool pause_settled() const;

  // Queues `fn` for the engine thread (EngineTask); the caller waits for task->done. ApiError 503 when the loop does
  // not run.
  std::shared_ptr<EngineTask> post(std::function<std::optional<EngineTask::Failure>(const std::vector<int32_t>&)> fn,
                                   std::function<void()> notify);

  // New submissions get 503 from now on (SIGTERM).
  void stop_admitting() { admitting_ = false; }
  bool admitting() const { return admitting_; }
  // The loop thread runs and has not failed.
  bool alive() const { return alive_; }
  EngineSnapshot snapshot() const;
  int64_t max_model_len() const { return max_model_len_; }

 private:
  void run();
  void admit(std::vector<std::shared_ptr<RequestStream>>& subs);
  void predict_cached_tokens();
  void dispatch(const StepOutput& out, double t_start, double t_end);
  void announce();
  void fail_all(const std::string& why);
  void publish();
  // On the engine thread: takes a pause request, and settles the pause once it holds.
  void apply_pause();
  // On the engine thread: runs the posted tasks; with `why`, ends them unrun with status 503.
  void run_tasks(const std::string* why = nullptr);

  std::unique_ptr<Engine> engine_;
  const int64_t max_in_flight_, max_model_len_;
  std::thread thread_;
  std::atomic<bool> alive_{false}, admitting_{true}, stopping_{false};

  mutable std::mutex mu_;  // guards the queues, in_flight_ and snapshot_
  std::condition_variable wake_;
  std::vector<std::shared_ptr<RequestStream>> submissions_, aborts_;
  std::vector<std::shared_ptr<EngineTask>> tasks_;
  bool tasks_closed_ = false;  // the loop ended: post() refuses
  int64_t in_flight_ = 0;
  EngineSnapshot snapshot_;
  // Pausing (guarded by mu_): a request not yet taken by the engine thread, the state, and who waits for it to settle.
  bool pause_requested_ = false, paused_ = false, pause_settled_ = false, clear_cache_ = false;
  PauseMode pause_mode_ = PauseMode::abort;
  std::vector<std::function<void()>> pause_waiters_;

  // Engine thread only: the requests in the engine, and those that ended in this iteration.
  std::unordered_map<RequestId, std::shared_ptr<RequestStream>> live_;
  struct Ending {
    std::shared_ptr<RequestStream> stream;
    std::optional<RequestOutput> output;
    std::optional<std::string> error;
    int error_status = 0;
    double time = 0;
  };
  std::vector<Ending> endings_;
};

}  // namespace kestrel::server
