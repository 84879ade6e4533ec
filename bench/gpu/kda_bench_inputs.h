// Inputs shared by the KDA benchmarks (kda_cuda_bench, kda_tc_bench): model-like random tokens on the device.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::bench {

constexpr int kKdaHeads = 32, kKdaDim = 128;

// n normal floats (mean, std_dev) on the device: a 16M-float random block drawn on the host, repeated, so that
// large inputs do not take minutes to draw.
inline cuda::DeviceBuffer<float> device_random(size_t n, float mean, float std_dev, std::mt19937& rng) {
  std::normal_distribution<float> normal(mean, std_dev);
  std::vector<float> block(std::min<size_t>(n, size_t{1} << 24));
  for (float& e : block) e = normal(rng);
  cuda::DeviceBuffer<float> d(n);
  for (size_t off = 0; off < n; off += block.size()) {
    const size_t count = std::min(block.size(), n - off);
    KESTREL_CUDA_CHECK(cudaMemcpy(d.get() + off, block.data(), count * sizeof(float), cudaMemcpyHostToDevice));
  }
  return d;
}

// Model-like raw inputs for T tokens of kKdaHeads heads of kKdaDim (the kernels fuse the L2 norm, the gate and the
// beta sigmoid).
struct KdaBenchInputs {
  cuda::DeviceBuffer<float> q, k, v, f, beta_logit, A_log, dt_bias;
  cuda::KdaInputs view;
  KdaBenchInputs(int64_t T, std::mt19937& rng)
      : q(device_random(T * kKdaHeads * kKdaDim, 0, 1, rng)),
        k(device_random(T * kKdaHeads * kKdaDim, 0, 1, rng)),
        v(device_random(T * kKdaHeads * kKdaDim, 0, 1, rng)),
        f(device_random(T * kKdaHeads * kKdaDim, 0, 1, rng)),
        beta_logit(device_random(T * kKdaHeads, 0, 2, rng)),
        A_log(device_random(kKdaHeads, 1.5f, 0.5f, rng)),
        dt_bias(device_random(kKdaHeads * kKdaDim, -3, 1, rng)) {
    view.q = q.get();
    view.k = k.get();
    view.v = v.get();
    view.gate = f.get();
    view.beta = beta_logit.get();
    view.A_log = A_log.get();
    view.dt_bias = dt_bias.get();
    view.beta_is_logit = true;
    view.normalize_qk = true;
    view.scale = 1.0f / std::sqrt(static_cast<float>(kKdaDim));
  }
};

}  // namespace kestrel::bench
