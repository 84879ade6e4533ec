// MLA (absorbed and MHA mode) and RoPE/YaRN reference kernels.
#include "kernels/cpu/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>
#include <random>
#include <vector>

#include "core/error.h"

namespace kestrel::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<float> random_vec(std::mt19937& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

YarnParams deepseek_yarn() {
  YarnParams y;
  y.factor = 40;
  y.original_max_position_embeddings = 4096;
  y.beta_fast = 32;
  y.beta_slow = 1;
  y.mscale = 1.0;
  y.mscale_all_dim = 1.0;
  return y;
}

// ---------------- RoPE / YaRN ----------------

TEST(RopeInvFreq, PlainTableIsThetaPowerRoundedOnce) {
  const std::vector<float> f = rope_inv_freq(64, 10000.0, nullptr);
  ASSERT_EQ(f.size(), 32u);
  EXPECT_EQ(f[0], 1.0f);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(f[i], static_cast<float>(std::pow(10000.0, -i / 32.0))) << i;
}

// dsa_mla.md §1.4: for DeepSeek-V3.2 (dim 64, theta 1e4, factor 40, original 4096, beta 32/1) the correction
// dims are 10 and 23; i <= 10 keeps f_i, i >= 23 divides it by 40, between blends with r = (i - 10) / 13.
TEST(RopeInvFreq, YarnDeepSeekCorrectionDimsAndBlend) {
  const YarnParams y = deepseek_yarn();
  const std::vector<float> f = rope_inv_freq(64, 10000.0, &y);
  const std::vector<float> plain = rope_inv_freq(64, 10000.0, nullptr);
  ASSERT_EQ(f.size(), 32u);
  for (int i = 0; i <= 10; ++i) EXPECT_EQ(f[i], plain[i]) << i;
  for (int i = 23; i < 32; ++i) EXPECT_EQ(f[i], static_cast<float>(std::pow(10000.0, -i / 32.0) / 40.0)) << i;
  for (int i = 11; i <= 22; ++i) {
    const double r = (i - 10) / 13.0;
    const double expected = std::pow(10000.0, -i / 32.0) * ((1.0 - r) + r / 40.0);
    EXPECT_EQ(f[i], static_cast<float>(expected)) << i;
    EXPECT_LT(f[i], plain[i]) << i;
    EXPECT_GT(f[i], plain[i] / 40.0f) << i;
  }
  // An intermediate i worked by hand: i = 16, r = 6/13, f_16 = 1e4^-0.5 * (7/13 + 6/520) = 0.01 * 286/520 = 0.0055.
  EXPECT_NEAR(f[16], 0.0055, 1e-9);
}

TEST(RopeInvFreq, YarnFactorOneChangesNothingAndBadArgsThrow) {
  YarnParams y = deepseek_yarn();
  y.factor = 1.0;
  EXPECT_EQ(rope_inv_freq(64, 10000.0, &y), rope_inv_freq(64, 10000.0, nullptr));
  EXPECT_THROW(rope_inv_freq(63, 10000.0, nullptr), Error);
  EXPECT_THROW(rope_inv_freq(0, 10000.0, nullptr), Error);
}

TEST(YarnMscale, DeepSeekValueAndSoftmaxScale) {
  const double m = yarn_mscale(40.0, 1.0);
  EXPECT_NEAR(m, 1.368888, 1e-6);
  EXPECT_NEAR(m, 0.1 * std::log(40.0) + 1.0, 1e-15);
  const double scale = m * m / std::sqrt(192.0);  // d_qk = 128 + 64
  EXPECT_NEAR(scale, 0.1352338, 1e-7);
  EXPECT_EQ(yarn_mscale(1.0, 1.0), 1.0);
  EXPECT_EQ(yarn_mscale(0.5, 1.0), 1.0);
  EXPECT_EQ(yarn_mscale(40.0, 0.0), 1.0);
}

// Hand-checked dim-4 case: f = {pi/2, 0}, pos 1. Interleaved rotates (x0,x1) by 90 degrees and keeps (x2,x3);
// NeoX rotates (x0,x2) by 90 degrees and keeps (x1,x3).
TEST(Rope, HandCheckedQuarterTurn) {
  const float f[2] = {static_cast<float>(std::numbers::pi / 2), 0.0f};
  std::vector<float> a = {1, 2, 3, 4}, b = a;
  rope_interleaved(a.data(), 1, 4, 4, 1, f);
  rope_neox(b.data(), 1, 4, 4, 1, f);
  const float ei[4] = {-2, 1, 3, 4}, en[4] = {-3, 2, 1, 4};
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(a[i], ei[i], 1e-6) << i;
    EXPECT_NEAR(b[i], en[i], 1e-6) << i;
  }
}

