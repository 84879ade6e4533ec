// The KDA glue kernels (kernels/cuda/kda_glue.h) against the CPU reference (kestrel::cpu::short_conv_silu,
// kda_gated_rmsnorm, kda_recurrent with the CPU preprocessing) on fresh random inputs, and the recurrence against
// the existing kda_decode.
#include "kernels/cuda/kda_glue.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/basic.h"
#include "kernels/cpu/kda.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {
namespace {

// All bits set: a NaN in every float, so any output a kernel fails to write shows up.
template <typename T>
void poison(DeviceBuffer<T>& d) {
  if (d.size() > 0) KESTREL_CUDA_CHECK(cudaMemset(d.get(), 0xff, d.bytes()));
}

std::vector<float> normal_vector(size_t n, float mean, float std_dev, std::mt19937& rng) {
  std::normal_distribution<float> normal(mean, std_dev);
  std::vector<float> v(n);
  for (float& e : v) e = normal(rng);
  return v;
}

std::vector<int64_t> offsets(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu(lengths.size() + 1, 0);
  for (size_t b = 0; b < lengths.size(); ++b) cu[b + 1] = cu[b] + lengths[b];
  return cu;
}

// `n` distinct slots out of `pool`, in random order.
std::vector<int32_t> random_slots(int n, int pool, uint32_t seed) {
  std::vector<int32_t> slots(static_cast<size_t>(pool));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), std::mt19937(seed));
  slots.resize(static_cast<size_t>(n));
  return slots;
}

// max |a - b| / max |b|: the error relative to the largest reference value. NaN in a fails every bound.
double max_rel_err(const float* a, const float* b, size_t n) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    err = std::isnan(d) ? INFINITY : std::max(err, d);
    ref = std::max(ref, std::fabs(static_cast<double>(b[i])));
  }
  return ref > 0 ? err / ref : err;
}

