#include "kernels/cpu/kda.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/basic.h"

namespace kestrel::cpu {
namespace {

// ‖a − b‖ / ‖b‖, accumulated in double.
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

bool all_finite(const std::vector<float>& a) {
  for (float x : a)
    if (!std::isfinite(x)) return false;
  return true;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// How the log gates of a random case are drawn (always through kda_gate, as the model does).
struct GateSpec {
  std::optional<float> lower_bound;  // nullopt: Kimi Linear softplus gate
  float dt_bias_mean;                // shifts f + dt_bias, i.e. how strongly the channels decay
  float f_std;
};

// Softplus gate with mostly mild decay (g around -0.05 .. -1), the Kimi Linear regime.
constexpr GateSpec kSoftplusGate{std::nullopt, -3.0f, 1.0f};
// K3 gate with lower bound -5.
constexpr GateSpec kLowerBoundGate{-5.0f, -1.0f, 1.0f};

// Inputs of one KDA call: q and k L2-normalised, beta in (0, 1), nonzero initial state.
struct KdaCase {
  int64_t T;
  int H, dk, dv;
  float scale;
  std::vector<float> q, k, v, g, beta, state;

  KdaCase(int64_t T_, int H_, int dk_, int dv_, const GateSpec& gate, uint32_t seed)
      : T(T_), H(H_), dk(dk_), dv(dv_), scale(1.0f / std::sqrt(static_cast<float>(dk_))) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    auto fill_normal = [&](std::vector<float>& x, size_t n, float std_dev, float mean) {
      x.resize(n);
      for (float& e : x) e = mean + std_dev * normal(rng);
    };
    const size_t qk_n = static_cast<size_t>(T * H * dk);
    fill_normal(q, qk_n, 1.0f, 0.0f);
    fill_normal(k, qk_n, 1.0f, 0.0f);
    fill_normal(v, static_cast<size_t>(T * H * dv), 1.0f, 0.0f);
    l2_normalize_rows(q.data(), T * H, dk, 1e-6f);
    l2_normalize_rows(k.data(), T * H, dk, 1e-6f);
    beta.resize(static_cast<size_t>(T * H));
    for (float& b : beta) b = 0.02f + 0.96f * uniform(rng);
    fill_normal(state, static_cast<size_t>(H) * dk * dv, 0.5f, 0.0f);

    std::vector<float> f, dt_bias, A_log(static_cast<size_t>(H));
    fill_normal(f, qk_n, gate.f_std, 0.0f);
    fill_normal(dt_bias, static_cast<size_t>(H) * dk, 1.0f, gate.dt_bias_mean);
    for (float& a : A_log) a = std::log(1.0f + 15.0f * uniform(rng));  // exp(A_log) in [1, 16], as at init
    g.resize(qk_n);
    kda_gate(f.data(), T, H, dk, A_log.data(), dt_bias.data(), gate.lower_bound, g.data());
  }

  // The tokens [t0, t0 + n) of this case as a new case with the given initial state.
  KdaCase slice(int64_t t0, int64_t n) const {
    KdaCase c = *this;
    c.T = n;
    auto cut = [&](const std::vector<float>& x, int64_t per_token) {
      return std::vector<float>(x.begin() + t0 * per_token, x.begin() + (t0 + n) * per_token);
    };
    c.q = cut(q, H * dk);
    c.k = cut(k, H * dk);
    c.g = cut(g, H * dk);
    c.v = cut(v, H * dv);
    c.beta = cut(beta, H);
    return c;
  }
};

struct KdaResult {
  std::vector<float> o, state;
};

KdaResult run_recurrent(const KdaCase& c) {
  KdaResult r{std::vector<float>(static_cast<size_t>(c.T * c.H * c.dv)), c.state};
  kda_recurrent(c.q.data(), c.k.data(), c.v.data(), c.g.data(), c.beta.data(), c.T, c.H, c.dk, c.dv, c.scale,
                r.state.data(), r.o.data());
  return r;
}

KdaResult run_chunked(const KdaCase& c, int64_t start_pos = 0, int chunk = 64) {
  KdaResult r{std::vector<float>(static_cast<size_t>(c.T * c.H * c.dv)), c.state};
  kda_chunked(c.q.data(), c.k.data(), c.v.data(), c.g.data(), c.beta.data(), c.T, c.H, c.dk, c.dv, c.scale,
              r.state.data(), r.o.data(), start_pos, chunk);
  return r;
}

// ---------------------------------------------------------------------------------------------------------------
// Hand-worked cases.

// One head, dk = dv = 2, scale 2. S0 = [[1, 0], [0, 2]] (row = key index).
// Token 1: k = (1, 0), v = (3, 1), beta = 0.5, alpha = exp(g) = (0.5, 1), q = (0, 1).
//   decay:  S = [[0.5, 0], [0, 2]];  S^T k = (0.5, 0);  beta (v - S^T k) = 0.5 (2.5, 1) = (1.25, 0.5)
//   update: row 0 += (1.25, 0.5)  ->  S = [[1.75, 0.5], [0, 2]]
//   output: S^T (2 q) = 2 * row 1 = (0, 4)
// Token 2: k = (0.6, 0.8), v = (1, -1), beta = 1, alpha = (1, 0.5), q = (1, 0).
//   decay:  S = [[1.75, 0.5], [0, 1]];  S^T k = (0.6*1.75, 0.6*0.5 + 0.8*1) = (1.05, 1.1)
//           v - S^T k = (-0.05, -2.1)
//   update: row 0 += 0.6 (-0.05, -2.1) = (-0.03, -1.26); row 1 += 0.8 (-0.05, -2.1) = (-0.04, -1.68)
//           S = [[1.72, -0.76], [-0.04, -0.68]]
//   output: S^T (2 q) = 2 * row 0 = (3.44, -1.52)
TEST(KdaRecurrent, HandWorkedTwoTokens) {
  const float ln_half = std::log(0.5f);
  const std::vector<float> q = {0, 1, 1, 0}, k = {1, 0, 0.6f, 0.8f}, v = {3, 1, 1, -1};
  const std::vector<float> g = {ln_half, 0, 0, ln_half}, beta = {0.5f, 1.0f};
  std::vector<float> state = {1, 0, 0, 2}, o(4);
  kda_recurrent(q.data(), k.data(), v.data(), g.data(), beta.data(), 2, 1, 2, 2, 2.0f, state.data(), o.data());
  const std::vector<float> want_o = {0, 4, 3.44f, -1.52f}, want_state = {1.72f, -0.76f, -0.04f, -0.68f};
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(o[i], want_o[i], 1e-5) << "o[" << i << "]";
    EXPECT_NEAR(state[i], want_state[i], 1e-5) << "state[" << i << "]";
  }
  // The chunked form on the same two tokens (one partial chunk) must agree.
  std::vector<float> state_c = {1, 0, 0, 2}, o_c(4);
  kda_chunked(q.data(), k.data(), v.data(), g.data(), beta.data(), 2, 1, 2, 2, 2.0f, state_c.data(), o_c.data());
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(o_c[i], want_o[i], 1e-5) << "chunked o[" << i << "]";
    EXPECT_NEAR(state_c[i], want_state[i], 1e-5) << "chunked state[" << i << "]";
  }
}