TEST(Rope, HandCheckedGenericAngles) {
  const float f[2] = {0.25f, 0.01f};
  const int64_t pos = 3;
  const double t0 = 3 * 0.25, t1 = 3 * static_cast<double>(0.01f);
  std::vector<float> a = {0.5f, -1.5f, 2.0f, 0.75f}, b = a;
  rope_interleaved(a.data(), 1, 4, 4, pos, f);
  rope_neox(b.data(), 1, 4, 4, pos, f);
  const double ei[4] = {0.5 * std::cos(t0) + 1.5 * std::sin(t0), 0.5 * std::sin(t0) - 1.5 * std::cos(t0),
                        2.0 * std::cos(t1) - 0.75 * std::sin(t1), 2.0 * std::sin(t1) + 0.75 * std::cos(t1)};
  const double en[4] = {0.5 * std::cos(t0) - 2.0 * std::sin(t0), -1.5 * std::cos(t1) - 0.75 * std::sin(t1),
                        0.5 * std::sin(t0) + 2.0 * std::cos(t0), -1.5 * std::sin(t1) + 0.75 * std::cos(t1)};
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(a[i], ei[i], 1e-6) << i;
    EXPECT_NEAR(b[i], en[i], 1e-6) << i;
  }
}

TEST(Rope, StridedVectorsLeaveTheGapAlone) {
  const float f[2] = {0.3f, 0.07f};
  std::mt19937 rng(1);
  std::vector<float> x = random_vec(rng, 3 * 6);
  std::vector<float> expected = x;
  for (int v = 0; v < 3; ++v) rope_interleaved(expected.data() + v * 6, 1, 4, 4, 11, f);
  rope_interleaved(x.data(), 3, 6, 4, 11, f);
  EXPECT_TRUE(bit_equal(x, expected));
}

// NeoX and interleaved pair different dimensions, so applying one where the other is meant gives different
// numbers; they agree only after permuting the data so that the same dims share a frequency.
TEST(Rope, NeoxAndInterleavedDifferButArePermutationsOfEachOther) {
  const YarnParams y = deepseek_yarn();
  const std::vector<float> f = rope_inv_freq(64, 10000.0, &y);
  std::mt19937 rng(2);
  const std::vector<float> x = random_vec(rng, 64);
  std::vector<float> inter = x, neox = x;
  rope_interleaved(inter.data(), 1, 64, 64, 77, f.data());
  rope_neox(neox.data(), 1, 64, 64, 77, f.data());
  double max_diff = 0;
  for (int i = 0; i < 64; ++i) max_diff = std::max(max_diff, std::fabs(static_cast<double>(inter[i]) - neox[i]));
  EXPECT_GT(max_diff, 0.1);
  // neox(x) = unpermute(interleaved(permute(x))) with permute: neox dims (i, i+32) -> interleaved dims (2i, 2i+1).
  std::vector<float> permuted(64);
  for (int i = 0; i < 32; ++i) {
    permuted[2 * i] = x[i];
    permuted[2 * i + 1] = x[i + 32];
  }
  rope_interleaved(permuted.data(), 1, 64, 64, 77, f.data());
  std::vector<float> back(64);
  for (int i = 0; i < 32; ++i) {
    back[i] = permuted[2 * i];
    back[i + 32] = permuted[2 * i + 1];
  }
  EXPECT_TRUE(bit_equal(back, neox));
}

