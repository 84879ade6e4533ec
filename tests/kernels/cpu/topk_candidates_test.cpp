// Exact top-k from bounded fast scores: the outward-rounded interval ends, a hand-worked row, random rows in
// contract (heavy ties, -0/+0, -inf, NaN, short rows, adversarial noise at the bound) against topk_indices over
// the exact scores, what happens out of contract, and the candidate counts of a decode-sized row.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/topk_candidates.h"

namespace kestrel::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kMax = std::numeric_limits<float>::max();
// The tests check |fast - exact| <= bound exactly in long double (x87: 64 significant bits).
static_assert(std::numeric_limits<long double>::digits >= 64);

long double distance(float a, float b) {
  return std::abs(static_cast<long double>(a) - static_cast<long double>(b));
}

std::vector<int32_t> reference_topk(const std::vector<float>& exact, int k) {
  std::vector<int32_t> out(static_cast<size_t>(k));
  topk_indices(exact.data(), static_cast<int64_t>(exact.size()), k, out.data());
  return out;
}

struct BoundedRun {
  std::vector<int32_t> out;
  std::vector<int64_t> rescored;  // exact_score's arguments, in call order
  TopkCandidateStats stats;
};

BoundedRun run_bounded(const std::vector<float>& fast, const std::vector<float>& bound,
                       const std::vector<float>& exact, int k) {
  BoundedRun r;
  r.out.assign(static_cast<size_t>(k), -7);
  const auto exact_score = [&](int64_t i) {
    r.rescored.push_back(i);
    return exact[static_cast<size_t>(i)];
  };
  topk_from_bounded(fast.data(), bound.data(), static_cast<int64_t>(fast.size()), k, exact_score, r.out.data(),
                    &r.stats);
  return r;
}

TEST(TopkBounds, HandWorkedEnds) {
  // 1 - 2^-100 and 1 + 2^-100 are not floats: the ends step out to the neighbours of 1.
  const float tiny = std::ldexp(1.0f, -100);
  EXPECT_EQ(topk_lower_bound(1.0f, tiny), 1.0f - std::ldexp(1.0f, -24));
  EXPECT_EQ(topk_upper_bound(1.0f, tiny), 1.0f + std::ldexp(1.0f, -23));
  // Exact differences stay put.
  EXPECT_EQ(topk_lower_bound(3.0f, 1.0f), 2.0f);
  EXPECT_EQ(topk_upper_bound(3.0f, 0.5f), 3.5f);
  EXPECT_EQ(topk_lower_bound(-2.5f, 0.0f), -2.5f);
  EXPECT_EQ(topk_upper_bound(-0.0f, 0.0f), 0.0f);
  // Infinities: an infinite bound is "unknown"; an infinite fast score with a finite bound is that score.
  EXPECT_EQ(topk_lower_bound(5.0f, kInf), -kInf);
  EXPECT_EQ(topk_upper_bound(-kInf, kInf), kInf);
  EXPECT_EQ(topk_lower_bound(kInf, 5.0f), kInf);
  EXPECT_EQ(topk_upper_bound(-kInf, 5.0f), -kInf);
  // Overflow rounds outward to infinity; kMax - kMax is exactly 0.
  EXPECT_EQ(topk_upper_bound(kMax, kMax), kInf);
  EXPECT_EQ(topk_lower_bound(-kMax, kMax), -kInf);
  EXPECT_EQ(topk_lower_bound(kMax, kMax), 0.0f);
}

