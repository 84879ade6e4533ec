// Step costs measured while the engine runs, and the prefill share of a step they allow. A step that carries prompt
// tokens beside running decodes makes every one of those streams wait for it; with a latency factor F the scheduler
// gives a step with decodes only as many prompt tokens as keep its predicted time within F times the predicted time
// of the decodes alone (docs/engine.md, "Step budget"). The predictions come from the steps the engine ran:
//   - the time of a step of n decode rows, one running mean per power-of-two bucket of n (1, 2, 3-4, 5-8, ...), from
//     steps without prompt tokens;
//   - the marginal time of one prompt token, from steps with both (their time less the decode prediction, per
//     prompt token) and, until one was seen, from steps of prompt tokens only (an overestimate: it keeps the fixed
//     cost of a step).
// Means are exponential (weight kAlpha on the newest step). The first step of each decode bucket is skipped, since it
// pays one-time costs (CUDA graph capture, first touches of workspaces); the first prompt steps are kept (one-time
// costs there only overestimate the per-token cost, which gives smaller prompt shares until later steps correct it).
// Without predictions there is no limit.
#pragma once
#include <array>
#include <cstdint>

namespace kestrel {

class StepCostModel {
 public:
  static constexpr double kAlpha = 0.25;
  // Steps whose prompt part is smaller than this do not teach the per-token cost (their time is mostly fixed cost).
  static constexpr int64_t kMinPromptSample = 64;

  // A step of `decode_rows` single-token rows and `prompt_tokens` other tokens took `seconds`.
  void observe(int64_t decode_rows, int64_t prompt_tokens, double seconds);
  // Predicted seconds of a step of n decode rows; < 0 when no step near n was measured.
  double decode_seconds(int64_t n) const;
  // Whether n's own bucket was measured (the scheduler runs steps of decodes alone until it is).
  bool knows_decode(int64_t n) const;
  // Predicted seconds per prompt token; < 0 when unknown.
  double prompt_token_seconds() const;
  // The most prompt tokens a step with n > 0 decode rows may carry under factor F > 1; -1: unknown (nothing
  // measured yet) or no limit (F <= 1, which means off; n = 0).
  int64_t prompt_allowance(int64_t n, double factor) const;

 private:
  static int bucket(int64_t n);
  struct Mean {
    double value = 0;
    int64_t seen = 0;  // observations, the skipped first one included
  };
  static void update(Mean& m, double x, bool skip_first);
  std::array<Mean, 24> decode_{};
  Mean mixed_, prompt_only_;
};

}  // namespace kestrel