TEST(Rope, RotatingBackByMinusPosRestoresTheInput) {
  const YarnParams y = deepseek_yarn();
  const std::vector<float> f = rope_inv_freq(64, 10000.0, &y);
  std::mt19937 rng(3);
  for (int64_t pos : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{4097}, int64_t{100000}}) {
    const std::vector<float> x = random_vec(rng, 2 * 64);
    std::vector<float> a = x, b = x;
    rope_interleaved(a.data(), 2, 64, 64, pos, f.data());
    rope_interleaved(a.data(), 2, 64, 64, -pos, f.data());
    rope_neox(b.data(), 2, 64, 64, pos, f.data());
    rope_neox(b.data(), 2, 64, 64, -pos, f.data());
    for (int i = 0; i < 128; ++i) {
      EXPECT_NEAR(a[i], x[i], 1e-6) << "pos " << pos << " i " << i;
      EXPECT_NEAR(b[i], x[i], 1e-6) << "pos " << pos << " i " << i;
    }
  }
}

TEST(Rope, BadArgumentsThrow) {
  float x[4] = {0, 0, 0, 0};
  const float f[2] = {1, 1};
  EXPECT_THROW(rope_interleaved(x, 1, 4, 3, 0, f), Error);
  EXPECT_THROW(rope_neox(x, 2, 2, 4, 0, f), Error);
}

// ---------------- MLA ----------------

struct MlaCase {
  int H = 4, dn = 16, R = 8, dv = 16, C = 32;
  int64_t n_kv = 0;
  float scale = 0.5f;
  std::vector<float> q, wkv_b, kv;
  MlaCase(std::mt19937& rng, int64_t n) : n_kv(n) {
    q = random_vec(rng, static_cast<size_t>(H * (dn + R)));
    wkv_b = random_vec(rng, static_cast<size_t>(H * (dn + dv) * C));
    kv = random_vec(rng, static_cast<size_t>(n * (C + R)));
  }
  // absorb -> attend -> unabsorb
  void absorbed(const int32_t* idx, int64_t n_idx, std::vector<float>& o, std::vector<float>& lse) const {
    std::vector<float> q_abs(static_cast<size_t>(H * (C + R))), obar(static_cast<size_t>(H * C));
    mla_absorb_query(q.data(), wkv_b.data(), H, dn, dv, C, R, q_abs.data());
    lse.assign(static_cast<size_t>(H), 0.0f);
    mla_attend_absorbed(q_abs.data(), H, C, R, kv.data(), n_kv, idx, n_idx, scale, obar.data(), lse.data());
    o.assign(static_cast<size_t>(H * dv), 0.0f);
    mla_unabsorb_output(obar.data(), wkv_b.data(), H, dn, dv, C, o.data());
  }
  void mha(const int32_t* idx, int64_t n_idx, std::vector<float>& o, std::vector<float>& lse) const {
    o.assign(static_cast<size_t>(H * dv), 0.0f);
    lse.assign(static_cast<size_t>(H), 0.0f);
    mla_attend_mha(q.data(), wkv_b.data(), H, dn, dv, C, R, kv.data(), n_kv, idx, n_idx, scale, o.data(), lse.data());
  }
};

// Per head: max |a - b| <= rel * max |b| over that head's outputs.
void expect_close_per_head(const std::vector<float>& a, const std::vector<float>& b, int H, int d, double rel) {
  ASSERT_EQ(a.size(), b.size());
  for (int h = 0; h < H; ++h) {
    double ref_max = 0, diff = 0;
    for (int j = 0; j < d; ++j) {
      ref_max = std::max(ref_max, std::fabs(static_cast<double>(b[h * d + j])));
      diff = std::max(diff, std::fabs(static_cast<double>(a[h * d + j]) - b[h * d + j]));
    }
    EXPECT_LE(diff, rel * ref_max) << "head " << h;
  }
}

