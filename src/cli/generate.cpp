// kestrel generate: offline generation of many prompts at once through the engine, on the CPU reference.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "core/error.h"
#include "core/npy.h"
#include "engine/engine.h"
#include "model/model.h"
#include "text/tokenizer.h"

namespace kestrel::cli {
namespace {

std::vector<int32_t> parse_ids(const std::string& s, const char* flag) {
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
      if (used != tok.size() || v < 0 || v > INT32_MAX) fail("{}: '{}' is not a token id", flag, tok);
      ids.push_back(static_cast<int32_t>(v));
    }
    i = j + 1;
  }
  return ids;
}

struct GenerateArgs {
  std::string model_dir, dump_logits, output_json, stop_token_ids;
  std::vector<std::string> prompt_ids;
  std::vector<std::string> prompts;  // text, encoded with the checkpoint's tokenizer
  SamplingParams sampling;
  EngineFlags flags;
};

int run_generate(GenerateArgs a) {
  if (a.prompt_ids.empty() && a.prompts.empty()) fail("generate needs --prompt TEXT or --prompt-ids IDS");
  std::vector<std::vector<int32_t>> prompts;
  for (const std::string& p : a.prompt_ids) {
    prompts.push_back(parse_ids(p, "--prompt-ids"));
    if (prompts.back().empty()) fail("--prompt-ids: no token ids given");
  }
  std::optional<text::Tokenizer> tokenizer;
  if (!a.prompts.empty()) tokenizer = text::Tokenizer::load(a.model_dir);
  for (const std::string& p : a.prompts) {
    prompts.push_back(tokenizer->encode(p));
    if (prompts.back().empty()) fail("--prompt: the text encodes to no tokens");
  }
  const bool dump = !a.dump_logits.empty();
  if (dump && (prompts.size() != 1 || a.sampling.n != 1))
    fail("--dump-logits writes the logits of one sequence: give one --prompt-ids and --n 1");
  if (!a.stop_token_ids.empty()) a.sampling.stop_token_ids = parse_ids(a.stop_token_ids, "--stop-token-ids");

  const auto t0 = std::chrono::steady_clock::now();
  const auto model = a.flags.load_model(a.model_dir);
  const ModelConfig& cfg = model->config();
  const auto t1 = std::chrono::steady_clock::now();
  std::shared_ptr<void> device;
  const std::unique_ptr<Engine> engine_ptr = make_engine(*model, a.flags, device);
  Engine& engine = *engine_ptr;
  print_cache_plan(engine);

  for (auto& p : prompts) engine.add_request(p, a.sampling, 0, dump);
  const std::vector<RequestOutput> outputs = engine.run_to_completion();
  const auto t2 = std::chrono::steady_clock::now();

  std::ofstream json;
  if (!a.output_json.empty()) {
    json.open(a.output_json);
    if (!json) fail("cannot write {}", a.output_json);
  }
  int64_t generated = 0;
  for (const RequestOutput& r : outputs)
    for (const Completion& c : r.completions) {
      // Each completion is printed in the form its prompt came in: ids for --prompt-ids, text for --prompt.
      if (r.id >= static_cast<RequestId>(a.prompt_ids.size())) {
        std::printf("%s\n", nlohmann::json(tokenizer->decode(c.token_ids)).dump().c_str());
      } else {
        std::string ids;
        for (int32_t t : c.token_ids) ids += fmt::format("{}{}", ids.empty() ? "" : " ", t);
        std::printf("%s\n", ids.c_str());
      }
      generated += static_cast<int64_t>(c.token_ids.size());
      if (json.is_open()) {
        nlohmann::json j{{"request", r.id},        {"index", c.index},
                         {"prompt_ids", r.prompt}, {"output_ids", c.token_ids},
                         {"finish_reason", finish_reason_name(c.finish)}};
        if (a.sampling.logprobs >= 0) {
          nlohmann::json lps = nlohmann::json::array();
          for (const TokenLogprob& lp : c.logprobs) {
            nlohmann::json top = nlohmann::json::array();
            for (const auto& [t, l] : lp.top) top.push_back({t, l});
            lps.push_back({{"token", lp.token}, {"logprob", lp.logprob}, {"top", top}});
          }
          j["logprobs"] = lps;
        }
        json << j.dump() << "\n";
      }
      if (dump) {
        const int64_t V = cfg.vocab_size;
        write_npy(a.dump_logits, c.logits.data(), {static_cast<int64_t>(c.logits.size()) / V, V});
      }
    }
  const EngineStats st = engine.stats();
  std::fprintf(stderr,
               "[kestrel] %s: load %.3f s; %zu prompt(s), %lld tokens generated in %lld steps (%lld tokens computed) "
               "%.3f s; prefix cache: %lld of %lld tokens hit, KDA checkpoints %lld taken / %lld used; %lld "
               "preemption(s)\n",
               arch_name(cfg.arch), std::chrono::duration<double>(t1 - t0).count(), prompts.size(),
               static_cast<long long>(generated), static_cast<long long>(st.steps),
               static_cast<long long>(st.computed_tokens), std::chrono::duration<double>(t2 - t1).count(),
               static_cast<long long>(st.prefix.hit_tokens), static_cast<long long>(st.prefix.query_tokens),
               static_cast<long long>(st.prefix.checkpoints_taken), static_cast<long long>(st.prefix.checkpoints_used),
               static_cast<long long>(st.preemptions));
  if (!st.spec.accepted_per_pos.empty())
    std::fprintf(stderr,
                 "[kestrel] speculative decoding: %lld drafts, %lld of %lld draft tokens accepted, mean acceptance "
                 "length %.2f\n",
                 static_cast<long long>(st.spec.num_drafts), static_cast<long long>(st.spec.num_accepted_tokens),
                 static_cast<long long>(st.spec.num_draft_tokens), st.spec.mean_acceptance_length());
  return 0;
}

}  // namespace

