// Device functions shared by the kernels that quantise what the DSA indexer and the MLA latent store: the
// power-of-two (ue8m0) scale rounding of quantize_fp8_ue8m0 and the butterflies of cpu::hadamard_inplace, each with
// exactly the CPU's fp32 operations (spelled out: __fadd_rn, __fsub_rn), so that the results are the CPU's bit for bit.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda::quant {

// round_up_pow2 of src/core/formats.cpp for a finite s > 0 (a subnormal s gives 2^-126).
__device__ __forceinline__ float round_up_pow2(float s) {
  const uint32_t bits = __float_as_uint(s);
  const uint32_t exp_field = bits >> 23;
  if (exp_field == 0) return __uint_as_float(1u << 23);
  if ((bits & 0x007FFFFFu) == 0) return s;
  return __uint_as_float((exp_field + 1) << 23);
}

// The D values at x (D a power of two) copied into buf (D floats of shared memory) and put through the butterflies of
// cpu::hadamard_inplace (without its 1/sqrt(D) factor) by the calling warp. The butterflies of one stage touch
// disjoint pairs, each pair by one lane, so a stage is the CPU's stage whatever lane does which pair. Ends with a
// __syncwarp, so the whole warp may read buf afterwards.
__device__ __forceinline__ void hadamard_butterflies_warp(const float* __restrict__ x, int D, float* buf) {
  const int lane = threadIdx.x & 31;
  for (int i = lane; i < D; i += 32) buf[i] = x[i];
  for (int half = 1; half < D; half *= 2) {
    __syncwarp();
    for (int p = lane; p < D / 2; p += 32) {
      const int i = (p & ~(half - 1)) * 2 + (p & (half - 1));  // the low element of the p-th pair of this stage
      const float a = buf[i], b = buf[i + half];
      buf[i] = __fadd_rn(a, b);
      buf[i + half] = __fsub_rn(a, b);
    }
  }
  __syncwarp();
}

}  // namespace kestrel::cuda::quant
