// The /metrics endpoint: vLLM's metric names with a `kestrel:` prefix, labelled model_name, in the Prometheus text
// format (version 0.0.4). Gauges come from the engine loop's snapshot; counters and histograms are built on the
// HTTP side from the timestamps of finished requests.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "server/engine_loop.h"

namespace kestrel::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  // A histogram of counts kept elsewhere (per bucket of `bounds`, the last beyond them).
  Histogram(std::vector<double> bounds, std::vector<uint64_t> counts, double sum)
      : bounds_(std::move(bounds)), counts_(std::move(counts)), sum_(sum) {
    for (uint64_t c : counts_) count_ += c;
  }
  void observe(double v);
  // Appends the _bucket (cumulative, with +Inf), _sum and _count lines of `name`.
  void render(std::string& out, const std::string& name, const std::string& labels) const;
  uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, the last is (largest bound, +Inf)
  double sum_ = 0;
  uint64_t count_ = 0;
};

// The timeline of one finished request, as its handler saw it.
struct RequestRecord {
  double arrival = 0, scheduled = 0, first_token = 0, finished = 0;
  std::vector<double> token_gaps;  // seconds between consecutive tokens of a completion
  int64_t prompt_tokens = 0, generation_tokens = 0;
  std::string finished_reason;  // stop, length, abort, error
};

// Gauges of the HTTP side, read when /metrics is rendered.
struct ServerGauges {
  int64_t open_connections = 0;    // TCP connections open now (the one asking for /metrics included)
  int64_t text_tasks_waiting = 0;  // text work queued for a text thread
  int64_t text_tasks_running = 0;  // text work on a text thread now
  // With --enable-lora: the most adapters loaded at once and an adapter id's name (kestrel:lora_requests_info).
  int max_loras = 0;  // 0: LoRA not enabled, no lora_requests_info
  std::function<std::string(int32_t)> lora_name;
};

class ServerMetrics {
 public:
  // `max_model_len` bounds the token-count histograms (1-2-5 steps up to it, as vLLM's).
  explicit ServerMetrics(std::string model_name, int64_t max_model_len = 1 << 20);
  // kestrel:cache_config_info's labels (block_size, num_gpu_blocks, cache_dtype, ...), set once at start.
  void set_cache_config(std::vector<std::pair<std::string, std::string>> labels);

  void record(const RequestRecord& r);
  // Counts a request refused before it reached the engine (status 4xx/5xx).
  void record_rejected(int status);
  // Counts every HTTP response by status (kestrel:http_requests_total): 500s show up here.
  void record_response(int status);
  std::string render(const EngineSnapshot& s, const ServerGauges& g = {}) const;

 private:
  std::string model_name_;
  mutable std::mutex mu_;
  int64_t prompt_tokens_ = 0, generation_tokens_ = 0;
  std::map<std::string, int64_t> success_;  // by finished_reason
  std::map<int, int64_t> rejected_;         // by HTTP status
  std::map<int, int64_t> responses_;        // by HTTP status
  Histogram ttft_, itl_, e2e_, queue_, prefill_, decode_;
  Histogram prompt_hist_, generation_hist_, tpot_;
  std::vector<std::pair<std::string, std::string>> cache_config_;
};

}  // namespace kestrel::server
