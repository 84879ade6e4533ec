// kestrel bench latency / throughput (docs/serving.md): the meaning and output of `vllm bench latency` and
// `vllm bench throughput`, measured on the engine in this process (CPU backend). Prompts are random token ids;
// generation ignores the end-of-sequence token, so every completion is exactly --output-len tokens.
#include "cli/bench_offline.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/engine_flags.h"
#include "core/error.h"
#include "core/stats.h"
#include "engine/engine.h"
#include "model/model.h"

namespace kestrel::cli {
namespace {

struct OfflineArgs {
  std::string model_dir, output_json, dataset = "random";
  int input_len = 0, output_len = 0, n = 1;
  uint64_t seed = 0;
  EngineFlags flags;
  int batch_size = 8, num_iters_warmup = 10, num_iters = 30;  // latency
  int num_prompts = 1000;                                     // throughput
};

// The loaded model, its engine and the random prompts every run draws from.
struct Bench {
  std::unique_ptr<Model> model;
  std::shared_ptr<void> device;  // the GPU backend, with --device cuda
  std::unique_ptr<Engine> engine;
  std::mt19937_64 rng;

  explicit Bench(const OfflineArgs& a) : rng(a.seed) {
    KESTREL_CHECK(a.input_len >= 1, "--input-len must be >= 1");
    KESTREL_CHECK(a.output_len >= 1, "--output-len must be >= 1");
    KESTREL_CHECK(a.n >= 1, "--n must be >= 1");
    model = a.flags.load_model(a.model_dir);
    engine = make_engine(*model, a.flags, device);
    print_cache_plan(*engine);
  }

  std::vector<int32_t> random_prompt(int len) {
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(model->config().vocab_size - 1));
    std::vector<int32_t> ids(static_cast<size_t>(len));
    for (int32_t& t : ids) t = token(rng);
    return ids;
  }

  // vLLM's sampling for both benchmarks: temperature 1, top-p 1, the end-of-sequence token ignored.
  static SamplingParams sampling(const OfflineArgs& a, uint64_t request) {
    SamplingParams s;
    s.n = a.n;
    s.max_tokens = a.output_len;
    s.temperature = 1.0f;
    s.ignore_eos = true;
    s.seed = a.seed + request;
    return s;
  }
};

void write_json(const std::string& path, const nlohmann::ordered_json& j) {
  if (path.empty()) return;
  std::ofstream f(path);
  if (!f) fail("cannot write {}", path);
  f << j.dump(4) << "\n";
  std::fprintf(stderr, "[kestrel] wrote %s\n", path.c_str());
}

// With --speculative-config: vLLM's acceptance figures, printed and in the JSON (mean acceptance length = 1 +
// accepted / drafts, the target's own token included; the per-position rate = accepted at it / drafts).
void add_spec_stats(const Engine& engine, nlohmann::ordered_json& j) {
  const SpecDecodeCounters s = engine.stats().spec;
  if (s.accepted_per_pos.empty()) return;
  const double rate = s.num_draft_tokens ? static_cast<double>(s.num_accepted_tokens) / s.num_draft_tokens : 0.0;
  std::vector<double> per_pos;
  for (int64_t n : s.accepted_per_pos) per_pos.push_back(s.num_drafts ? static_cast<double>(n) / s.num_drafts : 0.0);
  std::printf("Mean acceptance length: %.2f\n", s.mean_acceptance_length());
  std::printf("Draft acceptance rate: %.3f (%lld of %lld draft tokens, %lld drafts)\n", rate,
              static_cast<long long>(s.num_accepted_tokens), static_cast<long long>(s.num_draft_tokens),
              static_cast<long long>(s.num_drafts));
  j["spec_decode"] = {{"num_drafts", s.num_drafts},
                      {"num_draft_tokens", s.num_draft_tokens},
                      {"num_accepted_tokens", s.num_accepted_tokens},
                      {"num_accepted_tokens_per_pos", s.accepted_per_pos},
                      {"mean_acceptance_length", s.mean_acceptance_length()},
                      {"draft_acceptance_rate", rate},
                      {"acceptance_rate_per_pos", per_pos}};
}

int run_latency(const OfflineArgs& a) {
  KESTREL_CHECK(a.batch_size >= 1, "--batch-size must be >= 1");
  KESTREL_CHECK(a.num_iters >= 1, "--num-iters must be >= 1");
  KESTREL_CHECK(a.num_iters_warmup >= 0, "--num-iters-warmup must be >= 0");
  Bench b(a);
  // One batch of prompts, sent again every iteration (as vLLM does; with prefix caching on, later iterations find
  // the prompts cached).
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < a.batch_size; ++i) prompts.push_back(b.random_prompt(a.input_len));
  const auto run_batch = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < a.batch_size; ++i) b.engine->add_request(prompts[i], Bench::sampling(a, i));
    for (const RequestOutput& r : b.engine->run_to_completion())
      for (const Completion& c : r.completions)
        KESTREL_CHECK(static_cast<int>(c.token_ids.size()) == a.output_len,
                      "request {} completion {} ended after {} of {} tokens", r.id, c.index, c.token_ids.size(),
                      a.output_len);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::fprintf(stderr, "[kestrel] warming up: %d iteration(s)\n", a.num_iters_warmup);
  for (int i = 0; i < a.num_iters_warmup; ++i) run_batch();
  std::vector<double> latencies;
  for (int i = 0; i < a.num_iters; ++i) latencies.push_back(run_batch());

  std::vector<double> sorted = latencies;
  std::sort(sorted.begin(), sorted.end());
  const double avg = std::accumulate(latencies.begin(), latencies.end(), 0.0) / static_cast<double>(a.num_iters);
  std::printf("Avg latency: %s seconds\n", fmt::format("{}", avg).c_str());
  nlohmann::ordered_json pct;
  for (int p : {10, 25, 50, 75, 90, 99}) {
    const double v = percentile(sorted, p);
    pct[std::to_string(p)] = v;
    std::printf("%d%% percentile latency: %s seconds\n", p, fmt::format("{}", v).c_str());
  }
  nlohmann::ordered_json result = {{"avg_latency", avg}, {"latencies", latencies}, {"percentiles", pct}};
  add_spec_stats(*b.engine, result);
  write_json(a.output_json, result);
  return 0;
}

