// GPU MoE routing and routed experts against the CPU reference: cpu::moe_route, and MoE::forward's expert math
// (cpu::linear, cpu::swiglu) on the same bf16 / MXFP4 values, and cpu::expert_ffn_fp8_block's rule for FP8
// block-scaled experts (stage by stage, with a bound on every element), on fresh random inputs.
#include "kernels/cuda/moe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "fp8_block_check.h"
#include "kernels/cpu/basic.h"
#include "kernels/cpu/fp8_linear.h"
#include "kernels/cpu/moe.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {
namespace {

// All bits set: a NaN in every float and id -1 in every int32, so an output the kernels fail to write shows up.
template <typename T>
void poison(DeviceBuffer<T>& d) {
  if (d.size() > 0) KESTREL_CUDA_CHECK(cudaMemset(d.get(), 0xff, d.bytes()));
}

// ‖a − b‖ / ‖b‖ in double; NaN in a makes every comparison with a bound fail.
double rel_err(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  // An all-zero reference (a token of zero activations) is matched only by zeros.
  if (den == 0.0) return num == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

// ---------------------------------------------------------------- routing

struct RouteCase {
  const char* name;
  int E, top_k, n_group, topk_group;
  bool renormalize;
  float scaling;
  bool bias;
  int64_t T;
  bool ties;  // logits and bias drawn from a few values, so that scores and group scores tie exactly
};

// The GPU evaluates the CPU's sigmoid formula with exp correctly rounded; the host's expf is correctly rounded
// except in rare cases (glibc: < 0.502 ulp), where a score may differ by one ulp. Ids are expected bit-identical
// (a one-ulp difference would have to meet a near-tie within one ulp to move an id, and exact ties are computed
// identically); weights are a few roundings from the scores, so 1e-6 relative covers a one-ulp score difference.
constexpr double kWeightBound = 1e-6;

void check_route(const RouteCase& c, uint32_t seed) {
  SCOPED_TRACE(c.name);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float tie_logits[] = {-2.0f, -1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 2.0f};
  const float tie_bias[] = {-0.125f, 0.0f, 0.125f};
  std::uniform_int_distribution<int> pick_logit(0, 6), pick_bias(0, 2);
  std::vector<float> logits(static_cast<size_t>(c.T) * c.E), bias(c.E);
  for (float& v : logits) v = c.ties ? tie_logits[pick_logit(rng)] : 2.0f * normal(rng);
  for (float& v : bias) v = c.ties ? tie_bias[pick_bias(rng)] : 0.1f * normal(rng);

  const MoeRoutingParams p{c.E, c.top_k, c.n_group, c.topk_group, c.renormalize, c.scaling};
  DeviceBuffer<float> d_logits = to_device(logits), d_bias = to_device(bias);
  DeviceBuffer<int32_t> d_ids(static_cast<size_t>(c.T) * c.top_k);
  DeviceBuffer<float> d_weights(d_ids.size());
  poison(d_ids);
  poison(d_weights);
  moe_route(d_logits.get(), c.bias ? d_bias.get() : nullptr, c.T, p, d_ids.get(), d_weights.get(), nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<int32_t> ids = to_host(d_ids);
  const std::vector<float> weights = to_host(d_weights);

  const cpu::MoeRouting r{c.E, c.top_k, c.n_group, c.topk_group, c.renormalize, c.scaling};
  std::vector<int32_t> want_ids(c.top_k);
  std::vector<float> want_weights(c.top_k);
  int id_mismatches = 0, weight_mismatches = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    cpu::moe_route(logits.data() + t * c.E, c.bias ? bias.data() : nullptr, r, want_ids.data(),
                   want_weights.data());
    for (int s = 0; s < c.top_k; ++s) {
      const size_t i = static_cast<size_t>(t) * c.top_k + s;
      id_mismatches += ids[i] != want_ids[s];
      weight_mismatches += !(std::fabs(weights[i] - want_weights[s]) <= kWeightBound * std::fabs(want_weights[s]));
      if (ids[i] != want_ids[s] && id_mismatches == 1)
        ADD_FAILURE() << "first id mismatch: token " << t << " slot " << s << ": " << ids[i] << " vs "
                      << want_ids[s];
    }
  }
  EXPECT_EQ(id_mismatches, 0);
  EXPECT_EQ(weight_mismatches, 0);
}

TEST(MoeRoute, MatchesCpu) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const RouteCase cases[] = {
      {"deepseek_v3", 256, 8, 8, 4, true, 2.5f, true, 300, false},
      {"deepseek_v3_ties", 256, 8, 8, 4, true, 2.5f, true, 300, true},
      {"kimi_k2", 384, 8, 1, 1, true, 2.827f, true, 64, false},
      {"kimi_896_k16", 896, 16, 1, 1, true, 2.5f, true, 64, false},
      {"kimi_896_k16_ties", 896, 16, 1, 1, true, 2.5f, true, 64, true},
      {"max_experts_no_bias_no_renorm", 1024, 8, 1, 1, false, 1.0f, false, 37, false},
      {"small_no_renorm_T1", 8, 2, 1, 1, false, 1.0f, false, 1, false},
      {"odd_groups_ties", 72, 6, 4, 2, true, 1.5f, true, 100, true},
      {"singleton_groups", 64, 4, 64, 8, true, 1.0f, true, 50, false},
      {"singleton_groups_ties", 64, 4, 64, 8, true, 1.0f, true, 50, true},
      {"every_expert", 16, 16, 1, 1, true, 1.0f, true, 5, true},
      {"all_groups_kept", 32, 3, 4, 4, false, 0.5f, true, 40, true},
  };
  uint32_t seed = 11;
  for (const RouteCase& c : cases) check_route(c, seed++);
}

TEST(MoeRoute, RejectsBadParameters) {
  const float* logits = reinterpret_cast<const float*>(16);
  int32_t* ids = reinterpret_cast<int32_t*>(16);
  float* weights = reinterpret_cast<float*>(16);
  auto route = [&](MoeRoutingParams p) { moe_route(logits, nullptr, 4, p, ids, weights, nullptr); };
  EXPECT_THROW(route({1025, 8, 1, 1, true, 1.0f}), Error);     // more experts than threads in a block
  EXPECT_THROW(route({256, 0, 1, 1, true, 1.0f}), Error);      // no expert per token
  EXPECT_THROW(route({16, 17, 1, 1, true, 1.0f}), Error);      // more slots than experts
  EXPECT_THROW(route({256, 8, 3, 1, true, 1.0f}), Error);      // groups do not divide the experts
  EXPECT_THROW(route({256, 8, 8, 9, true, 1.0f}), Error);      // more kept groups than groups
  EXPECT_THROW(route({256, 40, 8, 1, true, 1.0f}), Error);     // one group of 32 leaves fewer than 40 candidates
  EXPECT_THROW(route({256, 8, 8, 4, true, NAN}), Error);       // non-finite scaling
}

// ---------------------------------------------------------------- experts

// One layer's experts: the values the GPU multiplies (exact in bf16, both dtypes), and their device copies.
struct Experts {
  ExpertDtype dtype;
  int E;
  int64_t D, F;
  std::vector<float> w13, w2;  // [E, 2F, D], [E, D, F]
  DeviceBuffer<uint16_t> d_w13, d_w2;
  DeviceBuffer<uint8_t> d_w13_packed, d_w13_scales, d_w2_packed, d_w2_scales;

