// kestrel make-model: write a checkpoint directory with deterministic random weights.
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "core/error.h"
#include "cpu/cpu_backend.h"
#include "model/dspark.h"
#include "model/lora.h"
#include "model/make_model.h"
#include "model/model.h"

namespace kestrel::cli {

Runner add_make_model(CLI::App& app) {
  struct Args {
    std::string arch, preset = "tiny", out, hf_overrides, lora_out, dspark_out;
    uint64_t seed = 0;
    int lora_rank = 8, dspark_block_size = 5;
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
  mk->add_option("--lora-out", a->lora_out,
                 "also write a random PEFT LoRA adapter over every module LoRA can adapt (a preset with weights)");
  mk->add_option("--lora-rank", a->lora_rank, "the adapter's rank r (lora_alpha = 2r), 1..64");
  mk->add_option("--dspark-out", a->dspark_out,
                 "also write a random DSpark drafter for the model (--speculative-config method dspark; a preset with "
                 "weights)");
  mk->add_option("--dspark-block-size", a->dspark_block_size, "the drafter's dspark_block_size, 1..32")
      ->capture_default_str();
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
    if (!a->lora_out.empty()) {
      KESTREL_CHECK(p.has_weights || a->dummy_weights, "--lora-out needs a checkpoint with weights");
      KESTREL_CHECK(a->lora_rank >= 1 && a->lora_rank <= kMaxLoraRank, "--lora-rank {} is outside [1, {}]",
                    a->lora_rank, kMaxLoraRank);
      const auto m = load_cpu_model(a->out);
      const auto modules = dynamic_cast<const CpuBackend&>(m->backend()).lora_modules();
      write_lora_adapter(a->lora_out, a->lora_rank, 2.0f * static_cast<float>(a->lora_rank), modules, a->seed + 1);
      std::printf("wrote %s: a rank-%d LoRA adapter of %zu modules\n", a->lora_out.c_str(), a->lora_rank,
                  modules.size());
    }
    if (!a->dspark_out.empty()) {
      KESTREL_CHECK(p.has_weights || a->dummy_weights, "--dspark-out needs a checkpoint with weights");
      KESTREL_CHECK(a->dspark_block_size >= 1 && a->dspark_block_size <= 32, "--dspark-block-size {} is outside [1, 32]",
                    a->dspark_block_size);
      write_dspark_drafter(a->dspark_out, a->out, a->seed + 2, a->dspark_block_size);
      std::printf("wrote %s: a DSpark drafter (block %d)\n", a->dspark_out.c_str(), a->dspark_block_size);
    }
    return 0;
  };
}

}  // namespace kestrel::cli