class KdaGlue : public ::testing::Test {
 protected:
  void SetUp() override {
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// ---------------------------------------------------------------------------------------------- short conv

// Both sides form z = sum_i w_i x_i in fp32 in different orders (the CPU's 8-lane tree, the GPU's fma chain), so
// |dz| <= W 2^-24 sum_i |w_i x_i| (2.4e-7 of it for W = 4); silu's slope lies in [-0.1, 1.1]; expf against
// std::exp and the division add a few ulps of the output. 1e-6 of (sum_i |w_i x_i| + |out|) covers that with
// margin. The histories are copies of inputs and must match bit for bit.
constexpr double kConvBound = 1e-6;

void check_short_conv(const std::vector<int64_t>& lengths, int64_t C, int W, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "C=" << C << " W=" << W << " seed=" << seed);
  std::mt19937 rng(seed);
  const int B = static_cast<int>(lengths.size());
  const std::vector<int64_t> cu = offsets(lengths);
  const int64_t T = cu[B], hist_size = (W - 1) * C;
  const std::vector<float> x = normal_vector(static_cast<size_t>(T * C), 0.0f, 1.0f, rng);
  const std::vector<float> w = normal_vector(static_cast<size_t>(C * W), 0.0f, 0.5f, rng);
  // Each sequence's history sits in a shuffled slot of a pool with one spare slot, which must stay untouched.
  const int pool = B + 1;
  const std::vector<int32_t> slots = random_slots(B, pool, seed + 1);
  const std::vector<float> hist0 = normal_vector(static_cast<size_t>(pool * hist_size), 0.0f, 1.0f, rng);

  std::vector<float> want_out(static_cast<size_t>(T * C)), want_hist = hist0, magnitude(want_out.size());
  for (int b = 0; b < B; ++b) {
    const float* hb = hist0.data() + slots[b] * hist_size;
    for (int64_t t = 0; t < lengths[b]; ++t)
      for (int64_t c = 0; c < C; ++c) {
        double m = 0;
        for (int i = 0; i < W; ++i) {
          const int64_t rel = t - (W - 1) + i;
          const float xv = rel >= 0 ? x[(cu[b] + rel) * C + c] : hb[(rel + W - 1) * C + c];
          m += std::fabs(static_cast<double>(w[c * W + i]) * xv);
        }
        magnitude[(cu[b] + t) * C + c] = static_cast<float>(m);
      }
    cpu::short_conv_silu(x.data() + cu[b] * C, lengths[b], C, w.data(), W, want_hist.data() + slots[b] * hist_size,
                         want_out.data() + cu[b] * C);
  }

  const DeviceBuffer<float> d_x = to_device(x), d_w = to_device(w);
  const DeviceBuffer<int64_t> d_cu = to_device(cu);
  DeviceBuffer<float> d_hist(hist0.size()), d_out(want_out.size());
  std::vector<float*> hist_ptrs(static_cast<size_t>(B));
  for (int b = 0; b < B; ++b) hist_ptrs[b] = d_hist.get() + slots[b] * hist_size;
  DeviceBuffer<float*> d_hist_ptrs(hist_ptrs.size());
  if (W > 1) {  // W == 1 has no history: hist stays null
    d_hist.upload(hist0.data());
    d_hist_ptrs.upload(hist_ptrs.data());
  }
  poison(d_out);
  short_conv_silu_varlen(d_x.get(), d_cu.get(), B, C, d_w.get(), W, W > 1 ? d_hist_ptrs.get() : nullptr, d_out.get(),
                         nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());

  const std::vector<float> got_out = to_host(d_out), got_hist = W > 1 ? to_host(d_hist) : std::vector<float>{};
  double worst = 0;  // largest error as a fraction of its bound
  for (size_t i = 0; i < want_out.size(); ++i) {
    const double bound = kConvBound * (magnitude[i] + std::fabs(want_out[i]));
    const double err = std::fabs(static_cast<double>(got_out[i]) - want_out[i]);
    ASSERT_LE(err, bound) << "out[" << i / C << ", " << i % C << "]: got " << got_out[i] << " want " << want_out[i];
    worst = std::max(worst, err / bound);
  }
  EXPECT_EQ(std::memcmp(got_hist.data(), want_hist.data(), want_hist.size() * sizeof(float)), 0)
      << "histories (the spare slot included) differ from the CPU's";
  std::printf("short conv C=%lld W=%d T=%lld: largest error %.3g of the bound\n", static_cast<long long>(C), W,
              static_cast<long long>(T), worst);
}

// Lengths 1 and 2 are shorter than W - 1 = 3: their new history keeps older history rows.
TEST_F(KdaGlue, ShortConvMatchesCpu) {
  check_short_conv({1, 2, 70}, 96, 4, 101);
  check_short_conv({1, 2, 70}, 512, 4, 102);
}

// An empty sequence (history unchanged), C not a multiple of the 128-channel tile, the widths 1, 2 and 8, and a
// batch of many one-token sequences (decode).
TEST_F(KdaGlue, ShortConvWidthsEmptySequenceAndDecodeBatch) {
  check_short_conv({0, 3, 1, 130}, 200, 2, 111);
  check_short_conv({5, 0, 9}, 33, 1, 112);
  check_short_conv({3, 12, 7}, 130, 8, 113);
  check_short_conv(std::vector<int64_t>(300, 1), 64, 4, 114);
}

// ---------------------------------------------------------------------------------------------- gated RMSNorm

// The GPU's fp32 result differs from the CPU's by a relative 1e-6 at most (other summation order of the squares,
// sqrtf, expf; every error is a factor on the row or element), and rounding to bf16 adds at most half a bf16 ulp
// of the value. Half an ulp of y: |y| = m 2^E with m in [0.5, 1) has ulp 2^(E-8).
void check_gated_rmsnorm(int64_t T, int H, int dv, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "T=" << T << " H=" << H << " dv=" << dv);
  std::mt19937 rng(seed);
  const size_t n = static_cast<size_t>(T * H * dv);
  const std::vector<float> o = normal_vector(n, 0.0f, 3.0f, rng), r = normal_vector(n, 0.0f, 2.0f, rng);
  const std::vector<float> w = normal_vector(static_cast<size_t>(dv), 1.0f, 0.3f, rng);
  const float eps = 1e-5f;
  std::vector<float> want(n);
  cpu::kda_gated_rmsnorm(o.data(), r.data(), w.data(), T, H, dv, eps, want.data());

