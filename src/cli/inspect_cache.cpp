// kestrel inspect-cache: the packed cache of a model per GPU (bytes per token, row layout, padding, capacity).
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "core/error.h"
#include "engine/cache_report.h"
#include "model/make_model.h"

namespace kestrel::cli {
namespace {

struct InspectArgs {
  std::string model_dir, preset, arch, kv_cache_dtype = "fp8", index_dtype = "fp8";
  CacheReportOptions report;
};

const Preset& preset_by_name(const std::string& name, const std::string& arch) {
  if (!arch.empty()) return find_preset(parse_arch(arch), name);
  const Preset* found = nullptr;
  std::string names;
  for (const Preset& p : presets()) {
    names += fmt::format("{}{} ({})", names.empty() ? "" : ", ", p.name, arch_name(p.arch));
    if (p.name != name) continue;
    if (found) fail("preset '{}' exists for several architectures: give --arch", name);
    found = &p;
  }
  if (!found) fail("no preset '{}'; presets: {}", name, names);
  return *found;
}

int run_inspect(InspectArgs a) {
  if (a.model_dir.empty() == a.preset.empty()) fail("inspect-cache needs exactly one of --model and --preset");
  if (a.kv_cache_dtype == "nvfp4") a.report.latent = LatentCacheDtype::nvfp4;
  else if (a.kv_cache_dtype != "fp8") fail("--kv-cache-dtype '{}' is not one of fp8, nvfp4", a.kv_cache_dtype);
  if (a.index_dtype == "mxfp4") a.report.index_keys = IndexKeyDtype::mxfp4;
  else if (a.index_dtype != "fp8") fail("--index-dtype '{}' is not one of fp8, mxfp4", a.index_dtype);
  ModelConfig cfg;
  std::string title;
  if (!a.preset.empty()) {
    const Preset& p = preset_by_name(a.preset, a.arch);
    cfg = preset_config(p);
    title = p.name;
  } else {
    cfg = ModelConfig::load(a.model_dir + "/config.json");
    title = a.model_dir;
  }
  std::fputs(format_cache_report(inspect_cache(cfg, title, a.report)).c_str(), stdout);
  return 0;
}

}  // namespace

Runner add_inspect_cache(CLI::App& app) {
  auto* cmd = app.add_subcommand("inspect-cache", "the packed cache per GPU: bytes per token, rows, capacity");
  auto a = std::make_shared<InspectArgs>();
  cmd->add_option("--model", a->model_dir, "checkpoint directory (its config.json)");
  cmd->add_option("--preset", a->preset, "a make-model preset, e.g. k3.1-pro");
  cmd->add_option("--arch", a->arch, "architecture of the preset, where the name is ambiguous (tiny, small)");
  cmd->add_option("--kv-cache-dtype", a->kv_cache_dtype, "MLA latent: fp8 | nvfp4")->capture_default_str();
  cmd->add_option("--index-dtype", a->index_dtype, "DSA index keys: fp8 | mxfp4")->capture_default_str();
  cmd->add_option("--tp", a->report.tp, "tensor-parallel GPUs")->capture_default_str();
  cmd->add_option("--dcp", a->report.dcp, "decode-context-parallel GPUs (within the TP group)")->capture_default_str();
  cmd->add_option("--cache-gib,--gpu-memory", a->report.cache_gib, "cache budget per GPU in GiB (capacity table)");
  cmd->add_option("--block-size", a->report.block_size, "tokens per row (0: the planner's choice)");
  cmd->add_option("--max-model-len", a->report.max_model_len, "full-request length (0: the config's context length)");
  return [cmd, a]() { return cmd->parsed() ? run_inspect(*a) : -1; };
}

}  // namespace kestrel::cli
