// The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (JSON or server-sent events), /v1/models,
// /tokenize, /detokenize, /health, /metrics, /version; the RL routes of rl_api.h. The API side owns text: it tokenises, renders the chat
// template, detokenises incrementally, applies stop strings and runs the reasoning and tool-call parsers; the
// engine loop sees token ids only.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <random>
#include <optional>
#include <string>
#include <vector>

#include "server/engine_loop.h"
#include "server/http_server.h"
#include "server/lora_api.h"
#include "server/metrics.h"
#include "server/output_parser.h"
#include "server/protocol.h"
#include "server/rl_api.h"
#include "server/structured_output.h"
#include "server/text_pool.h"
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
  // Text work (parsing, chat template, tokenising) runs on its own threads behind a bounded queue (429 when full).
  int text_threads = 2;
  size_t text_queue = 256;
  double template_seconds = 10;  // wall-time budget of one chat-template render
  std::vector<std::string> model_aliases;  // more names a request's `model` may use
  Json generation_defaults = Json::object();  // sampling fields of generation_config.json, for requests without them
  int max_logprobs = 20;
};

// The sampling defaults of MODEL_DIR/generation_config.json as request fields (vLLM's --generation-config auto):
// temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens. Empty when absent.
Json generation_defaults(const std::string& dir);

class OpenAIApi {
 public:
  // `chat_template` may be null (the checkpoint has none): chat requests then fail with 400. `lora` may be null (no
  // LoRA routes: they answer that LoRA is not enabled).
  OpenAIApi(const ApiOptions& opts, const text::Tokenizer& tok, const text::ChatTemplate* chat_template,
            EngineLoop& loop, ServerMetrics& metrics, LoraApi* lora = nullptr);

  awaitable<void> handle(HttpExchange& ex);
  // SIGTERM: running renders are cancelled, queued text work gets 503, the text threads are joined.
  void stop_text_work() { text_pool_.stop(); }
  // Where /metrics reads kestrel:num_open_connections (the HTTP server, made after the API).
  void set_open_connections(std::function<int()> f) { open_connections_ = std::move(f); }

 private:
  struct Job;
  struct SimpleResponse {
    int status;
    std::string body;
    const char* content_type = "application/json";
  };
  awaitable<void> route(HttpExchange& ex);
  // The routes answered without waiting on the engine.
  SimpleResponse simple_route(const HttpExchange& ex, const std::atomic<bool>* cancel = nullptr) const;
  // Runs `work` on the text threads and waits for it; a client that goes away cancels it. False when the client
  // went away (nothing is to be answered). `answer`: the work builds the answer of a request the engine has
  // served; it is not refused for a full queue, and after SIGTERM (the text threads stopped, running requests
  // still finishing) it runs here instead.
  awaitable<bool> off_thread(HttpExchange& ex, std::function<void(const std::atomic<bool>&)> work,
                             bool answer = false);
  awaitable<void> completions(HttpExchange& ex);
  awaitable<void> chat(HttpExchange& ex);
  void prepare_completions(const std::string& body, Job& job, const std::atomic<bool>& cancel);
  void prepare_chat(const std::string& body, Job& job, const std::atomic<bool>& cancel);
  void prepare_chat_json(Json& body, Job& job, const std::atomic<bool>& cancel);
  awaitable<void> responses(HttpExchange& ex);
  awaitable<void> generate(HttpExchange& ex, Job& job);
  // The LoRA adapter id a request's `model` names (0: the base model); 404 for a name the server does not serve.
  int32_t check_model(const std::string& model) const;
  void apply_defaults(Json& body) const;
  std::string render_chat(const Json& messages, const Json& tools, bool add_generation_prompt,
                          bool continue_final_message, const Json& kwargs, const std::atomic<bool>* cancel) const;
  // Refuses (400, before any tokenising) a text whose length alone puts it over max_model_len.
  void check_text_length(const std::string& text, const char* param) const;
  std::vector<int32_t> encode_prompt(const std::string& text) const;
  std::string token_text(int32_t id) const;
  uint64_t draw_seed();

  ApiOptions opts_;
  const text::Tokenizer& tok_;
  const text::ChatTemplate* chat_template_;
  EngineLoop& loop_;
  ServerMetrics& metrics_;
  LoraApi* lora_;
  RlApi rl_;
  int64_t created_;
  std::mutex seed_mu_;
  std::mt19937_64 seed_rng_;
  StructuredOutputs structured_;
  std::function<int()> open_connections_;
  TextPool text_pool_;  // last: its threads stop before the members they use go
};

}  // namespace kestrel::server
