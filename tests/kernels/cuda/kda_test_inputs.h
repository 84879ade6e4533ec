// Inputs and comparisons shared by the KDA kernel tests (kda_cuda_test, kda_prefill_tc_test): random tokens of
// dk = dv = 128 heads in the raw form a fused kernel takes and the preprocessed form the CPU reference takes, their
// device copies, and the relative error. Each test is an executable of its own, so everything here is inline.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/basic.h"
#include "kernels/cpu/kda.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda::kda_test {

constexpr int kDim = 128;
constexpr int64_t kHeadState = int64_t{kDim} * kDim;

// ‖a − b‖ / ‖b‖ in double; NaN (an unwritten poisoned output) makes every comparison with a bound fail.
inline double rel_err(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}
inline double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return rel_err(a.data(), b.data(), std::min(a.size(), b.size()));
}

// All bits set: a NaN in every float, so any output the kernel fails to write shows up.
template <typename T>
inline void poison(DeviceBuffer<T>& d) {
  if (d.size() > 0) KESTREL_CUDA_CHECK(cudaMemset(d.get(), 0xff, d.bytes()));
}

// How the gates are drawn (as the CPU reference's tests do).
struct GateSpec {
  std::optional<float> lower_bound;  // nullopt: Kimi Linear softplus gate
  float dt_bias_mean;                // shifts f + dt_bias, i.e. how strongly the channels decay
  float f_std;
};
constexpr GateSpec kSoftplusGate{std::nullopt, -3.0f, 1.0f};  // mild decay, the Kimi Linear regime
constexpr GateSpec kLowerBoundGate{-5.0f, -1.0f, 1.0f};       // Kimi K3
constexpr GateSpec kStrongGate{std::nullopt, 1.0f, 2.0f};     // per-token g down to about -80

// T tokens of H heads: the raw model-side inputs (what a fused kernel takes) and the preprocessed ones the CPU
// reference takes (q, k L2-normalised; g = kda_gate(f); beta = sigmoid(logit)).
struct Tokens {
  int64_t T;
  int H;
  std::optional<float> lower_bound;
  std::vector<float> q_raw, k_raw, v, f, beta_logit, A_log, dt_bias;
  std::vector<float> q, k, g, beta;

  Tokens(int64_t T_, int H_, const GateSpec& gate, uint32_t seed) : T(T_), H(H_), lower_bound(gate.lower_bound) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    const size_t n = static_cast<size_t>(T * H * kDim);
    auto fill = [&](std::vector<float>& x, size_t count, float mean, float std_dev) {
      x.resize(count);
      for (float& e : x) e = mean + std_dev * normal(rng);
    };
    fill(q_raw, n, 0.0f, 1.0f);
    fill(k_raw, n, 0.0f, 1.0f);
    fill(v, n, 0.0f, 1.0f);
    fill(f, n, 0.0f, gate.f_std);
    fill(beta_logit, static_cast<size_t>(T * H), 0.0f, 2.0f);
    fill(dt_bias, static_cast<size_t>(H) * kDim, gate.dt_bias_mean, 1.0f);
    A_log.resize(static_cast<size_t>(H));
    for (float& a : A_log) a = std::log(1.0f + 15.0f * uniform(rng));  // exp(A_log) in [1, 16], as at init

    q = q_raw;
    k = k_raw;
    cpu::l2_normalize_rows(q.data(), T * H, kDim, 1e-6f);
    cpu::l2_normalize_rows(k.data(), T * H, kDim, 1e-6f);
    g.resize(n);
    cpu::kda_gate(f.data(), T, H, kDim, A_log.data(), dt_bias.data(), lower_bound, g.data());
    beta.resize(beta_logit.size());
    for (size_t i = 0; i < beta.size(); ++i) beta[i] = cpu::sigmoid(beta_logit[i]);
  }
};

// Device copies of a Tokens and the KdaInputs that reads them, either raw with every preprocessing step fused
// into the kernel, or preprocessed.
struct DeviceTokens {
  DeviceBuffer<float> q, k, v, gate, beta, A_log, dt_bias;
  KdaInputs inputs;

  DeviceTokens(const Tokens& t, bool fused)
      : q(to_device(fused ? t.q_raw : t.q)),
        k(to_device(fused ? t.k_raw : t.k)),
        v(to_device(t.v)),
        gate(to_device(fused ? t.f : t.g)),
        beta(to_device(fused ? t.beta_logit : t.beta)),
        A_log(to_device(t.A_log)),
        dt_bias(to_device(t.dt_bias)) {
    inputs.q = q.get();
    inputs.k = k.get();
    inputs.v = v.get();
    inputs.gate = gate.get();
    inputs.beta = beta.get();
    inputs.scale = 1.0f / std::sqrt(static_cast<float>(kDim));
    if (fused) {
      inputs.A_log = A_log.get();
      inputs.dt_bias = dt_bias.get();
      inputs.gate_lower_bound = t.lower_bound;
      inputs.beta_is_logit = true;
      inputs.normalize_qk = true;
    }
  }
};


// `n` distinct slots out of `pool`, in random order.
inline std::vector<int32_t> random_slots(int n, int pool, uint32_t seed) {
  std::vector<int32_t> slots(static_cast<size_t>(pool));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), std::mt19937(seed));
  slots.resize(static_cast<size_t>(n));
  return slots;
}

}  // namespace kestrel::cuda::kda_test