  const DeviceBuffer<float> d_o = to_device(o), d_r = to_device(r), d_w = to_device(w);
  DeviceBuffer<uint16_t> d_y(n);
  poison(d_y);
  kda_gated_rmsnorm_bf16(d_o.get(), d_r.get(), d_w.get(), T, H, dv, eps, d_y.get(), nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got = to_host(d_y);

  size_t exact = 0;
  for (size_t i = 0; i < n; ++i) {
    int e = 0;
    std::frexp(want[i], &e);
    const double bound = std::ldexp(1.0, e - 9) + 1e-6 * std::fabs(want[i]);
    const float g = bf16_to_f32(got[i]);
    ASSERT_LE(std::fabs(static_cast<double>(g) - want[i]), bound) << "y[" << i << "]: got " << g << " want " << want[i];
    exact += got[i] == f32_to_bf16(want[i]);
  }
  std::printf("gated rmsnorm T=%lld H=%d dv=%d: %zu of %zu equal to the CPU value rounded to bf16\n",
              static_cast<long long>(T), H, dv, exact, n);
}

TEST_F(KdaGlue, GatedRmsNormBf16MatchesCpu) {
  check_gated_rmsnorm(1, 4, 32, 201);
  check_gated_rmsnorm(37, 3, 128, 202);
  check_gated_rmsnorm(5, 2, 100, 203);  // dv not a multiple of the warp
  check_gated_rmsnorm(3, 1, 7, 204);
}

// ---------------------------------------------------------------------------------------------- recurrence

// Both sides compute in fp32; the GPU sums in other orders, reads the updated state as S_d^T q + delta (k . q)
// rather than S^T q, and evaluates the fused gate with expf / log1pf. Errors of that kind stay near 1e-6 of the
// largest values over a few hundred tokens; the bound is 1e-4 of the largest reference value.
constexpr double kRecurrentBound = 1e-4;

enum class Preprocess { kFusedSoftplus, kFusedLowerBound, kGiven, kFusedGateGivenQk };

const char* name(Preprocess p) {
  switch (p) {
    case Preprocess::kFusedSoftplus: return "fused softplus gate";
    case Preprocess::kFusedLowerBound: return "fused lower-bound gate";
    case Preprocess::kGiven: return "preprocessed inputs";
    case Preprocess::kFusedGateGivenQk: return "fused gate, normalised q and k given";
  }
  return "";
}

// T tokens of H heads: the raw model-side inputs and the preprocessed ones the CPU reference takes, as src/cpu/kda_core.cpp
// prepares them (q, k l2-normalised with eps 1e-6; g = kda_gate(f); beta = sigmoid(logit)).
struct Tokens {
  int64_t T;
  int H, dk, dv;
  std::optional<float> lower_bound;
  std::vector<float> q_raw, k_raw, v, f, beta_logit, A_log, dt_bias;
  std::vector<float> q, k, g, beta;

  Tokens(int64_t T_, int H_, int dk_, int dv_, Preprocess p, uint32_t seed) : T(T_), H(H_), dk(dk_), dv(dv_) {
    std::mt19937 rng(seed);
    if (p == Preprocess::kFusedLowerBound) lower_bound = -5.0f;
    const size_t nk = static_cast<size_t>(T * H * dk), nv = static_cast<size_t>(T * H * dv);
    q_raw = normal_vector(nk, 0.0f, 1.0f, rng);
    k_raw = normal_vector(nk, 0.0f, 1.0f, rng);
    v = normal_vector(nv, 0.0f, 1.0f, rng);
    f = normal_vector(nk, 0.0f, 1.0f, rng);
    beta_logit = normal_vector(static_cast<size_t>(T * H), 0.0f, 2.0f, rng);
    // Mild decay for the softplus gate (the Kimi Linear regime); the lower-bound gate reaches at most -5.
    dt_bias = normal_vector(static_cast<size_t>(H * dk), lower_bound ? -1.0f : -3.0f, 1.0f, rng);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    A_log.resize(static_cast<size_t>(H));
    for (float& a : A_log) a = std::log(1.0f + 15.0f * uniform(rng));  // exp(A_log) in [1, 16], as at init

    q = q_raw;
    k = k_raw;
    cpu::l2_normalize_rows(q.data(), T * H, dk, 1e-6f);
    cpu::l2_normalize_rows(k.data(), T * H, dk, 1e-6f);
    g.resize(nk);
    cpu::kda_gate(f.data(), T, H, dk, A_log.data(), dt_bias.data(), lower_bound, g.data());
    beta.resize(beta_logit.size());
    for (size_t i = 0; i < beta.size(); ++i) beta[i] = cpu::sigmoid(beta_logit[i]);
  }
};

// Device copies of a Tokens and the KdaInputs that reads them with the preprocessing `p` asks the kernel for.
struct DeviceTokens {
  DeviceBuffer<float> q, k, v, gate, beta, A_log, dt_bias;
  KdaInputs inputs;