  MoeExpertWeights view() const {
    return MoeExpertWeights{dtype,       E, D, F, d_w13.get(), d_w2.get(), d_w13_packed.get(), d_w13_scales.get(),
                            d_w2_packed.get(), d_w2_scales.get()};
  }
};

// bf16: normal values scaled by 1/sqrt(fan-in), rounded to bf16. MXFP4: every e2m1 code uniformly, block exponents
// 2^-8 .. 2^-4 (about the same magnitude), and one block in 64 with exponent code 0 (2^-127, the subnormal scale).
void fill_weights(ExpertDtype dtype, int64_t rows, int64_t cols, std::mt19937& rng, std::vector<float>& values,
                  DeviceBuffer<uint16_t>& bf16, DeviceBuffer<uint8_t>& packed, DeviceBuffer<uint8_t>& scales) {
  const size_t n = static_cast<size_t>(rows * cols);
  values.resize(n);
  if (dtype == ExpertDtype::bf16) {
    std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(cols)));
    std::vector<uint16_t> bits(n);
    for (size_t i = 0; i < n; ++i) {
      bits[i] = f32_to_bf16(normal(rng));
      values[i] = bf16_to_f32(bits[i]);
    }
    bf16 = to_device(bits);
    return;
  }
  std::uniform_int_distribution<int> byte(0, 255), exponent(127 - 8, 127 - 4), rare(0, 63);
  std::vector<uint8_t> p(n / 2), s(n / 32);
  for (uint8_t& b : p) b = static_cast<uint8_t>(byte(rng));
  for (uint8_t& e : s) e = rare(rng) == 0 ? 0 : static_cast<uint8_t>(exponent(rng));
  mxfp4_decode(p.data(), s.data(), static_cast<int64_t>(n), values.data());
  packed = to_device(p);
  scales = to_device(s);
}

Experts make_experts(ExpertDtype dtype, int E, int64_t D, int64_t F, uint32_t seed) {
  Experts w{dtype, E, D, F, {}, {}, {}, {}, {}, {}, {}, {}};
  std::mt19937 rng(seed);
  fill_weights(dtype, E * 2 * F, D, rng, w.w13, w.d_w13, w.d_w13_packed, w.d_w13_scales);
  fill_weights(dtype, E * D, F, rng, w.w2, w.d_w2, w.d_w2_packed, w.d_w2_scales);
  return w;
}

