#include "cli/engine_flags.h"

#include <cstdio>

#include "cli/device.h"
#include "core/error.h"

namespace kestrel::cli {

ModelOptions EngineFlags::model_options() const {
  ModelOptions o;
  o.latent_cache = parse_kv_cache_dtype(kv_cache_dtype, resolved_device(), "--kv-cache-dtype");
  if (index_dtype == "mxfp4") o.index_keys = IndexKeyDtype::mxfp4;
  else if (index_dtype != "fp8") fail("--index-dtype '{}' is not one of fp8, mxfp4", index_dtype);
  if (kda_prefill == "recurrent") {
    // The mode's promise is bit-exact results for any split of a prompt, which the GPU's kernels do not keep yet.
    if (resolved_device() == "cuda")
      fail("--kda-prefill recurrent promises bit-exact splits, which the GPU does not keep yet; use --device cpu");
    o.kda_chunked_prefill = false;
  }
  else if (kda_prefill != "chunked") fail("--kda-prefill '{}' is not one of chunked, recurrent", kda_prefill);
  return o;
}

void add_step_budget_flags(CLI::App& cmd, EngineConfig& e) {
  cmd.add_option("--long-prefill-token-threshold", e.long_prefill_token_threshold,
                 "most prompt tokens of one request in a step (vLLM's; 0: no cap)")
      ->capture_default_str();
  cmd.add_option("--max-itl-factor", e.max_itl_factor,
                 "a step with running decodes takes prompt tokens only up to this factor of the decodes' own step "
                 "time, predicted from measured steps (0: off; otherwise > 1)")
      ->capture_default_str();
}

void check_step_budget_flags(const EngineConfig& e) {
  if (e.long_prefill_token_threshold < 0)
    fail("--long-prefill-token-threshold must be >= 0, got {}", e.long_prefill_token_threshold);
  if (e.max_itl_factor != 0 && !(e.max_itl_factor > 1))
    fail("--max-itl-factor must be 0 (off) or greater than 1, got {}", e.max_itl_factor);
}

EngineConfig EngineFlags::engine_config() const {
  check_step_budget_flags(engine);
  EngineConfig e = engine;
  e.cache_bytes = cache_mib << 20;
  e.enable_prefix_caching = !no_prefix_caching;
  if (!speculative_config.empty()) e.speculative = parse_speculative_config(speculative_config);
  return e;
}

std::string EngineFlags::resolved_device() const { return resolve_device(device); }

std::unique_ptr<Model> EngineFlags::load_model(const std::string& dir) const {
  const std::string dev = resolved_device();
  LoadOptions lo = load.options(engine.max_model_len);
  // The mtp drafter runs the checkpoint's own MTP layer.
  lo.load_mtp = !speculative_config.empty() && parse_speculative_config(speculative_config).method == "mtp";
  return Model::load(dir, model_options(), make_backend(dev, gpu_memory_utilization), lo);
}

std::unique_ptr<Engine> make_engine(const Model& model, const EngineFlags& f, std::shared_ptr<void>& keep) {
  EngineConfig cfg = f.engine_config();
  if (const DeviceAttach attach = device_attach(f.resolved_device()))
    keep = attach(model, cfg);
  return std::make_unique<Engine>(model, cfg);
}

void add_engine_flags(CLI::App& cmd, EngineFlags& f) {
  EngineConfig& e = f.engine;
  cmd.add_option("--kv-cache-dtype", f.kv_cache_dtype,
                 "MLA latent cache: auto (the model's dtype: bf16 on the GPU, fp32 on the CPU) | bf16 | fp8 | nvfp4");
  cmd.add_option("--index-dtype", f.index_dtype, "DSA index keys: fp8 | mxfp4");
  cmd.add_option("--kda-prefill", f.kda_prefill,
                 "chunked (default) | recurrent (token by token everywhere: every split is bit-exact)");
  cmd.add_option("--max-num-batched-tokens", e.max_num_batched_tokens, "token budget of a step")
      ->capture_default_str();
  cmd.add_option("--max-num-seqs", e.max_num_seqs, "sequences running at once")->capture_default_str();
  add_step_budget_flags(cmd, e);
  cmd.add_option("--cache-mib", f.cache_mib, "cache pool size")->capture_default_str();
  cmd.add_option("--block-size", e.block_size, "tokens per cache row (power of two; 0: the planner's choice)");
  cmd.add_option("--max-model-len", e.max_model_len, "longest sequence (0: the config's context length)");
  cmd.add_flag("--no-prefix-caching", f.no_prefix_caching, "do not reuse cached prefixes");
  cmd.add_option("--device", f.device, "auto | cuda | cpu")->capture_default_str();
  cmd.add_option("--gpu-memory-utilization", f.gpu_memory_utilization,
                 "fraction of the GPU's memory for weights, workspaces and cache (default 0.9; GPU only)");
  cmd.add_option("--speculative-config", f.speculative_config,
                 "speculative decoding, JSON as vLLM's: {\"method\": \"ngram\", \"num_speculative_tokens\": K, "
                 "\"prompt_lookup_min\": N, \"prompt_lookup_max\": M} (CPU)");
  add_load_flags(cmd, f.load);
}

void print_cache_plan(const Engine& engine) {
  const CachePlan& plan = engine.cache_plan();
  const int32_t rows = engine.cache().pool().num_rows();
  std::fprintf(stderr,
               "[kestrel] cache: %d rows of %lld B (%.1f MiB), B = %d, %lld B per token, %d state row(s) per request; "
               "max_model_len %lld: %lld full-length sequence(s) fit\n",
               rows, static_cast<long long>(plan.row_bytes), rows * static_cast<double>(plan.row_bytes) / (1 << 20),
               plan.block_size, static_cast<long long>(plan.token_bytes), plan.state_rows_per_request,
               static_cast<long long>(engine.max_model_len()),
               static_cast<long long>(rows / plan.rows_per_request(engine.max_model_len())));
}

}  // namespace kestrel::cli
