// kestrel serve: the OpenAI-compatible server, with vLLM's flag names (docs/serving.md). Flags that need hardware
// or features this build does not have are refused with a message that says which and why.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/device.h"
#include "cli/engine_flags.h"
#include "cli/load_flags.h"
#include "core/error.h"
#include "engine/spec_decode.h"
#include "model/lora.h"
#include "server/serve.h"

namespace kestrel::cli {
namespace {

// vLLM's human-readable integers (--max-model-len 32k): k/m/g/t are powers of 1000, K/M/G/T of 1024, a decimal
// before them is allowed when the result is whole ("25.6k" = 25600); -1 and plain integers as they are.
int64_t human_int(const std::string& flag, const std::string& text) {
  static const std::string units = "kmgtKMGT";
  std::string digits = text;
  double scale = 1;
  if (!digits.empty() && units.find(digits.back()) != std::string::npos) {
    const size_t u = units.find(digits.back());
    scale = std::pow(u < 4 ? 1000.0 : 1024.0, static_cast<double>(u % 4 + 1));
    digits.pop_back();
  }
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(digits, &used);
  } catch (const std::exception&) {
    used = std::string::npos;
  }
  const double x = v * scale;
  if (digits.empty() || used != digits.size() || !std::isfinite(x) || x != std::floor(x) || x < -1 || x > 9e15)
    fail("{} '{}' is not an integer (suffixes: k, m, g = 1000^n; K, M, G = 1024^n)", flag, text);
  return static_cast<int64_t>(x);
}

// One --lora-modules value, as vLLM takes it: name=path, or a JSON object {"name": ..., "path": ...,
// "base_model_name": ...} (base_model_name is accepted and not checked: one base model is served).
std::pair<std::string, std::string> parse_lora_module(const std::string& text) {
  if (!text.empty() && text.front() == '{') {
    const auto j = nlohmann::json::parse(text, nullptr, false);
    if (!j.is_object()) fail("--lora-modules '{}' is not a JSON object", text);
    std::string name, path;
    for (const auto& [k, v] : j.items()) {
      if (k != "name" && k != "path" && k != "base_model_name")
        fail("--lora-modules: '{}' is not a field (name, path, base_model_name)", k);
      if (!v.is_string()) fail("--lora-modules: '{}' must be a string", k);
      if (k == "name") name = v.get<std::string>();
      if (k == "path") path = v.get<std::string>();
    }
    if (name.empty() || path.empty()) fail("--lora-modules '{}' needs a name and a path", text);
    return {name, path};
  }
  const size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == text.size())
    fail("--lora-modules '{}' is not name=path (or a JSON object with name and path)", text);
  return {text.substr(0, eq), text.substr(eq + 1)};
}

struct ServeArgs {
  server::ServeOptions opts;
  std::string model_flag, max_model_len = "0", dtype = "auto", generation_config = "auto", uvicorn_log_level = "info";
  std::vector<std::string> served_model_names, lora_modules;
  int data_parallel_size = 1;
  bool enable_expert_parallel = false, enable_lora = false, enforce_eager = false, disable_log_requests = false;
  int tensor_parallel_size = 1, decode_context_parallel_size = 1;
  double gpu_memory_utilization = 0;
  int64_t kv_cache_memory_bytes = int64_t{256} << 20;
  std::string kv_cache_dtype = "auto", index_cache_dtype = "fp8", speculative_config;
  LoadFlags load;
  std::string device = "auto";
  uint64_t seed = 0;
  bool enable_prefix_caching = true, enable_chunked_prefill = true, trust_remote_code = false, batch_invariant = false;
};