// With exponents of f and e within [-20, 8], f -+ e is exact in double, so the ends can be checked to be the
// nearest floats on the outer side.
TEST(TopkBounds, OutwardAndTightOnRandomPairs) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> exp_f(-8, 8), exp_e(-20, 4), sign(0, 1);
  for (int t = 0; t < 200000; ++t) {
    const float f = (sign(rng) ? -1.0f : 1.0f) * std::ldexp(mant(rng), exp_f(rng));
    const float e = std::ldexp(mant(rng), exp_e(rng));
    const double lo_exact = static_cast<double>(f) - e, hi_exact = static_cast<double>(f) + e;
    const float lo = topk_lower_bound(f, e), hi = topk_upper_bound(f, e);
    ASSERT_LE(lo, lo_exact) << f << " " << e;
    ASSERT_GT(std::nextafter(lo, kInf), lo_exact) << f << " " << e;
    ASSERT_GE(hi, hi_exact) << f << " " << e;
    ASSERT_LT(std::nextafter(hi, -kInf), hi_exact) << f << " " << e;
  }
}

// n = 6, k = 2. Lower ends [1, 2.75, 2, 3, -, 0.25] -> tau = 2.75 (second largest); upper ends
// [1.5, 3, 3, 3, -, 0.75] -> candidates 1, 2, 3. Exact scores 3, 2, 3 there: the tie at 3 goes to position 1.
TEST(TopkFromBounded, HandWorkedRow) {
  const std::vector<float> fast = {1.25f, 2.875f, 2.5f, 3.0f, kNaN, 0.5f};
  const std::vector<float> bound = {0.25f, 0.125f, 0.5f, 0.0f, 1.0f, 0.25f};
  const std::vector<float> exact = {1.0f, 3.0f, 2.0f, 3.0f, kNaN, 0.5f};
  const BoundedRun r = run_bounded(fast, bound, exact, 2);
  EXPECT_EQ(r.out, (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(r.out, reference_topk(exact, 2));
  EXPECT_EQ(r.rescored, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(r.stats.threshold, 2.75f);
  EXPECT_EQ(r.stats.candidates, 3);
  EXPECT_EQ(r.stats.bound_violations, 0);
  // Fewer selectable keys than k: every key whose interval reaches above -inf is rescored, then -1 padding.
  const BoundedRun all = run_bounded(fast, bound, exact, 7);
  EXPECT_EQ(all.out, (std::vector<int32_t>{1, 3, 2, 0, 5, -1, -1}));
  EXPECT_EQ(all.stats.threshold, -kInf);
  EXPECT_EQ(all.stats.candidates, 5);
}

// Zero bounds on distinct adjacent floats: exactly k candidates (one more would mean the ends were rounded
// outward where the difference is exact).
TEST(TopkFromBounded, ZeroBoundsRescoreExactlyK) {
  std::mt19937 rng(3);
  std::vector<float> exact(1000);
  float v = 1.0f;
  for (float& s : exact) {
    s = v;
    v = std::nextafter(v, kInf);
  }
  std::shuffle(exact.begin(), exact.end(), rng);
  const std::vector<float> bound(exact.size(), 0.0f);
  for (int k : {1, 17, 999, 1000}) {
    const BoundedRun r = run_bounded(exact, bound, exact, k);
    EXPECT_EQ(r.out, reference_topk(exact, k)) << k;
    EXPECT_EQ(r.stats.candidates, k) << k;
  }
}

// Random rows in contract. Scores come from a small pool (heavy ties, both zeros), a grid, or spread floats,
// with -inf, +inf and NaN sprinkled in; bounds are zero, varied per key, or occasionally +inf; fast scores sit
// at +-bound (by rank, so that the exact top-k looks worst and the rest best, or by random sign), inside it, or
// flag unselectable keys with NaN.
class RandomRows {
 public:
  explicit RandomRows(uint32_t seed) : rng_(seed) {}

  struct Row {
    std::vector<float> exact, fast, bound;
    int k = 0;
    int64_t at_bound = 0;  // finite keys with |fast - exact| == bound > 0
  };

  Row make(int n) {
    Row row;
    row.k = pick_k(n);
    row.exact.resize(static_cast<size_t>(n));
    const int score_style = uni(0, 2), bound_style = uni(0, 2), noise_style = uni(0, 3);
    const double special = uni(0, 3) == 0 ? 0.0 : 0.15;
    for (float& s : row.exact) s = score(score_style, special);
    std::vector<char> in_top(row.exact.size(), 0);
    for (int32_t p : reference_topk(row.exact, row.k)) {
      if (p >= 0) in_top[static_cast<size_t>(p)] = 1;
    }
    row.fast.resize(row.exact.size());
    row.bound.resize(row.exact.size());
    for (size_t i = 0; i < row.exact.size(); ++i) {
      const double sign = noise_style == 0 ? (in_top[i] ? -1.0 : 1.0) : (uni(0, 1) ? -1.0 : 1.0);
      fill_key(row.exact[i], bound_value(bound_style), sign, noise_style, row.fast[i], row.bound[i]);
      if (std::isfinite(row.exact[i]) && std::isfinite(row.bound[i]) && row.bound[i] > 0 &&
          distance(row.fast[i], row.exact[i]) == row.bound[i]) {
        ++row.at_bound;
      }
    }
    return row;
  }

 private:
  int uni(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  double real() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng_); }

  int pick_k(int n) {
    switch (uni(0, 6)) {
      case 0: return 1;
      case 1: return n;
      case 2: return n + uni(1, 5);
      case 3: return std::max(0, n - 1);
      case 4: return uni(0, 2);
      default: return uni(1, std::max(1, n));
    }
  }

  float score(int style, double special) {
    if (real() < special) {
      const int which = uni(0, 5);
      return which <= 2 ? -kInf : which <= 4 ? kNaN : kInf;
    }
    static constexpr float kPool[] = {-3.0f, -1.0f, -0.5f, -0.0f, 0.0f, 0.25f, 0.5f, 1.0f, 2.0f, 2.5f};
    switch (style) {
      case 0: return kPool[uni(0, 9)];
      case 1: return std::ldexp(static_cast<float>(uni(-64, 64)), -4);
      default: {
        const float m = std::uniform_real_distribution<float>(1.0f, 2.0f)(rng_);
        return (uni(0, 1) ? -1.0f : 1.0f) * std::ldexp(m, uni(-8, 8));
      }
    }
  }

  float bound_value(int style) {
    if (style == 0) return 0.0f;
    if (uni(0, 30) == 0) return kInf;
    if (style == 1 && uni(0, 2) == 0) return 0.0f;
    const float m = std::uniform_real_distribution<float>(1.0f, 2.0f)(rng_);
    return std::ldexp(style == 1 ? std::round(m * 8) / 8 : m, uni(-20, 2));
  }

  // A fast score for exact score s within bound e. With noise on the bound, the bound is lowered to the distance
  // actually reached when that is a float, so that |fast - s| == bound exactly despite the rounding of fast.
  void fill_key(float s, float e, double sign, int noise_style, float& fast, float& bound) {
    if (std::isnan(s) || (s == -kInf && uni(0, 2) == 0)) {
      if (uni(0, 1)) {
        fast = kNaN;
        bound = e;
      } else {
        fast = uni(0, 1) ? -kInf : static_cast<float>(uni(-5, 5));
        bound = kInf;
      }
      return;
    }
    if (std::isinf(s) || e == kInf) {
      fast = std::isinf(s) && e != kInf ? s : static_cast<float>(uni(-5, 5));
      bound = std::isinf(s) && e != kInf ? e : kInf;
      return;
    }
    bound = e;
    if (e == 0) {
      fast = s == 0 && uni(0, 1) ? -s : s;  // -0 and +0 are the same real number
      return;
    }
    // s and e are multiples of 2^-46 below 2^10 in magnitude, so these long double sums are exact.
    const long double step =
        noise_style == 3 ? static_cast<long double>(e) * uni(-8, 8) / 8 : static_cast<long double>(sign) * e;
    fast = static_cast<float>(static_cast<long double>(s) + step);
    while (distance(fast, s) > e) fast = std::nextafter(fast, s);
    if (noise_style != 3) {
      const long double reached = distance(fast, s);
      if (static_cast<long double>(static_cast<float>(reached)) == reached) bound = static_cast<float>(reached);
    }
  }

  std::mt19937 rng_;
};

TEST(TopkFromBounded, RandomRowsMatchExactTopk) {
  RandomRows gen(2024);
  int64_t rows = 0, at_bound = 0, rescored = 0, keys = 0;
  for (int t = 0; t < 6000; ++t) {
    const int n = t % 10 == 0 ? 1000 + t % 3000 : t % 70;
    const RandomRows::Row row = gen.make(n);
    const BoundedRun r = run_bounded(row.fast, row.bound, row.exact, row.k);
    ASSERT_EQ(r.out, reference_topk(row.exact, row.k)) << "row " << t << " n " << n << " k " << row.k;
    ASSERT_EQ(r.stats.bound_violations, 0) << "row " << t;
    // The split steps give the same candidates, and exact_score saw exactly those, once each, ascending.
    const float tau = topk_candidate_threshold(row.fast.data(), row.bound.data(), n, row.k);
    ASSERT_EQ(tau, r.stats.threshold);
    const std::vector<int32_t> cand =
        row.k == 0 ? std::vector<int32_t>{} : topk_candidates(row.fast.data(), row.bound.data(), n, tau);
    ASSERT_EQ(std::vector<int64_t>(cand.begin(), cand.end()), r.rescored) << "row " << t;
    ASSERT_EQ(r.stats.candidates, static_cast<int64_t>(cand.size()));
    for (int64_t i : r.rescored) ASSERT_FALSE(std::isnan(row.fast[static_cast<size_t>(i)]));
    ++rows;
    at_bound += row.at_bound;
    rescored += r.stats.candidates;
    keys += n;
  }
  // The generator really puts noise on the bound (the adversarial case), not only inside it.
  EXPECT_GT(at_bound, keys / 10);
  EXPECT_LT(rescored, keys);
  std::printf("random rows: %lld rows, %lld keys, %lld rescored, %lld at the bound\n", static_cast<long long>(rows),
              static_cast<long long>(keys), static_cast<long long>(rescored), static_cast<long long>(at_bound));
}

TEST(TopkFromBounded, ArgumentErrors) {
  const std::vector<float> fast = {1.0f, 2.0f};
  const std::vector<float> exact = {1.0f, 2.0f};
  int32_t out[2];
  const auto score = [&](int64_t i) { return exact[static_cast<size_t>(i)]; };
  const std::vector<float> negative = {0.0f, -1.0f}, nan_bound = {kNaN, 0.0f};
  EXPECT_THROW(topk_from_bounded(fast.data(), negative.data(), 2, 1, score, out), Error);
  EXPECT_THROW(topk_from_bounded(fast.data(), nan_bound.data(), 2, 1, score, out), Error);
  EXPECT_THROW(topk_candidate_threshold(fast.data(), negative.data(), 2, -1), Error);
  const int32_t unsorted[] = {1, 0};
  EXPECT_THROW(topk_among_candidates(unsorted, exact.data(), 2, 1, out), Error);
  // A NaN fast score declares the key unselectable, so its bound is never read.
  const std::vector<float> flagged = {kNaN, 2.0f};
  BoundedRun r = run_bounded(flagged, nan_bound, exact, 2);
  EXPECT_EQ(r.out, (std::vector<int32_t>{1, -1}));
}

// Out of contract: an exact score outside its interval. No equality is promised. A rescored key outside its
// interval is counted in bound_violations; a key that was not rescored can hide a better exact score unseen.
TEST(TopkFromBounded, OutOfContractIsReportedOnlyWhenRescored) {
  const std::vector<float> fast = {1.0f, 2.0f};
  const std::vector<float> bound = {0.0f, 0.0f};
  const BoundedRun seen = run_bounded(fast, bound, {1.0f, 5.0f}, 1);
  EXPECT_EQ(seen.stats.bound_violations, 1);
  const std::vector<float> hidden_exact = {9.0f, 2.0f};
  const BoundedRun hidden = run_bounded(fast, bound, hidden_exact, 1);
  EXPECT_EQ(hidden.stats.bound_violations, 0);
  EXPECT_EQ(hidden.rescored, (std::vector<int64_t>{1}));
  EXPECT_NE(hidden.out, reference_topk(hidden_exact, 1));
}

// A decode-sized row: n = 131072 keys, k = 2048, indexer-like scores s = k_scale * sum_j w_j ReLU(dot_j) with
// H_I = 64 heads and D = 128 (dot ~ N(0, D), as for unit-variance q and k), bound = rel * k_scale * sum_j |w_j| M
// with M = E sum_d |q_d k_d| = 2D/pi the per-head magnitude. Prints the mean number of keys rescored for several
// relative bounds, with the fast scores on the exact ones (errors far below the bound, as measured for the f16
// fast path) and at the adversarial +-bound.
TEST(TopkFromBounded, DecodeSizedCandidateCounts) {
  constexpr int kKeys = 131072, kTop = 2048, kHeads = 64, kDim = 128, kRows = 2;
  std::mt19937 rng(99);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_scale(-1.0f, 1.0f);
  const double magnitude_per_head = 2.0 * kDim / 3.14159265358979;
  const int rel_exponents[] = {-6, -12, -16};
  double sum_zero[3] = {}, sum_adv[3] = {};
  for (int row = 0; row < kRows; ++row) {
    std::vector<float> w(kHeads);
    double w_abs = 0;
    for (float& x : w) {
      x = normal(rng) / 8;
      w_abs += std::abs(x);
    }
    std::vector<float> exact(kKeys), scale(kKeys);
    for (int i = 0; i < kKeys; ++i) {
      scale[static_cast<size_t>(i)] = std::exp2(log_scale(rng));
      float sum = 0;
      for (int j = 0; j < kHeads; ++j) {
        sum += w[static_cast<size_t>(j)] * std::max(0.0f, normal(rng) * std::sqrt(static_cast<float>(kDim)));
      }
      exact[static_cast<size_t>(i)] = scale[static_cast<size_t>(i)] * sum;
    }
    std::vector<char> in_top(kKeys, 0);
    for (int32_t p : reference_topk(exact, kTop)) in_top[static_cast<size_t>(p)] = 1;
    for (int b = 0; b < 3; ++b) {
      std::vector<float> bound(kKeys), adversarial(kKeys);
      for (int i = 0; i < kKeys; ++i) {
        const size_t u = static_cast<size_t>(i);
        bound[u] = static_cast<float>(std::ldexp(scale[u] * w_abs * magnitude_per_head, rel_exponents[b]));
        // Pulled inside the bound by the float rounding of exact -+ bound, as in the random rows.
        float f = static_cast<float>(static_cast<long double>(exact[u]) + (in_top[u] ? -1.0L : 1.0L) * bound[u]);
        while (distance(f, exact[u]) > bound[u]) f = std::nextafter(f, exact[u]);
        adversarial[u] = f;
      }
      const BoundedRun zero = run_bounded(exact, bound, exact, kTop);
      const BoundedRun adv = run_bounded(adversarial, bound, exact, kTop);
      ASSERT_EQ(zero.out, reference_topk(exact, kTop));
      ASSERT_EQ(adv.out, reference_topk(exact, kTop));
      sum_zero[b] += static_cast<double>(zero.stats.candidates);
      sum_adv[b] += static_cast<double>(adv.stats.candidates);
    }
  }
  for (int b = 0; b < 3; ++b) {
    std::printf("n %d k %d, bound 2^%d relative: mean rescored %.0f (fast = exact), %.0f (fast at -+bound)\n", kKeys,
                kTop, rel_exponents[b], sum_zero[b] / kRows, sum_adv[b] / kRows);
  }
}

}  // namespace
}  // namespace kestrel::cpu
