// MoE routing (DeepSeek-V3 "noaux_tc" / Kimi): sigmoid scores, a correction bias that only selects,
// group-limited top-k, renormalised unbiased weights times the routed scaling factor.
#pragma once
#include <cstdint>

namespace kestrel::cpu {

struct MoeRouting {
  int n_experts = 0;
  int top_k = 0;
  int n_group = 1;
  int topk_group = 1;
  bool renormalize = true;
  float scaling = 1.0f;
};

// logits: [E] router logits of one token; bias: [E] or nullptr. Writes top_k expert ids (rank order: higher biased
// score first, ties to the lower id) and their weights. Groups (n_group > 1) are scored by the sum of their two
// highest biased scores and the best topk_group groups survive (ties to the lower group).
void moe_route(const float* logits, const float* bias, const MoeRouting& r, int32_t* ids, float* weights);

// How close moe_route's choice for these logits is to changing: the smallest gap, in biased score, at a boundary it
// draws -- between the last chosen and the first unchosen candidate, and (grouped routing) between the last
// surviving and the first dropped group's score. A perturbation of the scores smaller than half of it cannot change
// the chosen set. +infinity where nothing is left out.
float moe_route_margin(const float* logits, const float* bias, const MoeRouting& r);

}  // namespace kestrel::cpu