  DeviceTokens(const Tokens& t, Preprocess p)
      : q(to_device(p == Preprocess::kGiven || p == Preprocess::kFusedGateGivenQk ? t.q : t.q_raw)),
        k(to_device(p == Preprocess::kGiven || p == Preprocess::kFusedGateGivenQk ? t.k : t.k_raw)),
        v(to_device(t.v)),
        gate(to_device(p == Preprocess::kGiven ? t.g : t.f)),
        beta(to_device(p == Preprocess::kGiven ? t.beta : t.beta_logit)),
        A_log(to_device(t.A_log)),
        dt_bias(to_device(t.dt_bias)) {
    inputs.q = q.get();
    inputs.k = k.get();
    inputs.v = v.get();
    inputs.gate = gate.get();
    inputs.beta = beta.get();
    inputs.scale = 1.0f / std::sqrt(static_cast<float>(t.dk));
    if (p != Preprocess::kGiven) {
      inputs.A_log = A_log.get();
      inputs.dt_bias = dt_bias.get();
      inputs.gate_lower_bound = t.lower_bound;
      inputs.beta_is_logit = true;
      inputs.normalize_qk = p != Preprocess::kFusedGateGivenQk;
    }
  }
};

struct RecurrentCase {
  std::vector<int64_t> lengths;
  int H, dk, dv;
  Preprocess preprocess;
  bool initial_state;      // random initial states, else zeros (a fresh sequence)
  int64_t stride_pad = 0;  // state_stride = H*dk*dv + stride_pad when positive, else 0 (bare states)
};

// One varlen call over sequences whose states sit in shuffled slots of a larger pool; outputs and final states are
// compared with cpu::kda_recurrent per sequence, slots no sequence owns (and the padding between states) must stay
// bit-identical, and so must the state of an empty sequence.
void check_recurrent(const RecurrentCase& rc, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "H=" << rc.H << " dk=" << rc.dk << " dv=" << rc.dv << " " << name(rc.preprocess)
                                  << (rc.initial_state ? " with" : " without") << " initial state, pad "
                                  << rc.stride_pad);
  const int B = static_cast<int>(rc.lengths.size()), H = rc.H, dk = rc.dk, dv = rc.dv;
  const std::vector<int64_t> cu = offsets(rc.lengths);
  const Tokens tok(cu[B], H, dk, dv, rc.preprocess, seed);
  const int64_t state_size = int64_t{H} * dk * dv, stride = state_size + rc.stride_pad;
  const int pool = B + 2;
  const std::vector<int32_t> slots = random_slots(B, pool, seed + 1);
  std::mt19937 rng(seed + 2);
  std::vector<float> initial = normal_vector(static_cast<size_t>(pool * stride), 0.0f, 0.5f, rng);
  if (!rc.initial_state)
    for (int32_t s : slots) std::fill_n(initial.begin() + s * stride, state_size, 0.0f);

