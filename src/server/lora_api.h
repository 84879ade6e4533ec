// LoRA adapters in the server (issue #20), as vLLM serves them: `--enable-lora` with `--lora-modules name=path`
// loads adapters at start, POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter
// {"lora_name"} load and unload them while the server runs, and a request whose `model` is an adapter's name runs
// through it (base model: the served name). /v1/models lists the adapters with the base model as their parent.
//
// An adapter's file is read and checked on the text threads; it is handed to the model on the engine thread between
// two steps (EngineLoop::post), so no step sees half an adapter. Each name gets an id of its own, never reused, so
// the prefix cache never shares blocks across adapters or across a name's reloads. An adapter that requests in
// flight run through is not unloaded or replaced (400): their tokens would mix two sets of weights.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/model.h"
#include "server/engine_loop.h"
#include "server/http_server.h"

namespace kestrel::server {

struct LoraOptions {
  bool enabled = false;  // --enable-lora
  int max_loras = 1;     // --max-loras: adapters loaded at once
  int max_lora_rank = 16;  // --max-lora-rank
};

class LoraApi {
 public:
  LoraApi(LoraOptions opts, Model& model, EngineLoop& loop, std::vector<std::string> base_names);

  const LoraOptions& options() const { return opts_; }
  // Before the engine loop starts: reads and loads an adapter (--lora-modules). Error naming the adapter.
  void load_at_start(const std::string& name, const std::string& path);

  static bool handles(const std::string& path) {
    return path == "/v1/load_lora_adapter" || path == "/v1/unload_lora_adapter";
  }
  using OffThread = std::function<awaitable<bool>(HttpExchange&, std::function<void(const std::atomic<bool>&)>)>;
  // Throws ApiError for a bad request.
  awaitable<void> handle(HttpExchange& ex, const OffThread& off_thread);

  // The adapter id of a loaded adapter's name; nullopt for any other name.
  std::optional<int32_t> id_of(const std::string& name) const;
  // The name of a loaded adapter's id; the id as text for one unloaded since.
  std::string name_of(int32_t id) const;
  // The /v1/models cards of the loaded adapters, by name.
  nlohmann::ordered_json model_cards(int64_t created, int64_t max_model_len) const;

 private:
  struct Entry {
    int32_t id = 0;
    std::string path;
  };
  awaitable<void> load(HttpExchange& ex, const OffThread& off_thread);
  awaitable<void> unload(HttpExchange& ex);
  using EngineFn = std::function<std::optional<EngineTask::Failure>(const std::vector<int32_t>&)>;
  // Posts `fn` (which frees `name` in busy_ when it runs) to the engine thread and answers `success` once it ran
  // without a failure; frees `name` itself when the post is refused; nothing when the client left.
  awaitable<void> run_on_engine(HttpExchange& ex, EngineFn fn, const std::string& name, const char* param,
                                const std::string& success);
  void check_name(const std::string& name) const;

  const LoraOptions opts_;
  Model& model_;  // touched on the engine thread only, once the loop runs
  EngineLoop& loop_;
  const std::vector<std::string> base_names_;
  mutable std::mutex mu_;
  std::map<std::string, Entry> loaded_;  // guarded by mu_
  std::set<std::string> busy_;           // names being loaded or unloaded (guarded by mu_)
  int32_t next_id_ = 1;                  // guarded by mu_
};

}  // namespace kestrel::server
