#include "engine/model_runner.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace kestrel {

std::vector<SampledToken> StepExecutor::execute_sampled(const StepPlan&, std::span<const SampleRow>) {
  fail("this executor does not sample; the engine samples its logits");
}

void StepExecutor::keep_hidden(std::vector<int>) {
  fail("this executor does not hand the target's hidden states to a drafter (method mtp runs on the CPU)");
}
const std::vector<float>& StepExecutor::hidden() const { fail("this executor keeps no hidden states"); }

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
  int64_t tokens = 0;
  for (const SequenceStep& st : in.steps) tokens += static_cast<int64_t>(st.ids.size());
  if (keep_hidden_)
    hidden_.resize(static_cast<size_t>(tokens * model_.config().hidden_size *
                                       static_cast<int64_t>(std::max<size_t>(1, hidden_layers_.size()))));
  if (!in.steps.empty())
    model_.forward(StepBatch{cache_.pool().base(), &cache_.plan(), in.steps}, logits_.data(),
                   keep_hidden_ ? hidden_.data() : nullptr, hidden_layers_);
  return logits_;
}

}  // namespace kestrel
