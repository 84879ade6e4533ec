// kestrel generate: offline generation on the CPU reference.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "core/npy.h"
#include "engine/sampler.h"
#include "model/model.h"

namespace kestrel::cli {
namespace {

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = s.find_first_of(", ", i);
    if (j == std::string::npos) j = s.size();
    if (j > i) {
      const std::string tok = s.substr(i, j - i);
      size_t used = 0;
      long long v = 0;
      try {
        v = std::stoll(tok, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != tok.size() || v < 0 || v > INT32_MAX) fail("--prompt-ids: '{}' is not a token id", tok);
      ids.push_back(static_cast<int32_t>(v));
    }
    i = j + 1;
  }
  if (ids.empty()) fail("--prompt-ids: no token ids given");
  return ids;
}

struct GenerateArgs {
  std::string model_dir, prompt_ids, prompt, dump_logits, output_json, kv_cache_dtype = "auto";
  int max_tokens = 16;
  float temperature = 0.0f, top_p = 1.0f;
  uint64_t seed = 0;
  bool ignore_eos = false;
};

int run_generate(const GenerateArgs& a) {
  if (!a.prompt.empty())
    fail("--prompt needs the tokenizer, which this build does not have yet; pass --prompt-ids");
  if (a.prompt_ids.empty()) fail("generate needs --prompt-ids");
  KESTREL_CHECK(a.max_tokens >= 1, "--max-tokens must be >= 1, got {}", a.max_tokens);
  ModelOptions opts;
  if (a.kv_cache_dtype == "fp8") opts.latent_cache = LatentCacheDtype::fp8;
  else if (a.kv_cache_dtype != "auto") fail("--kv-cache-dtype '{}' is not supported on the CPU (auto, fp8)", a.kv_cache_dtype);

  const auto t0 = std::chrono::steady_clock::now();
  const auto model = Model::load(a.model_dir, opts);
  const ModelConfig& cfg = model->config();
  const auto t1 = std::chrono::steady_clock::now();

  std::vector<int32_t> prompt = parse_ids(a.prompt_ids);
  const int64_t V = cfg.vocab_size;
  const bool dump = !a.dump_logits.empty();
  std::vector<float> all_logits, logits(static_cast<size_t>(prompt.size()) * V);
  SequenceState seq = model->new_sequence();
  model->forward(seq, prompt.data(), static_cast<int64_t>(prompt.size()), logits.data(), !dump);
  const float* last = logits.data() + (dump ? (prompt.size() - 1) * V : 0);
  if (dump) all_logits = logits;
  const auto t2 = std::chrono::steady_clock::now();

  Sampler sampler(SamplingParams{a.temperature, a.top_p, a.seed});
  std::vector<int32_t> out;
  std::vector<float> step(V);
  for (int i = 0; i < a.max_tokens; ++i) {
    const int32_t tok = sampler.sample(last, V);
    out.push_back(tok);
    if ((!a.ignore_eos && tok == cfg.eos_token_id) || i + 1 == a.max_tokens) break;
    model->forward(seq, &tok, 1, step.data());
    if (dump) all_logits.insert(all_logits.end(), step.begin(), step.end());
    last = step.data();
  }
  const auto t3 = std::chrono::steady_clock::now();

  std::string ids;
  for (int32_t t : out) ids += fmt::format("{}{}", ids.empty() ? "" : " ", t);
  std::printf("%s\n", ids.c_str());
  const double load_s = std::chrono::duration<double>(t1 - t0).count();
  const double prefill_s = std::chrono::duration<double>(t2 - t1).count();
  const double decode_s = std::chrono::duration<double>(t3 - t2).count();
  std::fprintf(stderr, "[kestrel] %s: load %.3f s, prefill %zu tokens %.3f s, decode %zu tokens %.3f s\n",
               arch_name(cfg.arch), load_s, prompt.size(), prefill_s, out.size(), decode_s);
  if (dump) write_npy(a.dump_logits, all_logits.data(), {static_cast<int64_t>(all_logits.size() / V), V});
  if (!a.output_json.empty()) {
    std::ofstream f(a.output_json);
    if (!f) fail("cannot write {}", a.output_json);
    f << nlohmann::json{{"prompt_ids", prompt}, {"output_ids", out}}.dump() << "\n";
  }
  return 0;
}

}  // namespace

Runner add_generate(CLI::App& app) {
  auto* gen = app.add_subcommand("generate", "offline generation on the CPU reference");
  auto g = std::make_shared<GenerateArgs>();
  gen->add_option("model_dir", g->model_dir, "checkpoint directory")->required();
  gen->add_option("--prompt-ids", g->prompt_ids, "comma-separated token ids");
  gen->add_option("--prompt", g->prompt, "prompt text (needs the tokenizer)");
  gen->add_option("--max-tokens", g->max_tokens, "tokens to generate");
  gen->add_option("--temperature", g->temperature, "0 = greedy (default)");
  gen->add_option("--top-p", g->top_p, "nucleus sampling mass");
  gen->add_option("--seed", g->seed, "sampling seed");
  gen->add_flag("--ignore-eos", g->ignore_eos, "do not stop at the end-of-sequence token");
  gen->add_option("--kv-cache-dtype", g->kv_cache_dtype, "auto | fp8");
  gen->add_option("--dump-logits", g->dump_logits, "write fp32 logits [positions, vocab] as .npy");
  gen->add_option("--output-json", g->output_json, "write prompt and output ids as JSON");
  return [gen, g]() { return gen->parsed() ? run_generate(*g) : -1; };
}

}  // namespace kestrel::cli