// MoE::forward's expert part on the CPU: per (token, slot) pair gate/up = cpu::linear on the bf16 values,
// cpu::swiglu rounded to bf16 (as the GPU stores it), down = cpu::linear, then the weighted slots summed in rank order.
std::vector<float> reference(const Experts& w, const std::vector<uint16_t>& x, int64_t T,
                             const std::vector<int32_t>& ids, const std::vector<float>& weights, int top_k) {
  const int64_t D = w.D, F = w.F;
  std::vector<float> y(static_cast<size_t>(T * D), 0.0f), xin(D), gate_up(2 * F), h(F), out(D);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < D; ++i) xin[i] = bf16_to_f32(x[t * D + i]);
    for (int s = 0; s < top_k; ++s) {
      const int e = ids[t * top_k + s];
      if (e < 0 || e >= w.E) continue;
      cpu::linear(xin.data(), w.w13.data() + static_cast<size_t>(e) * 2 * F * D, gate_up.data(), 1, D, 2 * F);
      cpu::swiglu(gate_up.data(), gate_up.data() + F, h.data(), F);
      for (float& v : h) v = round_to_bf16(v);
      cpu::linear(h.data(), w.w2.data() + static_cast<size_t>(e) * D * F, out.data(), 1, F, D);
      const float wgt = weights[t * top_k + s];
      for (int64_t i = 0; i < D; ++i) y[t * D + i] += wgt * out[i];
    }
  }
  return y;
}

// Both sides multiply the same bf16-exact values (products exact in fp32) and differ only in the fp32 summation
// order of the two GEMMs (relative ~1e-6) and in expf's last bit inside silu. Such a difference moves the bf16
// rounding of an h element to its other neighbour when the fp32 value lies that close to a rounding midpoint: one
// bf16 ulp, at most 2^-7 of the element. If every element of h moved, a token's output would move by about 2^-7
// relative (the down weights are random, so ‖W2 Δh‖ / ‖W2 h‖ ≈ ‖Δh‖ / ‖h‖): kTokenBound = 1e-2 covers that worst
// case with a margin. Moves are rare (a ~1e-6 relative difference against a 2^-8 spacing), so over a whole batch the
// error is far smaller: a CPU simulation of a different summation order gave 2e-5 over 20,000 pairs (worst single
// pair 1.6e-3), hence kBatchBound = 2e-3.
constexpr double kTokenBound = 1e-2;
constexpr double kBatchBound = 2e-3;

struct ExpertCase {
  const char* name;
  int64_t T;
  int top_k, E;
  int64_t D, F;
  int used;       // ids drawn from experts [0, used): the others get no tokens
  bool skew;      // slot 0 of every token is expert used - 1, so that expert has T rows (several row tiles)
  bool masked;    // about one slot in eight is -1 (contributes nothing)
};

// Per token top_k distinct experts from [0, used) in random order, and weights in (0.05, 1).
void make_routing(const ExpertCase& c, std::mt19937& rng, std::vector<int32_t>& ids, std::vector<float>& weights) {
  std::uniform_real_distribution<float> uniform(0.05f, 1.0f);
  std::uniform_int_distribution<int> eighth(0, 7);
  ids.resize(static_cast<size_t>(c.T) * c.top_k);
  weights.resize(ids.size());
  std::vector<int32_t> pool(c.used);
  for (int64_t t = 0; t < c.T; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    int first = 0;
    if (c.skew) {
      std::swap(pool[0], pool[c.used - 1]);
      first = 1;
    }
    for (int s = first; s < c.top_k; ++s) {
      std::uniform_int_distribution<int> pick(s, c.used - 1);
      std::swap(pool[s], pool[pick(rng)]);
    }
    for (int s = 0; s < c.top_k; ++s) {
      const size_t i = static_cast<size_t>(t) * c.top_k + s;
      ids[i] = c.masked && eighth(rng) == 0 ? -1 : pool[s];
      weights[i] = uniform(rng);
    }
  }
}

std::vector<uint16_t> random_activations(int64_t T, int64_t D, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(T * D));
  for (uint16_t& v : x) v = f32_to_bf16(normal(rng));
  return x;
}

