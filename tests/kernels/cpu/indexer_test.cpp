// DSA lightning indexer reference: Hadamard rotation, FP8 indexer scores, top-k with the tie rule, and sparse
// attention over the selected rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/attention.h"

namespace kestrel::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<float> random_vec(std::mt19937& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// A random e4m3 code that is not NaN (0x7F / 0xFF).
uint8_t random_code(std::mt19937& rng) {
  std::uniform_int_distribution<int> u(0, 253);
  int b = u(rng);
  if (b >= 0x7F) ++b;
  return static_cast<uint8_t>(b);
}

// e4m3 codes used in the hand-worked cases.
constexpr uint8_t kZero = 0x00, kHalf = 0x30, kOne = 0x38, kOneHalf = 0x3C, kTwo = 0x40, kMinusOne = 0xB8,
                  kMinusTwo = 0xC0, kMax = 0x7E /* 448 */, kMinusMax = 0xFE, kTiny = 0x01 /* 2^-9 */;

// ---------------- Hadamard ----------------

TEST(Hadamard, HandCheckedTwoAndFour) {
  float x2[2] = {3, 1};
  hadamard_inplace(x2, 2);
  EXPECT_NEAR(x2[0], 4 / std::sqrt(2.0), 1e-6);
  EXPECT_NEAR(x2[1], 2 / std::sqrt(2.0), 1e-6);
  // H4 = [[1,1,1,1],[1,-1,1,-1],[1,1,-1,-1],[1,-1,-1,1]] / 2 applied to [1,2,3,4].
  float x4[4] = {1, 2, 3, 4};
  hadamard_inplace(x4, 4);
  const float e4[4] = {5, -1, -2, 0};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(x4[i], e4[i], 1e-6) << i;
  float x1[1] = {-2.5f};
  hadamard_inplace(x1, 1);
  EXPECT_EQ(x1[0], -2.5f);
}

// Sylvester ordering: H[i][j] = (-1)^popcount(i & j) / sqrt(n).
TEST(Hadamard, MatchesSylvesterMatrix) {
  std::mt19937 rng(20);
  const int n = 32;
  const std::vector<float> x = random_vec(rng, n);
  std::vector<float> y = x;
  hadamard_inplace(y.data(), n);
  for (int i = 0; i < n; ++i) {
    double e = 0;
    for (int j = 0; j < n; ++j) e += (std::popcount(static_cast<unsigned>(i & j)) % 2 ? -1.0 : 1.0) * x[j];
    EXPECT_NEAR(y[i], e / std::sqrt(static_cast<double>(n)), 1e-6) << i;
  }
}

TEST(Hadamard, IsAnOrthonormalInvolution) {
  std::mt19937 rng(21);
  for (int n : {2, 8, 64, 128}) {
    const std::vector<float> a = random_vec(rng, n), b = random_vec(rng, n);
    std::vector<float> ha = a, hb = b;
    hadamard_inplace(ha.data(), n);
    hadamard_inplace(hb.data(), n);
    double dot_ab = 0, dot_h = 0, na = 0, nb = 0;
    for (int i = 0; i < n; ++i) {
      dot_ab += static_cast<double>(a[i]) * b[i];
      dot_h += static_cast<double>(ha[i]) * hb[i];
      na += static_cast<double>(a[i]) * a[i];
      nb += static_cast<double>(b[i]) * b[i];
    }
    EXPECT_NEAR(dot_h, dot_ab, 1e-6 * std::sqrt(na * nb)) << n;
    std::vector<float> twice = ha;
    hadamard_inplace(twice.data(), n);
    for (int i = 0; i < n; ++i) EXPECT_NEAR(twice[i], a[i], 1e-6) << n << " " << i;
  }
}

TEST(Hadamard, RejectsNonPowersOfTwo) {
  float x[12] = {};
  EXPECT_THROW(hadamard_inplace(x, 12), Error);
  EXPECT_THROW(hadamard_inplace(x, 0), Error);
}

// ---------------- indexer scores ----------------

// Hi = 2, D = 4. q head 0 = [1, 2, 0.5, -1], head 1 = [-1, -1, 0, 2]; w = [0.5, -0.125].
//  key 0 = [1, 1, 2, 1]:    dots 3, 0        -> 2 * (0.5*3)              = 3
//  key 1 = [2, 0, 0, 1.5]:  dots 0.5, 1      -> 4 * (0.5*0.5 - 0.125*1)  = 0.5
//  key 2 = [0, 0, -2, 0]:   dots -1, 0       -> both ReLUs 0             = 0
//  key 3 = [2^-9, 0, 0, 0]: dots 2^-9, -2^-9 -> 8 * 0.5 * 2^-9           = 2^-7
//  key 4 = [-2, -1, 0, 0]:  dots -4, 3       -> negative weight wins: 1 * (-0.125*3) = -0.375
TEST(IndexerScores, HandChecked) {
  const uint8_t q[8] = {kOne, kTwo, kHalf, kMinusOne, kMinusOne, kMinusOne, kZero, kTwo};
  const uint8_t k[20] = {kOne,  kOne, kTwo,      kOne,  kTwo,      kZero,     kZero, kOneHalf, kZero, kZero,
                         kMinusTwo, kZero, kTiny, kZero, kZero, kZero, kMinusTwo, kMinusOne, kZero, kZero};
  const float w[2] = {0.5f, -0.125f};
  const float k_scale[5] = {2, 4, 8, 8, 1};
  float s[5];
  indexer_scores(q, w, 2, 4, k, k_scale, 5, s);
  EXPECT_EQ(s[0], 3.0f);
  EXPECT_EQ(s[1], 0.5f);
  EXPECT_EQ(s[2], 0.0f);
  EXPECT_EQ(s[3], std::ldexp(1.0f, -7));
  EXPECT_EQ(s[4], -0.375f);
}

// The dot is exact before its one rounding: 448*448 + 2^-9*2^-9 - 448*448 = 2^-18, which a running fp32 sum
// would lose entirely.
TEST(IndexerScores, DotIsExactBeforeRounding) {
  const uint8_t q[4] = {kMax, kTiny, kMinusMax, kZero};
  const uint8_t k[4] = {kMax, kTiny, kMax, kZero};
  const float w = 1.0f, k_scale = 1.0f;
  float s;
  indexer_scores(q, &w, 1, 4, k, &k_scale, 1, &s);
  EXPECT_EQ(s, std::ldexp(1.0f, -18));
}

struct RandomIndexer {
  int Hi, D;
  int64_t S;
  std::vector<uint8_t> q, k;
  std::vector<float> w, k_scale;
  RandomIndexer(std::mt19937& rng, int hi, int d, int64_t s, bool mixed_sign_weights) : Hi(hi), D(d), S(s) {
    q.resize(static_cast<size_t>(Hi * D));
    k.resize(static_cast<size_t>(S * D));
    for (auto& c : q) c = random_code(rng);
    for (auto& c : k) c = random_code(rng);
    w = random_vec(rng, Hi, mixed_sign_weights ? -1.0f : 0.01f, 1.0f);
    std::uniform_int_distribution<int> e(-20, 4);
    for (int64_t i = 0; i < S; ++i) k_scale.push_back(std::ldexp(1.0f, e(rng)));
  }
  std::vector<float> scores() const {
    std::vector<float> s(static_cast<size_t>(S));
    indexer_scores(q.data(), w.data(), Hi, D, k.data(), k_scale.data(), S, s.data());
    return s;
  }
  // Score in double on the dequantised values, and the sum of the magnitudes of its terms.
  void reference(int64_t s, double& score, double& magnitude) const {
    double acc = 0, mag = 0;
    for (int j = 0; j < Hi; ++j) {
      double d = 0;
      for (int i = 0; i < D; ++i)
        d += static_cast<double>(e4m3_to_f32(q[j * D + i])) * e4m3_to_f32(k[s * D + i]);
      const double term = w[j] * std::max(d, 0.0);
      acc += term;
      mag += std::fabs(term);
    }
    score = k_scale[s] * acc;
    magnitude = k_scale[s] * mag;
  }
};

// With positive weights the terms do not cancel and the score is within 1e-6 relative of the double-precision
// value; with mixed-sign weights the error is bounded relative to the sum of the terms' magnitudes instead
// ((Hi + 2) units of rounding, below 1e-6 for Hi = 8).
TEST(IndexerScores, MatchesDoublePrecisionOnDequantisedValues) {
  std::mt19937 rng(22);
  for (bool mixed : {false, true}) {
    const RandomIndexer ix(rng, 8, 128, 400, mixed);
    const std::vector<float> s = ix.scores();
    for (int64_t i = 0; i < ix.S; ++i) {
      double ref, mag;
      ix.reference(i, ref, mag);
      EXPECT_NEAR(s[i], ref, 1e-6 * (mixed ? mag : std::fabs(ref))) << "mixed " << mixed << " key " << i;
    }
  }
  // Hi = 64, as in DeepSeek-V3.2: bound (Hi + 2) * 2^-24 relative to the magnitudes.
  const RandomIndexer ix(rng, 64, 128, 100, true);
  const std::vector<float> s = ix.scores();
  for (int64_t i = 0; i < ix.S; ++i) {
    double ref, mag;
    ix.reference(i, ref, mag);
    EXPECT_NEAR(s[i], ref, 66 * std::ldexp(1.0, -24) * mag) << i;
  }
}

// ReLU comes before the (possibly negative) weight: when every head's dot is <= 0 the score is exactly 0.
TEST(IndexerScores, ZeroWhenEveryDotIsNonPositive) {
  std::mt19937 rng(23);
  const int Hi = 16, D = 32;
  const int64_t S = 200;
  std::vector<uint8_t> q(Hi * D), k(S * D);
  for (auto& c : q) c = random_code(rng) & 0x7F;  // non-negative values
  for (auto& c : k) c = random_code(rng) | 0x80;  // non-positive values
  for (int j = 0; j < D; ++j) q[j] = kZero;       // head 0 dots are exactly 0
  const std::vector<float> w = random_vec(rng, Hi, -4.0f, 4.0f);
  const std::vector<float> k_scale(S, 0.125f);
  std::vector<float> s(S, 1.0f);
  indexer_scores(q.data(), w.data(), Hi, D, k.data(), k_scale.data(), S, s.data());
  for (int64_t i = 0; i < S; ++i) EXPECT_EQ(s[i], 0.0f) << i;
}

// A key's score depends only on that key: permuting the keys permutes the scores, bit for bit.
TEST(IndexerScores, IndependentOfKeyOrder) {
  std::mt19937 rng(24);
  const RandomIndexer ix(rng, 8, 64, 300, true);
  const std::vector<float> s = ix.scores();
  std::vector<int64_t> perm(ix.S);
  for (int64_t i = 0; i < ix.S; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<uint8_t> k2(ix.k.size());
  std::vector<float> ks2(ix.S), s2(ix.S);
  for (int64_t i = 0; i < ix.S; ++i) {
    std::copy_n(ix.k.begin() + perm[i] * ix.D, ix.D, k2.begin() + i * ix.D);
    ks2[i] = ix.k_scale[perm[i]];
  }
  indexer_scores(ix.q.data(), ix.w.data(), ix.Hi, ix.D, k2.data(), ks2.data(), ix.S, s2.data());
  for (int64_t i = 0; i < ix.S; ++i) EXPECT_EQ(std::bit_cast<uint32_t>(s2[i]), std::bit_cast<uint32_t>(s[perm[i]]));
}

TEST(IndexerScores, NanCodeGivesNanScoreThatTopkSkips) {
  const uint8_t q[2] = {kOne, kOne};
  const uint8_t k[6] = {kOne, kOne, 0x7F, kOne, kOne, 0xFF};
  const float w = 1.0f;
  const float k_scale[3] = {1, 1, 1};
  float s[3];
  indexer_scores(q, &w, 1, 2, k, k_scale, 3, s);
  EXPECT_EQ(s[0], 2.0f);
  EXPECT_TRUE(std::isnan(s[1]));
  EXPECT_TRUE(std::isnan(s[2]));
  int32_t top[3];
  topk_indices(s, 3, 3, top);
  EXPECT_EQ(top[0], 0);
  EXPECT_EQ(top[1], -1);
  EXPECT_EQ(top[2], -1);
}

// ---------------- top-k ----------------

std::vector<int32_t> topk(const std::vector<float>& s, int k) {
  std::vector<int32_t> out(static_cast<size_t>(k), -7);
  topk_indices(s.data(), static_cast<int64_t>(s.size()), k, out.data());
  return out;
}

TEST(Topk, HandCheckedTieRule) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> s = {1, 3, 3, -0.0f, 0, -kInf, nan, 2};
  EXPECT_EQ(topk(s, 1), (std::vector<int32_t>{1}));
  EXPECT_EQ(topk(s, 5), (std::vector<int32_t>{1, 2, 7, 0, 3}));
  EXPECT_EQ(topk(s, 6), (std::vector<int32_t>{1, 2, 7, 0, 3, 4}));
  EXPECT_EQ(topk(s, 8), (std::vector<int32_t>{1, 2, 7, 0, 3, 4, -1, -1}));
  EXPECT_EQ(topk(s, 10), (std::vector<int32_t>{1, 2, 7, 0, 3, 4, -1, -1, -1, -1}));
}

TEST(Topk, MinusZeroRanksAsPlusZero) {
  EXPECT_EQ(topk({-0.0f, 0.0f}, 1), (std::vector<int32_t>{0}));
  EXPECT_EQ(topk({0.0f, -0.0f}, 1), (std::vector<int32_t>{0}));
  EXPECT_EQ(topk({-1.0f, 0.0f, -0.0f, 0.0f}, 4), (std::vector<int32_t>{1, 2, 3, 0}));
}

TEST(Topk, DegenerateRows) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(topk({-kInf, -kInf, nan}, 2), (std::vector<int32_t>{-1, -1}));
  EXPECT_EQ(topk({}, 3), (std::vector<int32_t>{-1, -1, -1}));
  EXPECT_EQ(topk({5, 5, 5}, 3), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(topk({kInf, 1, kInf}, 2), (std::vector<int32_t>{0, 2}));
  int32_t untouched = 99;
  const float one = 1;
  topk_indices(&one, 1, 0, &untouched);
  EXPECT_EQ(untouched, 99);
  EXPECT_THROW(topk_indices(&one, 1, -1, &untouched), Error);
}

// Reference: keep the selectable candidates, stable-sort by score descending (stable keeps lower positions first
// among equal scores, and -0 == +0 under >), take k, pad with -1.
std::vector<int32_t> topk_reference(const std::vector<float>& s, int k) {
  std::vector<int32_t> pos;
  for (int32_t i = 0; i < static_cast<int32_t>(s.size()); ++i)
    if (!std::isnan(s[i]) && s[i] != -kInf) pos.push_back(i);
  std::stable_sort(pos.begin(), pos.end(), [&](int32_t a, int32_t b) { return s[a] > s[b]; });
  pos.resize(std::min(pos.size(), static_cast<size_t>(k)));
  pos.resize(static_cast<size_t>(k), -1);
  return pos;
}

TEST(Topk, MatchesStableSortReferenceWithHeavyTies) {
  std::mt19937 rng(25);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float pool[] = {0.0f, -0.0f, 0.0f, 0.0f, 1.5f, -2.0f, 3.0f, 3.0f, 1e-30f, -kInf, nan, kInf, 0.25f, -0.25f};
  std::uniform_int_distribution<int> pick(0, static_cast<int>(std::size(pool)) - 1);
  std::uniform_int_distribution<int> coin(0, 3);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  int rows = 0;
  for (int n : {0, 1, 2, 3, 7, 16, 33, 100, 257, 1000}) {
    for (int rep = 0; rep < 600; ++rep, ++rows) {
      std::vector<float> s(static_cast<size_t>(n));
      // Three in four values come from a small pool (exact ties, zeros of both signs, -inf, NaN).
      for (float& v : s) v = coin(rng) ? pool[pick(rng)] : gauss(rng);
      std::uniform_int_distribution<int> kd(1, n + 3);
      const int k = rep % 5 == 0 ? n + 2 : kd(rng);
      ASSERT_EQ(topk(s, k), topk_reference(s, k)) << "n " << n << " k " << k << " rep " << rep;
    }
  }
  // Long rows with k much smaller than n, as in decode with a 2048 budget.
  for (int rep = 0; rep < 10; ++rep, ++rows) {
    std::vector<float> s(20000);
    for (float& v : s) v = coin(rng) ? pool[pick(rng)] : gauss(rng);
    ASSERT_EQ(topk(s, 2048), topk_reference(s, 2048)) << rep;
  }
  EXPECT_GT(rows, 6000);
}

// ---------------- sparse attention = dense attention when every causal token is selected ----------------

// The indexer scores (FP8 codes from a small pool, so many exact ties and zeros) pick k >= context rows; the
// sparse call visits them in rank order and agrees with dense attention over rows 0..t to rounding. Sorted
// ascending, the index list visits the rows in the dense order and the results are bit for bit equal.
TEST(SparseAttention, EqualsDenseWhenEveryCausalTokenIsSelected) {
  std::mt19937 rng(26);
  const int H = 4, C = 32, R = 8, Hi = 4, D = 16;
  const uint8_t code_pool[] = {kZero, kOne, kMinusOne, kTwo, kMinusTwo, kHalf};
  std::uniform_int_distribution<int> pick(0, static_cast<int>(std::size(code_pool)) - 1);
  const int64_t n_cache = 120;  // rows past the query position are in the cache but not causal
  const std::vector<float> kv = random_vec(rng, static_cast<size_t>(n_cache * (C + R)));
  for (int64_t t : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{31}, int64_t{64}, int64_t{99}}) {
    const int64_t n_ctx = t + 1;
    std::vector<uint8_t> q_codes(Hi * D), k_codes(n_ctx * D);
    for (auto& c : q_codes) c = code_pool[pick(rng)];
    for (auto& c : k_codes) c = code_pool[pick(rng)];
    const std::vector<float> w = random_vec(rng, Hi);
    const std::vector<float> k_scale(static_cast<size_t>(n_ctx), 0.5f);
    std::vector<float> scores(static_cast<size_t>(n_ctx));
    indexer_scores(q_codes.data(), w.data(), Hi, D, k_codes.data(), k_scale.data(), n_ctx, scores.data());

    const std::vector<float> q_abs = random_vec(rng, static_cast<size_t>(H * (C + R)));
    const float scale = 0.4f;
    std::vector<float> dense(static_cast<size_t>(H * C)), dense_lse(H);
    mla_attend_absorbed(q_abs.data(), H, C, R, kv.data(), n_ctx, nullptr, 0, scale, dense.data(), dense_lse.data());
    for (int k : {static_cast<int>(n_ctx), static_cast<int>(n_ctx) + 5, 2048}) {
      std::vector<int32_t> idx(static_cast<size_t>(k));
      topk_indices(scores.data(), n_ctx, k, idx.data());
      std::vector<float> sparse(static_cast<size_t>(H * C)), sparse_lse(H);
      mla_attend_absorbed(q_abs.data(), H, C, R, kv.data(), n_cache, idx.data(), k, scale, sparse.data(),
                          sparse_lse.data());
      for (int h = 0; h < H; ++h) {
        double ref_max = 0, diff = 0;
        for (int c = 0; c < C; ++c) {
          ref_max = std::max(ref_max, std::fabs(static_cast<double>(dense[h * C + c])));
          diff = std::max(diff, std::fabs(static_cast<double>(sparse[h * C + c]) - dense[h * C + c]));
        }
        EXPECT_LE(diff, 1e-6 * ref_max) << "t " << t << " k " << k << " h " << h;
        EXPECT_NEAR(sparse_lse[h], dense_lse[h], 1e-6 * std::max(1.0f, std::fabs(dense_lse[h])));
      }
      std::sort(idx.begin(), idx.end());
      mla_attend_absorbed(q_abs.data(), H, C, R, kv.data(), n_cache, idx.data(), k, scale, sparse.data(),
                          sparse_lse.data());
      EXPECT_EQ(0, std::memcmp(sparse.data(), dense.data(), dense.size() * sizeof(float))) << "t " << t << " k " << k;
      EXPECT_EQ(0, std::memcmp(sparse_lse.data(), dense_lse.data(), dense_lse.size() * sizeof(float)));
    }
  }
}

}  // namespace
}  // namespace kestrel::cpu
