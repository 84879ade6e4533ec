#include "kernels/cpu/topk_candidates.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "kernels/cpu/attention.h"

namespace kestrel::cpu {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

void check_count(int64_t n, int k) {
  KESTREL_CHECK(n >= 0 && n <= std::numeric_limits<int32_t>::max(), "topk candidates: bad key count {}", n);
  KESTREL_CHECK(k >= 0, "topk candidates: negative k {}", k);
}

float checked_bound(const float* bound, int64_t i) {
  const float e = bound[i];
  KESTREL_CHECK(e >= 0, "topk candidates: bound of key {} is {} (must be >= 0, not NaN)", i, e);
  return e;
}

// The rounding error of s = RN(a + b) as a float: exactly (a + b) - s when nothing overflows (Knuth's TwoSum);
// NaN or inf when an intermediate overflowed, which the callers treat as "round outward".
float two_sum_error(float a, float b, float s) {
  const float b_virtual = s - a;
  const float a_virtual = s - b_virtual;
  return (a - a_virtual) + (b - b_virtual);
}

}  // namespace

float topk_lower_bound(float f, float e) {
  if (e == kInf) return -kInf;
  if (std::isinf(f)) return f;
  const float s = f - e;
  if (std::isinf(s)) return s;  // -inf: below any real lower end
  const float err = two_sum_error(f, -e, s);
  return err >= 0 ? s : std::nextafter(s, -kInf);
}

float topk_upper_bound(float f, float e) {
  if (e == kInf) return kInf;
  if (std::isinf(f)) return f;
  const float s = f + e;
  if (std::isinf(s)) return s;
  const float err = two_sum_error(f, e, s);
  return err <= 0 ? s : std::nextafter(s, kInf);
}

float topk_candidate_threshold(const float* fast, const float* bound, int64_t n, int k) {
  check_count(n, k);
  if (k == 0) return kInf;
  std::vector<float> lower;
  lower.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(fast[i])) continue;
    lower.push_back(topk_lower_bound(fast[i], checked_bound(bound, i)));
  }
  if (lower.size() < static_cast<size_t>(k)) return -kInf;
  const auto kth = lower.begin() + (k - 1);
  std::nth_element(lower.begin(), kth, lower.end(), std::greater<float>());
  return *kth;
}

std::vector<int32_t> topk_candidates(const float* fast, const float* bound, int64_t n, float threshold) {
  check_count(n, 0);
  KESTREL_CHECK(!std::isnan(threshold), "topk_candidates: NaN threshold");
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(fast[i])) continue;
    const float hi = topk_upper_bound(fast[i], checked_bound(bound, i));
    if (hi > -kInf && hi >= threshold) out.push_back(static_cast<int32_t>(i));
  }
  return out;
}

void topk_among_candidates(const int32_t* candidates, const float* exact_scores, int64_t n_candidates, int k,
                           int32_t* out) {
  check_count(n_candidates, k);
  for (int64_t c = 1; c < n_candidates; ++c) {
    KESTREL_CHECK(candidates[c - 1] < candidates[c], "topk_among_candidates: candidates not strictly ascending "
                  "at {} ({} then {})", c, candidates[c - 1], candidates[c]);
  }
  // Candidates in ascending position order make topk_indices's position tie-break, applied to candidate
  // numbers, the same as over the original positions.
  topk_indices(exact_scores, n_candidates, k, out);
  for (int r = 0; r < k; ++r) {
    if (out[r] >= 0) out[r] = candidates[out[r]];
  }
}

void topk_from_bounded(const float* fast, const float* bound, int64_t n, int k,
                       const std::function<float(int64_t)>& exact_score, int32_t* out, TopkCandidateStats* stats) {
  const float threshold = topk_candidate_threshold(fast, bound, n, k);
  const std::vector<int32_t> candidates = k == 0 ? std::vector<int32_t>{} : topk_candidates(fast, bound, n, threshold);
  std::vector<float> exact(candidates.size());
  int64_t violations = 0;
  for (size_t c = 0; c < candidates.size(); ++c) {
    const int32_t i = candidates[c];
    exact[c] = exact_score(i);
    const float ranked = std::isnan(exact[c]) ? -kInf : exact[c];
    if (ranked < topk_lower_bound(fast[i], bound[i]) || ranked > topk_upper_bound(fast[i], bound[i])) ++violations;
  }
  topk_among_candidates(candidates.data(), exact.data(), static_cast<int64_t>(candidates.size()), k, out);
  if (stats) {
    stats->threshold = threshold;
    stats->candidates = static_cast<int64_t>(candidates.size());
    stats->bound_violations = violations;
  }
}

}  // namespace kestrel::cpu