TEST(Mla, AbsorbedEqualsMhaMode) {
  std::mt19937 rng(10);
  for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{9}, int64_t{37}, int64_t{100}}) {
    const MlaCase m(rng, n);
    std::vector<float> oa, la, om, lm;
    m.absorbed(nullptr, 0, oa, la);
    m.mha(nullptr, 0, om, lm);
    expect_close_per_head(oa, om, m.H, m.dv, 1e-5);
    for (int h = 0; h < m.H; ++h) EXPECT_NEAR(la[h], lm[h], 1e-5 * std::max(1.0f, std::fabs(lm[h]))) << n;
    // And over a subset in scrambled order.
    std::vector<int32_t> idx;
    for (int32_t t = 0; t < n; t += 3) idx.push_back(t);
    std::shuffle(idx.begin(), idx.end(), rng);
    m.absorbed(idx.data(), static_cast<int64_t>(idx.size()), oa, la);
    m.mha(idx.data(), static_cast<int64_t>(idx.size()), om, lm);
    expect_close_per_head(oa, om, m.H, m.dv, 1e-5);
    for (int h = 0; h < m.H; ++h) EXPECT_NEAR(la[h], lm[h], 1e-5 * std::max(1.0f, std::fabs(lm[h]))) << n;
  }
}

TEST(Mla, IdxSubsetEqualsAttendingOverAGatheredCopy) {
  std::mt19937 rng(11);
  const MlaCase m(rng, 100);
  std::vector<int32_t> idx = {57, 3, 99, 0, 42, 41, 8, 77, 13};
  MlaCase gathered = m;
  gathered.n_kv = static_cast<int64_t>(idx.size());
  gathered.kv.clear();
  for (int32_t t : idx)
    gathered.kv.insert(gathered.kv.end(), m.kv.begin() + t * (m.C + m.R), m.kv.begin() + (t + 1) * (m.C + m.R));
  std::vector<float> o1, l1, o2, l2;
  m.absorbed(idx.data(), static_cast<int64_t>(idx.size()), o1, l1);
  gathered.absorbed(nullptr, 0, o2, l2);
  EXPECT_TRUE(bit_equal(o1, o2));
  EXPECT_TRUE(bit_equal(l1, l2));
  m.mha(idx.data(), static_cast<int64_t>(idx.size()), o1, l1);
  gathered.mha(nullptr, 0, o2, l2);
  EXPECT_TRUE(bit_equal(o1, o2));
  EXPECT_TRUE(bit_equal(l1, l2));
}

TEST(Mla, InvalidIndicesAreSkipped) {
  std::mt19937 rng(12);
  const MlaCase m(rng, 20);
  const std::vector<int32_t> noisy = {-1, 3, 20, 7, -5, 1000, 2, std::numeric_limits<int32_t>::min(), -1};
  const std::vector<int32_t> clean = {3, 7, 2};
  std::vector<float> o1, l1, o2, l2;
  m.absorbed(noisy.data(), static_cast<int64_t>(noisy.size()), o1, l1);
  m.absorbed(clean.data(), static_cast<int64_t>(clean.size()), o2, l2);
  EXPECT_TRUE(bit_equal(o1, o2));
  EXPECT_TRUE(bit_equal(l1, l2));
  m.mha(noisy.data(), static_cast<int64_t>(noisy.size()), o1, l1);
  m.mha(clean.data(), static_cast<int64_t>(clean.size()), o2, l2);
  EXPECT_TRUE(bit_equal(o1, o2));
  EXPECT_TRUE(bit_equal(l1, l2));
}