// Runs moe_experts with a poisoned workspace and output and returns y.
std::vector<float> run_experts(const Experts& w, const DeviceBuffer<uint16_t>& x, int64_t T,
                               const DeviceBuffer<int32_t>& ids, const DeviceBuffer<float>& weights, int top_k) {
  DeviceBuffer<uint8_t> ws(moe_workspace_bytes(T, top_k, w.E, w.D, w.F));
  DeviceBuffer<float> y(static_cast<size_t>(T * w.D));
  poison(ws);
  poison(y);
  moe_experts(x.get(), T, ids.get(), weights.get(), top_k, w.view(), y.get(), ws.get(), ws.size(), nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  return to_host(y);
}

void check_experts(const ExpertCase& c, ExpertDtype dtype, uint32_t seed) {
  SCOPED_TRACE(std::string(c.name) + (dtype == ExpertDtype::bf16 ? " bf16" : " mxfp4"));
  const Experts w = make_experts(dtype, c.E, c.D, c.F, seed);
  std::mt19937 rng(seed + 1000);
  std::vector<int32_t> ids;
  std::vector<float> weights;
  make_routing(c, rng, ids, weights);
  const std::vector<uint16_t> x = random_activations(c.T, c.D, rng);
  const DeviceBuffer<uint16_t> d_x = to_device(x);
  const DeviceBuffer<int32_t> d_ids = to_device(ids);
  const DeviceBuffer<float> d_weights = to_device(weights);

  const std::vector<float> y = run_experts(w, d_x, c.T, d_ids, d_weights, c.top_k);
  const std::vector<float> want = reference(w, x, c.T, ids, weights, c.top_k);
  double worst = 0.0;
  for (int64_t t = 0; t < c.T; ++t) {
    // A token whose slots are all masked has y = 0 exactly on both sides.
    bool any = false;
    for (int s = 0; s < c.top_k; ++s) any |= ids[t * c.top_k + s] >= 0;
    if (!any) {
      for (int64_t i = 0; i < c.D; ++i) ASSERT_EQ(y[t * c.D + i], 0.0f) << "token " << t;
      continue;
    }
    const double err = rel_err(y.data() + t * c.D, want.data() + t * c.D, c.D);
    worst = std::max(worst, err);
    ASSERT_LE(err, kTokenBound) << "token " << t;
  }
  const double batch = rel_err(y.data(), want.data(), y.size());
  EXPECT_LE(batch, kBatchBound);
  std::printf("  %-22s %-5s batch %.2e, worst token %.2e\n", c.name, dtype == ExpertDtype::bf16 ? "bf16" : "mxfp4",
              batch, worst);

  // Deterministic: a second run (fresh poisoned workspace) gives the same bits.
  const std::vector<float> again = run_experts(w, d_x, c.T, d_ids, d_weights, c.top_k);
  EXPECT_EQ(std::memcmp(y.data(), again.data(), y.size() * sizeof(float)), 0);
}

const ExpertCase kExpertCases[] = {
    {"T1_k2", 1, 2, 16, 256, 128, 16, false, false},
    {"T5_k8_some_empty", 5, 8, 16, 256, 128, 12, false, false},
    {"T20_odd_tiles", 20, 2, 8, 160, 96, 8, false, false},  // D % 64 = 32, K tails of 32 and 96
    {"T40_k8_some_empty", 40, 8, 32, 256, 128, 24, false, false},
    {"T64_k8_wide", 64, 8, 16, 1024, 256, 16, false, false},
    {"T300_k2", 300, 2, 8, 256, 128, 8, false, false},
    {"T300_k8_skew_masked", 300, 8, 64, 256, 128, 48, true, true},
};

TEST(MoeExperts, Bf16MatchesCpu) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 100;
  for (const ExpertCase& c : kExpertCases) check_experts(c, ExpertDtype::bf16, seed++);
}

TEST(MoeExperts, Mxfp4MatchesCpu) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  uint32_t seed = 200;
  for (const ExpertCase& c : kExpertCases) check_experts(c, ExpertDtype::mxfp4, seed++);
}

// Routing and experts captured once in a CUDA graph and replayed on new logits give the same bits as direct calls:
// nothing the host decided at capture time depends on the routing.
TEST(MoeExperts, GraphReplayEqualsDirectCalls) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  constexpr int64_t T = 37, D = 256, F = 128;
  const MoeRoutingParams p{64, 8, 8, 4, true, 2.5f};
  const Experts w = make_experts(ExpertDtype::mxfp4, p.n_experts, D, F, 7);
  std::mt19937 rng(8);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random_logits = [&] {
    std::vector<float> v(static_cast<size_t>(T) * p.n_experts);
    for (float& e : v) e = 2.0f * normal(rng);
    return v;
  };
  DeviceBuffer<uint16_t> x = to_device(random_activations(T, D, rng));
  DeviceBuffer<float> logits(static_cast<size_t>(T) * p.n_experts), bias = to_device(std::vector<float>(64, 0.01f));
  DeviceBuffer<int32_t> ids(static_cast<size_t>(T) * p.top_k);
  DeviceBuffer<float> weights(ids.size()), y(static_cast<size_t>(T * D));
  DeviceBuffer<uint8_t> ws(moe_workspace_bytes(T, p.top_k, p.n_experts, D, F));

  cudaStream_t stream;
  KESTREL_CUDA_CHECK(cudaStreamCreate(&stream));
  auto step = [&] {
    moe_route(logits.get(), bias.get(), T, p, ids.get(), weights.get(), stream);
    moe_experts(x.get(), T, ids.get(), weights.get(), p.top_k, w.view(), y.get(), ws.get(), ws.size(), stream);
  };
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  step();
  KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (int round = 0; round < 3; ++round) {
    logits.upload(random_logits().data());
    poison(y);
    poison(ws);
    step();
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> direct = to_host(y);
    poison(y);
    poison(ws);
    KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> replayed = to_host(y);
    EXPECT_TRUE(std::all_of(direct.begin(), direct.end(), [](float v) { return std::isfinite(v); }));
    EXPECT_EQ(std::memcmp(direct.data(), replayed.data(), direct.size() * sizeof(float)), 0) << "round " << round;
  }
  KESTREL_CUDA_CHECK(cudaGraphExecDestroy(exec));
  KESTREL_CUDA_CHECK(cudaGraphDestroy(graph));
  KESTREL_CUDA_CHECK(cudaStreamDestroy(stream));
}

// ---------------------------------------------------------------- FP8 block-scaled experts

// One layer's FP8 experts: random codes (no NaN) and block scales, host copies for the CPU, device copies for the GPU.
struct Fp8Experts {
  int E;
  int64_t D, F;
  std::vector<uint8_t> w13, w2;  // [E, 2F, D], [E, D, F]
  std::vector<float> s13, s2;    // [E, 2F/128, D/128], [E, D/128, F/128]
  DeviceBuffer<uint8_t> d_w13, d_w2;
  DeviceBuffer<float> d_s13, d_s2;