int run_serve(ServeArgs& a) {
  server::ServeOptions& o = a.opts;
  std::vector<std::string> refused;
  if (!a.model_flag.empty()) {
    if (!o.model_dir.empty() && o.model_dir != a.model_flag)
      fail("the model is given twice: '{}' and --model '{}'", o.model_dir, a.model_flag);
    o.model_dir = a.model_flag;
  }
  if (o.model_dir.empty()) fail("serve needs the model: kestrel serve MODEL_DIR (or --model MODEL_DIR)");
  o.engine.max_model_len = human_int("--max-model-len", a.max_model_len);
  if (o.engine.max_model_len == -1) o.engine.max_model_len = 0;  // vLLM's -1: the model's own
  if (o.engine.max_model_len < 0) fail("--max-model-len must be positive, or -1 for the model's");
  if (!a.served_model_names.empty()) {
    o.served_model_name = a.served_model_names[0];
    o.model_aliases.assign(a.served_model_names.begin() + 1, a.served_model_names.end());
  }
  const std::string device = resolve_device(a.device);
  if (a.data_parallel_size < 1) fail("--data-parallel-size must be >= 1");
  if (a.data_parallel_size > 1)
    refused.push_back(fmt::format("--data-parallel-size {}: data parallelism (one engine per rank behind one API "
                                  "server) is not built; run one kestrel serve per GPU behind a load balancer",
                                  a.data_parallel_size));
  if (a.enable_expert_parallel)
    refused.push_back("--enable-expert-parallel: expert parallelism needs NCCL multi-GPU execution, which is not "
                      "built yet (experts run on one device)");
  if (!a.lora_modules.empty() && !a.enable_lora) fail("--lora-modules needs --enable-lora");
  if (a.enable_lora && device == "cuda")
    refused.push_back("--enable-lora: the CUDA backend does not run LoRA adapters yet (the CPU backend does: "
                      "--device cpu)");
  if (a.enable_lora) {
    if (o.lora.max_loras < 1) fail("--max-loras must be >= 1, got {}", o.lora.max_loras);
    if (o.lora.max_lora_rank < 1 || o.lora.max_lora_rank > kMaxLoraRank)
      fail("--max-lora-rank {} is outside [1, {}] (the largest rank the LoRA kernels take)", o.lora.max_lora_rank,
           kMaxLoraRank);
    o.lora.enabled = true;
    for (const std::string& m : a.lora_modules) o.lora_modules.push_back(parse_lora_module(m));
  }
  if (a.dtype != "auto" && a.dtype != "bfloat16" && a.dtype != "float32" && a.dtype != "float")
    refused.push_back(fmt::format("--dtype {}: weights are kept in their stored precision (bf16, FP8, MXFP4) and "
                                  "computed in bf16 on the GPU, fp32 on the CPU; only auto, bfloat16 and float32 are "
                                  "accepted",
                                  a.dtype));
  else if (a.dtype != "auto")
    std::fprintf(stderr, "[kestrel] --dtype %s: weights stay in their stored precision; the %s computes in %s\n",
                 a.dtype.c_str(), device == "cuda" ? "GPU" : "CPU", device == "cuda" ? "bf16" : "fp32");
  static const std::vector<std::string> levels = {"critical", "error", "warning", "info", "debug", "trace"};
  if (std::find(levels.begin(), levels.end(), a.uvicorn_log_level) == levels.end())
    fail("--uvicorn-log-level '{}' is not one of critical, error, warning, info, debug, trace", a.uvicorn_log_level);
  if (a.generation_config != "auto" && a.generation_config != "vllm") {
    if (!std::filesystem::is_directory(a.generation_config))
      fail("--generation-config '{}' is not auto, vllm or a directory", a.generation_config);
    o.generation_config_dir = a.generation_config;
  } else if (a.generation_config == "auto") {
    o.generation_config_dir = o.model_dir;
  }
  if (o.max_logprobs < 0 || o.max_logprobs > 20)
    fail("--max-logprobs must be in 0..20 (the sampler returns at most 20 alternatives), got {}", o.max_logprobs);
  check_step_budget_flags(o.engine);
  if (a.tensor_parallel_size < 1) fail("--tensor-parallel-size must be >= 1");
  if (a.tensor_parallel_size > 1)
    refused.push_back(fmt::format("--tensor-parallel-size {}: tensor parallelism needs {} GPUs and the CUDA backend; "
                                  "the CPU backend serves one rank",
                                  a.tensor_parallel_size, a.tensor_parallel_size));
  if (a.decode_context_parallel_size > 1)
    refused.push_back(fmt::format("--decode-context-parallel-size {}: decode context parallelism is not built into "
                                  "the server yet (it runs on simulated ranks only)",
                                  a.decode_context_parallel_size));
  if (!a.speculative_config.empty()) {
    // Bad JSON, an unknown field or a bad value is an error naming the field; a device not built yet is refused with
    // the rest (a drafter that does not fit the model is an error when the engine is made).
    SpeculativeConfig spec = parse_speculative_config(a.speculative_config);
    if (device == "cuda")
      refused.push_back("--speculative-config: speculative decoding is not supported with --device cuda yet (it runs "
                        "on the CPU reference: --device cpu)");
    o.engine.speculative = std::move(spec);
  }
  if (a.batch_invariant && device == "cuda")
    refused.push_back("--batch-invariant: the GPU's kernels are not batch-invariant yet (cuBLASLt chooses algorithms "
                      "per batch shape); use --device cpu");
  if (!a.enable_chunked_prefill)
    refused.push_back("--no-enable-chunked-prefill: the scheduler always chunks prompts to the step's token budget");
  if (!refused.empty()) {
    std::string msg = "cannot serve as asked:";
    for (const std::string& r : refused) msg += "\n  " + r;
    fail("{}", msg);
  }
  if (a.gpu_memory_utilization != 0 && device == "cpu")
    std::fprintf(stderr, "[kestrel] --gpu-memory-utilization has no effect on the CPU; the cache takes "
                         "--kv-cache-memory-bytes (%lld)\n", static_cast<long long>(a.kv_cache_memory_bytes));
  o.load = a.load.options(o.engine.max_model_len);
  o.load.load_mtp = o.engine.speculative && o.engine.speculative->method == "mtp";  // the drafter's own layer
  o.model.latent_cache = parse_kv_cache_dtype(a.kv_cache_dtype, device, "--kv-cache-dtype");
  if (a.index_cache_dtype == "mxfp4") o.model.index_keys = IndexKeyDtype::mxfp4;
  else if (a.index_cache_dtype != "fp8") fail("--index-cache-dtype '{}' is not one of fp8, mxfp4", a.index_cache_dtype);
  // Batch invariance holds on the CPU already; this also makes every split of a prompt give the same bits.
  if (a.batch_invariant) o.model.kda_chunked_prefill = false;
  o.engine.enable_prefix_caching = a.enable_prefix_caching;
  o.engine.cache_bytes = a.kv_cache_memory_bytes;
  const double utilization = a.gpu_memory_utilization;
  const bool cuda_graphs = !a.enforce_eager;
  o.make_backend = [device, utilization, cuda_graphs] { return make_backend(device, utilization, cuda_graphs); };
  o.attach_device = device_attach(device);
  for (const std::string* p : {&o.tool_call_parser, &o.reasoning_parser})
    if (!p->empty() && *p != "kimi_k3" && *p != "deepseek_v32")
      fail("parser '{}' is not one of kimi_k3, deepseek_v32", *p);
  return server::serve(o);
}

}  // namespace

