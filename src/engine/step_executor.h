// What runs a step's forward: the row copies the plan orders, then the model over the cache pool. The CPU model
// runner (model_runner.h) is one; the GPU runner (src/gpu) is another, whose pool lives in GPU memory. The engine
// sees only this interface, so the scheduler, prefix cache and sampling are the same for every backend.
#pragma once
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "cache/cache_manager.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"

namespace kestrel {

class Model;

// A row an executor samples itself (an executor whose device samples: the logits never reach the host).
struct SampleRow {
  int64_t logits_row = 0;                 // among the step's wanted rows, in plan order
  const SamplingParams* params = nullptr;
  double uniform = 0.0;                   // Sampler::draw_uniform() of the row's sequence
  std::vector<PenaltyToken> penalties;    // Sampler::penalty_tokens() of the row's sequence
  // Structured output: the tokens the row may choose (bit t of token_mask[t / 32]; empty: all), handed only to an
  // executor whose applies_token_masks() is true.
  std::span<const uint32_t> token_mask;
};
struct SampledToken {
  int32_t token = 0;
  TokenLogprob logprob;  // when params->logprobs >= 0
};

class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  // Row copies and zeroing on the pool, in order.
  virtual void apply(std::span<const RowOp> ops) = 0;
  // Runs the plan's row ops and forward. Returns the logits [wanted positions, vocab] on the host, sequences in
  // plan order.
  virtual const std::vector<float>& execute(const StepPlan& plan) = 0;
  // Drafters conditioned on the target (engine/spec_decode.h): from now on execute() also keeps every step token's
  // hidden states of `layers` (Model::forward's), [step tokens, layers.size() * hidden_size] in plan order, returned
  // by hidden(). Executors that cannot refuse it (Error).
  virtual void keep_hidden(std::vector<int> layers);
  virtual const std::vector<float>& hidden() const;
  // Whether execute_sampled can choose tokens with these parameters.
  virtual bool samples(const SamplingParams&) const { return false; }
  // Whether execute_sampled applies SampleRow::token_mask (structured output). Without it, a step with a
  // constrained row samples on the host from the logits execute() returns.
  virtual bool applies_token_masks() const { return false; }
  // Runs the plan as execute() does and chooses each row's token as sample_token() (engine/sampler.h) would.
  virtual std::vector<SampledToken> execute_sampled(const StepPlan& plan, std::span<const SampleRow> rows);
};

// Makes the executor of an engine once its cache exists.
using StepExecutorFactory = std::function<std::unique_ptr<StepExecutor>(const Model&, CacheManager&)>;

}  // namespace kestrel
