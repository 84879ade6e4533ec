#include "server/text_pool.h"

#include <algorithm>

#include "server/api_error.h"

namespace kestrel::server {

TextPool::TextPool(int threads, size_t max_queued) : max_queued_(max_queued) {
  for (int i = 0; i < std::max(threads, 1); ++i) threads_.emplace_back([this] { run(); });
}

TextPool::~TextPool() { stop(); }

std::shared_ptr<TextPool::Task> TextPool::submit(std::function<void(const std::atomic<bool>&)> work,
                                                 std::function<void()> notify, bool bounded) {
  auto t = std::make_shared<Task>();
  t->work = std::move(work);
  t->notify = std::move(notify);
  {
    std::lock_guard lock(mu_);
    if (stopped_) throw ApiError(503, "the server is shutting down");
    if (bounded && queue_.size() >= max_queued_)
      throw ApiError(429, "too many requests are waiting for their prompt to be rendered and tokenised; retry later");
    queue_.push_back(t);
  }
  wake_.notify_one();
  return t;
}

void TextPool::finish(Task& t) {
  t.done = true;
  if (t.notify) t.notify();
}

void TextPool::run() {
  for (;;) {
    std::shared_ptr<Task> t;
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return stopped_ || !queue_.empty(); });
      if (stopped_) return;
      t = std::move(queue_.front());
      queue_.pop_front();
      running_.push_back(t);
    }
    try {
      t->work(t->cancel);
    } catch (...) {
      t->error = std::current_exception();
    }
    {
      std::lock_guard lock(mu_);
      running_.erase(std::find(running_.begin(), running_.end(), t));
    }
    finish(*t);
  }
}

void TextPool::stop() {
  std::deque<std::shared_ptr<Task>> dropped;
  {
    std::lock_guard lock(mu_);
    if (stopped_.exchange(true)) return;
    for (const auto& t : running_) t->cancel = true;
    dropped.swap(queue_);
  }
  wake_.notify_all();
  for (const auto& t : dropped) {
    t->dropped = true;
    t->error = std::make_exception_ptr(ApiError(503, "the server is shutting down"));
    finish(*t);
  }
  for (auto& th : threads_) th.join();
  threads_.clear();
}

size_t TextPool::queued() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

size_t TextPool::running() const {
  std::lock_guard lock(mu_);
  return running_.size();
}

}  // namespace kestrel::server