  Fp8Experts(int e, int64_t d, int64_t f, uint64_t seed) : E(e), D(d), F(f) {
    w13.resize(static_cast<size_t>(E * 2 * F * D));
    w2.resize(static_cast<size_t>(E * D * F));
    fp8_check::random_codes(w13.data(), static_cast<int64_t>(w13.size()), seed);
    fp8_check::random_codes(w2.data(), static_cast<int64_t>(w2.size()), seed + 1);
    // e4m3 codes reach 448: scales near 2^-11 keep gate/up and down outputs O(1) for activations O(1).
    s13 = fp8_check::random_scales(E * (2 * F / 128) * (D / 128), seed + 2, -13, -10);
    s2 = fp8_check::random_scales(E * (D / 128) * (F / 128), seed + 3, -13, -10);
    d_w13 = to_device(w13);
    d_w2 = to_device(w2);
    d_s13 = to_device(s13);
    d_s2 = to_device(s2);
  }
  const uint8_t* w13_of(int e) const { return w13.data() + static_cast<size_t>(e) * 2 * F * D; }
  const float* s13_of(int e) const { return s13.data() + static_cast<size_t>(e) * (2 * F / 128) * (D / 128); }
  const uint8_t* w2_of(int e) const { return w2.data() + static_cast<size_t>(e) * D * F; }
  const float* s2_of(int e) const { return s2.data() + static_cast<size_t>(e) * (D / 128) * (F / 128); }
  MoeExpertWeights view() const {
    MoeExpertWeights w;
    w.dtype = ExpertDtype::fp8_block;
    w.n_experts = E;
    w.D = D;
    w.F = F;
    w.fp8_w13 = d_w13.get();
    w.fp8_w13_scales = d_s13.get();
    w.fp8_w2 = d_w2.get();
    w.fp8_w2_scales = d_s2.get();
    return w;
  }
};

