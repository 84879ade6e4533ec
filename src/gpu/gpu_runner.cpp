#include "gpu/gpu_runner.h"

#include <cuda_runtime_api.h>

#include <algorithm>

#include "core/error.h"
#include "engine/step_inputs.h"
#include "kernels/cuda/runtime.h"
#include "kernels/cuda/sampling.h"

namespace kestrel::gpu {

void GpuModelRunner::apply(std::span<const RowOp> ops) {
  const int64_t rb = cache_.plan().row_bytes;
  const cudaStream_t st = model_.stream();
  for (const RowOp& op : ops) {
    uint8_t* dst = pool_ + int64_t{op.dst} * rb;
    if (op.src < 0) KESTREL_CUDA_CHECK(cudaMemsetAsync(dst, 0, rb, st));
    else KESTREL_CUDA_CHECK(cudaMemcpyAsync(dst, pool_ + int64_t{op.src} * rb, rb, cudaMemcpyDeviceToDevice, st));
  }
  // The next forward runs on the same stream, after these; a plan with no forward still leaves them done.
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(st));
}

const std::vector<float>& GpuModelRunner::execute(const StepPlan& plan) {
  apply(plan.ops);
  const StepInputs in = step_inputs(plan, cache_.plan().block_size);
  logits_.resize(static_cast<size_t>(in.wanted_logits * model_.host().config().vocab_size));
  if (!in.steps.empty()) model_.forward(StepBatch{pool_, &cache_.plan(), in.steps}, logits_.data());
  return logits_;
}

bool GpuModelRunner::samples(const SamplingParams& p) const {
  return model_.samples_on_gpu() && p.logprobs <= cuda::kMaxSampleTopLogprobs;
}

std::vector<SampledToken> GpuModelRunner::execute_sampled(const StepPlan& plan, std::span<const SampleRow> rows) {
  apply(plan.ops);
  const StepInputs in = step_inputs(plan, cache_.plan().block_size);
  std::vector<SampledToken> out;
  if (!in.steps.empty()) model_.forward_sampled(StepBatch{pool_, &cache_.plan(), in.steps}, rows, out);
  return out;
}

std::unique_ptr<GpuBackend> GpuBackend::attach(const Model& host, EngineConfig& cfg, double utilization,
                                               std::FILE* log) {
  KESTREL_CHECK(cuda::device_count() > 0, "--device cuda: no CUDA device is visible");
  auto b = std::unique_ptr<GpuBackend>(new GpuBackend());
  const size_t budget = DeviceArena::budget(utilization);
  b->arena_ = std::make_unique<DeviceArena>(budget);
  GpuLimits lim;
  lim.max_tokens = cfg.max_num_batched_tokens;
  lim.max_seqs = cfg.max_num_seqs;
  const int64_t model_len = host.config().max_position_embeddings;
  lim.max_model_len = cfg.max_model_len > 0 ? cfg.max_model_len : (model_len > 0 ? model_len : 1 << 20);
  lim.block_size = engine_plan(host, cfg).block_size;  // the engine's rows: KDA checkpoints and block tables
  b->model_ = std::make_unique<GpuModel>(host, lim, *b->arena_);
  const size_t left = b->arena_->remaining();
  if (cfg.num_rows == 0) cfg.cache_bytes = static_cast<int64_t>(left - std::min<size_t>(left, size_t{1} << 20));
  if (log)
    std::fprintf(log,
                 "[kestrel] GPU memory: budget %.2f GiB (--gpu-memory-utilization %.2f): weights %.3f GiB, "
                 "workspaces %.3f GiB, cache pool up to %.3f GiB\n",
                 budget / double(1 << 30), utilization, b->model_->weight_bytes() / double(1 << 30),
                 b->model_->workspace_bytes() / double(1 << 30), left / double(1 << 30));
  if (log && b->model_->rounded_weights() > 0)
    std::fprintf(log,
                 "[kestrel] warning: %zu weights are not exactly representable in bf16 (FP8 block scales that are not "
                 "powers of two); the GPU's bf16 copies round them, so its results differ from the CPU reference's by "
                 "that rounding\n",
                 b->model_->rounded_weights());
  GpuBackend* raw = b.get();
  cfg.executor = [raw](const Model& m, CacheManager& cache) -> std::unique_ptr<StepExecutor> {
    KESTREL_CHECK(&m == &raw->model_->host(), "the GPU backend was attached for another model");
    KESTREL_CHECK(!raw->pool_taken_, "a GPU backend serves one engine (its pool is taken)");
    KESTREL_CHECK(cache.plan().block_size == raw->model_->limits().block_size,
                  "the engine's block size {} is not the {} the GPU backend was sized for",
                  cache.plan().block_size, raw->model_->limits().block_size);
    raw->pool_taken_ = true;
    const size_t bytes = static_cast<size_t>(cache.pool().num_rows()) * static_cast<size_t>(cache.plan().row_bytes);
    auto* pool = raw->arena_->take_n<uint8_t>(bytes, "cache pool");
    KESTREL_CUDA_CHECK(cudaMemset(pool, 0, bytes));
    return std::make_unique<GpuModelRunner>(*raw->model_, cache, pool);
  };
  return b;
}

}  // namespace kestrel::gpu
