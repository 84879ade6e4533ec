// The engine's step executor on the GPU: the scheduler's row copies applied to the cache pool in GPU memory, then the
// model's step on its CUDA backend (logits copied back, or tokens sampled on the GPU). attach_engine (cuda_backend.h)
// makes one for an engine.
#pragma once
#include <memory>
#include <vector>

#include "engine/engine.h"
#include "engine/step_executor.h"
#include "gpu/cuda_backend.h"

namespace kestrel::gpu {

class GpuModelRunner : public StepExecutor {
 public:
  // pool: device memory for cache.pool().num_rows() rows of the plan's row size, zeroed.
  GpuModelRunner(const Model& model, CacheManager& cache, uint8_t* pool)
      : model_(model), backend_(cuda_backend(model)), cache_(cache), pool_(pool) {}
  void apply(std::span<const RowOp> ops) override;
  const std::vector<float>& execute(const StepPlan& plan) override;
  bool samples(const SamplingParams& p) const override;
  // Rows the GPU samples get their structured-output masks applied there (kernels/cuda/sampling.h).
  bool applies_token_masks() const override { return true; }
  std::vector<SampledToken> execute_sampled(const StepPlan& plan, std::span<const SampleRow> rows) override;
  uint8_t* pool() const { return pool_; }

 private:
  const Model& model_;
  CudaBackend& backend_;
  CacheManager& cache_;
  uint8_t* pool_;
  std::vector<float> logits_;
};

}  // namespace kestrel::gpu
