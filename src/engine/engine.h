// The engine: requests in, tokens out, one loop of schedule -> execute -> update. It owns the cache (one pool of
// rows laid out by the cache planner), the scheduler and the model runner; the model is shared and read-only.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "cache/cache_manager.h"
#include "engine/model_runner.h"
#include "engine/step_executor.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"
#include "engine/spec_decode.h"
#include "model/model.h"

namespace kestrel {

struct EngineConfig {
  int32_t num_rows = 0;          // rows of the cache pool; 0: as many as cache_bytes holds
  int64_t cache_bytes = int64_t{256} << 20;
  int block_size = 0;            // B; 0: the planner's choice in [16 or the KDA chunk, max_block_size]
  int max_block_size = 64;       // prefix-cache hits are at most this coarse
  int64_t max_model_len = 0;     // 0: the config's context length, capped at what the cache holds
  int64_t max_num_batched_tokens = 2048;
  int max_num_seqs = 256;
  SchedulingPolicy policy = SchedulingPolicy::fcfs;
  int64_t long_prefill_token_threshold = 0;  // SchedulerConfig's: vLLM's per-sequence prompt tokens per step
  double max_itl_factor = 0;                 // SchedulerConfig's: the prompt share beside decodes (0: off)
  // The step time the scheduler learns from, given the step and the measured seconds (empty: the measured time).
  // For tests and simulations of other hardware.
  std::function<double(const StepPlan&, double)> step_seconds;
  bool enable_prefix_caching = true;
  int checkpoint_interval = 1;   // KDA checkpoints every this many blocks of prompt
  // Empty: the CPU model runner over a host pool. Set (the GPU runner): the pool's bytes live with the executor,
  // unless executor_on_host_pool (an executor that runs on the host's pool, e.g. in tests).
  StepExecutorFactory executor;
  bool executor_on_host_pool = false;
  // Speculative decoding (--speculative-config): drafts verified in the engine's steps (engine/spec_decode.h).
  std::optional<SpeculativeConfig> speculative;
  // The drafter to use instead of the config's method (tests: drafters with chosen drafts or distributions).
  std::shared_ptr<Drafter> drafter;
};

// Points an engine's config at a device before the Engine is built (the GPU backend: weights uploaded, memory
// budget, executor); returns what must outlive the engine. Empty: the CPU.
using DeviceAttach = std::function<std::shared_ptr<void>(const Model&, EngineConfig&)>;

// The cache plan an Engine of this model and config lays its rows out by (what a device backend sizes for).
CachePlan engine_plan(const Model& model, const EngineConfig& cfg);

// A token a sequence produced in a step.
struct TokenEvent {
  RequestId request = 0;
  int index = 0;
  int32_t token = 0;
};

struct StepOutput {
  std::vector<TokenEvent> tokens;
  std::vector<RequestOutput> finished;
  int64_t num_tokens = 0;  // tokens the step computed
  int num_preempted = 0;
};

struct EngineStats {
  int64_t steps = 0, computed_tokens = 0, generated_tokens = 0, preemptions = 0;
  PrefixCacheCounters prefix;
  SpecDecodeCounters spec;  // all zero without speculative decoding
};

class Engine {
 public:
  Engine(const Model& model, const EngineConfig& cfg);

  // Queues a request; throws Error (naming the limit) for one that can never run: tokens outside the vocabulary,
  // invalid sampling parameters, prompt + max_tokens beyond max_model_len (which the cache holds).
  RequestId add_request(std::vector<int32_t> prompt, const SamplingParams& params, int priority = 0,
                        bool keep_logits = false, uint64_t cache_key = 0);
  // Ends a request wherever it is, all its rows returned; its completions so far, finish reason abort.
  RequestOutput abort(RequestId id);
  StepOutput step();
  // Steps until every request finished; their outputs in order of request id.
  std::vector<RequestOutput> run_to_completion();
  bool has_unfinished() const { return !requests_.empty(); }
  // Forgets every cached prefix and KDA checkpoint (after a weight update they describe another model). Only with no
  // request unfinished, whose rows would keep their names: false then, and nothing changes (as vLLM's).
  bool reset_prefix_cache();

  const CachePlan& cache_plan() const { return cache_.plan(); }
  const CacheManager& cache() const { return cache_; }
  const Scheduler& scheduler() const { return scheduler_; }
  int64_t max_model_len() const { return max_model_len_; }
  EngineStats stats() const;
  // Every row's reference count against the sequences that hold it; Error on a mismatch (tests).
  void check_accounting() const;

 private:
  void sample(Sequence& s, const float* logits, StepOutput& out);
  // The step of `plan`, executed since `start`, teaches the scheduler its cost (EngineConfig::step_seconds).
  void observe_step(const StepPlan& plan, std::chrono::steady_clock::time_point start);
  // Speculative decoding: drafts for every running sequence that is about to decode (appended to its tokens).
  void propose_drafts();
  // The token chosen for s (by its sampler or by the executor): appended, reported, checked for the end.
  void record(Sequence& s, int32_t token, TokenLogprob* logprob, StepOutput& out);
  // Whether the executor can sample every sequence of the plan that samples this step (none keeps its logits, none
  // forks its n completions now), so that the logits stay on its device.
  bool samples_on_executor(const StepPlan& plan) const;
  // The requests whose sequences all finished are collected; the step's counters.
  StepOutput finish_step(const StepPlan& plan, const std::vector<RequestId>& touched, StepOutput out);
  void fork(Sequence& parent, const float* logits, StepOutput& out);
  // The log-probabilities of the prompt tokens whose logits this step computed (rows [logits_from, count) of x).
  void score_prompt(Sequence& s, const ScheduledSequence& x, const float* logits);
  void finish_if_done(Sequence& s, int32_t token);
  RequestOutput collect(Request& r) const;

  const Model& model_;
  EngineConfig cfg_;
  CacheManager cache_;
  int64_t max_model_len_;
  Scheduler scheduler_;
  std::unique_ptr<StepExecutor> runner_;
  std::unordered_map<RequestId, std::unique_ptr<Request>> requests_;
  RequestId next_id_ = 0;
  EngineStats stats_;
  std::shared_ptr<Drafter> drafter_;
  Draft draft_;
  int64_t hidden_width_ = 0;  // per token, of the hidden states the drafter takes (0: none)
};

}  // namespace kestrel