// H = 2, dk = 2, T = 2. exp(A_log) = (1, 2). x = f + dt_bias per element:
//   token 0: head 0 (0, 25), head 1 (-1, 0);  token 1: head 0 (2, -1), head 1 (25, 1)
// softplus(0) = ln 2 = 0.69314718, softplus(25) = 25 (threshold 20), softplus(-1) = ln(1 + e^-1) = 0.31326169,
// softplus(2) = ln(1 + e^2) = 2.12692801, softplus(1) = ln(1 + e) = 1.31326169.
TEST(KdaGate, SoftplusHandValues) {
  const std::vector<float> dt_bias = {1, -2, 0, 1};  // [H*dk]
  const std::vector<float> f = {-1, 27, -1, -1, 1, 1, 25, 0};
  const std::vector<float> A_log = {0.0f, std::log(2.0f)};
  std::vector<float> g(8);
  kda_gate(f.data(), 2, 2, 2, A_log.data(), dt_bias.data(), std::nullopt, g.data());
  const double want[8] = {-0.69314718, -25.0, -2 * 0.31326169, -2 * 0.69314718,
                          -2.12692801, -0.31326169, -50.0,       -2 * 1.31326169};
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(g[i], want[i], 2e-6 * std::max(1.0, std::abs(want[i]))) << i;
}

