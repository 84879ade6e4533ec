#include "server/engine_loop.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>

#include "server/api_error.h"

namespace kestrel::server {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool RequestStream::take(RequestEvents& into) {
  std::lock_guard lock(mu_);
  for (TokenRecord& t : pending_.tokens) into.tokens.push_back(std::move(t));
  pending_.tokens.clear();
  if (pending_.finished) into.finished = std::move(pending_.finished);
  if (pending_.error) {
    into.error = std::move(pending_.error);
    into.error_status = pending_.error_status;
  }
  pending_.finished.reset();
  pending_.error.reset();
  if (over_) into.finish_time = pending_.finish_time;
  return over_;
}

void RequestStream::push(std::vector<TokenRecord>&& tokens) {
  {
    std::lock_guard lock(mu_);
    for (TokenRecord& t : tokens) pending_.tokens.push_back(std::move(t));
  }
  if (notify_) notify_();
}

void RequestStream::end(std::optional<RequestOutput> out, std::optional<std::string> error, int error_status,
                        double time) {
  {
    std::lock_guard lock(mu_);
    pending_.finished = std::move(out);
    pending_.error = std::move(error);
    pending_.error_status = error_status;
    pending_.finish_time = time;
    over_ = true;
  }
  if (notify_) notify_();
}

EngineLoop::EngineLoop(std::unique_ptr<Engine> engine, int64_t max_in_flight)
    : engine_(std::move(engine)),
      max_in_flight_(max_in_flight),
      max_model_len_(engine_->max_model_len()) {}

EngineLoop::~EngineLoop() { stop(); }

void EngineLoop::start() {
  alive_ = true;
  thread_ = std::thread([this] { run(); });
}

void EngineLoop::stop() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

std::shared_ptr<RequestStream> EngineLoop::submit(std::vector<int32_t> prompt, SamplingParams params, int priority,
                                                  RequestStream::Notify notify) {
  if (!alive_) throw ApiError(503, "the engine is not running");
  if (!admitting_) throw ApiError(503, "the server is shutting down and admits no new requests");
  auto r = std::make_shared<RequestStream>(std::move(prompt), std::move(params), priority, std::move(notify));
  r->arrival_ = now_seconds();
  {
    std::lock_guard lock(mu_);
    if (in_flight_ >= max_in_flight_)
      throw ApiError(429, fmt::format("the server is at capacity ({} requests in flight); retry later", in_flight_));
    ++in_flight_;
    submissions_.push_back(r);
  }
  wake_.notify_one();
  return r;
}

void EngineLoop::abort(const std::shared_ptr<RequestStream>& r) {
  {
    std::lock_guard lock(mu_);
    aborts_.push_back(r);
  }
  wake_.notify_one();
}

void EngineLoop::pause(PauseMode mode, bool clear_cache, std::function<void()> settled) {
  {
    std::lock_guard lock(mu_);
    pause_requested_ = paused_ = true;
    pause_settled_ = false;
    pause_mode_ = mode;
    clear_cache_ = clear_cache && mode != PauseMode::keep;
    if (settled) pause_waiters_.push_back(std::move(settled));
  }
  wake_.notify_one();
}

void EngineLoop::resume() {
  std::vector<std::function<void()>> waiters;
  {
    std::lock_guard lock(mu_);
    paused_ = pause_requested_ = false;
    pause_settled_ = true;  // a pause undone before it settled has nothing left to wait for
    waiters.swap(pause_waiters_);
  }
  wake_.notify_one();
  for (auto& w : waiters) w();
}

std::shared_ptr<EngineTask> EngineLoop::post(
    std::function<std::optional<EngineTask::Failure>(const std::vector<int32_t>&)> fn, std::function<void()> notify) {
  if (!alive_) throw ApiError(503, "the engine is not running");
  auto t = std::make_shared<EngineTask>();
  t->fn = std::move(fn);
  t->notify = std::move(notify);
  {
    std::lock_guard lock(mu_);
    if (tasks_closed_) throw ApiError(503, "the engine is not running");
    tasks_.push_back(t);
  }
  wake_.notify_one();
  return t;
}

void EngineLoop::run_tasks(const std::string* why) {
  std::vector<std::shared_ptr<EngineTask>> tasks;
  std::vector<int32_t> in_use;
  {
    std::lock_guard lock(mu_);
    if (why) tasks_closed_ = true;
    tasks.swap(tasks_);
    if (tasks.empty()) return;
    for (const auto& r : submissions_) in_use.push_back(r->params_.lora_id);
  }
  for (const auto& [id, r] : live_) in_use.push_back(r->params_.lora_id);
  for (auto& t : tasks) {
    if (why) {
      t->failure = EngineTask::Failure{503, *why};
    } else {
      try {
        t->failure = t->fn(in_use);
      } catch (const Error& e) {
        t->failure = EngineTask::Failure{400, e.what()};
      }
    }
    t->done = true;
    if (t->notify) t->notify();
  }
}

bool EngineLoop::paused() const {
  std::lock_guard lock(mu_);
  return paused_;
}

bool EngineLoop::pause_settled() const {
  std::lock_guard lock(mu_);
  return pause_settled_;
}

void EngineLoop::apply_pause() {
  bool abort_all = false, clear = false;
  {
    std::lock_guard lock(mu_);
    if (!paused_ || pause_settled_) return;
    abort_all = pause_requested_ && pause_mode_ == PauseMode::abort;
    pause_requested_ = false;
    const bool drained = pause_mode_ == PauseMode::keep || !engine_->has_unfinished() || abort_all;
    if (!drained) return;
    clear = clear_cache_;
  }
  if (abort_all) {
    for (auto& [id, r] : live_) endings_.push_back({r, engine_->abort(id), std::nullopt, 0, now_seconds()});
    live_.clear();
  }
  if (clear) engine_->reset_prefix_cache();
  std::vector<std::function<void()>> waiters;
  {
    std::lock_guard lock(mu_);
    if (!paused_) return;  // resumed meanwhile
    pause_settled_ = true;
    waiters.swap(pause_waiters_);
  }
  for (auto& w : waiters) w();
}

EngineSnapshot EngineLoop::snapshot() const {
  std::lock_guard lock(mu_);
  EngineSnapshot s = snapshot_;
  s.in_flight = in_flight_;
  return s;
}

void EngineLoop::admit(std::vector<std::shared_ptr<RequestStream>>& subs) {
  for (auto& r : subs) {
    try {
      r->id_ = engine_->add_request(r->prompt_, r->params_, r->priority_);
      live_.emplace(r->id_, r);
    } catch (const Error& e) {
      endings_.push_back({r, std::nullopt, std::string(e.what()), 400, now_seconds()});
    }
  }
  subs.clear();
}

// Publishes the snapshot, then tells the requests that ended: whoever sees an end sees a snapshot (and an
// in-flight count) without that request.
void EngineLoop::announce() {
  publish();
  {
    std::lock_guard lock(mu_);
    in_flight_ -= static_cast<int64_t>(endings_.size());
  }
  for (Ending& e : endings_) e.stream->end(std::move(e.output), std::move(e.error), e.error_status, e.time);
  endings_.clear();
}

void EngineLoop::publish() {
  const EngineStats st = engine_->stats();
  const RowPool& pool = engine_->cache().pool();
  std::lock_guard lock(mu_);
  snapshot_.num_running = engine_->scheduler().num_running();
  snapshot_.num_waiting = engine_->scheduler().num_waiting();
  snapshot_.kv_cache_usage = static_cast<double>(pool.num_referenced()) / pool.num_rows();
  snapshot_.prefix = st.prefix;
  snapshot_.steps = st.steps;
  snapshot_.preemptions = st.preemptions;
  snapshot_.spec = st.spec;
  auto loras = [](const std::vector<Sequence*>& seqs) {
    std::vector<int32_t> ids;
    for (const Sequence* s : seqs)
      if (s->request->params.lora_id != 0) ids.push_back(s->request->params.lora_id);
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    return ids;
  };
  snapshot_.running_loras = loras(engine_->scheduler().running());
  snapshot_.waiting_loras = loras(engine_->scheduler().waiting());
}

void EngineLoop::fail_all(const std::string& why) {
  std::vector<std::shared_ptr<RequestStream>> failed;
  {
    std::lock_guard lock(mu_);
    failed.swap(submissions_);
    aborts_.clear();
  }
  for (auto& [id, r] : live_) failed.push_back(r);
  for (Ending& e : endings_) failed.push_back(e.stream);
  live_.clear();
  endings_.clear();
  {
    std::lock_guard lock(mu_);
    in_flight_ -= static_cast<int64_t>(failed.size());
  }
  const double t = now_seconds();
  for (auto& r : failed) r->end(std::nullopt, why, 503, t);
}

// The prefix-cache hit each request waiting for its first admission would get now. The scheduler's lookup in the
// coming step sees the same cache, unless an admission earlier in that step evicts some of those blocks.
void EngineLoop::predict_cached_tokens() {
  const Scheduler& sched = engine_->scheduler();
  int room = sched.config().max_num_seqs - sched.num_running();
  for (const Sequence* s : sched.waiting()) {
    if (room-- <= 0) break;
    const auto it = live_.find(s->request->id);
    if (s->index != 0 || it == live_.end() || it->second->scheduled_ != 0) continue;
    SequenceRows rows;
    it->second->cached_tokens_ = engine_->cache().lookup(rows, s->tokens, s->prompt_len - 1, s->request->cache_key).tokens;
  }
}

void EngineLoop::dispatch(const StepOutput& out, double t_start, double t_end) {
  // Per-token log-probabilities are on the sequences (running or waiting) until the request finishes, then on its
  // output. A completion's tokens of this step are the last ones of its list.
  std::unordered_map<RequestId, const Request*> unfinished;
  std::unordered_map<RequestId, const RequestOutput*> finished;
  for (const RequestOutput& f : out.finished) finished[f.id] = &f;
  std::map<std::pair<RequestId, int>, size_t> in_step, taken;
  for (const TokenEvent& e : out.tokens)
    if (const auto it = live_.find(e.request); it != live_.end() && it->second->params_.logprobs >= 0)
      ++in_step[{e.request, e.index}];
  if (!in_step.empty()) {
    for (const Sequence* s : engine_->scheduler().running()) unfinished[s->request->id] = s->request;
    for (const Sequence* s : engine_->scheduler().waiting()) unfinished[s->request->id] = s->request;
  }
  auto logprobs_of = [&](RequestId id, int index) -> const std::vector<TokenLogprob>* {
    if (const auto f = finished.find(id); f != finished.end()) {
      for (const Completion& c : f->second->completions)
        if (c.index == index) return &c.logprobs;
    } else if (const auto r = unfinished.find(id); r != unfinished.end()) {
      for (const auto& s : r->second->seqs)
        if (s->index == index) return &s->logprobs;
    }
    return nullptr;
  };

  std::unordered_map<RequestId, std::vector<TokenRecord>> batches;
  for (const TokenEvent& e : out.tokens) {
    const auto it = live_.find(e.request);
    if (it == live_.end()) continue;
    TokenRecord t{e.index, e.token, std::nullopt, t_end};
    if (it->second->params_.logprobs >= 0) {
      const std::pair<RequestId, int> key{e.request, e.index};
      const size_t k = taken[key]++, n = in_step[key];
      const std::vector<TokenLogprob>* lps = logprobs_of(e.request, e.index);
      if (lps && lps->size() >= n) t.logprob = (*lps)[lps->size() - n + k];
    }
    batches[e.request].push_back(std::move(t));
  }
  for (auto& [id, toks] : batches) {
    RequestStream& r = *live_.at(id);
    if (r.scheduled_ == 0) r.scheduled_ = t_start;
    r.push(std::move(toks));
  }
  for (const Sequence* s : engine_->scheduler().running())
    if (const auto it = live_.find(s->request->id); it != live_.end() && it->second->scheduled_ == 0)
      it->second->scheduled_ = t_start;
  for (const RequestOutput& f : out.finished) {
    const auto it = live_.find(f.id);
    if (it == live_.end()) continue;
    endings_.push_back({it->second, f, std::nullopt, 0, t_end});
    live_.erase(it);
  }
}

void EngineLoop::run() {
  std::vector<std::shared_ptr<RequestStream>> subs, aborts;
  try {
    while (true) {
      {
        std::unique_lock lock(mu_);
        // Paused, submissions stay queued, and with mode keep nothing steps.
        const auto work = [&] {
          const bool steps = engine_->has_unfinished() && !(paused_ && pause_mode_ == PauseMode::keep);
          return stopping_ || !aborts_.empty() || !tasks_.empty() || pause_requested_ || (paused_ && !pause_settled_) ||
                 steps ||
                 (!paused_ && !submissions_.empty());
        };
        if (!work()) wake_.wait(lock, work);
        if (!paused_) subs.swap(submissions_);
        aborts.swap(aborts_);
        // An abort of a request still queued ends it here: the engine never saw it.
        for (auto& r : aborts)
          if (const auto it = std::find(submissions_.begin(), submissions_.end(), r); it != submissions_.end()) {
            endings_.push_back({r, std::nullopt, std::nullopt, 0, now_seconds()});
            submissions_.erase(it);
          }
      }
      apply_pause();
      admit(subs);
      for (auto& r : aborts) {
        const auto it = live_.find(r->id_);
        if (r->id_ < 0 || it == live_.end()) continue;
        endings_.push_back({r, engine_->abort(r->id_), std::nullopt, 0, now_seconds()});
        live_.erase(it);
      }
      aborts.clear();
      if (stopping_) break;
      run_tasks();
      const bool frozen = [&] {
        std::lock_guard lock(mu_);
        return paused_ && pause_mode_ == PauseMode::keep;
      }();
      if (engine_->has_unfinished() && !frozen) {
        predict_cached_tokens();
        const double t0 = now_seconds();
        const StepOutput out = engine_->step();
        const double t1 = now_seconds();
        dispatch(out, t0, t1);
        const auto& bounds = iteration_token_bounds();
        const size_t b = std::lower_bound(bounds.begin(), bounds.end(), static_cast<double>(out.num_tokens)) -
                         bounds.begin();
        std::lock_guard lock(mu_);
        ++snapshot_.iteration_tokens[b];
        snapshot_.iteration_tokens_sum += static_cast<double>(out.num_tokens);
      }
      announce();
      apply_pause();
      announce();
    }
    for (auto& [id, r] : live_) endings_.push_back({r, engine_->abort(id), std::nullopt, 0, now_seconds()});
    live_.clear();
    announce();
    fail_all("the server stopped");
    const std::string why = "the server stopped";
    run_tasks(&why);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[kestrel] engine loop failed: %s\n", e.what());
    alive_ = false;
    const std::string why = fmt::format("the engine failed: {}", e.what());
    fail_all(why);
    run_tasks(&why);
    return;
  }
  alive_ = false;
}

}  // namespace kestrel::server
