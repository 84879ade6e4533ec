#include "cli/load_flags.h"

#include <cstdio>

#include "core/error.h"

namespace kestrel::cli {

LoadOptions LoadFlags::options(int64_t max_model_len) const {
  LoadOptions lo;
  // fastsafetensors is what Kestrel's own safetensors loading does already: shards memory-mapped, copied straight to
  // the device.
  if (load_format == "fastsafetensors")
    std::fprintf(stderr, "[kestrel] --load-format fastsafetensors: Kestrel's safetensors loading already does what "
                         "fastsafetensors does (shards copied straight to the device through pinned buffers)\n");
  if (load_format == "auto" || load_format == "safetensors" || load_format == "fastsafetensors")
    lo.load_format = "safetensors";
  else if (load_format == "dummy")
    lo.load_format = "dummy";
  else
    fail("--load-format '{}' is not one of auto, safetensors, fastsafetensors, dummy", load_format);
  if (!hf_overrides.empty()) {
    lo.hf_overrides = nlohmann::json::parse(hf_overrides, nullptr, false);
    if (lo.hf_overrides.is_discarded()) fail("--hf-overrides is not valid JSON: {}", hf_overrides);
    if (!lo.hf_overrides.is_object()) fail("--hf-overrides must be a JSON object, got {}", hf_overrides);
  }
  lo.seed = dummy_seed;
  lo.max_model_len = max_model_len;
  return lo;
}

void add_load_flags(CLI::App& cmd, LoadFlags& f) {
  cmd.add_option("--load-format", f.load_format,
                 "auto | safetensors | fastsafetensors | dummy (random weights of the checkpoint's shapes and stored "
                 "dtypes; only config.json is read)")
      ->capture_default_str();
  cmd.add_option("--hf-overrides", f.hf_overrides,
                 "JSON merged into config.json, e.g. '{\"num_hidden_layers\": 4}' (unknown keys are an error)");
  cmd.add_option("--dummy-seed", f.dummy_seed, "seed of --load-format dummy's weights")->capture_default_str();
}

}  // namespace kestrel::cli
