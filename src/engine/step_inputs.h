// The translation of a step plan into what the model's forward takes: per sequence its new tokens, block table,
// slots (row * B + offset of each new token), state rows and checkpoint targets. Kernels see these plain pages;
// no kernel knows about rows, requests or the scheduler.
#pragma once
#include <vector>

#include "engine/scheduler.h"
#include "model/model.h"

namespace kestrel {

// The spans of `steps` point into the plan's sequences and into this object.
struct StepInputs {
  std::vector<SequenceStep> steps;
  std::vector<std::vector<int64_t>> slots;
  std::vector<std::vector<CheckpointTarget>> checkpoints;
  int64_t wanted_logits = 0;  // rows of logits the step produces
};
StepInputs step_inputs(const StepPlan& plan, int block_size);

}  // namespace kestrel
