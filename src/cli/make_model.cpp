// kestrel make-model: write a checkpoint directory with deterministic random weights.
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "model/make_model.h"

namespace kestrel::cli {

Runner add_make_model(CLI::App& app) {
  struct Args {
    std::string arch, preset = "tiny", out;
    uint64_t seed = 0;
  };
  auto a = std::make_shared<Args>();
  auto* mk = app.add_subcommand("make-model", "write a checkpoint with deterministic random weights");
  mk->add_option("--arch", a->arch, "kimi_k3 | kimi_linear | deepseek_v32")->required();
  mk->add_option("--preset", a->preset, "tiny, small (kimi_k3), or a full-size config-only preset");
  mk->add_option("--out", a->out, "output directory")->required();
  mk->add_option("--seed", a->seed, "weight seed");
  return [mk, a]() {
    if (!mk->parsed()) return -1;
    const Preset& p = find_preset(parse_arch(a->arch), a->preset);
    make_model(p, a->out, a->seed);
    const ParameterCount n = count_parameters(preset_config(p));
    std::printf("wrote %s (%s %s%s): %.3g parameters, %.3g active\n", a->out.c_str(), arch_name(p.arch),
                p.name.c_str(), p.has_weights ? "" : ", config only", static_cast<double>(n.total),
                static_cast<double>(n.active));
    if (!p.notes.empty()) std::printf("%s\n", p.notes.c_str());
    return 0;
  };
}

}  // namespace kestrel::cli
