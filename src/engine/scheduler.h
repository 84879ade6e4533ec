// The scheduler: continuous batching with one token budget per step shared by decodes and chunked prefills
// (there are no prefill and decode phases: each sequence has a count of computed tokens and gets what the budget
// allows), admission with prefix-cache lookups, preemption by recompute when rows run out, KDA checkpoints.
//
// Exactness rules it keeps (docs/engine.md): with chunked KDA prefill a prompt is cut only at multiples of the
// KDA chunk (or at its end), a step never mixes prompt and generated tokens of a sequence, and only blocks
// computed as prompt are named for reuse, so every cut, hit and recompute gives the bits of one uncut prefill.
#pragma once
#include <cstdint>
#include <vector>

#include "cache/cache_manager.h"
#include "engine/sequence.h"
#include "engine/step_cost.h"

namespace kestrel {

enum class SchedulingPolicy { fcfs, priority };

struct SchedulerConfig {
  int64_t max_num_batched_tokens = 2048;
  int max_num_seqs = 256;
  SchedulingPolicy policy = SchedulingPolicy::fcfs;
  int prefill_alignment = 1;    // Model::prefill_alignment(): > 1 means prompts run KDA chunked
  int checkpoint_interval = 1;  // KDA checkpoints at every this many block boundaries of computed prompt
  // vLLM's long_prefill_token_threshold: one sequence's prompt tokens in a step are at most this many (0: no cap).
  int64_t long_prefill_token_threshold = 0;
  // > 1: a step with running decodes carries at most the prompt tokens that keep its predicted time within this
  // factor of the decodes' own step time (engine/step_cost.h); never fewer than kMinPromptChunk (or one KDA chunk),
  // so that prompts progress, except while the decodes' step time for that many rows is not measured yet: then the
  // step runs them alone (twice per power-of-two bucket of rows: the first is skipped). 0: off.
  double max_itl_factor = 0;
};

// The fewest prompt tokens a step with decodes may carry under max_itl_factor.
inline constexpr int64_t kMinPromptChunk = 64;

// One sequence's part of a step.
struct ScheduledSequence {
  Sequence* seq = nullptr;
  int64_t start = 0, count = 0;
  bool prompt = false;      // prompt tokens of a multi-token prompt: KDA runs chunked
  int64_t logits_from = 0;  // logits wanted for tokens [logits_from, count) of the step
  struct Checkpoint {
    int64_t position;
    std::vector<int32_t> rows;
  };
  std::vector<Checkpoint> checkpoints;
  // Speculative decoding: the step verifies the sequence's last num_draft tokens (count = 1 + num_draft, logits
  // for every position). spec_slots: where the KDA state after each of the first num_draft positions goes (the
  // sequence's per-position slots). `rejected` is set by the engine after verification, before commit: that many
  // of the last positions are dropped (their state slot is swapped out, their blocks are never named).
  int num_draft = 0;
  std::vector<Checkpoint> spec_slots;
  int64_t rejected = 0;
};

struct StepPlan {
  std::vector<RowOp> ops;  // before the forward: state rows of admitted sequences
  std::vector<ScheduledSequence> seqs;
  std::vector<int32_t> pins;  // checkpoint rows read by `ops`, held until the step is committed
  int64_t num_tokens = 0;
  int num_preempted = 0;
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& cfg, CacheManager& cache);

  const SchedulerConfig& config() const { return cfg_; }
  // A sequence holding no rows joins the waiting queue.
  void add_waiting(Sequence* s);
  // A sequence that holds rows already (a fork) joins the running ones.
  void add_running(Sequence* s);
  // Takes a waiting or running sequence out, all its rows returned.
  void remove(Sequence* s);

  StepPlan schedule();
  // The step of `plan` took `seconds` (measured by the engine around its execution): teaches the step cost model.
  void observe(const StepPlan& plan, double seconds);
  const StepCostModel& step_costs() const { return costs_; }
  // The prompt tokens the last schedule() allowed beside its decodes (-1: no limit but the token budget; 0: none,
  // a step of decodes alone measures them).
  int64_t last_prompt_allowance() const { return last_allowance_; }
  // After the step ran: advances computed tokens (less each sequence's rejected drafts: the KDA state of its last
  // kept position is swapped in), names full blocks and checkpoints of kept positions, releases pins.
  void commit(const StepPlan& plan);

  bool idle() const { return waiting_.empty() && running_.empty(); }
  int num_running() const { return static_cast<int>(running_.size()); }
  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  const std::vector<Sequence*>& running() const { return running_; }
  const std::vector<Sequence*>& waiting() const { return waiting_; }
  int64_t num_preemptions() const { return preemptions_; }

 private:
  bool before(const Sequence* a, const Sequence* b) const;  // queue order of the policy
  void insert_sorted(std::vector<Sequence*>& q, Sequence* s) const;
  // Tokens of `s` to compute this step from position `start` with `budget` left (0: none fit).
  int64_t tokens_to_run(const Sequence& s, int64_t start, int64_t budget) const;
  // Where blocks stop being reusable: blocks computed from generated tokens differ from a prefill's.
  int64_t reusable_end(const Sequence& s) const;
  ScheduledSequence make_step(Sequence* s, int64_t start, int64_t count) const;
  void preempt(Sequence* s);
  // Speculative decoding: extends the plain decodes of sequences with drafts by as many drafts as the budget, the
  // rows they already hold and rows nobody holds allow (drafts never preempt); the others are dropped.
  void add_drafts(StepPlan& plan, int64_t& budget);
  void admit_waiting(StepPlan& plan, int64_t& budget, int64_t& prompt_budget);
  // The token budget a sequence with `left` tokens to compute may use now: a prompt segment also within the
  // prompt share and the per-sequence threshold.
  int64_t segment_budget(int64_t left, int64_t budget, int64_t prompt_budget) const;
  void add_checkpoints(StepPlan& plan);

  SchedulerConfig cfg_;
  CacheManager& cache_;
  std::vector<Sequence*> waiting_, running_;  // running_ in schedule order: the last one is preempted first
  int64_t admissions_ = 0, preemptions_ = 0;
  StepCostModel costs_;
  int64_t last_allowance_ = -1;
};

}  // namespace kestrel
