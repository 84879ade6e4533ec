// The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (JSON or server-sent events), /v1/models,
// /tokenize, /detokenize, /health, /metrics, /version; the RL routes of rl_api.h. The API side owns text: it tokenises, renders the chat
// template, detokenises incrementally, applies stop strings and runs the reasoning and tool-call parsers; the
// engine loop sees token ids only.
#pragma once
#include <cstdint>
#include <mutex>
#include <random>
#include <optional>
#include <string>
#include <vector>

#include "server/engine_loop.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/output_parser.h"
#include "server/protocol.h"
#include "server/rl_api.h"
#include "server/structured_output.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace kestrel::server {

struct ApiOptions {
  std::string served_model_name;
  std::string model_dir;
  std::string api_key;  // empty: no authentication
  std::optional<ParserFormat> tool_call_parser, reasoning_parser;
  bool enable_auto_tool_choice = false;
  int32_t eos_token_id = -1;
  int64_t vocab_size = 0;
  std::optional<uint64_t> seed;  // seeds requests without one (reproducible runs); none: random
};

class OpenAIApi {
 public:
  // `chat_template` may be null (the checkpoint has none): chat requests then fail with 400.
  OpenAIApi(const ApiOptions& opts, const text::Tokenizer& tok, const text::ChatTemplate* chat_template,
            EngineLoop& loop, ServerMetrics& metrics);

  awaitable<void> handle(HttpExchange& ex);

 private:
  struct Job;
  struct SimpleResponse {
    int status;
    std::string body;
    const char* content_type = "application/json";
  };
  awaitable<void> route(HttpExchange& ex);
  // The routes answered without waiting on the engine.
  SimpleResponse simple_route(const HttpExchange& ex) const;
  awaitable<void> completions(HttpExchange& ex);
  awaitable<void> chat(HttpExchange& ex);
  awaitable<void> generate(HttpExchange& ex, Job& job);
  void check_model(const std::string& model) const;
  std::string render_chat(const Json& messages, const Json& tools, bool add_generation_prompt,
                          bool continue_final_message, const Json& kwargs) const;
  std::vector<int32_t> encode_prompt(const std::string& text) const;
  std::string token_text(int32_t id) const;
  uint64_t draw_seed();

  ApiOptions opts_;
  const text::Tokenizer& tok_;
  const text::ChatTemplate* chat_template_;
  EngineLoop& loop_;
  ServerMetrics& metrics_;
  RlApi rl_;
  int64_t created_;
  std::mutex seed_mu_;
  std::mt19937_64 seed_rng_;
  StructuredOutputs structured_;
};

}  // namespace kestrel::server