  const DeviceTokens dt(tok, rc.preprocess);
  KdaInputs inputs = dt.inputs;
  inputs.state_stride = rc.stride_pad > 0 ? stride : 0;
  DeviceBuffer<float> d_pool = to_device(initial), d_o(static_cast<size_t>(cu[B] * H * dv));
  const DeviceBuffer<int64_t> d_cu = to_device(cu);
  const DeviceBuffer<int32_t> d_slots = to_device(slots);
  poison(d_o);
  kda_recurrent_varlen(inputs, d_cu.get(), B, H, dk, dv, d_pool.get(), d_slots.get(), d_o.get(), nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got_o = to_host(d_o), got_pool = to_host(d_pool);

  std::vector<float> want_o(got_o.size());
  double worst = 0;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int b = 0; b < B; ++b) {
    SCOPED_TRACE(testing::Message() << "sequence " << b << " of length " << rc.lengths[b]);
    std::vector<float> state(initial.begin() + slots[b] * stride, initial.begin() + slots[b] * stride + state_size);
    const int64_t qk = cu[b] * H * dk, vo = cu[b] * H * dv;
    cpu::kda_recurrent(tok.q.data() + qk, tok.k.data() + qk, tok.v.data() + vo, tok.g.data() + qk,
                       tok.beta.data() + cu[b] * H, rc.lengths[b], H, dk, dv, scale, state.data(), want_o.data() + vo);
    const float* got_state = got_pool.data() + slots[b] * stride;
    if (rc.lengths[b] == 0) {
      EXPECT_EQ(std::memcmp(got_state, state.data(), state_size * sizeof(float)), 0)
          << "an empty sequence must leave its state bit-identical";
      continue;
    }
    const double state_err = max_rel_err(got_state, state.data(), static_cast<size_t>(state_size));
    EXPECT_LE(state_err, kRecurrentBound) << "final state";
    const size_t n_o = static_cast<size_t>(rc.lengths[b] * H * dv);
    const double o_err = max_rel_err(got_o.data() + vo, want_o.data() + vo, n_o);
    EXPECT_LE(o_err, kRecurrentBound) << "outputs";
    worst = std::max({worst, state_err, o_err});
  }
  // Everything outside the owned states: the other slots and the padding after each state.
  std::vector<bool> owned(static_cast<size_t>(pool), false);
  for (int32_t s : slots) owned[s] = true;
  for (int s = 0; s < pool; ++s) {
    const int64_t from = owned[s] ? state_size : 0;
    EXPECT_EQ(std::memcmp(got_pool.data() + s * stride + from, initial.data() + s * stride + from,
                          (stride - from) * sizeof(float)),
              0)
        << "slot " << s << (owned[s] ? ": the padding after the state changed" : " belongs to no sequence but changed");
  }
  std::printf("recurrent H=%d dk=%d dv=%d T=%lld (%s, %s initial state): largest relative error %.3g\n", H, dk, dv,
              static_cast<long long>(cu[B]), name(rc.preprocess), rc.initial_state ? "with" : "without", worst);
}

TEST_F(KdaGlue, RecurrentVarlenMatchesCpu) {
  const std::vector<int64_t> lengths = {1, 5, 130};
  uint32_t seed = 300;
  for (int dim : {32, 128})
    for (int H : {2, 4})
      for (Preprocess p : {Preprocess::kFusedSoftplus, Preprocess::kFusedLowerBound})
        for (bool initial : {false, true}) check_recurrent({lengths, H, dim, dim, p, initial}, ++seed);
}

// Inputs preprocessed outside (the plain cpu::kda_recurrent contract), the gate fused but q and k given, head
// sizes that are no multiple of the 32-column tile or the 4-warp row split, the largest head (8 warps), an empty
// sequence, and states inside larger rows (state_stride).
TEST_F(KdaGlue, RecurrentVarlenOtherSizesAndOptions) {
  check_recurrent({{7, 0, 65}, 3, 32, 32, Preprocess::kGiven, true}, 401);
  check_recurrent({{40, 1}, 2, 128, 128, Preprocess::kFusedGateGivenQk, true}, 402);
  check_recurrent({{1, 33, 70}, 2, 40, 72, Preprocess::kFusedSoftplus, true}, 403);
  check_recurrent({{17, 3}, 3, 64, 48, Preprocess::kFusedLowerBound, true, 12}, 404);
  check_recurrent({{9, 66}, 1, 256, 256, Preprocess::kFusedSoftplus, true}, 405);
  check_recurrent({{5, 2}, 2, 1, 1, Preprocess::kGiven, true, 3}, 406);
  check_recurrent({{20}, 2, 200, 17, Preprocess::kFusedSoftplus, false}, 407);
}

