// The routes an RL framework drives the server with, as vLLM names them: POST /pause (?mode=abort|wait|keep,
// &clear_cache=true|false), POST /resume, GET /is_paused, and POST /v1/score_tokens, the teacher-forced
// log-probability of every given token of a sequence through the engine that generates (docs/serving.md). Weight
// updates are not here yet.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

#include "server/engine_loop.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "text/tokenizer.h"

namespace kestrel::server {

class RlApi {
 public:
  RlApi(std::string served_model_name, const text::Tokenizer& tok, int64_t vocab_size, EngineLoop& loop,
        ServerMetrics& metrics)
      : model_name_(std::move(served_model_name)), tok_(tok), vocab_size_(vocab_size), loop_(loop), metrics_(metrics) {}

  // Runs text work (parsing, tokenising; with `answer`, building the answer of a served request) off the HTTP
  // threads and waits for it; false when the client went away.
  using OffThread =
      std::function<awaitable<bool>(HttpExchange&, std::function<void(const std::atomic<bool>&)>, bool answer)>;
  void set_off_thread(OffThread f) { off_thread_ = std::move(f); }
  // The LoRA adapter id a request's `model` names (0: the served names and none), throwing ApiError 404 for an
  // unknown name (OpenAIApi::check_model, the one check of a request's model). Required.
  void set_model_resolver(std::function<int32_t(const std::string&)> f) { resolve_model_ = std::move(f); }

  static bool handles(const std::string& path);
  // Throws ApiError for a bad request (the caller replies with it).
  awaitable<void> handle(HttpExchange& ex);

 private:
  awaitable<void> pause(HttpExchange& ex);
  awaitable<void> score_tokens(HttpExchange& ex);
  // `param` names the field in a 400 (a text too long to fit max_model_len whatever its tokens).
  std::vector<int32_t> ids_of(const std::variant<std::string, std::vector<int32_t>>& prompt, bool add_special,
                              const char* param) const;

  std::string model_name_;
  const text::Tokenizer& tok_;
  int64_t vocab_size_;
  EngineLoop& loop_;
  ServerMetrics& metrics_;
  OffThread off_thread_;
  std::function<int32_t(const std::string&)> resolve_model_;
};

}  // namespace kestrel::server
