// What runs a step's forward: the row copies the plan orders, then the model over the cache pool. The CPU model
// runner (model_runner.h) is one; the GPU runner (src/gpu) is another, whose pool lives in GPU memory. The engine
// sees only this interface, so the scheduler, prefix cache and sampling are the same for every backend.
#pragma once
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "cache/cache_manager.h"
#include "engine/scheduler.h"

namespace kestrel {

class Model;

class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  // Row copies and zeroing on the pool, in order.
  virtual void apply(std::span<const RowOp> ops) = 0;
  // Runs the plan's row ops and forward. Returns the logits [wanted positions, vocab] on the host, sequences in
  // plan order.
  virtual const std::vector<float>& execute(const StepPlan& plan) = 0;
};

// Makes the executor of an engine once its cache exists.
using StepExecutorFactory = std::function<std::unique_ptr<StepExecutor>(const Model&, CacheManager&)>;

}  // namespace kestrel
