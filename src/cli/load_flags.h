// vLLM's loading flags, shared by serve, generate and the offline benchmarks: --load-format (auto | safetensors |
// fastsafetensors | dummy), --hf-overrides JSON, and --dummy-seed for dummy weights.
#pragma once
#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

#include "model/model.h"

namespace kestrel::cli {

struct LoadFlags {
  std::string load_format = "auto", hf_overrides;
  uint64_t dummy_seed = 0;
  // Error naming the flag whose value is wrong (an unknown format, --hf-overrides that is not a JSON object).
  LoadOptions options(int64_t max_model_len) const;
};

void add_load_flags(CLI::App& cmd, LoadFlags& f);

}  // namespace kestrel::cli
