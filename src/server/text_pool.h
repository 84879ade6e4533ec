// Text work off the HTTP threads: chat-template rendering, tokenising and request parsing run on a few worker
// threads behind a bounded queue, so that a slow or hostile request (a large chat_template_kwargs, a long prompt)
// never stalls the HTTP threads that answer /health and stream tokens. A full queue answers 429; after stop() (SIGTERM)
// new work gets 503 and the work running is told to cancel (template renders check the flag as they go).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kestrel::server {

class TextPool {
 public:
  struct Task {
    std::function<void(const std::atomic<bool>& cancel)> work;
    std::function<void()> notify;  // called (on a worker thread) once done is set
    std::atomic<bool> cancel{false}, done{false};
    bool dropped = false;      // failed by stop() before it ran (set before done)
    std::exception_ptr error;  // what work threw; read once done
  };

  TextPool(int threads, size_t max_queued);
  ~TextPool();
  TextPool(const TextPool&) = delete;
  TextPool& operator=(const TextPool&) = delete;

  // Queues `work`. ApiError 429 when max_queued tasks wait already (unless `bounded` is false: the answer of a
  // request the engine has served, bounded by the engine's own admission), 503 after stop().
  std::shared_ptr<Task> submit(std::function<void(const std::atomic<bool>&)> work, std::function<void()> notify,
                               bool bounded = true);
  // Cancels the running tasks, fails the queued ones (ApiError 503) and joins the threads.
  void stop();
  size_t queued() const;   // waiting for a thread
  size_t running() const;  // on a thread now
  bool stopped() const { return stopped_; }

 private:
  void run();
  static void finish(Task& t);

  const size_t max_queued_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Task>> queue_;
  std::vector<std::shared_ptr<Task>> running_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stopped_{false};
};

}  // namespace kestrel::server
