// The model runner: turns a step plan into what the model's forward takes (per-sequence token spans, block
// tables, slots, state rows, checkpoint targets), does the plan's row copies first, and runs the step.
#pragma once
#include <span>
#include <vector>

#include "cache/cache_manager.h"
#include "engine/scheduler.h"
#include "engine/step_executor.h"
#include "engine/step_inputs.h"
#include "model/model.h"

namespace kestrel {

class ModelRunner : public StepExecutor {
 public:
  ModelRunner(const Model& model, CacheManager& cache) : model_(model), cache_(cache) {}
  // Row copies and zeroing on the pool, in order.
  void apply(std::span<const RowOp> ops) override;
  // Runs the plan's row ops and forward. Returns the logits [wanted positions, vocab], sequences in plan order.
  const std::vector<float>& execute(const StepPlan& plan) override;
  void keep_hidden(std::vector<int> layers) override {
    keep_hidden_ = true;
    hidden_layers_ = std::move(layers);
  }
  const std::vector<float>& hidden() const override { return hidden_; }

 private:
  const Model& model_;
  CacheManager& cache_;
  std::vector<float> logits_, hidden_;
  bool keep_hidden_ = false;
  std::vector<int> hidden_layers_;
};

}  // namespace kestrel