// One token per sequence through both GPU kernels (kda_decode needs dk = dv = 128): the same function in the same
// state layout, both in fp32 with other summation orders, so they agree to 1e-5 of the largest value.
TEST_F(KdaGlue, RecurrentVarlenOfOneTokenEqualsDecode) {
  const int N = 6, H = 4, dim = 128, pool = N + 2;
  const int64_t state_size = int64_t{H} * dim * dim;
  const std::vector<int32_t> slots = random_slots(N, pool, 501);
  std::mt19937 rng(502);
  const std::vector<float> initial = normal_vector(static_cast<size_t>(pool * state_size), 0.0f, 0.5f, rng);
  const DeviceBuffer<int32_t> d_slots = to_device(slots);
  const DeviceBuffer<int64_t> d_cu = to_device(offsets(std::vector<int64_t>(N, 1)));
  for (Preprocess p : {Preprocess::kFusedSoftplus, Preprocess::kFusedLowerBound, Preprocess::kGiven}) {
    SCOPED_TRACE(name(p));
    const Tokens tok(N, H, dim, dim, p, 503);
    const DeviceTokens dt(tok, p);
    DeviceBuffer<float> pool_decode = to_device(initial), pool_varlen = to_device(initial);
    DeviceBuffer<float> o_decode(static_cast<size_t>(N) * H * dim), o_varlen(o_decode.size());
    poison(o_decode);
    poison(o_varlen);
    kda_decode(dt.inputs, N, H, dim, dim, pool_decode.get(), d_slots.get(), o_decode.get(), nullptr);
    kda_recurrent_varlen(dt.inputs, d_cu.get(), N, H, dim, dim, pool_varlen.get(), d_slots.get(), o_varlen.get(),
                         nullptr);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> a = to_host(o_varlen), b = to_host(o_decode);
    const std::vector<float> sa = to_host(pool_varlen), sb = to_host(pool_decode);
    const double o_err = max_rel_err(a.data(), b.data(), a.size());
    const double s_err = max_rel_err(sa.data(), sb.data(), sa.size());
    EXPECT_LE(o_err, 1e-5);
    EXPECT_LE(s_err, 1e-5);
    std::printf("varlen vs decode (%s): relative error o %.3g, state %.3g\n", name(p), o_err, s_err);
  }
}

// ---------------------------------------------------------------------------------------------- graphs, arguments

