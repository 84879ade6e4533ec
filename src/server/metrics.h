// The /metrics endpoint: vLLM's metric names with a `kestrel:` prefix, labelled model_name, in the Prometheus text
// format (version 0.0.4). Gauges come from the engine loop's snapshot; counters and histograms are built on the
// HTTP side from the timestamps of finished requests.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "server/engine_loop.h"

namespace kestrel::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
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

class ServerMetrics {
 public:
  explicit ServerMetrics(std::string model_name);

  void record(const RequestRecord& r);
  // Counts a request refused before it reached the engine (status 4xx/5xx).
  void record_rejected(int status);
  std::string render(const EngineSnapshot& s) const;

 private:
  std::string model_name_;
  mutable std::mutex mu_;
  int64_t prompt_tokens_ = 0, generation_tokens_ = 0;
  std::map<std::string, int64_t> success_;  // by finished_reason
  std::map<int, int64_t> rejected_;         // by HTTP status
  Histogram ttft_, itl_, e2e_, queue_, prefill_, decode_;
};

}  // namespace kestrel::server