Runner add_serve(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (flags as vLLM's)");
  auto a = std::make_shared<ServeArgs>();
  server::ServeOptions& o = a->opts;
  EngineConfig& e = o.engine;
  cmd->add_option("model_dir", o.model_dir, "checkpoint directory");
  cmd->add_option("--model", a->model_flag, "checkpoint directory (instead of MODEL_DIR)");
  cmd->add_option("--host", o.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", o.port, "port (0: any free port)")->capture_default_str();
  cmd->add_option("--api-key", o.api_key, "require 'Authorization: Bearer KEY' on /v1 routes");
  cmd->add_option("--served-model-name", a->served_model_names,
                  "model name(s) in the API: the first is reported, every one is accepted (default: MODEL_DIR)")
      ->expected(1, 64);
  cmd->add_option("--tensor-parallel-size", a->tensor_parallel_size, "GPUs sharing each layer");
  cmd->add_option("--decode-context-parallel-size", a->decode_context_parallel_size,
                  "ranks sharding the context of decode attention");
  cmd->add_option("--max-model-len", a->max_model_len,
                  "longest sequence, e.g. 32768, 32k, 32K (default: the model's, capped by the cache)");
  cmd->add_option("--dtype", a->dtype, "auto | bfloat16 | float32 (weights stay in their stored precision)")
      ->capture_default_str();
  cmd->add_flag("--enforce-eager", a->enforce_eager, "GPU: no CUDA graphs, every step eager (no effect on the CPU)");
  cmd->add_option("--generation-config", a->generation_config,
                  "auto (the checkpoint's generation_config.json gives default sampling), vllm (none), or a directory")
      ->capture_default_str();
  cmd->add_flag("--disable-log-requests", a->disable_log_requests, "accepted (requests are not logged)");
  cmd->add_option("--uvicorn-log-level", a->uvicorn_log_level, "accepted: critical | error | warning | info | debug | trace")
      ->capture_default_str();
  cmd->add_option("--max-logprobs", o.max_logprobs, "most logprobs / top_logprobs / prompt_logprobs a request may ask")
      ->capture_default_str();
  cmd->add_option("--allowed-origins", o.allowed_origins, "CORS: a JSON list of origins, e.g. '[\"*\"]'")
      ->capture_default_str();
  cmd->add_option("--data-parallel-size", a->data_parallel_size, "refused above 1 (not built)");
  cmd->add_flag("--enable-expert-parallel", a->enable_expert_parallel, "refused (not built)");
  cmd->add_flag("--enable-lora", a->enable_lora, "serve LoRA adapters (CPU backend): --lora-modules and the "
                "/v1/load_lora_adapter, /v1/unload_lora_adapter routes");
  cmd->add_option("--lora-modules", a->lora_modules, "adapters loaded at start: name=path or JSON {\"name\", \"path\"}")
      ->expected(1, 64);
  cmd->add_option("--max-loras", o.lora.max_loras, "LoRA adapters loaded at once")->capture_default_str();
  cmd->add_option("--max-lora-rank", o.lora.max_lora_rank, "largest LoRA rank accepted (<= 64)")->capture_default_str();
  cmd->add_option("--max-num-seqs", e.max_num_seqs, "sequences running at once")->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", e.max_num_batched_tokens, "token budget of a step")
      ->capture_default_str();
  add_step_budget_flags(*cmd, e);
  cmd->add_option("--gpu-memory-utilization", a->gpu_memory_utilization, "GPU memory fraction (GPU only)");
  cmd->add_option("--kv-cache-memory-bytes", a->kv_cache_memory_bytes, "bytes of the cache pool")
      ->capture_default_str();
  cmd->add_option("--kv-cache-dtype", a->kv_cache_dtype,
                  "MLA latent cache: auto (the model's dtype: bf16 on the GPU, fp32 on the CPU) | bf16 | fp8 | nvfp4")
      ->capture_default_str();
  cmd->add_option("--index-cache-dtype", a->index_cache_dtype, "DSA index keys: fp8 | mxfp4")->capture_default_str();
  cmd->add_option("--block-size", e.block_size, "tokens per cache row (0: the planner's choice)");
  cmd->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", a->enable_prefix_caching,
                "reuse cached prompt prefixes (on by default)");
  cmd->add_flag("--enable-chunked-prefill,!--no-enable-chunked-prefill", a->enable_chunked_prefill,
                "split long prompts over steps (always on)");
  cmd->add_flag("--enable-auto-tool-choice", o.enable_auto_tool_choice, "parse tool calls for tool_choice auto");
  cmd->add_option("--tool-call-parser", o.tool_call_parser, "kimi_k3 | deepseek_v32");
  cmd->add_option("--reasoning-parser", o.reasoning_parser, "kimi_k3 | deepseek_v32");
  cmd->add_option("--chat-template", o.chat_template, "Jinja chat template file (default: the checkpoint's)");
  cmd->add_option("--speculative-config", a->speculative_config,
                  "speculative decoding, JSON as vLLM's: {\"method\": \"ngram\", \"num_speculative_tokens\": K, "
                  "\"prompt_lookup_min\": N, \"prompt_lookup_max\": M} (CPU)");
  add_load_flags(*cmd, a->load);
  cmd->add_flag("--trust-remote-code", a->trust_remote_code, "accepted for vLLM compatibility (no effect)");
  auto* seed = cmd->add_option("--seed", a->seed, "seeds the sampling of requests that give no seed");
  cmd->add_option("--device", a->device, "auto | cuda | cpu")->capture_default_str();
  cmd->add_flag("--batch-invariant", a->batch_invariant, "results independent of batching and prompt splits");
  cmd->add_option("--max-queued-requests", o.max_queued_requests, "requests in flight beyond which new ones get 429")
      ->capture_default_str();
  cmd->add_option("--max-request-bytes", o.max_request_bytes, "largest request body (413 beyond)")
      ->capture_default_str();
  cmd->add_option("--http-threads", o.http_threads, "HTTP server threads")->capture_default_str();
  cmd->add_option("--max-connections", o.max_connections, "open connections beyond which new ones get 503")
      ->capture_default_str();
  cmd->add_option("--shutdown-timeout", o.shutdown_timeout, "seconds running requests get after SIGTERM")
      ->capture_default_str();
  cmd->add_option("--timeout-keep-alive", o.keep_alive_timeout, "seconds an idle keep-alive connection stays open")
      ->capture_default_str();
  cmd->add_option("--http-header-timeout", o.header_timeout, "seconds a request's header may take to arrive")
      ->capture_default_str();
  cmd->add_option("--http-body-min-rate", o.body_min_rate, "bytes/s a request body must average")
      ->capture_default_str();
  cmd->add_option("--text-threads", o.text_threads, "threads rendering chat templates and tokenising")
      ->capture_default_str();
  cmd->add_option("--max-text-queue", o.max_text_queue, "requests waiting for text work beyond which new ones get 429")
      ->capture_default_str();
  return [cmd, a, seed]() {
    if (!cmd->parsed()) return -1;
    if (seed->count()) a->opts.seed = a->seed;
    return run_serve(*a);
  };
}

}  // namespace kestrel::cli
