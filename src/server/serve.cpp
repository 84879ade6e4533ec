#include "server/serve.h"

#include "cpu/cpu_backend.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "core/error.h"
#include "server/engine_loop.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/openai_api.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace kestrel::server {
namespace {

// One connection is one descriptor: let the server hold as many as the hard limit allows.
void raise_descriptor_limit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    setrlimit(RLIMIT_NOFILE, &lim);
  }
}

}  // namespace

int serve(const ServeOptions& o) {
  // Signals are taken synchronously below; block them before any thread starts so that every thread inherits it.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  raise_descriptor_limit();

  const auto t0 = std::chrono::steady_clock::now();
  const std::unique_ptr<Model> model =
      Model::load(o.model_dir, o.model, o.make_backend ? o.make_backend() : std::make_unique<CpuBackend>(), o.load);
  const text::Tokenizer tok = text::Tokenizer::load(o.model_dir);
  std::optional<text::ChatTemplate> chat_template;
  try {
    chat_template.emplace(text::ChatTemplate::from_model_dir(o.model_dir, o.chat_template));
  } catch (const Error& e) {
    if (!o.chat_template.empty()) throw;
    std::fprintf(stderr, "[kestrel] no chat template (%s): chat requests will be refused\n", e.what());
  }

  ApiOptions api;
  api.served_model_name = o.served_model_name.empty() ? o.model_dir : o.served_model_name;
  api.model_dir = std::filesystem::absolute(o.model_dir).string();
  api.api_key = o.api_key;
  if (!o.tool_call_parser.empty()) api.tool_call_parser = parser_format(o.tool_call_parser);
  if (!o.reasoning_parser.empty()) api.reasoning_parser = parser_format(o.reasoning_parser);
  api.enable_auto_tool_choice = o.enable_auto_tool_choice;
  if (o.enable_auto_tool_choice && !api.tool_call_parser)
    fail("--enable-auto-tool-choice needs --tool-call-parser (kimi_k3 or deepseek_v32)");
  api.eos_token_id = static_cast<int32_t>(model->config().eos_token_id);
  api.vocab_size = model->config().vocab_size;
  api.seed = o.seed;
  api.model_aliases = o.model_aliases;
  api.generation_defaults = generation_defaults(o.generation_config_dir);
  if (!api.generation_defaults.empty())
    std::fprintf(stderr, "[kestrel] default sampling from %s/generation_config.json: %s\n",
                 o.generation_config_dir.c_str(), api.generation_defaults.dump().c_str());
  api.max_logprobs = o.max_logprobs;
  api.text_threads = o.text_threads;
  api.text_queue = static_cast<size_t>(std::max<int64_t>(o.max_text_queue, 1));

  EngineConfig engine_cfg = o.engine;
  const std::shared_ptr<void> device = o.attach_device ? o.attach_device(*model, engine_cfg) : nullptr;
  auto engine = std::make_unique<Engine>(*model, engine_cfg);
  const CachePlan cache_plan = engine->cache_plan();
  const int64_t cache_rows = engine->cache().pool().num_rows();
  EngineLoop loop(std::move(engine), o.max_queued_requests);
  ServerMetrics metrics(api.served_model_name, loop.max_model_len());
  metrics.set_cache_config({{"block_size", std::to_string(cache_plan.block_size)},
                            {"num_gpu_blocks", std::to_string(cache_rows)},
                            {"cache_row_bytes", std::to_string(cache_plan.row_bytes)},
                            {"kv_cache_memory_bytes", std::to_string(engine_cfg.cache_bytes)},
                            {"enable_prefix_caching", engine_cfg.enable_prefix_caching ? "True" : "False"}});
  std::vector<std::string> base_names = {api.served_model_name};
  base_names.insert(base_names.end(), api.model_aliases.begin(), api.model_aliases.end());
  LoraApi lora(o.lora, *model, loop, base_names);
  for (const auto& [name, path] : o.lora_modules) lora.load_at_start(name, path);
  if (o.lora.enabled)
    std::fprintf(stderr, "[kestrel] LoRA: %zu adapter(s) loaded, at most %d at once, rank <= %d\n",
                 o.lora_modules.size(), o.lora.max_loras, o.lora.max_lora_rank);
  OpenAIApi handlers(api, tok, chat_template ? &*chat_template : nullptr, loop, metrics,
                     o.lora.enabled ? &lora : nullptr);

  HttpServerOptions http_opts;
  http_opts.host = o.host;
  http_opts.port = o.port;
  http_opts.threads = o.http_threads;
  http_opts.max_body_bytes = o.max_request_bytes;
  http_opts.max_connections = o.max_connections;
  {
    const auto origins = nlohmann::json::parse(o.allowed_origins, nullptr, false);
    if (!origins.is_array()) fail("--allowed-origins must be a JSON list of strings, e.g. '[\"*\"]'");
    for (const auto& x : origins) {
      if (!x.is_string()) fail("--allowed-origins must be a JSON list of strings, e.g. '[\"*\"]'");
      http_opts.allowed_origins.push_back(x.get<std::string>());
    }
  }
  http_opts.idle_timeout = o.keep_alive_timeout;
  http_opts.header_timeout = o.header_timeout;
  http_opts.body_min_rate = o.body_min_rate;
  http_opts.on_status = [&metrics](int status) { metrics.record_response(status); };
  HttpServer http(http_opts, [&handlers](HttpExchange& ex) { return handlers.handle(ex); });
  handlers.set_open_connections([&http] { return http.open_connections(); });
  const int port = http.listen();
  loop.start();
  http.start();
  std::fprintf(stderr, "[kestrel] serving %s (%s) on http://%s:%d (loaded in %.2f s, max_model_len %lld)\n",
               api.served_model_name.c_str(), arch_name(model->config().arch), o.host.c_str(), port,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
               static_cast<long long>(loop.max_model_len()));
  std::fflush(stderr);

  int sig = 0;
  sigwait(&signals, &sig);
  std::fprintf(stderr, "[kestrel] %s: no new requests; waiting up to %.0f s for %lld running ones\n",
               sig == SIGTERM ? "SIGTERM" : "SIGINT", o.shutdown_timeout,
               static_cast<long long>(loop.snapshot().in_flight));
  loop.stop_admitting();
  // Renders and tokenising in progress are cancelled now, not after the grace period: they have produced nothing
  // a client waits for yet.
  handlers.stop_text_work();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(o.shutdown_timeout);
  while (loop.snapshot().in_flight > 0 && loop.alive() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  // Let the handlers write the last bytes of the finished requests before the connections close.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const int64_t left = loop.snapshot().in_flight;
  loop.stop();
  http.stop();
  std::fprintf(stderr, "[kestrel] stopped (%lld request(s) cut off)\n", static_cast<long long>(left));
  return 0;
}

}  // namespace kestrel::server
