// `kestrel make-model`: presets of the three architectures and complete, loadable checkpoint directories with
// deterministic random weights (config.json, safetensors, tokenizer files, chat template).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"

namespace kestrel {

struct Preset {
  std::string name;
  Arch arch;
  bool has_weights;   // false: a full-size config for planning and single-layer benchmarks only
  std::string notes;  // which values are assumptions
};
const std::vector<Preset>& presets();
const Preset& find_preset(Arch arch, const std::string& name);  // Error listing the valid names
ModelConfig preset_config(const Preset& p);

struct ParameterCount {
  int64_t total = 0;
  int64_t active = 0;  // per token: everything but the routed experts, plus top-k of them
};
ParameterCount count_parameters(const ModelConfig& cfg);

struct MakeModelOptions {
  nlohmann::json hf_overrides = nlohmann::json::object();  // merged into the preset's config (--hf-overrides)
  bool tokenizer = false;  // also for a config-only preset: the trained tokenizer and chat template
  // The weights of --load-format dummy written as safetensors (any preset; one tensor at a time), in place of the
  // preset's own (the tiny and small presets' weights come from build_weights).
  bool dummy_weights = false;
};

// Writes the checkpoint directory `out` (created if needed). Weights are drawn from a counter-based generator
// keyed by (seed, tensor name), so the same seed gives the same bytes on every machine.
void make_model(const Preset& p, const std::string& out, uint64_t seed, const MakeModelOptions& o = {});

}  // namespace kestrel
