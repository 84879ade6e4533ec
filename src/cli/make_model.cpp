// kestrel make-model: write a checkpoint directory with deterministic random weights.
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "core/error.h"
#include "model/make_model.h"
#include "model/model.h"

namespace kestrel::cli {

Runner add_make_model(CLI::App& app) {
  struct Args {
    std::string arch, preset = "tiny", out, hf_overrides;
    uint64_t seed = 0;
    bool tokenizer = false, dummy_weights = false;
  };
  auto a = std::make_shared<Args>();
  auto* mk = app.add_subcommand("make-model", "write a checkpoint with deterministic random weights");
  mk->add_option("--arch", a->arch, "kimi_k3 | kimi_linear | deepseek_v32")->required();
  mk->add_option("--preset", a->preset, "tiny, small (kimi_k3), or a full-size config-only preset");
  mk->add_option("--out", a->out, "output directory")->required();
  mk->add_option("--seed", a->seed, "weight seed");
  mk->add_option("--hf-overrides", a->hf_overrides, "JSON merged into the preset's config, e.g. '{\"num_hidden_layers\": 2}'");
  mk->add_flag("--tokenizer", a->tokenizer, "also write the tokenizer and chat template of a config-only preset");
  mk->add_flag("--dummy-weights", a->dummy_weights,
               "write --load-format dummy's weights as safetensors (any preset, any size; one tensor at a time)");
  return [mk, a]() {
    if (!mk->parsed()) return -1;
    const Preset& p = find_preset(parse_arch(a->arch), a->preset);
    MakeModelOptions o;
    if (!a->hf_overrides.empty()) {
      o.hf_overrides = nlohmann::json::parse(a->hf_overrides, nullptr, false);
      if (o.hf_overrides.is_discarded() || !o.hf_overrides.is_object())
        fail("--hf-overrides must be a JSON object, got {}", a->hf_overrides);
    }
    o.tokenizer = a->tokenizer;
    o.dummy_weights = a->dummy_weights;
    make_model(p, a->out, a->seed, o);
    const ParameterCount n = count_parameters(load_model_config(a->out));
    const char* what = a->dummy_weights ? ", dummy weights" : p.has_weights ? "" : ", config only";
    std::printf("wrote %s (%s %s%s): %.3g parameters, %.3g active\n", a->out.c_str(), arch_name(p.arch),
                p.name.c_str(), what, static_cast<double>(n.total), static_cast<double>(n.active));
    if (!p.notes.empty()) std::printf("%s\n", p.notes.c_str());
    return 0;
  };
}

}  // namespace kestrel::cli
