// kestrel bench serve: load an OpenAI-compatible server and report vLLM's serving metrics (docs/serving.md).
// With --sweep-concurrency it runs once per concurrency and prints the frontier of tokens/s per user against
// tokens/s per device; bench/serve/plot_frontier.py draws it from the saved result.
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/bench_offline.h"
#include "cli/commands.h"
#include "core/error.h"
#include "server/bench_serve.h"

namespace kestrel::cli {
namespace {

struct BenchArgs {
  server::BenchServeOptions opts;
  std::string host, save_result, sweep;
  int port = 0;
  std::vector<std::string> goodput;
  int devices = 1;
};

std::vector<int> parse_levels(const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    int v = 0;
    try {
      v = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || v < 1) fail("--sweep-concurrency: '{}' is not a positive integer", item);
    out.push_back(v);
  }
  if (out.empty()) fail("--sweep-concurrency needs levels, e.g. 1,2,4,8");
  return out;
}

int run_bench_serve(BenchArgs& a) {
  server::BenchServeOptions& o = a.opts;
  if (!a.host.empty() || a.port) o.base_url = fmt::format("http://{}:{}", a.host.empty() ? "127.0.0.1" : a.host,
                                                          a.port ? a.port : 8000);
  for (const std::string& g : a.goodput) {
    const size_t colon = g.find(':');
    const std::string key = g.substr(0, colon);
    if (colon == std::string::npos || (key != "ttft" && key != "tpot" && key != "e2el"))
      fail("--goodput '{}': give ttft:MS, tpot:MS or e2el:MS", g);
    o.goodput[key] = std::stod(g.substr(colon + 1));
  }
  KESTREL_CHECK(a.devices >= 1, "--num-devices must be >= 1");
  nlohmann::ordered_json saved;
  if (a.sweep.empty()) {
    saved = server::bench_serve(o);
    std::printf("%s", server::format_bench_result(saved).c_str());
  } else {
    saved = {{"sweep", nlohmann::ordered_json::array()}, {"num_devices", a.devices}};
    std::string table = fmt::format("{:>12} {:>14} {:>18} {:>18} {:>12} {:>12}\n", "concurrency", "req/s",
                                    "out tok/s/device", "out tok/s/user", "TTFT p50 ms", "TPOT p50 ms");
    const uint64_t seed = o.seed;
    for (int c : parse_levels(a.sweep)) {
      o.max_concurrency = c;
      o.seed = seed + static_cast<uint64_t>(c) * 1000003;  // new prompts: no level finds the last one's in the cache
      nlohmann::ordered_json r = server::bench_serve(o);
      std::printf("%s", server::format_bench_result(r).c_str());
      r["output_throughput_per_device"] = r["output_throughput"].get<double>() / a.devices;
      table += fmt::format("{:>12} {:>14.2f} {:>18.2f} {:>18.2f} {:>12.2f} {:>12.2f}\n", c,
                           r["request_throughput"].get<double>(), r["output_throughput_per_device"].get<double>(),
                           r["output_tokens_per_s_per_user"].get<double>(), r["median_ttft_ms"].get<double>(),
                           r["median_tpot_ms"].get<double>());
      saved["sweep"].push_back(std::move(r));
    }
    std::printf("%s\n%s", fmt::format("{:=^50}", " Concurrency sweep: the frontier ").c_str(), table.c_str());
  }
  if (!a.save_result.empty()) {
    std::ofstream f(a.save_result);
    if (!f) fail("cannot write {}", a.save_result);
    f << saved.dump(2) << "\n";
    std::fprintf(stderr, "[kestrel] wrote %s\n", a.save_result.c_str());
  }
  return 0;
}

}  // namespace

Runner add_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "benchmarks");
  bench->require_subcommand(1);
  auto* cmd = bench->add_subcommand("serve", "load an OpenAI-compatible server; vLLM's serving metrics");
  auto a = std::make_shared<BenchArgs>();
  server::BenchServeOptions& o = a->opts;
  cmd->add_option("--base-url", o.base_url, "server address")->capture_default_str();
  cmd->add_option("--host", a->host, "server host (instead of --base-url)");
  cmd->add_option("--port", a->port, "server port (instead of --base-url)");
  cmd->add_option("--model", o.model, "model name (default: the server's first)");
  cmd->add_option("--dataset,--dataset-name", o.dataset, "random | agentic")->capture_default_str();
  cmd->add_option("--num-prompts", o.num_prompts, "requests to send (agentic: sessions x turns)")
      ->capture_default_str();
  cmd->add_option("--max-concurrency", o.max_concurrency, "requests (agentic: sessions) in flight at most; 0: all");
  cmd->add_option("--request-rate", o.request_rate, "Poisson arrivals per second; 0 or absent: all at once");
  cmd->add_option("--random-input-len", o.random_input_len, "prompt tokens")->capture_default_str();
  cmd->add_option("--random-output-len", o.random_output_len, "output tokens (agentic: per turn)")
      ->capture_default_str();
  cmd->add_option("--random-range-ratio", o.random_range_ratio, "lengths uniform in len*(1 -+ ratio)");
  cmd->add_flag("--ignore-eos", o.ignore_eos, "generate exactly the output length");
  cmd->add_option("--seed", o.seed, "dataset seed");
  cmd->add_option("--goodput", a->goodput, "SLOs, e.g. ttft:500 tpot:50 (ms)");
  cmd->add_option("--save-result", a->save_result, "write the result (JSON)");
  cmd->add_option("--sweep-concurrency", a->sweep, "comma-separated concurrencies: one run each, frontier table");
  cmd->add_option("--num-devices", a->devices, "devices the server runs on (tokens/s per device)");
  cmd->add_option("--agentic-turns", o.agentic_turns, "turns per session")->capture_default_str();
  cmd->add_option("--agentic-prefix-len", o.agentic_prefix_len, "shared system + tools prefix tokens")
      ->capture_default_str();
  cmd->add_option("--agentic-turn-len", o.agentic_turn_len, "tokens a turn appends")->capture_default_str();
  cmd->add_option("--agentic-salt-len", o.agentic_salt_len, "per-user salt tokens before the prefix")
      ->capture_default_str();
  cmd->add_option("--agentic-think-time", o.agentic_think_time, "mean seconds between turns")->capture_default_str();
  cmd->add_option("--request-timeout", o.timeout, "seconds per request")->capture_default_str();
  const Runner offline = add_bench_offline(*bench);
  return [cmd, a, offline]() { return cmd->parsed() ? run_bench_serve(*a) : offline(); };
}

}  // namespace kestrel::cli
