#include "engine/model_runner.h"

#include <cstring>

namespace kestrel {

void ModelRunner::apply(std::span<const RowOp> ops) {
  RowPool& pool = cache_.pool();
  for (const RowOp& op : ops) {
    if (op.src < 0) std::memset(pool.row(op.dst), 0, pool.row_bytes());
    else std::memcpy(pool.row(op.dst), pool.row(op.src), pool.row_bytes());
  }
}

const std::vector<float>& ModelRunner::execute(const StepPlan& plan) {
  apply(plan.ops);
  const int64_t B = cache_.plan().block_size;
  const size_t n = plan.seqs.size();
  std::vector<std::vector<int64_t>> slots(n);
  std::vector<std::vector<CheckpointTarget>> checkpoints(n);
  std::vector<SequenceStep> steps(n);
  int64_t wanted = 0;
  for (size_t i = 0; i < n; ++i) {
    const ScheduledSequence& x = plan.seqs[i];
    const Sequence& s = *x.seq;
    const std::vector<int32_t>& table = s.rows.token_rows;
    slots[i].resize(x.count);
    for (int64_t t = 0; t < x.count; ++t) {
      const int64_t p = x.start + t;
      slots[i][t] = int64_t{table[p / B]} * B + p % B;
    }
    for (const ScheduledSequence::Checkpoint& c : x.checkpoints) checkpoints[i].push_back({c.position, c.rows});
    steps[i] = SequenceStep{std::span(s.tokens).subspan(x.start, x.count),
                            x.start,
                            x.prompt,
                            table,
                            slots[i],
                            s.rows.state_rows,
                            checkpoints[i],
                            x.logits_from};
    wanted += x.count - x.logits_from;
  }
  logits_.resize(static_cast<size_t>(wanted * model_.config().vocab_size));
  if (n > 0) model_.forward(StepBatch{cache_.pool().base(), &cache_.plan(), steps}, logits_.data());
  return logits_;
}

}  // namespace kestrel
