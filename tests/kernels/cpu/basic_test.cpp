// Hand-checked cases for the reference building blocks (GEMM, norms, activations, MoE routing) and the
// batch-invariance they promise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/basic.h"
#include "kernels/cpu/moe.h"

namespace kestrel::cpu {
namespace {

TEST(Basic, DotAndSumByHand) {
  const std::vector<float> a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  const std::vector<float> b = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2};
  EXPECT_EQ(dot(a.data(), b.data(), 11), 77.0f);  // 1+...+10 + 22
  EXPECT_EQ(sum(a.data(), 11), 66.0f);
  EXPECT_EQ(sum_sq(a.data(), 3), 14.0f);
  EXPECT_EQ(dot(a.data(), b.data(), 0), 0.0f);
}

TEST(Basic, LinearByHand) {
  // x [2,3], w [2,3] (out, in): y = x w^T
  const std::vector<float> x = {1, 2, 3, -1, 0, 2};
  const std::vector<float> w = {1, 0, -1, 2, 1, 0};
  std::vector<float> y(4);
  linear(x.data(), w.data(), y.data(), 2, 3, 2);
  EXPECT_EQ(y, (std::vector<float>{-2, 4, -3, -2}));
}

// Each output row is the same fixed-order dot product whatever the batch: a row alone and in a batch of 37 agree
// bit for bit (this is what makes prefill and decode, and batched and single requests, agree exactly).
TEST(Basic, LinearIsBatchInvariant) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  const int64_t M = 37, K = 300, N = 129;
  std::vector<float> x(M * K), w(N * K), y(M * N), y1(N);
  for (float& v : x) v = nd(rng);
  for (float& v : w) v = nd(rng);
  linear(x.data(), w.data(), y.data(), M, K, N);
  for (int64_t m = 0; m < M; ++m) {
    linear(x.data() + m * K, w.data(), y1.data(), 1, K, N);
    ASSERT_EQ(0, std::memcmp(y1.data(), y.data() + m * N, N * sizeof(float))) << "row " << m;
  }
}

TEST(Basic, RmsNormByHand) {
  const std::vector<float> x = {3, 4}, w = {1, 2};
  std::vector<float> y(2);
  rms_norm(x.data(), w.data(), y.data(), 1, 2, 0.0f);  // rms = sqrt(12.5)
  EXPECT_NEAR(y[0], 3 / std::sqrt(12.5f), 1e-6);
  EXPECT_NEAR(y[1], 2 * 4 / std::sqrt(12.5f), 1e-6);
  rms_norm(x.data(), w.data(), y.data(), 1, 2, 1.5f);  // eps inside the square root
  EXPECT_NEAR(y[0], 3 / std::sqrt(14.0f), 1e-6);
}

TEST(Basic, LayerNormByHand) {
  const std::vector<float> x = {1, 3}, w = {2, 2}, b = {0.5f, -0.5f};
  std::vector<float> y(2);
  layer_norm(x.data(), w.data(), b.data(), y.data(), 1, 2, 0.0f);  // mean 2, var 1
  EXPECT_NEAR(y[0], -2 + 0.5f, 1e-6);
  EXPECT_NEAR(y[1], 2 - 0.5f, 1e-6);
}

TEST(Basic, ActivationsByHand) {
  EXPECT_FLOAT_EQ(sigmoid(0.0f), 0.5f);
  EXPECT_NEAR(silu(1.0f), 1.0 / (1.0 + std::exp(-1.0)), 1e-7);
  EXPECT_NEAR(softplus(0.0f), std::log(2.0), 1e-7);
  EXPECT_EQ(softplus(30.0f), 30.0f);  // above the threshold 20 softplus returns its input
  float g[2] = {1.0f, -2.0f}, u[2] = {3.0f, 0.5f}, o[2];
  swiglu(g, u, o, 2);
  EXPECT_NEAR(o[0], silu(1.0f) * 3.0f, 1e-6);
  EXPECT_NEAR(o[1], silu(-2.0f) * 0.5f, 1e-6);
  float v[4] = {3, 4, 0, 0};
  l2_normalize_rows(v, 2, 2, 1e-6f);
  EXPECT_NEAR(v[0], 0.6f, 1e-6);
  EXPECT_NEAR(v[1], 0.8f, 1e-6);
  EXPECT_EQ(v[2], 0.0f);  // a zero vector stays zero thanks to eps (1e-6 inside the square root)
}

float logit(float p) { return std::log(p / (1 - p)); }

TEST(Moe, RoutingByHand) {
  // 4 experts, top-2, no groups. Sigmoid scores 0.9, 0.2, 0.6, 0.7; bias lifts expert 1 to the top of selection
  // but its weight stays its unbiased score.
  const float logits[4] = {logit(0.9f), logit(0.2f), logit(0.6f), logit(0.7f)};
  const float bias[4] = {0.0f, 1.0f, 0.0f, 0.0f};
  MoeRouting r{4, 2, 1, 1, true, 2.0f};
  int32_t ids[2];
  float w[2];
  moe_route(logits, bias, r, ids, w);
  EXPECT_EQ(ids[0], 1);  // 0.2 + 1.0
  EXPECT_EQ(ids[1], 0);  // 0.9
  EXPECT_NEAR(w[0], 0.2f / 1.1f * 2.0f, 1e-6);
  EXPECT_NEAR(w[1], 0.9f / 1.1f * 2.0f, 1e-6);
  r.renormalize = false;
  moe_route(logits, nullptr, r, ids, w);
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(ids[1], 3);
  EXPECT_NEAR(w[0], 0.9f * 2.0f, 1e-6);
  EXPECT_NEAR(w[1], 0.7f * 2.0f, 1e-6);
}

