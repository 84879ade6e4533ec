#include "server/metrics.h"

#include <algorithm>
#include <ctime>

#include <fmt/format.h>

namespace kestrel::server {
namespace {

// Latency buckets in seconds, from a millisecond (the tiny models on a CPU) to the long tail of big ones.
std::vector<double> latency_buckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0,
          2.5,   5.0,    7.5,   10.0, 20.0,  40.0, 80.0,  160.0, 640.0, 2560.0};
}
std::vector<double> token_gap_buckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
          0.3,    0.4,   0.5,    0.75,  1.0,  2.5,   5.0,  7.5,   10.0, 20.0, 40.0, 80.0};
}

// 1, 2, 5, 10, 20, 50, ... up to `max` (vLLM's build_1_2_5_buckets).
std::vector<double> token_count_buckets(int64_t max) {
  std::vector<double> b;
  for (double m = 1;; m *= 10)
    for (double k : {1.0, 2.0, 5.0}) {
      if (k * m > static_cast<double>(max)) return b.empty() ? std::vector<double>{1} : b;
      b.push_back(k * m);
    }
}

std::string number(double v) { return fmt::format("{}", v); }

// Label values escape backslash, quote and newline.
std::string label_value(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

void header(std::string& out, const std::string& name, const char* type, const char* help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

}  // namespace

void Histogram::observe(double v) {
  const size_t b = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  ++counts_[b];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& labels) const {
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += fmt::format("{}_bucket{{{},le=\"{}\"}} {}\n", name, labels, number(bounds_[i]), cumulative);
  }
  cumulative += counts_.back();
  out += fmt::format("{}_bucket{{{},le=\"+Inf\"}} {}\n", name, labels, cumulative);
  out += fmt::format("{}_sum{{{}}} {}\n{}_count{{{}}} {}\n", name, labels, number(sum_), name, labels, count_);
}

ServerMetrics::ServerMetrics(std::string model_name, int64_t max_model_len)
    : model_name_(std::move(model_name)),
      ttft_(latency_buckets()),
      itl_(token_gap_buckets()),
      e2e_(latency_buckets()),
      queue_(latency_buckets()),
      prefill_(latency_buckets()),
      decode_(latency_buckets()),
      prompt_hist_(token_count_buckets(max_model_len)),
      generation_hist_(token_count_buckets(max_model_len)),
      tpot_(token_gap_buckets()) {}

void ServerMetrics::set_cache_config(std::vector<std::pair<std::string, std::string>> labels) {
  std::lock_guard lock(mu_);
  cache_config_ = std::move(labels);
}

void ServerMetrics::record(const RequestRecord& r) {
  std::lock_guard lock(mu_);
  prompt_tokens_ += r.prompt_tokens;
  generation_tokens_ += r.generation_tokens;
  ++success_[r.finished_reason];
  prompt_hist_.observe(static_cast<double>(r.prompt_tokens));
  generation_hist_.observe(static_cast<double>(r.generation_tokens));
  // Time per output token: the request's mean gap between tokens (vLLM's mean_time_per_output_token).
  if (!r.token_gaps.empty()) {
    double sum = 0;
    for (double g : r.token_gaps) sum += g;
    tpot_.observe(sum / static_cast<double>(r.token_gaps.size()));
  }
  if (r.first_token > 0) ttft_.observe(r.first_token - r.arrival);
  for (double g : r.token_gaps) itl_.observe(g);
  e2e_.observe(r.finished - r.arrival);
  if (r.scheduled > 0) {
    queue_.observe(r.scheduled - r.arrival);
    if (r.first_token > 0) {
      prefill_.observe(r.first_token - r.scheduled);
      decode_.observe(r.finished - r.first_token);
    }
  }
}

void ServerMetrics::record_rejected(int status) {
  std::lock_guard lock(mu_);
  ++rejected_[status];
}

void ServerMetrics::record_response(int status) {
  std::lock_guard lock(mu_);
  ++responses_[status];
}

