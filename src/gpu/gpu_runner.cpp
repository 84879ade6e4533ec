#include "gpu/gpu_runner.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>

#include "core/error.h"
#include "engine/step_inputs.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::gpu {

void GpuModelRunner::apply(std::span<const RowOp> ops) {
  const int64_t rb = cache_.plan().row_bytes;
  const cudaStream_t st = backend_.stream();
  for (const RowOp& op : ops) {
    uint8_t* dst = pool_ + int64_t{op.dst} * rb;
    if (op.src < 0) KESTREL_CUDA_CHECK(cudaMemsetAsync(dst, 0, rb, st));
    else KESTREL_CUDA_CHECK(cudaMemcpyAsync(dst, pool_ + int64_t{op.src} * rb, rb, cudaMemcpyDeviceToDevice, st));
  }
  // The next step runs on the same stream, after these; a plan with no step still leaves them done.
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(st));
}

const std::vector<float>& GpuModelRunner::execute(const StepPlan& plan) {
  apply(plan.ops);
  const StepInputs in = step_inputs(plan, cache_.plan().block_size);
  logits_.resize(static_cast<size_t>(in.wanted_logits * model_.config().vocab_size));
  if (!in.steps.empty()) model_.forward(StepBatch{pool_, &cache_.plan(), in.steps}, logits_.data());
  return logits_;
}

bool GpuModelRunner::samples(const SamplingParams& p) const { return backend_.samples_rows(p); }

std::vector<SampledToken> GpuModelRunner::execute_sampled(const StepPlan& plan, std::span<const SampleRow> rows) {
  apply(plan.ops);
  const StepInputs in = step_inputs(plan, cache_.plan().block_size);
  std::vector<SampledToken> out;
  if (!in.steps.empty()) model_.forward_sampled(StepBatch{pool_, &cache_.plan(), in.steps}, rows, out);
  return out;
}

namespace {
// What an engine's GPU pool claims: one engine per backend (its pool is the rest of the arena).
struct PoolClaim {
  bool taken = false;
};
}  // namespace

std::shared_ptr<void> attach_engine(const Model& model, EngineConfig& cfg, std::FILE* log) {
  KESTREL_CHECK(!cfg.speculative, "--speculative-config: speculative decoding is not supported with --device cuda "
                                  "yet (it runs on the CPU reference: --device cpu)");
  CudaBackend& b = cuda_backend(model);
  GpuLimits lim;
  lim.max_tokens = cfg.max_num_batched_tokens;
  lim.max_seqs = cfg.max_num_seqs;
  const int64_t model_len = model.config().context_length;
  lim.max_model_len = cfg.max_model_len > 0 ? cfg.max_model_len : (model_len > 0 ? model_len : 1 << 20);
  lim.block_size = engine_plan(model, cfg).block_size;  // the engine's rows: KDA checkpoints and block tables
  if (!b.prepared()) b.prepare(model, lim);
  const GpuLimits& have = b.limits();
  KESTREL_CHECK(have.max_tokens >= lim.max_tokens && have.max_seqs >= lim.max_seqs &&
                    have.max_model_len >= lim.max_model_len && have.block_size == lim.block_size,
                "the CUDA backend's workspaces were sized for other limits");
  const size_t left = b.arena().remaining();
  if (cfg.num_rows == 0) cfg.cache_bytes = static_cast<int64_t>(left - std::min<size_t>(left, size_t{1} << 20));
  b.print_memory(log, model.stored_weight_bytes());
  if (log && b.rounded_weights() > 0)
    std::fprintf(log,
                 "[kestrel] warning: %zu weights are not exactly representable in bf16 (FP8 kv_b block scales that "
                 "are not powers of two); the GPU's bf16 copies round them, so its results differ from the CPU "
                 "reference's by that rounding\n",
                 b.rounded_weights());
  auto claim = std::make_shared<PoolClaim>();
  PoolClaim* c = claim.get();
  cfg.executor = [c, &b](const Model& m, CacheManager& cache) -> std::unique_ptr<StepExecutor> {
    KESTREL_CHECK(&m.backend() == &b, "the GPU backend was attached for another model");
    KESTREL_CHECK(!c->taken, "a GPU backend serves one engine (its pool is taken)");
    KESTREL_CHECK(cache.plan().block_size == b.limits().block_size,
                  "the engine's block size {} is not the {} the GPU backend was sized for", cache.plan().block_size,
                  b.limits().block_size);
    c->taken = true;
    const size_t bytes = static_cast<size_t>(cache.pool().num_rows()) * static_cast<size_t>(cache.plan().row_bytes);
    auto* pool = b.arena().take_n<uint8_t>(bytes, "cache pool");
    KESTREL_CUDA_CHECK(cudaMemset(pool, 0, bytes));
    return std::make_unique<GpuModelRunner>(m, cache, pool);
  };
  return claim;
}

}  // namespace kestrel::gpu