TEST(Moe, GroupLimitedRoutingByHand) {
  // 8 experts in 4 groups of 2; keep 2 groups scored by the sum of their top-2. Scores (sigmoid):
  // g0 {0.95, 0.05} = 1.0, g1 {0.5, 0.5} = 1.0, g2 {0.6, 0.6} = 1.2, g3 {0.3, 0.2} = 0.5.
  // Groups kept: g2 (1.2), then g0 and g1 tie at 1.0 -> the lower group g0. Top-3 among {0,1,4,5}: 0, 4, 5.
  const float p[8] = {0.95f, 0.05f, 0.5f, 0.5f, 0.6f, 0.6f, 0.3f, 0.2f};
  float logits[8];
  for (int i = 0; i < 8; ++i) logits[i] = logit(p[i]);
  MoeRouting r{8, 3, 4, 2, true, 1.0f};
  int32_t ids[3];
  float w[3];
  moe_route(logits, nullptr, r, ids, w);
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(ids[1], 4);  // equal scores: lower id first
  EXPECT_EQ(ids[2], 5);
  EXPECT_NEAR(w[0] + w[1] + w[2], 1.0f, 1e-6);
  EXPECT_NEAR(w[0], 0.95f / 2.15f, 1e-6);
}

// The margin is the gap at each boundary moe_route draws; moving every score by an eighth of it keeps the chosen set
// (group scores, sums of two, move by a quarter; a gap then shrinks by half at most).
TEST(Moe, RouteMarginIsTheGapAtTheBoundaries) {
  // Ungrouped top-2 of sigmoid scores {0.9, 0.2, 0.5, 0.7}: chosen 0.9 and 0.7, first left out 0.5: margin 0.2.
  const float p4[4] = {0.9f, 0.2f, 0.5f, 0.7f};
  float logits[8];
  for (int i = 0; i < 4; ++i) logits[i] = logit(p4[i]);
  MoeRouting r{4, 2, 1, 1, true, 1.0f};
  EXPECT_NEAR(moe_route_margin(logits, nullptr, r), 0.2f, 1e-6);
  // A bias moves the biased scores: {0.9, 1.2, 0.5, 0.7} -> chosen 1.2, 0.9; next 0.7: margin 0.2.
  const float bias[4] = {0.0f, 1.0f, 0.0f, 0.0f};
  EXPECT_NEAR(moe_route_margin(logits, bias, r), 0.2f, 1e-6);
  // Everything chosen: nothing to flip.
  MoeRouting all{4, 4, 1, 1, true, 1.0f};
  EXPECT_TRUE(std::isinf(moe_route_margin(logits, nullptr, all)));
  // Grouped: the by-hand case above has two groups tied at 1.0 (g0 kept, g1 dropped): margin 0.
  const float p8[8] = {0.95f, 0.05f, 0.5f, 0.5f, 0.6f, 0.6f, 0.3f, 0.2f};
  for (int i = 0; i < 8; ++i) logits[i] = logit(p8[i]);
  MoeRouting g{8, 3, 4, 2, true, 1.0f};
  EXPECT_NEAR(moe_route_margin(logits, nullptr, g), 0.0f, 1e-6);
  // Raise g0's second expert so the groups part (g0 1.1, g1 1.0): the margin is the smaller of the group gap (0.1)
  // and the expert gap among {0, 1, 4, 5} = {0.95, 0.15, 0.6, 0.6} (0.6 - 0.15 = 0.45).
  logits[1] = logit(0.15f);
  EXPECT_NEAR(moe_route_margin(logits, nullptr, g), 0.1f, 1e-5);
  // Random scores: a perturbation of an eighth of the margin keeps the chosen set.
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (int trial = 0; trial < 200; ++trial) {
    for (float& v : logits) v = u(rng);
    const float m = moe_route_margin(logits, nullptr, g);
    if (m < 1e-4f) continue;  // within the logit round trip's own rounding
    int32_t a[3], b[3];
    float wa[3], wb[3];
    moe_route(logits, nullptr, g, a, wa);
    // Nudge every score by m / 8 (in sigmoid space, through the logit), up and down alternately.
    float nudged[8];
    for (int i = 0; i < 8; ++i) {
      const float s = 1.0f / (1.0f + std::exp(-logits[i]));
      const float t = std::clamp(s + (i % 2 ? 0.125f : -0.125f) * m, 1e-6f, 1.0f - 1e-6f);
      nudged[i] = logit(t);
    }
    moe_route(nudged, nullptr, g, b, wb);
    std::sort(a, a + 3);
    std::sort(b, b + 3);
    EXPECT_TRUE(std::equal(a, a + 3, b)) << "trial " << trial << ", margin " << m;
  }
}

}  // namespace
}  // namespace kestrel::cpu