template <typename T>
std::vector<T> download(const T* d, size_t n) {
  std::vector<T> h(n);
  if (n > 0) KESTREL_CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

std::vector<float> run_fp8_experts(const Fp8Experts& w, const DeviceBuffer<float>& x, int64_t T,
                                   const DeviceBuffer<int32_t>& ids, const DeviceBuffer<float>& weights, int top_k,
                                   DeviceBuffer<uint8_t>& ws) {
  DeviceBuffer<float> y(static_cast<size_t>(T * w.D));
  poison(ws);
  poison(y);
  moe_experts(x.get(), T, ids.get(), weights.get(), top_k, w.view(), y.get(), ws.get(), ws.size(), nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  return to_host(y);
}

// Checks one call stage by stage against the CPU, every element against its bound:
//  1. the sort: the valid pairs grouped by expert, in pair order within an expert;
//  2. gate/up and swiglu: the GPU's fp32 swiglu rows against swiglu of cpu::linear_fp8_block's gate and up, within
//     the product bound propagated through silu (|silu'| < 1.1) and the product with up, plus 2^-20 relative for the
//     two sides' different exp;
//  3. the GPU's quantized swiglu rows: bit for bit cpu::quantize_fp8_groups of the GPU's fp32 rows;
//  4. down and combine: y against the CPU's down product of the GPU's quantized rows, combined in rank order, within
//     the weighted sum of the product bounds plus the combine's roundings;
// and end to end against the CPU alone (cpu::expert_ffn_fp8_block's rule on the CPU's own swiglu rows) per token:
// there the two sides' swiglu rows may quantize to neighbouring codes where a value lies within their difference of a
// rounding midpoint (rare: a ~1e-6 relative difference against the 2^-4 spacing of e4m3), so the bound is relative
// per token, as for bf16 experts.
void check_fp8_experts(const ExpertCase& c, const Fp8Experts& w, uint64_t seed) {
  SCOPED_TRACE(std::string(c.name) + " fp8_block");
  const int64_t T = c.T, D = c.D, F = c.F, P = T * c.top_k;
  const int E = c.E, top_k = c.top_k;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<int32_t> ids;
  std::vector<float> weights;
  make_routing(c, rng, ids, weights);
  const std::vector<float> x = fp8_check::random_activations(T, D, D, seed + 5);
  const DeviceBuffer<float> d_x = to_device(x);
  const DeviceBuffer<int32_t> d_ids = to_device(ids);
  const DeviceBuffer<float> d_weights = to_device(weights);
  DeviceBuffer<uint8_t> ws(moe_workspace_bytes(T, top_k, E, D, F, ExpertDtype::fp8_block));
  const std::vector<float> y = run_fp8_experts(w, d_x, T, d_ids, d_weights, top_k, ws);

  const detail::MoeFp8Intermediates im = detail::moe_fp8_intermediates(ws.get(), T, top_k, E, D, F);
  const std::vector<int32_t> offset = download(im.expert_offset, E + 1);
  const std::vector<int32_t> sorted = download(im.sorted_pair, P);
  const int64_t rows = offset[E];

  // 1. The sort.
  std::vector<int32_t> want_sorted;
  std::vector<int32_t> want_offset(E + 1, 0);
  for (int e = 0; e < E; ++e) {
    want_offset[e] = static_cast<int32_t>(want_sorted.size());
    for (int64_t p = 0; p < P; ++p)
      if (ids[p] == e) want_sorted.push_back(static_cast<int32_t>(p));
  }
  want_offset[E] = static_cast<int32_t>(want_sorted.size());
  ASSERT_EQ(offset, want_offset);
  ASSERT_TRUE(std::equal(want_sorted.begin(), want_sorted.end(), sorted.begin()));

  const std::vector<float> h_gpu = download(im.h_f32, static_cast<size_t>(rows * F));
  const std::vector<uint8_t> hc_gpu = download(im.h_codes, static_cast<size_t>(rows * F));
  const std::vector<float> hs_gpu = download(im.h_scales, static_cast<size_t>(rows * (F / 128)));

  std::vector<float> out_ref(static_cast<size_t>(P * D), 0.0f), out_bound(out_ref.size(), 0.0f);
  std::vector<float> out_cpu(out_ref.size(), 0.0f);  // the CPU alone
  double worst_h = 0.0, worst_out = 0.0;
  int64_t code_differences = 0;
  for (int e = 0; e < E; ++e) {
    const int64_t r0 = offset[e], n = offset[e + 1] - offset[e];
    if (n == 0) continue;
    // 2. gate/up and swiglu for the expert's rows (in sorted order).
    std::vector<float> xe(static_cast<size_t>(n * D));
    for (int64_t j = 0; j < n; ++j)
      std::copy_n(x.data() + (sorted[r0 + j] / top_k) * D, D, xe.data() + j * D);
    std::vector<uint8_t> xc(static_cast<size_t>(n * D));
    std::vector<float> xs(static_cast<size_t>(n * (D / 128))), gu(static_cast<size_t>(n * 2 * F));
    cpu::quantize_fp8_groups(xe.data(), n, D, D, xc.data(), xs.data());
    cpu::linear_fp8_block_quantized(xc.data(), xs.data(), n, D, w.w13_of(e), w.s13_of(e), 2 * F, gu.data());
    const std::vector<double> a_gu = fp8_check::magnitude_bound(xc.data(), xs.data(), n, D, w.w13_of(e), w.s13_of(e),
                                                                2 * F);
    std::vector<float> h_cpu(static_cast<size_t>(n * F)), h_bound(h_cpu.size());
    for (int64_t j = 0; j < n; ++j) {
      const float* row = gu.data() + j * 2 * F;
      cpu::swiglu(row, row + F, h_cpu.data() + j * F, F);
      for (int64_t f = 0; f < F; ++f) {
        const double bg = fp8_check::linear_bound(a_gu[j * 2 * F + f], D, fp8_check::kMmaC);
        const double bu = fp8_check::linear_bound(a_gu[j * 2 * F + F + f], D, fp8_check::kMmaC);
        const double b = 1.1 * bg * (std::fabs(row[F + f]) + bu) + std::fabs(cpu::silu(row[f])) * bu;
        h_bound[j * F + f] = static_cast<float>(b + 0x1p-20 * (std::fabs(h_cpu[j * F + f]) + b));
      }
    }
    worst_h = std::max(worst_h, fp8_check::expect_within("swiglu rows", h_gpu.data() + r0 * F, F, h_cpu.data(), n, F,
                                                         [&](int64_t j, int64_t f) { return h_bound[j * F + f]; }));

    // 3. The quantizer on the GPU's swiglu rows.
    std::vector<uint8_t> hc(static_cast<size_t>(n * F));
    std::vector<float> hs(static_cast<size_t>(n * (F / 128)));
    cpu::quantize_fp8_groups(h_gpu.data() + r0 * F, n, F, F, hc.data(), hs.data());
    EXPECT_TRUE(std::equal(hc.begin(), hc.end(), hc_gpu.begin() + r0 * F)) << "expert " << e << ": h codes";
    for (size_t i = 0; i < hs.size(); ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(hs[i]), std::bit_cast<uint32_t>(hs_gpu[r0 * (F / 128) + i]))
          << "expert " << e << ": h scale " << i;

    // 4. down on the GPU's quantized rows.
    std::vector<float> out(static_cast<size_t>(n * D));
    cpu::linear_fp8_block_quantized(hc.data(), hs.data(), n, F, w.w2_of(e), w.s2_of(e), D, out.data());
    const std::vector<double> a_out = fp8_check::magnitude_bound(hc.data(), hs.data(), n, F, w.w2_of(e), w.s2_of(e), D);
    // The CPU alone: its own swiglu rows quantized, then down.
    std::vector<uint8_t> hc_cpu(static_cast<size_t>(n * F));
    std::vector<float> hs_cpu(static_cast<size_t>(n * (F / 128))), out_alone(static_cast<size_t>(n * D));
    cpu::quantize_fp8_groups(h_cpu.data(), n, F, F, hc_cpu.data(), hs_cpu.data());
    cpu::linear_fp8_block_quantized(hc_cpu.data(), hs_cpu.data(), n, F, w.w2_of(e), w.s2_of(e), D, out_alone.data());
    for (int64_t i = 0; i < n * F; ++i) code_differences += hc_cpu[i] != hc[i];
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pair = sorted[r0 + j];
      std::copy_n(out.data() + j * D, D, out_ref.data() + pair * D);
      std::copy_n(out_alone.data() + j * D, D, out_cpu.data() + pair * D);
      for (int64_t d = 0; d < D; ++d)
        out_bound[pair * D + d] = static_cast<float>(fp8_check::linear_bound(a_out[j * D + d], F, fp8_check::kMmaC));
    }
  }

  // 4 (cont.). The combine, in rank order, and y's bound: each slot's product bound times its weight, plus a rounding
  // of each product and sum (2^-23 of the sum of |w o|).
  std::vector<float> y_ref(static_cast<size_t>(T * D), 0.0f), y_alone(y_ref.size(), 0.0f);
  std::vector<double> y_bound(y_ref.size(), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int s = 0; s < top_k; ++s) {
      const int64_t pair = t * top_k + s;
      if (ids[pair] < 0 || ids[pair] >= E) continue;
      const float wgt = weights[pair];
      for (int64_t d = 0; d < D; ++d) {
        y_ref[t * D + d] += wgt * out_ref[pair * D + d];
        y_alone[t * D + d] += wgt * out_cpu[pair * D + d];
        y_bound[t * D + d] += std::fabs(wgt) * (out_bound[pair * D + d] + 0x1p-23 * std::fabs(out_ref[pair * D + d])) +
                              0x1p-23 * std::fabs(y_ref[t * D + d]);
      }
    }
  worst_out = fp8_check::expect_within("y", y.data(), D, y_ref.data(), T, D,
                                       [&](int64_t t, int64_t d) { return y_bound[t * D + d]; });

  // End to end against the CPU alone, per token (tokens with every slot masked are 0 on both sides).
  double worst_token = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    bool any = false;
    for (int s = 0; s < top_k; ++s) any |= ids[t * top_k + s] >= 0;
    if (!any) {
      for (int64_t d = 0; d < D; ++d) ASSERT_EQ(y[t * D + d], 0.0f) << "token " << t;
      continue;
    }
    const double err = rel_err(y.data() + t * D, y_alone.data() + t * D, D);
    worst_token = std::max(worst_token, err);
    EXPECT_LE(err, kTokenBound) << "token " << t;
  }
  const double batch = rel_err(y.data(), y_alone.data(), y.size());
  EXPECT_LE(batch, kBatchBound);
  std::printf("  %-24s fp8   bound used: swiglu %.3f, y %.3f; against the CPU alone: batch %.2e, worst token %.2e, "
              "%lld of %lld swiglu codes differ\n",
              c.name, worst_h, worst_out, batch, worst_token, static_cast<long long>(code_differences),
              static_cast<long long>(rows * F));

  // Deterministic: a second run (freshly poisoned workspace) gives the same bits.
  const std::vector<float> again = run_fp8_experts(w, d_x, T, d_ids, d_weights, top_k, ws);
  EXPECT_EQ(std::memcmp(y.data(), again.data(), y.size() * sizeof(float)), 0);
}

