#include "engine/model_runner.h"

#include <cstring>

#include "core/error.h"

namespace kestrel {

std::vector<SampledToken> StepExecutor::execute_sampled(const StepPlan&, std::span<const SampleRow>) {
  fail("this executor does not sample; the engine samples its logits");
}

void ModelRunner::apply(std::span<const RowOp> ops) {
  RowPool& pool = cache_.pool();
  for (const RowOp& op : ops) {
    if (op.src < 0) std::memset(pool.row(op.dst), 0, pool.row_bytes());
    else std::memcpy(pool.row(op.dst), pool.row(op.src), pool.row_bytes());
  }
}

const std::vector<float>& ModelRunner::execute(const StepPlan& plan) {
  apply(plan.ops);
  const StepInputs in = step_inputs(plan, cache_.plan().block_size);
  logits_.resize(static_cast<size_t>(in.wanted_logits * model_.config().vocab_size));
  if (!in.steps.empty()) model_.forward(StepBatch{cache_.pool().base(), &cache_.plan(), in.steps}, logits_.data());
  return logits_;
}

}  // namespace kestrel