int run_throughput(const OfflineArgs& a) {
  if (a.dataset != "random") fail("--dataset-name '{}': only the random dataset is built", a.dataset);
  KESTREL_CHECK(a.num_prompts >= 1, "--num-prompts must be >= 1");
  Bench b(a);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < a.num_prompts; ++i) prompts.push_back(b.random_prompt(a.input_len));

  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < a.num_prompts; ++i) b.engine->add_request(prompts[i], Bench::sampling(a, i));
  const std::vector<RequestOutput> outputs = b.engine->run_to_completion();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  int64_t prompt_tokens = 0, output_tokens = 0;
  for (const RequestOutput& r : outputs) {
    prompt_tokens += static_cast<int64_t>(r.prompt.size());
    for (const Completion& c : r.completions) output_tokens += static_cast<int64_t>(c.token_ids.size());
  }
  const int64_t total_tokens = prompt_tokens + output_tokens;
  const double requests = static_cast<double>(outputs.size());
  std::printf("Throughput: %.2f requests/s, %.2f total tokens/s, %.2f output tokens/s\n", requests / elapsed,
              static_cast<double>(total_tokens) / elapsed, static_cast<double>(output_tokens) / elapsed);
  std::printf("Total num prompt tokens:  %lld\n", static_cast<long long>(prompt_tokens));
  std::printf("Total num output tokens:  %lld\n", static_cast<long long>(output_tokens));
  nlohmann::ordered_json result = {{"elapsed_time", elapsed},
                             {"num_requests", outputs.size()},
                             {"total_num_tokens", total_tokens},
                             {"total_num_prompt_tokens", prompt_tokens},
                             {"total_num_output_tokens", output_tokens},
                             {"requests_per_second", requests / elapsed},
                             {"tokens_per_second", static_cast<double>(total_tokens) / elapsed},
                             {"output_tokens_per_second", static_cast<double>(output_tokens) / elapsed}};
  add_spec_stats(*b.engine, result);
  write_json(a.output_json, result);
  return 0;
}

// The flags both benchmarks take; `input_len` and `output_len` defaults are each benchmark's vLLM default.
void add_common(CLI::App& cmd, OfflineArgs& a) {
  cmd.add_option("model_dir", a.model_dir, "checkpoint directory")->required();
  cmd.add_option("--input-len", a.input_len, "prompt tokens")->capture_default_str();
  cmd.add_option("--output-len", a.output_len, "tokens generated per completion")->capture_default_str();
  cmd.add_option("--n", a.n, "completions per prompt")->capture_default_str();
  cmd.add_option("--seed", a.seed, "seed of the random prompts and of sampling")->capture_default_str();
  cmd.add_option("--output-json", a.output_json, "write the result (JSON)");
  add_engine_flags(cmd, a.flags);
}

}  // namespace

Runner add_bench_offline(CLI::App& bench) {
  auto* lat = bench.add_subcommand("latency", "one batch, end to end, repeated; vLLM's bench latency (CPU engine)");
  auto la = std::make_shared<OfflineArgs>();
  la->input_len = 32;
  la->output_len = 128;
  add_common(*lat, *la);
  lat->add_option("--batch-size", la->batch_size, "requests in the batch")->capture_default_str();
  lat->add_option("--num-iters-warmup", la->num_iters_warmup, "untimed iterations first")->capture_default_str();
  lat->add_option("--num-iters", la->num_iters, "timed iterations")->capture_default_str();

  auto* thr = bench.add_subcommand("throughput", "many requests at once; vLLM's bench throughput (CPU engine)");
  auto ta = std::make_shared<OfflineArgs>();
  ta->input_len = 1024;
  ta->output_len = 128;
  add_common(*thr, *ta);
  thr->add_option("--num-prompts", ta->num_prompts, "requests")->capture_default_str();
  thr->add_option("--dataset-name", ta->dataset, "random (random token ids of --input-len)")->capture_default_str();

  return [lat, la, thr, ta]() {
    if (lat->parsed()) return run_latency(*la);
    if (thr->parsed()) return run_throughput(*ta);
    return -1;
  };
}

}  // namespace kestrel::cli