TEST(MoeExperts, Fp8MatchesCpu) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const ExpertCase cases[] = {
      {"T1_k2", 1, 2, 16, 256, 128, 16, false, false},
      {"T5_k8_some_empty", 5, 8, 16, 256, 128, 12, false, false},
      {"T20_k2", 20, 2, 8, 384, 256, 8, false, false},
      {"T40_k8_some_empty", 40, 8, 32, 256, 128, 24, false, false},
      {"T64_k8_wide", 64, 8, 16, 1024, 256, 16, false, false},
      {"T100_k6_skew_F384", 100, 6, 16, 512, 384, 16, true, false},
      {"T300_k8_skew_masked", 300, 8, 64, 256, 128, 48, true, true},
  };
  uint64_t seed = 300;
  for (const ExpertCase& c : cases) {
    const Fp8Experts w(c.E, c.D, c.F, seed);
    check_fp8_experts(c, w, seed + 1);
    seed += 10;
  }
}

// DeepSeek-V3.2's routed experts: D = 7168, F = 2048, 256 experts, top-8 (11.3 GB of FP8 weights, made once).
TEST(MoeExperts, Fp8DeepSeekShapesMatchCpu) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Fp8Experts w(256, 7168, 2048, 9000);
  const ExpertCase cases[] = {
      {"deepseek_T1", 1, 8, 256, 7168, 2048, 256, false, false},
      {"deepseek_T8", 8, 8, 256, 7168, 2048, 256, false, false},
      {"deepseek_T64", 64, 8, 256, 7168, 2048, 256, false, false},
      {"deepseek_T300_skew_masked", 300, 8, 256, 7168, 2048, 256, true, true},
  };
  uint64_t seed = 9100;
  for (const ExpertCase& c : cases) check_fp8_experts(c, w, seed += 10);
}