TEST(Mla, NoValidRowGivesZeroOutputAndMinusInfLse) {
  std::mt19937 rng(13);
  const MlaCase m(rng, 10);
  const std::vector<int32_t> invalid = {-1, 10, -7, 12345};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> q_abs(static_cast<size_t>(m.H * (m.C + m.R)));
  mla_absorb_query(m.q.data(), m.wkv_b.data(), m.H, m.dn, m.dv, m.C, m.R, q_abs.data());
  struct Call {
    const int32_t* idx;
    int64_t n_idx, n_kv;
  };
  for (const Call c : {Call{invalid.data(), 4, 10}, Call{invalid.data(), 0, 10}, Call{nullptr, 0, 0}}) {
    std::vector<float> obar(static_cast<size_t>(m.H * m.C), nan), lse(static_cast<size_t>(m.H), nan);
    mla_attend_absorbed(q_abs.data(), m.H, m.C, m.R, m.kv.data(), c.n_kv, c.idx, c.n_idx, m.scale, obar.data(),
                        lse.data());
    for (float v : obar) EXPECT_EQ(v, 0.0f);
    for (float v : lse) EXPECT_EQ(v, -kInf);
    std::vector<float> o(static_cast<size_t>(m.H * m.dv), nan);
    mla_attend_mha(m.q.data(), m.wkv_b.data(), m.H, m.dn, m.dv, m.C, m.R, m.kv.data(), c.n_kv, c.idx, c.n_idx,
                   m.scale, o.data(), lse.data());
    for (float v : o) EXPECT_EQ(v, 0.0f);
    for (float v : lse) EXPECT_EQ(v, -kInf);
  }
}

// One head, C = 2, R = 1, scale 1/2: q_abs = [1, 0, 1], rows [1, 2, 0] and [1, 4, 1] give scores 1/2 and 1,
// so p = (1, e^(1/2)) / (1 + e^(1/2)), out = [1, 2 + 2 p_1], lse = 1 + log(1 + e^(-1/2)).
TEST(Mla, HandCheckedOneHeadTwoTokens) {
  const float q_abs[3] = {1, 0, 1};
  const float kv[6] = {1, 2, 0, 1, 4, 1};
  float out[2], lse;
  mla_attend_absorbed(q_abs, 1, 2, 1, kv, 2, nullptr, 0, 0.5f, out, &lse);
  const double p1 = std::exp(0.5) / (1.0 + std::exp(0.5));
  EXPECT_NEAR(out[0], 1.0, 1e-6);
  EXPECT_NEAR(out[1], 2.0 + 2.0 * p1, 1e-6);
  EXPECT_NEAR(lse, 1.0 + std::log(1.0 + std::exp(-0.5)), 1e-6);
}

// W_UK = [[1, 2], [3, 4]], W_UV = [[5, 6]], q = [q_nope 1, 1 | q_pe 7]: q_abs = [1+3, 2+4, 7] = [4, 6, 7];
// obar = [1, 2] un-absorbs to 5 + 12 = 17.
TEST(Mla, HandCheckedAbsorbAndUnabsorb) {
  const float wkv_b[6] = {1, 2, 3, 4, 5, 6};
  const float q[3] = {1, 1, 7};
  float q_abs[3];
  mla_absorb_query(q, wkv_b, 1, 2, 1, 2, 1, q_abs);
  EXPECT_EQ(q_abs[0], 4.0f);
  EXPECT_EQ(q_abs[1], 6.0f);
  EXPECT_EQ(q_abs[2], 7.0f);
  const float obar[2] = {1, 2};
  float o;
  mla_unabsorb_output(obar, wkv_b, 1, 2, 1, 2, &o);
  EXPECT_EQ(o, 17.0f);
}

TEST(Mla, LseAndOutputMatchDoublePrecision) {
  std::mt19937 rng(14);
  const int H = 3, C = 48, R = 16;
  for (int64_t n : {int64_t{1}, int64_t{17}, int64_t{300}}) {
    const std::vector<float> q_abs = random_vec(rng, static_cast<size_t>(H * (C + R)));
    const std::vector<float> kv = random_vec(rng, static_cast<size_t>(n * (C + R)));
    const float scale = 0.3f;
    std::vector<float> out(static_cast<size_t>(H * C)), lse(H);
    mla_attend_absorbed(q_abs.data(), H, C, R, kv.data(), n, nullptr, 0, scale, out.data(), lse.data());
    for (int h = 0; h < H; ++h) {
      std::vector<double> s(static_cast<size_t>(n));
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t t = 0; t < n; ++t) {
        double d = 0;
        for (int i = 0; i < C + R; ++i) d += static_cast<double>(q_abs[h * (C + R) + i]) * kv[t * (C + R) + i];
        s[t] = d * scale;
        mx = std::max(mx, s[t]);
      }
      double l = 0;
      for (double v : s) l += std::exp(v - mx);
      const double ref_lse = mx + std::log(l);
      EXPECT_NEAR(lse[h], ref_lse, 1e-6 * std::max(1.0, std::fabs(ref_lse))) << "n " << n << " h " << h;
      for (int c = 0; c < C; ++c) {
        double o = 0;
        for (int64_t t = 0; t < n; ++t) o += std::exp(s[t] - mx) / l * kv[t * (C + R) + c];
        EXPECT_NEAR(out[h * C + c], o, 1e-6) << "n " << n << " h " << h << " c " << c;
      }
    }
  }
}

