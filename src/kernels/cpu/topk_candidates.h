// Exact top-k from fast scores with a per-key error bound: CPU reference for the planned GPU path that scans
// all keys with an inexact FP8 pass, rescores only the keys that can still be in the top-k with the exact
// kernel, and selects among those. The result is bit for bit topk_indices over the exact scores.
//
// Contract for every key i (fast f_i, bound e_i), with NaN exact scores counted as -inf (topk_indices never
// selects either):
//   - f_i NaN declares the key unselectable: its exact score is NaN or -inf. It is never rescored.
//   - Otherwise e_i >= 0 (may be +inf; NaN or negative throws), and the exact score s_i lies in the real interval
//     [f_i - e_i, f_i + e_i] (f_i = +-inf with finite e_i means s_i == f_i; e_i = +inf means "unknown").
//     A key whose exact score may be NaN while f_i is a number needs e_i = +inf.
// The interval ends are rounded outward to fp32 (topk_lower_bound / topk_upper_bound), so the caller states the
// real bound and never has to round it.
//
// Why the candidates suffice: let tau be the k-th largest lower bound lo_i (over keys with f_i not NaN; -inf
// when there are fewer than k, or when that k-th value is -inf). If tau > -inf, k keys have s_i >= lo_i >= tau,
// so they are selectable and the exact k-th best score T >= tau; every key of the exact top-k has
// hi_i >= s_i >= T >= tau. If tau == -inf, every selectable key has hi_i >= s_i > -inf. So the candidates
// {i : hi_i >= tau, hi_i > -inf} contain the exact top-k set, and since that set is the first k of a total order
// (higher score, then lower position), it is also the first k of the candidates in that order: ties at T and
// -0/+0 need no special case.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

namespace kestrel::cpu {

// Outward-rounded interval ends: the largest float <= the real f - e, the smallest float >= the real f + e
// (with the contract's meaning for infinities: e = +inf gives -inf / +inf, f = +-inf with finite e gives f).
// f must not be NaN, e must be >= 0.
float topk_lower_bound(float f, float e);
float topk_upper_bound(float f, float e);

// tau: the k-th largest topk_lower_bound over keys with fast[i] not NaN; -inf when fewer than k such keys;
// +inf for k == 0 (nothing to select). Throws on a NaN or negative bound of such a key.
float topk_candidate_threshold(const float* fast, const float* bound, int64_t n, int k);

// The keys that can be in the exact top-k for threshold tau: fast[i] not NaN, hi_i >= tau and hi_i > -inf,
// in ascending position order.
std::vector<int32_t> topk_candidates(const float* fast, const float* bound, int64_t n, float threshold);

// The exact top-k over all n keys, given the exact scores of candidates only (ascending positions, as from
// topk_candidates): `out` gets k entries in topk_indices's rank order (higher score, then lower position; -1
// padding). Exactly topk_indices over the n exact scores when the candidates contain the exact top-k set.
void topk_among_candidates(const int32_t* candidates, const float* exact_scores, int64_t n_candidates, int k,
                           int32_t* out);

struct TopkCandidateStats {
  float threshold = 0;       // tau
  int64_t candidates = 0;    // keys rescored
  // Candidates whose exact score fell outside [lo, hi]: the contract was broken and `out` may differ from the
  // exact top-k (a broken bound on a key that was not rescored cannot be seen).
  int64_t bound_violations = 0;
};

// All three steps: threshold, candidates, exact_score(i) for each candidate (in ascending i, once each), select.
void topk_from_bounded(const float* fast, const float* bound, int64_t n, int k,
                       const std::function<float(int64_t)>& exact_score, int32_t* out,
                       TopkCandidateStats* stats = nullptr);

}  // namespace kestrel::cpu