// Routing and FP8 experts captured once in a CUDA graph and replayed on new logits give the bits of direct calls.
TEST(MoeExperts, Fp8GraphReplayEqualsDirectCalls) {
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device";
  constexpr int64_t T = 37, D = 256, F = 256;
  const MoeRoutingParams p{64, 8, 8, 4, true, 2.5f};
  const Fp8Experts w(p.n_experts, D, F, 17);
  std::mt19937 rng(18);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  DeviceBuffer<float> x = to_device(fp8_check::random_activations(T, D, D, 19));
  DeviceBuffer<float> logits(static_cast<size_t>(T) * p.n_experts), bias = to_device(std::vector<float>(64, 0.01f));
  DeviceBuffer<int32_t> ids(static_cast<size_t>(T) * p.top_k);
  DeviceBuffer<float> weights(ids.size()), y(static_cast<size_t>(T * D));
  DeviceBuffer<uint8_t> ws(moe_workspace_bytes(T, p.top_k, p.n_experts, D, F, ExpertDtype::fp8_block));

  cudaStream_t stream;
  KESTREL_CUDA_CHECK(cudaStreamCreate(&stream));
  auto step = [&] {
    moe_route(logits.get(), bias.get(), T, p, ids.get(), weights.get(), stream);
    moe_experts(x.get(), T, ids.get(), weights.get(), p.top_k, w.view(), y.get(), ws.get(), ws.size(), stream);
  };
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  step();
  KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 3; ++round) {
    std::vector<float> l(static_cast<size_t>(T) * p.n_experts);
    for (float& v : l) v = 2.0f * normal(rng);
    logits.upload(l.data());
    poison(y);
    poison(ws);
    step();
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> direct = to_host(y);
    poison(y);
    poison(ws);
    KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> replayed = to_host(y);
    EXPECT_TRUE(std::all_of(direct.begin(), direct.end(), [](float v) { return std::isfinite(v); }));
    EXPECT_EQ(std::memcmp(direct.data(), replayed.data(), direct.size() * sizeof(float)), 0) << "round " << round;
  }
  KESTREL_CUDA_CHECK(cudaGraphExecDestroy(exec));
  KESTREL_CUDA_CHECK(cudaGraphDestroy(graph));
  KESTREL_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(MoeExperts, RejectsBadArguments) {
  const auto* x = reinterpret_cast<const uint16_t*>(256);
  const auto* ids = reinterpret_cast<const int32_t*>(256);
  const auto* weights = reinterpret_cast<const float*>(256);
  auto* y = reinterpret_cast<float*>(256);
  auto* ws = reinterpret_cast<void*>(256);
  MoeExpertWeights w{ExpertDtype::bf16, 8, 256, 128, x, x, nullptr, nullptr, nullptr, nullptr};
  const size_t need = moe_workspace_bytes(4, 2, 8, 256, 128);
  EXPECT_THROW(moe_workspace_bytes(4, 2, 8, 250, 128), Error);  // D not a multiple of 32
  EXPECT_THROW(moe_workspace_bytes(4, 0, 8, 256, 128), Error);  // no slots
  EXPECT_THROW(moe_experts(x, 4, ids, weights, 2, w, y, ws, need - 1, nullptr), Error);  // workspace too small
  EXPECT_THROW(moe_experts(x + 1, 4, ids, weights, 2, w, y, ws, need, nullptr), Error);  // misaligned x
  MoeExpertWeights no_down = w;
  no_down.w2 = nullptr;
  EXPECT_THROW(moe_experts(x, 4, ids, weights, 2, no_down, y, ws, need, nullptr), Error);
  MoeExpertWeights mx = w;
  mx.dtype = ExpertDtype::mxfp4;  // the MXFP4 arrays are missing
  EXPECT_THROW(moe_experts(x, 4, ids, weights, 2, mx, y, ws, need, nullptr), Error);
  EXPECT_NO_THROW(moe_experts(x, 0, ids, weights, 2, w, y, ws, 0, nullptr));  // T = 0: nothing to do

  const auto* xf = reinterpret_cast<const float*>(256);
  const auto* codes = reinterpret_cast<const uint8_t*>(256);
  MoeExpertWeights f8{};
  f8.dtype = ExpertDtype::fp8_block;
  f8.n_experts = 8;
  f8.D = 256;
  f8.F = 128;
  f8.fp8_w13 = codes;
  f8.fp8_w13_scales = weights;
  f8.fp8_w2 = codes;
  f8.fp8_w2_scales = weights;
  const size_t need8 = moe_workspace_bytes(4, 2, 8, 256, 128, ExpertDtype::fp8_block);
  EXPECT_GT(need8, need);  // fp32 swiglu rows and the quantized rows besides
  EXPECT_THROW(moe_workspace_bytes(4, 2, 8, 256, 96, ExpertDtype::fp8_block), Error);  // F not a multiple of 128
  EXPECT_THROW(moe_experts(x, 4, ids, weights, 2, f8, y, ws, need8, nullptr), Error);    // FP8 experts need fp32 x
  EXPECT_THROW(moe_experts(xf, 4, ids, weights, 2, w, y, ws, need, nullptr), Error);     // fp32 x needs FP8 experts
  EXPECT_THROW(moe_experts(xf, 4, ids, weights, 2, f8, y, ws, need8 - 1, nullptr), Error);  // workspace too small
  MoeExpertWeights no_scales = f8;
  no_scales.fp8_w2_scales = nullptr;
  EXPECT_THROW(moe_experts(xf, 4, ids, weights, 2, no_scales, y, ws, need8, nullptr), Error);
  EXPECT_NO_THROW(moe_experts(xf, 0, ids, weights, 2, f8, y, ws, 0, nullptr));  // T = 0: nothing to do
}

}  // namespace
}  // namespace kestrel::cuda