Runner add_generate(CLI::App& app) {
  auto* gen = app.add_subcommand("generate", "offline generation of many prompts at once through the engine (CPU)");
  auto g = std::make_shared<GenerateArgs>();
  SamplingParams& s = g->sampling;
  gen->add_option("model_dir", g->model_dir, "checkpoint directory")->required();
  gen->add_option("--prompt-ids", g->prompt_ids, "comma-separated token ids of one prompt; repeat for more prompts");
  gen->add_option("--prompt", g->prompts, "prompt text, encoded with the checkpoint's tokenizer; repeat for more");
  gen->add_option("--max-tokens", s.max_tokens, "tokens to generate per completion")->capture_default_str();
  gen->add_option("--n", s.n, "completions per prompt (they share the prompt's cache rows)")->capture_default_str();
  gen->add_option("--temperature", s.temperature, "0 = greedy (default)");
  gen->add_option("--top-p", s.top_p, "nucleus sampling mass");
  gen->add_option("--top-k", s.top_k, "sample among the k most likely tokens (0: all)");
  gen->add_option("--min-p", s.min_p, "drop tokens below min-p times the most likely one's probability");
  gen->add_option("--presence-penalty", s.presence_penalty, "subtracted from logits of generated tokens");
  gen->add_option("--frequency-penalty", s.frequency_penalty, "subtracted per occurrence among generated tokens");
  gen->add_option("--repetition-penalty", s.repetition_penalty, "divides (or multiplies) logits of seen tokens");
  gen->add_option("--seed", s.seed, "sampling seed (each completion draws its own stream)");
  gen->add_option("--logprobs", s.logprobs, "log-probabilities with this many top alternatives (in --output-json)");
  gen->add_option("--stop-token-ids", g->stop_token_ids, "comma-separated ids that end a completion");
  gen->add_flag("--ignore-eos", s.ignore_eos, "do not stop at the end-of-sequence token");
  add_engine_flags(*gen, g->flags);
  gen->add_option("--dump-logits", g->dump_logits, "write fp32 logits [positions, vocab] of one sequence as .npy");
  gen->add_option("--output-json", g->output_json, "write one JSON object per completion (JSON Lines)");
  return [gen, g]() { return gen->parsed() ? run_generate(*g) : -1; };
}

}  // namespace kestrel::cli