// Lower bound -5, exp(A_log) = (1, 2): g = -5 sigmoid(a x).
//   x = 0 -> -2.5;  head 0, x = -ln 3 -> sigmoid 0.25 -> -1.25;  head 1, x = ln(3)/2 -> a x = ln 3 -> sigmoid 0.75
//   -> -3.75;  head 1, x = -ln(3)/2 -> -1.25;  head 1, x = 15 -> a x = 30 -> sigmoid = 1 - 9.4e-14 -> -5
TEST(KdaGate, LowerBoundHandValues) {
  const float ln3 = std::log(3.0f);
  const std::vector<float> dt_bias = {0, 0, 0, 0};
  const std::vector<float> f = {0, -ln3, ln3 / 2, 15, 0, 0, -ln3 / 2, 0};
  const std::vector<float> A_log = {0.0f, std::log(2.0f)};
  std::vector<float> g(8);
  kda_gate(f.data(), 2, 2, 2, A_log.data(), dt_bias.data(), -5.0f, g.data());
  const double want[8] = {-2.5, -1.25, -3.75, -5.0, -2.5, -2.5, -1.25, -2.5};
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(g[i], want[i], 2e-6) << i;
  EXPECT_THROW(kda_gate(f.data(), 2, 2, 2, A_log.data(), dt_bias.data(), 0.5f, g.data()), Error);
}

double silu_d(double x) { return x / (1.0 + std::exp(-x)); }

// C = 2, W = 3; w_c0 = (1, 2, 3), w_c1 = (0, 0, 1) (tap 2 multiplies the current token).
// Call 1, zero history, x = [(1, -1), (2, 0.5)]:
//   c0: t0 3*1 = 3, t1 2*1 + 3*2 = 8;  c1: -1, 0.5.   History after: [(1, -1), (2, 0.5)].
// Call 2, x = [(-1, 4)] (one token, shorter than the history):
//   c0: 1*1 + 2*2 + 3*(-1) = 2;  c1: 4.   History after: [(2, 0.5), (-1, 4)].
TEST(ShortConvSilu, HandValuesWithHistoryCarry) {
  const std::vector<float> w = {1, 2, 3, 0, 0, 1};
  std::vector<float> hist(4, 0.0f), out(4);
  const std::vector<float> x1 = {1, -1, 2, 0.5f};
  short_conv_silu(x1.data(), 2, 2, w.data(), 3, hist.data(), out.data());
  const double want1[4] = {silu_d(3), silu_d(-1), silu_d(8), silu_d(0.5)};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(out[i], want1[i], 1e-6) << i;
  const std::vector<float> hist1 = {1, -1, 2, 0.5f};
  EXPECT_EQ(hist, hist1);

  const std::vector<float> x2 = {-1, 4};
  short_conv_silu(x2.data(), 1, 2, w.data(), 3, hist.data(), out.data());
  EXPECT_NEAR(out[0], silu_d(2), 1e-6);
  EXPECT_NEAR(out[1], silu_d(4), 1e-6);
  const std::vector<float> hist2 = {2, 0.5f, -1, 4};
  EXPECT_EQ(hist, hist2);
}

// Splitting a sequence anywhere gives the same outputs as one call (the history carries exactly).
TEST(ShortConvSilu, SplitCallsEqualOneCall) {
  const int64_t T = 37, C = 5;
  const int W = 4;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> x(T * C), w(C * W);
  for (float& e : x) e = normal(rng);
  for (float& e : w) e = normal(rng);
  std::vector<float> hist_a((W - 1) * C, 0.0f), out_a(T * C);
  short_conv_silu(x.data(), T, C, w.data(), W, hist_a.data(), out_a.data());
  std::vector<float> hist_b((W - 1) * C, 0.0f), out_b(T * C);
  int64_t t = 0;
  for (int64_t n : {1, 2, 10, 24}) {
    short_conv_silu(x.data() + t * C, n, C, w.data(), W, hist_b.data(), out_b.data() + t * C);
    t += n;
  }
  ASSERT_EQ(t, T);
  EXPECT_TRUE(bit_equal(out_a, out_b));
  EXPECT_TRUE(bit_equal(hist_a, hist_b));
}

