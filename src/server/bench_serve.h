// `kestrel bench serve`: a load generator for OpenAI-compatible servers (Kestrel, vLLM, SGLang) that reports what
// `vllm bench serve` reports. Requests are streaming completions of token-id prompts, sent at a Poisson rate under
// a concurrency cap, on one Asio thread (timestamps are taken as chunks arrive).
//
// Datasets:
//  random   prompts of --random-input-len tokens (+- --random-range-ratio), --random-output-len tokens out.
//  agentic  multi-turn sessions: a per-user salt, then a long system + tools prefix, then turns that each append a
//           user message of a few hundred tokens and the previous answer to the growing context; short outputs;
//           think time between turns. It reports the prefix-cache hit rate it achieved (from the usage of the
//           responses, and from the server's /metrics when it has Kestrel's or vLLM's counters).
// Prompt tokens come from the server's /tokenize of random words, so every id is valid for its tokenizer.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kestrel::server {

struct BenchServeOptions {
  std::string base_url = "http://127.0.0.1:8000";
  std::string model;              // empty: the first of /v1/models
  std::string dataset = "random";
  int num_prompts = 100;          // requests (agentic: sessions x turns)
  int max_concurrency = 0;        // 0: no cap (agentic: sessions at once; 0 = all)
  double request_rate = 0;        // requests (agentic: sessions) per second; 0: all at once
  int random_input_len = 1024, random_output_len = 128;
  double random_range_ratio = 0;
  bool ignore_eos = false;
  uint64_t seed = 0;
  std::map<std::string, double> goodput;  // SLOs in ms: ttft, tpot, e2el
  // agentic
  int agentic_turns = 5;
  int agentic_prefix_len = 2048, agentic_turn_len = 256, agentic_salt_len = 16;
  double agentic_think_time = 0.2;  // mean seconds between a reply and the next turn (exponential)
  double timeout = 600;             // seconds per request
};

// Runs the benchmark; returns the result object (the vLLM keys, plus prefix_hit_rate for agentic).
nlohmann::ordered_json bench_serve(const BenchServeOptions& opts);
// The human-readable summary, in vllm bench serve's layout.
std::string format_bench_result(const nlohmann::ordered_json& result);

}  // namespace kestrel::server
