// The engine's GPU backend: one arena of GPU memory (--gpu-memory-utilization) holding the weights, the step
// workspaces and the cache pool, and the step executor that applies the scheduler's row copies to that pool and runs
// GpuModel::forward. attach() fills an EngineConfig so that Engine runs on the GPU with nothing else changed.
#pragma once
#include <cstdio>
#include <memory>
#include <vector>

#include "engine/engine.h"
#include "engine/step_executor.h"
#include "gpu/device_arena.h"
#include "gpu/gpu_model.h"

namespace kestrel::gpu {

class GpuModelRunner : public StepExecutor {
 public:
  // pool: device memory for cache.pool().num_rows() rows of the plan's row size, zeroed.
  GpuModelRunner(GpuModel& model, CacheManager& cache, uint8_t* pool) : model_(model), cache_(cache), pool_(pool) {}
  void apply(std::span<const RowOp> ops) override;
  const std::vector<float>& execute(const StepPlan& plan) override;
  bool samples(const SamplingParams& p) const override;
  std::vector<SampledToken> execute_sampled(const StepPlan& plan, std::span<const SampleRow> rows) override;
  uint8_t* pool() const { return pool_; }

 private:
  GpuModel& model_;
  CacheManager& cache_;
  uint8_t* pool_;
  std::vector<float> logits_;
};

// Everything of an engine that lives on the GPU. Must outlive the Engine it was attached to.
class GpuBackend {
 public:
  // Takes utilization * the device's memory (less what is already in use) in one allocation, uploads `host` and
  // sets aside the workspaces for cfg's limits, then points cfg at the GPU: cfg.cache_bytes becomes what is left
  // (unless cfg.num_rows is set) and cfg.executor makes a GpuModelRunner over a pool taken from the arena. Prints
  // the budget to `log` (null: silent).
  static std::unique_ptr<GpuBackend> attach(const Model& host, EngineConfig& cfg, double utilization,
                                            std::FILE* log);
  GpuModel& model() { return *model_; }
  DeviceArena& arena() { return *arena_; }

 private:
  std::unique_ptr<DeviceArena> arena_;
  std::unique_ptr<GpuModel> model_;
  bool pool_taken_ = false;
};

}  // namespace kestrel::gpu
