// The engine and model flags that the in-process commands (generate, bench latency, bench throughput) share, with
// one meaning everywhere.
#pragma once
#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/load_flags.h"
#include "engine/engine.h"
#include "model/model.h"

namespace kestrel::cli {

struct EngineFlags {
  std::string kv_cache_dtype = "auto", index_dtype = "fp8", kda_prefill = "chunked";
  EngineConfig engine;
  int64_t cache_mib = 256;
  bool no_prefix_caching = false;
  std::string device = "auto";
  std::string speculative_config;  // --speculative-config JSON (engine/spec_decode.h)
  double gpu_memory_utilization = 0;
  LoadFlags load;

  // Error naming the flag whose value is not one of its choices.
  ModelOptions model_options() const;
  EngineConfig engine_config() const;
  // "cpu" or "cuda" (cli/device.h).
  std::string resolved_device() const;
  // The model of `dir` on the flags' device, loaded as the load flags say.
  std::unique_ptr<Model> load_model(const std::string& dir) const;
};

// An engine on the flags' device; `keep` holds what the engine's device needs (declare it before the engine).
std::unique_ptr<Engine> make_engine(const Model& model, const EngineFlags& f, std::shared_ptr<void>& keep);

// --kv-cache-dtype, --index-dtype, --kda-prefill, --max-num-batched-tokens, --max-num-seqs, the step budget flags,
// --cache-mib, --block-size, --max-model-len, --no-prefix-caching, --device, --gpu-memory-utilization, and the load
// flags.
void add_engine_flags(CLI::App& cmd, EngineFlags& f);

// The prompt share of a step (engine/scheduler.h): --long-prefill-token-threshold, --max-itl-factor; and their
// check (an Error naming the flag).
void add_step_budget_flags(CLI::App& cmd, EngineConfig& e);
void check_step_budget_flags(const EngineConfig& e);

// The cache layout an engine chose, one line on stderr.
void print_cache_plan(const Engine& engine);

}  // namespace kestrel::cli
