// `kestrel serve`: loads a checkpoint, starts the engine loop and the HTTP server, and runs until SIGTERM/SIGINT,
// on which it stops admitting, lets running requests finish for a grace period, and returns 0.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model/model.h"
#include "server/lora_api.h"

namespace kestrel::server {

struct ServeOptions {
  std::string model_dir;
  std::string host = "0.0.0.0";
  int port = 8000;
  std::string api_key;
  std::string served_model_name;  // empty: the model directory as given
  std::vector<std::string> model_aliases;  // more names requests may use (several --served-model-name)
  std::string generation_config_dir;       // where generation_config.json gives default sampling; empty: none
  int max_logprobs = 20;                   // --max-logprobs
  std::string allowed_origins = "[\"*\"]";    // CORS (--allowed-origins), a JSON list
  std::string chat_template;      // a file overriding the checkpoint's template
  std::string tool_call_parser, reasoning_parser;  // empty: none
  bool enable_auto_tool_choice = false;
  ModelOptions model;
  LoadOptions load;
  EngineConfig engine;
  int64_t max_queued_requests = 1024;  // requests in flight beyond which new ones get 429
  uint64_t max_request_bytes = uint64_t{32} << 20;
  int http_threads = 4;
  int max_connections = 4096;
  double shutdown_timeout = 30;        // seconds running requests get after SIGTERM
  double keep_alive_timeout = 5;       // an idle keep-alive connection is closed after this many seconds
  double header_timeout = 10;          // a request's header must arrive within this many seconds
  double body_min_rate = 16384;        // bytes/s a request body must average (after header_timeout)
  int text_threads = 2;                // threads rendering chat templates and tokenising
  int64_t max_text_queue = 256;        // requests waiting for those threads beyond which new ones get 429
  std::optional<uint64_t> seed;        // seeds of requests that give none are drawn from this
  LoraOptions lora;                    // --enable-lora, --max-loras, --max-lora-rank
  std::vector<std::pair<std::string, std::string>> lora_modules;  // --lora-modules: (name, path), loaded at start
  std::function<std::unique_ptr<Backend>()> make_backend;  // empty: the CPU backend
  DeviceAttach attach_device;          // empty: the CPU engine
};

// Serves until a termination signal; returns the process exit code.
int serve(const ServeOptions& opts);

}  // namespace kestrel::server
