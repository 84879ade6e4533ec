// Device-side pieces shared by the KDA kernels: the preprocessing that the kernels fuse in.
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/kda_launch.h"

namespace kestrel::cuda::detail {

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// softplus with beta 1 and threshold 20, as cpu::softplus.
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// The log gate of channel d of head h for the gate input x (g itself, or f when the gate is fused).
__device__ __forceinline__ float kda_log_gate(const KdaTokenArgs& in, int h, int d, float x) {
  if (!in.A_log) return x;
  const float a = expf(in.A_log[h]);
  const float z = x + in.dt_bias[h * kKdaDim + d];
  return in.has_lower_bound ? in.lower_bound * sigmoid(a * z) : -a * softplus(z);
}

__device__ __forceinline__ float kda_beta(const KdaTokenArgs& in, float x) {
  return in.beta_is_logit ? sigmoid(x) : x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

}  // namespace kestrel::cuda::detail