// H = 2, dv = 2, eps = 3.5, w = (1, 2).
//   head 0: o = (3, 4), mean(o^2) = 12.5, rms = sqrt(16) = 4; r = (0, 0) -> sigmoid 0.5
//           y = (3/4 * 1 * 0.5, 4/4 * 2 * 0.5) = (0.375, 1)
//   head 1: o = (-4, 3), rms = 4; r = (ln 3, -ln 3) -> sigmoid (0.75, 0.25)
//           y = (-4/4 * 1 * 0.75, 3/4 * 2 * 0.25) = (-0.75, 0.375)
TEST(KdaGatedRmsNorm, HandValues) {
  const float ln3 = std::log(3.0f);
  const std::vector<float> o = {3, 4, -4, 3}, r = {0, 0, ln3, -ln3}, w = {1, 2};
  std::vector<float> y(4);
  kda_gated_rmsnorm(o.data(), r.data(), w.data(), 1, 2, 2, 3.5f, y.data());
  const double want[4] = {0.375, 1.0, -0.75, 0.375};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(y[i], want[i], 1e-6) << i;
}

// ---------------------------------------------------------------------------------------------------------------
// The recurrence against an independent double-precision transcription of the header's per-token rule.

KdaResult naive_recurrence_double(const KdaCase& c) {
  const int H = c.H, dk = c.dk, dv = c.dv;
  std::vector<double> S(c.state.begin(), c.state.end());
  std::vector<float> o(static_cast<size_t>(c.T * H * dv));
  for (int64_t t = 0; t < c.T; ++t)
    for (int h = 0; h < H; ++h) {
      double* s = S.data() + static_cast<size_t>(h) * dk * dv;
      const size_t qk = static_cast<size_t>((t * H + h) * dk), vo = static_cast<size_t>((t * H + h) * dv);
      const double b = c.beta[t * H + h];
      for (int i = 0; i < dk; ++i)
        for (int j = 0; j < dv; ++j) s[i * dv + j] *= std::exp(static_cast<double>(c.g[qk + i]));
      std::vector<double> delta(dv);
      for (int j = 0; j < dv; ++j) {
        double pred = 0;
        for (int i = 0; i < dk; ++i) pred += s[i * dv + j] * c.k[qk + i];
        delta[j] = b * (c.v[vo + j] - pred);
      }
      for (int i = 0; i < dk; ++i)
        for (int j = 0; j < dv; ++j) s[i * dv + j] += c.k[qk + i] * delta[j];
      for (int j = 0; j < dv; ++j) {
        double acc = 0;
        for (int i = 0; i < dk; ++i) acc += s[i * dv + j] * (static_cast<double>(c.scale) * c.q[qk + i]);
        o[vo + j] = static_cast<float>(acc);
      }
    }
  return {o, std::vector<float>(S.begin(), S.end())};
}