std::string ServerMetrics::render(const EngineSnapshot& s, const ServerGauges& g) const {
  const std::string lab = fmt::format("model_name=\"{}\"", label_value(model_name_));
  std::string out;
  auto gauge = [&](const char* name, const char* help, double v) {
    header(out, name, "gauge", help);
    out += fmt::format("{}{{{}}} {}\n", name, lab, number(v));
  };
  auto counter = [&](const char* name, const char* help, double v) {
    header(out, name, "counter", help);
    out += fmt::format("{}{{{}}} {}\n", name, lab, number(v));
  };
  gauge("kestrel:num_requests_running", "Number of requests in model execution batches.", s.num_running);
  gauge("kestrel:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting);
  gauge("kestrel:num_requests_in_flight", "Requests accepted by the server and not yet finished.",
        static_cast<double>(s.in_flight));
  gauge("kestrel:kv_cache_usage_perc", "KV-cache usage: the fraction of cache rows held by sequences (1 = 100%).",
        s.kv_cache_usage);
  if (g.max_loras > 0) {
    // vLLM's vllm:lora_requests_info: one sample whose labels name the adapters of the running and the waiting
    // requests (comma-separated), its value the time of the snapshot.
    auto names = [&](const std::vector<int32_t>& ids) {
      std::string list;
      for (int32_t id : ids) {
        if (!list.empty()) list += ',';
        list += g.lora_name ? g.lora_name(id) : std::to_string(id);
      }
      return label_value(list);
    };
    header(out, "kestrel:lora_requests_info", "gauge", "Running stats on lora requests.");
    out += fmt::format("kestrel:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\","
                       "waiting_lora_adapters=\"{}\"}} {}\n",
                       g.max_loras, names(s.running_loras), names(s.waiting_loras),
                       number(static_cast<double>(std::time(nullptr))));
  }
  gauge("kestrel:num_open_connections", "TCP connections open now (this one included).",
        static_cast<double>(g.open_connections));
  gauge("kestrel:num_text_tasks_waiting", "Text work (parsing, chat templates, tokenising) queued for a text thread.",
        static_cast<double>(g.text_tasks_waiting));
  gauge("kestrel:num_text_tasks_running", "Text work running on a text thread now.",
        static_cast<double>(g.text_tasks_running));
  counter("kestrel:prefix_cache_queries_total", "Prefix cache queries, in prompt tokens queried.",
          static_cast<double>(s.prefix.query_tokens));
  counter("kestrel:prefix_cache_hits_total", "Prefix cache hits, in prompt tokens found cached.",
          static_cast<double>(s.prefix.hit_tokens));
  counter("kestrel:num_preemptions_total", "Cumulative number of preemptions by the scheduler.",
          static_cast<double>(s.preemptions));
  if (!s.spec.accepted_per_pos.empty()) {  // with --speculative-config (vLLM's spec_decode counters)
    counter("kestrel:spec_decode_num_drafts_total", "Number of spec decoding drafts (sequences verified in a step).",
            static_cast<double>(s.spec.num_drafts));
    counter("kestrel:spec_decode_num_draft_tokens_total", "Number of draft tokens.",
            static_cast<double>(s.spec.num_draft_tokens));
    counter("kestrel:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.",
            static_cast<double>(s.spec.num_accepted_tokens));
    header(out, "kestrel:spec_decode_num_accepted_tokens_per_pos_total", "counter",
           "Accepted tokens per draft position.");
    for (size_t i = 0; i < s.spec.accepted_per_pos.size(); ++i)
      out += fmt::format("kestrel:spec_decode_num_accepted_tokens_per_pos_total{{{},position=\"{}\"}} {}\n", lab, i,
                         s.spec.accepted_per_pos[i]);
  }

  std::lock_guard lock(mu_);
  counter("kestrel:prompt_tokens_total", "Number of prefill tokens processed.", static_cast<double>(prompt_tokens_));
  counter("kestrel:generation_tokens_total", "Number of generation tokens processed.",
          static_cast<double>(generation_tokens_));
  header(out, "kestrel:request_success_total", "counter", "Count of finished requests, by finish reason.");
  for (const char* reason : {"stop", "length", "abort", "error"}) {
    const auto it = success_.find(reason);
    out += fmt::format("kestrel:request_success_total{{{},finished_reason=\"{}\"}} {}\n", lab, reason,
                       it == success_.end() ? 0 : it->second);
  }
  header(out, "kestrel:request_rejected_total", "counter", "Requests refused before reaching the engine, by status.");
  for (const auto& [status, n] : rejected_)
    out += fmt::format("kestrel:request_rejected_total{{{},status=\"{}\"}} {}\n", lab, status, n);
  header(out, "kestrel:http_requests_total", "counter", "HTTP responses, by status (500: a server fault).");
  for (const int status : {200, 400, 500})  // always present, so that a rate of errors can be taken from zero
    if (!responses_.count(status))
      out += fmt::format("kestrel:http_requests_total{{{},status=\"{}\"}} 0\n", lab, status);
  for (const auto& [status, n] : responses_)
    out += fmt::format("kestrel:http_requests_total{{{},status=\"{}\"}} {}\n", lab, status, n);
  auto histogram = [&](const char* name, const char* help, const Histogram& h) {
    header(out, name, "histogram", help);
    h.render(out, name, lab);
  };
  histogram("kestrel:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttft_);
  histogram("kestrel:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", itl_);
  histogram("kestrel:e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.", e2e_);
  histogram("kestrel:request_queue_time_seconds", "Histogram of time spent waiting before first scheduled.", queue_);
  histogram("kestrel:request_prefill_time_seconds", "Histogram of time from first scheduled to first token.",
            prefill_);
  histogram("kestrel:request_decode_time_seconds", "Histogram of time from first token to the last.", decode_);
  histogram("kestrel:request_prompt_tokens", "Number of prefill tokens processed, per request.", prompt_hist_);
  histogram("kestrel:request_generation_tokens", "Number of generation tokens processed, per request.",
            generation_hist_);
  histogram("kestrel:time_per_output_token_seconds", "Histogram of a request's mean time per output token.", tpot_);
  histogram("kestrel:iteration_tokens_total", "Histogram of the number of tokens per engine step.",
            Histogram(iteration_token_bounds(), s.iteration_tokens, s.iteration_tokens_sum));
  if (!cache_config_.empty()) {
    header(out, "kestrel:cache_config_info", "gauge", "Information of the cache configuration.");
    std::string labels = lab;
    for (const auto& [k, v] : cache_config_) labels += fmt::format(",{}=\"{}\"", k, label_value(v));
    out += fmt::format("kestrel:cache_config_info{{{}}} 1\n", labels);
  }
  return out;
}

}  // namespace kestrel::server
