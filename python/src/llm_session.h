// What the Python `LLM` runs on: one model, its tokenizer and one engine, in this process. A call hands it a batch of
// requests (token ids and sampling parameters) and gets every request's outputs once all have finished: generated
// text (incremental detokenizing and stop strings, as the server does), token ids, log-probabilities of the sampled
// tokens and of the prompt tokens (teacher-forced scoring goes through the same engine path as generation).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "engine/engine.h"
#include "model/model.h"
#include "text/tokenizer.h"

namespace kestrel::python {

struct SessionOptions {
  ModelOptions model;
  LoadOptions load;
  EngineConfig engine;
  std::string device = "cpu";           // "cpu" or "cuda" (resolved)
  double gpu_memory_utilization = 0;    // 0: the GPU backend's default
};

struct GenerateRequest {
  std::vector<int32_t> prompt;
  SamplingParams params;
  std::vector<std::string> stop;
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;
  bool detokenize = true;
  int priority = 0;
};

struct CompletionResult {
  int index = 0;
  std::string text;
  std::vector<int32_t> token_ids;
  std::vector<TokenLogprob> logprobs;  // with params.logprobs >= 0
  std::string finish_reason;           // "stop", "length" or "abort"
  // The stop string or stop token id that ended it (none: the end-of-sequence token, or another reason).
  std::optional<std::variant<int32_t, std::string>> stop_reason;
};

struct GenerateResult {
  std::vector<int32_t> prompt;
  std::vector<CompletionResult> outputs;      // empty for a request that only scores (max_tokens 0)
  std::vector<TokenLogprob> prompt_logprobs;  // positions prompt_logprobs_start, ..., prompt - 1
  int64_t prompt_logprobs_start = 0;
};

class LlmSession {
 public:
  LlmSession(const std::string& model_dir, const SessionOptions& opts);
  ~LlmSession();

  // Runs the requests together (continuous batching) to their ends; results in the order of `requests`. An invalid
  // request is an Error naming it, and then none of the batch runs. Calls from several threads take turns.
  std::vector<GenerateResult> generate(const std::vector<GenerateRequest>& requests);

  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens) const;
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const;
  // The text of one token ("" for an id the tokenizer does not know).
  std::string token_text(int32_t id) const;
  // Forgets every cached prefix (false, changing nothing, while requests run).
  bool reset_prefix_cache() {
    std::lock_guard lock(mu_);
    return engine_->reset_prefix_cache();
  }

  // LoRA adapters (model/lora.h): reads the PEFT directory and loads it as `id`, replacing the weights the id had
  // (an Error naming the file and tensor for a bad adapter, the backend's for one without LoRA).
  void load_lora(int32_t id, const std::string& path, int max_rank);
  void unload_lora(int32_t id) {
    std::lock_guard lock(mu_);
    model_->unload_lora(id);
  }

  const ModelConfig& config() const { return model_->config(); }
  int64_t max_model_len() const { return engine_->max_model_len(); }
  EngineStats stats() const {
    std::lock_guard lock(mu_);
    return engine_->stats();
  }

 private:
  std::unique_ptr<Model> model_;
  text::Tokenizer tokenizer_;
  std::shared_ptr<void> device_;  // what a GPU engine needs, released after the engine
  std::unique_ptr<Engine> engine_;
  mutable std::mutex mu_;  // one caller drives the engine at a time
};

}  // namespace kestrel::python