TEST(KdaRecurrent, MatchesDoublePrecisionNaive) {
  for (const GateSpec& gate : {kSoftplusGate, kLowerBoundGate})
    for (auto [dk, dv] : {std::pair{16, 16}, std::pair{32, 16}, std::pair{8, 24}}) {
      const KdaCase c(150, 2, dk, dv, gate, 11u + dk + dv);
      const KdaResult got = run_recurrent(c), want = naive_recurrence_double(c);
      EXPECT_LE(rel_err(got.o, want.o), 1e-5) << "dk=" << dk << " dv=" << dv;
      EXPECT_LE(rel_err(got.state, want.state), 1e-5) << "dk=" << dk << " dv=" << dv;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Chunked form.

constexpr double kChunkedBound = 1e-5;

TEST(KdaChunked, MatchesRecurrent) {
  for (const GateSpec& gate : {kSoftplusGate, kLowerBoundGate})
    for (auto [dk, dv] : {std::pair{16, 16}, std::pair{32, 16}})
      for (int64_t T : {1, 5, 63, 64, 65, 130, 200}) {
        const KdaCase c(T, 2, dk, dv, gate, static_cast<uint32_t>(100 + T + dk));
        const KdaResult rec = run_recurrent(c), chk = run_chunked(c);
        EXPECT_LE(rel_err(chk.o, rec.o), kChunkedBound) << "T=" << T << " dk=" << dk << " dv=" << dv;
        EXPECT_LE(rel_err(chk.state, rec.state), kChunkedBound) << "T=" << T << " dk=" << dk << " dv=" << dv;
      }
}

TEST(KdaChunked, OtherChunkLengthsMatchRecurrent) {
  const KdaCase c(100, 2, 16, 16, kSoftplusGate, 5);
  const KdaResult rec = run_recurrent(c);
  for (int chunk : {1, 16, 32}) {
    const KdaResult chk = run_chunked(c, 0, chunk);
    EXPECT_LE(rel_err(chk.o, rec.o), kChunkedBound) << "chunk=" << chunk;
    EXPECT_LE(rel_err(chk.state, rec.state), kChunkedBound) << "chunk=" << chunk;
  }
}

// Per-token log gates spread over (-30, 0): within one chunk G falls to about -1000, so any exp(-G) would
// overflow. Everything must stay finite and agree with the recurrence. This is the hardest case for the bound:
// G_r - G_s is a difference of two large cumulative sums, so its absolute error grows like |G| * 2^-24
// (observed ‖Δo‖/‖o‖ ≈ 7e-6 here, against ≈ 1e-7 for the recurrent form vs a double-precision reference).
TEST(KdaChunked, StrongDecayStaysFiniteAndMatchesRecurrent) {
  for (const GateSpec& gate : {GateSpec{-30.0f, 0.0f, 2.0f}, GateSpec{std::nullopt, 1.0f, 2.0f}}) {
    const KdaCase c(200, 2, 32, 16, gate, 77);
    float g_min = 0;
    for (float x : c.g) g_min = std::min(g_min, x);
    EXPECT_LT(g_min, -20.0f);
    const KdaResult rec = run_recurrent(c), chk = run_chunked(c);
    ASSERT_TRUE(all_finite(chk.o));
    ASSERT_TRUE(all_finite(chk.state));
    EXPECT_LE(rel_err(chk.o, rec.o), kChunkedBound);
    EXPECT_LE(rel_err(chk.state, rec.state), kChunkedBound);
  }
}

// Cutting at multiples of the chunk length is bit-identical to the uncut call.
TEST(KdaChunked, SegmentsAtChunkBoundariesAreBitIdentical) {
  const KdaCase c(200, 2, 32, 16, kSoftplusGate, 21);
  const KdaResult whole = run_chunked(c);
  KdaCase first = c.slice(0, 128);
  const KdaResult a = run_chunked(first);
  KdaCase second = c.slice(128, 72);
  second.state = a.state;
  const KdaResult b = run_chunked(second, 128);
  std::vector<float> o_cat = a.o;
  o_cat.insert(o_cat.end(), b.o.begin(), b.o.end());
  EXPECT_TRUE(bit_equal(o_cat, whole.o));
  EXPECT_TRUE(bit_equal(b.state, whole.state));
}

// A segment that starts at absolute position 30 begins with a partial chunk of 34 tokens.
TEST(KdaChunked, PartialFirstChunk) {
  const KdaCase c(170, 2, 16, 16, kLowerBoundGate, 33);
  const KdaResult rec = run_recurrent(c), chk = run_chunked(c, 30);
  EXPECT_LE(rel_err(chk.o, rec.o), kChunkedBound);
  EXPECT_LE(rel_err(chk.state, rec.state), kChunkedBound);

  // Cut at the next absolute chunk boundary (position 64, i.e. after 34 tokens): bit-identical.
  const KdaResult a = run_chunked(c.slice(0, 34), 30);
  KdaCase rest = c.slice(34, 136);
  rest.state = a.state;
  const KdaResult b = run_chunked(rest, 64);
  std::vector<float> o_cat = a.o;
  o_cat.insert(o_cat.end(), b.o.begin(), b.o.end());
  EXPECT_TRUE(bit_equal(o_cat, chk.o));
  EXPECT_TRUE(bit_equal(b.state, chk.state));
}

TEST(KdaChunked, CheckpointsEqualRecurrentStates) {
  const KdaCase c(200, 2, 32, 16, kSoftplusGate, 44);
  const size_t state_size = c.state.size();
  std::vector<float> state = c.state, o(static_cast<size_t>(c.T * c.H * c.dv)), ckpt(4 * state_size, -7.0f);
  const int n = kda_chunked(c.q.data(), c.k.data(), c.v.data(), c.g.data(), c.beta.data(), c.T, c.H, c.dk, c.dv,
                            c.scale, state.data(), o.data(), 0, 64, ckpt.data(), 64);
  ASSERT_EQ(n, 3);
  // Recurrent states after tokens 63, 127, 191.
  std::vector<float> rec_state = c.state;
  for (int j = 0; j < 3; ++j) {
    KdaCase seg = c.slice(64 * j, 64);
    seg.state = rec_state;
    rec_state = run_recurrent(seg).state;
    const std::vector<float> got(ckpt.begin() + j * state_size, ckpt.begin() + (j + 1) * state_size);
    EXPECT_LE(rel_err(got, rec_state), kChunkedBound) << "checkpoint " << j;
  }
  // Nothing written past the third checkpoint.
  for (size_t i = 3 * state_size; i < ckpt.size(); ++i) ASSERT_EQ(ckpt[i], -7.0f);

  // Offset start: positions 100..299 with a checkpoint every 128 cross boundaries after positions 127 and 255.
  std::vector<float> state2 = c.state, ckpt2(2 * state_size);
  EXPECT_EQ(kda_chunked(c.q.data(), c.k.data(), c.v.data(), c.g.data(), c.beta.data(), c.T, c.H, c.dk, c.dv,
                        c.scale, state2.data(), o.data(), 100, 64, ckpt2.data(), 128),
            2);
  const KdaResult to_127 = run_recurrent(c.slice(0, 28));
  const std::vector<float> got(ckpt2.begin(), ckpt2.begin() + state_size);
  EXPECT_LE(rel_err(got, to_127.state), kChunkedBound);
}

TEST(KdaChunked, ThreadCountDoesNotChangeResult) {
  const KdaCase c(130, 3, 16, 16, kSoftplusGate, 55);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const KdaResult one = run_chunked(c), one_rec = run_recurrent(c);
  omp_set_num_threads(3);
  const KdaResult three = run_chunked(c), three_rec = run_recurrent(c);
  omp_set_num_threads(saved);
  EXPECT_TRUE(bit_equal(one.o, three.o));
  EXPECT_TRUE(bit_equal(one.state, three.state));
  EXPECT_TRUE(bit_equal(one_rec.o, three_rec.o));
  EXPECT_TRUE(bit_equal(one_rec.state, three_rec.state));
}

TEST(KdaChunked, RejectsInvalidArguments) {
  KdaCase c(10, 1, 4, 4, kSoftplusGate, 9);
  std::vector<float> o(static_cast<size_t>(c.T * c.dv)), ckpt(c.state.size());
  EXPECT_THROW(kda_chunked(c.q.data(), c.k.data(), c.v.data(), c.g.data(), c.beta.data(), c.T, 1, 4, 4, c.scale,
                           c.state.data(), o.data(), 0, 64, ckpt.data(), 96),
               Error);
  c.g[7] = 0.01f;
  EXPECT_THROW(kda_chunked(c.q.data(), c.k.data(), c.v.data(), c.g.data(), c.beta.data(), c.T, 1, 4, 4, c.scale,
                           c.state.data(), o.data()),
               Error);
}

}  // namespace
}  // namespace kestrel::cpu
