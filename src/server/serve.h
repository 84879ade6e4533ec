// `kestrel serve`: loads a checkpoint, starts the engine loop and the HTTP server, and runs until SIGTERM/SIGINT,
// on which it stops admitting, lets running requests finish for a grace period, and returns 0.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "engine/engine.h"
#include "model/model.h"

namespace kestrel::server {

struct ServeOptions {
  std::string model_dir;
  std::string host = "0.0.0.0";
  int port = 8000;
  std::string api_key;
  std::string served_model_name;  // empty: the model directory as given
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
  std::optional<uint64_t> seed;        // seeds of requests that give none are drawn from this
  std::function<std::unique_ptr<Backend>()> make_backend;  // empty: the CPU backend
  DeviceAttach attach_device;          // empty: the CPU engine
};

// Serves until a termination signal; returns the process exit code.
int serve(const ServeOptions& opts);

}  // namespace kestrel::server
