// The engine and model flags that the in-process commands (generate, bench latency, bench throughput) share, with
// one meaning everywhere.
#pragma once
#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

#include "engine/engine.h"
#include "model/model.h"

namespace kestrel::cli {

struct EngineFlags {
  std::string kv_cache_dtype = "auto", index_dtype = "fp8", kda_prefill = "chunked";
  EngineConfig engine;
  int64_t cache_mib = 256;
  bool no_prefix_caching = false;

  // Error naming the flag whose value is not one of its choices.
  ModelOptions model_options() const;
  EngineConfig engine_config() const;
};

// --kv-cache-dtype, --index-dtype, --kda-prefill, --max-num-batched-tokens, --max-num-seqs, --cache-mib,
// --block-size, --max-model-len, --no-prefix-caching.
void add_engine_flags(CLI::App& cmd, EngineFlags& f);

// The cache layout an engine chose, one line on stderr.
void print_cache_plan(const Engine& engine);

}  // namespace kestrel::cli
