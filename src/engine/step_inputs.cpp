#include "engine/step_inputs.h"

#include <algorithm>

namespace kestrel {

StepInputs step_inputs(const StepPlan& plan, int block_size) {
  const int64_t B = block_size;
  const size_t n = plan.seqs.size();
  StepInputs in;
  in.slots.resize(n);
  in.checkpoints.resize(n);
  in.steps.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const ScheduledSequence& x = plan.seqs[i];
    const Sequence& s = *x.seq;
    const std::vector<int32_t>& table = s.rows.token_rows;
    std::vector<int64_t>& slots = in.slots[i];
    slots.resize(x.count);
    for (int64_t t = 0; t < x.count; ++t) {
      const int64_t p = x.start + t;
      // A model without attention layers keeps no token rows: its tokens have no slots.
      slots[t] = table.empty() ? -1 : int64_t{table[p / B]} * B + p % B;
    }
    for (const ScheduledSequence::Checkpoint& c : x.checkpoints) in.checkpoints[i].push_back({c.position, c.rows});
    // A verification step's per-position state slots are checkpoints too (a prefix-cache checkpoint may share a
    // position with one: both get the state).
    for (const ScheduledSequence::Checkpoint& c : x.spec_slots) in.checkpoints[i].push_back({c.position, c.rows});
    std::stable_sort(in.checkpoints[i].begin(), in.checkpoints[i].end(),
                     [](const CheckpointTarget& a, const CheckpointTarget& b) { return a.position < b.position; });
    in.steps[i] = SequenceStep{std::span(s.tokens).subspan(x.start, x.count),
                               x.start,
                               x.prompt,
                               table,
                               slots,
                               s.rows.state_rows,
                               in.checkpoints[i],
                               x.logits_from,
                               s.request->params.lora_id};
    in.wanted_logits += x.count - x.logits_from;
  }
  return in;
}

}  // namespace kestrel