// The three calls captured into a CUDA graph (no allocation, no host synchronisation inside) and replayed give the
// same bits as direct calls: the kernels are deterministic and capturable.
TEST_F(KdaGlue, CapturedGraphReplaysBitIdentically) {
  const int H = 2, dim = 32, W = 4;
  const std::vector<int64_t> lengths = {3, 1, 50};
  const std::vector<int64_t> cu = offsets(lengths);
  const int B = 3;
  const int64_t T = cu[B], C = int64_t{H} * dim;
  const Tokens tok(T, H, dim, dim, Preprocess::kFusedSoftplus, 601);
  const DeviceTokens dt(tok, Preprocess::kFusedSoftplus);
  std::mt19937 rng(602);
  const std::vector<float> conv_w = normal_vector(static_cast<size_t>(C * W), 0.0f, 0.5f, rng);
  const std::vector<float> hist0 = normal_vector(static_cast<size_t>(B * (W - 1) * C), 0.0f, 1.0f, rng);
  const std::vector<float> state0 = normal_vector(static_cast<size_t>(B * H * dim * dim), 0.0f, 0.5f, rng);
  const std::vector<float> norm_w = normal_vector(static_cast<size_t>(dim), 1.0f, 0.3f, rng);
  const DeviceBuffer<float> d_conv_w = to_device(conv_w), d_norm_w = to_device(norm_w);
  const DeviceBuffer<int64_t> d_cu = to_device(cu);
  const DeviceBuffer<int32_t> d_slots = to_device(std::vector<int32_t>{2, 0, 1});

  struct Outputs {
    std::vector<float> conv, hist, o, state;
    std::vector<uint16_t> y;
  };
  cudaStream_t stream;
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto run = [&](bool graph) {
    DeviceBuffer<float> hist = to_device(hist0), state = to_device(state0), conv(static_cast<size_t>(T * C)),
                        o(static_cast<size_t>(T * C));
    DeviceBuffer<uint16_t> y(static_cast<size_t>(T * C));
    std::vector<float*> ptrs(B);
    for (int b = 0; b < B; ++b) ptrs[b] = hist.get() + b * (W - 1) * C;
    const DeviceBuffer<float*> d_ptrs = to_device(ptrs);
    auto calls = [&] {
      short_conv_silu_varlen(dt.q.get(), d_cu.get(), B, C, d_conv_w.get(), W, d_ptrs.get(), conv.get(), stream);
      kda_recurrent_varlen(dt.inputs, d_cu.get(), B, H, dim, dim, state.get(), d_slots.get(), o.get(), stream);
      kda_gated_rmsnorm_bf16(o.get(), dt.v.get(), d_norm_w.get(), T, H, dim, 1e-5f, y.get(), stream);
    };
    if (graph) {
      cudaGraph_t g;
      cudaGraphExec_t exec;
      KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      calls();
      KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
      KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
      KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
      KESTREL_CUDA_CHECK(cudaGraphExecDestroy(exec));
      KESTREL_CUDA_CHECK(cudaGraphDestroy(g));
    } else {
      calls();
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    return Outputs{to_host(conv), to_host(hist), to_host(o), to_host(state), to_host(y)};
  };
  const Outputs direct = run(false), replayed = run(true);
  KESTREL_CUDA_CHECK(cudaStreamDestroy(stream));
  auto same = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  EXPECT_TRUE(same(direct.conv, replayed.conv));
  EXPECT_TRUE(same(direct.hist, replayed.hist));
  EXPECT_TRUE(same(direct.o, replayed.o));
  EXPECT_TRUE(same(direct.state, replayed.state));
  EXPECT_TRUE(same(direct.y, replayed.y));
}

TEST_F(KdaGlue, RejectsMalformedArguments) {
  const Tokens tok(2, 1, 32, 32, Preprocess::kFusedSoftplus, 701);
  const DeviceTokens dt(tok, Preprocess::kFusedSoftplus);
  DeviceBuffer<float> pool(32 * 32), o(2 * 32), x(2 * 32), w(32 * 9), out(2 * 32);
  const DeviceBuffer<int32_t> slots = to_device(std::vector<int32_t>{0});
  const DeviceBuffer<int64_t> cu = to_device(std::vector<int64_t>{0, 2});
  DeviceBuffer<float*> hist(1);
  auto recurrent = [&](const KdaInputs& in, int dk, int dv) {
    kda_recurrent_varlen(in, cu.get(), 1, 1, dk, dv, pool.get(), slots.get(), o.get(), nullptr);
  };
  EXPECT_THROW(recurrent(dt.inputs, 0, 32), Error);
  EXPECT_THROW(recurrent(dt.inputs, 32, 257), Error);
  KdaInputs half_gate = dt.inputs;
  half_gate.dt_bias = nullptr;
  EXPECT_THROW(recurrent(half_gate, 32, 32), Error);
  KdaInputs bound_without_gate = dt.inputs;
  bound_without_gate.A_log = bound_without_gate.dt_bias = nullptr;
  bound_without_gate.gate_lower_bound = -5.0f;
  EXPECT_THROW(recurrent(bound_without_gate, 32, 32), Error);
  KdaInputs short_stride = dt.inputs;
  short_stride.state_stride = 32 * 32 - 1;
  EXPECT_THROW(recurrent(short_stride, 32, 32), Error);
  EXPECT_THROW(short_conv_silu_varlen(x.get(), cu.get(), 1, 32, w.get(), 9, hist.get(), out.get(), nullptr), Error);
  EXPECT_THROW(short_conv_silu_varlen(x.get(), cu.get(), 1, 32, w.get(), 0, hist.get(), out.get(), nullptr), Error);
  EXPECT_THROW(short_conv_silu_varlen(x.get(), cu.get(), 1, 32, w.get(), 4, nullptr, out.get(), nullptr), Error);
  EXPECT_THROW(short_conv_silu_varlen(x.get(), cu.get(), 1, 32, w.get(), 4, hist.get(), x.get(), nullptr), Error);
  EXPECT_THROW(kda_gated_rmsnorm_bf16(o.get(), o.get(), w.get(), 2, 1, 0, 1e-5f, nullptr, nullptr), Error);
}

}  // namespace
}  // namespace kestrel::cuda