// Each head's result is the same computed alone or with the other heads.
TEST(Mla, HeadsAreIndependentBitForBit) {
  std::mt19937 rng(15);
  const MlaCase m(rng, 50);
  std::vector<float> q_abs(static_cast<size_t>(m.H * (m.C + m.R))), obar(static_cast<size_t>(m.H * m.C)), lse(m.H);
  mla_absorb_query(m.q.data(), m.wkv_b.data(), m.H, m.dn, m.dv, m.C, m.R, q_abs.data());
  mla_attend_absorbed(q_abs.data(), m.H, m.C, m.R, m.kv.data(), m.n_kv, nullptr, 0, m.scale, obar.data(), lse.data());
  std::vector<float> o_all(static_cast<size_t>(m.H * m.dv)), l_all(m.H);
  mla_attend_mha(m.q.data(), m.wkv_b.data(), m.H, m.dn, m.dv, m.C, m.R, m.kv.data(), m.n_kv, nullptr, 0, m.scale,
                 o_all.data(), l_all.data());
  for (int h = 0; h < m.H; ++h) {
    std::vector<float> ob1(m.C), o1(m.dv);
    float l1;
    mla_attend_absorbed(q_abs.data() + h * (m.C + m.R), 1, m.C, m.R, m.kv.data(), m.n_kv, nullptr, 0, m.scale,
                        ob1.data(), &l1);
    EXPECT_EQ(0, std::memcmp(ob1.data(), obar.data() + h * m.C, m.C * sizeof(float))) << h;
    EXPECT_EQ(l1, lse[h]);
    mla_attend_mha(m.q.data() + h * (m.dn + m.R), m.wkv_b.data() + h * (m.dn + m.dv) * m.C, 1, m.dn, m.dv, m.C, m.R,
                   m.kv.data(), m.n_kv, nullptr, 0, m.scale, o1.data(), &l1);
    EXPECT_EQ(0, std::memcmp(o1.data(), o_all.data() + h * m.dv, m.dv * sizeof(float))) << h;
    EXPECT_EQ(l1, l_all[h]);
  }
}

// A score of -inf (an overflowing product) contributes nothing and never turns into NaN; with every score -inf
// the call behaves as if no row were valid. C = 1, R = 1, q_abs = [3e38, 0]: row 0 = [-3e38, 1] scores -inf,
// row 1 = [1, 2] scores 3e38, so the output is row 1's latent, 1.
TEST(Mla, MinusInfScoresAreHarmless) {
  const float big = 3e38f;
  const float q_abs[2] = {big, 0};
  const float kv[4] = {-big, 1, 1, 2};
  float out, lse;
  mla_attend_absorbed(q_abs, 1, 1, 1, kv, 2, nullptr, 0, 1.0f, &out, &lse);
  EXPECT_EQ(out, 1.0f);
  EXPECT_EQ(lse, big);
  const int32_t only_first = 0;
  mla_attend_absorbed(q_abs, 1, 1, 1, kv, 2, &only_first, 1, 1.0f, &out, &lse);
  EXPECT_EQ(out, 0.0f);
  EXPECT_EQ(lse, -kInf);
}

}  // namespace
}  // namespace kestrel::cpu
