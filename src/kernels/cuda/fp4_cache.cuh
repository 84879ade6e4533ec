// Device functions of the 4-bit cache formats (fp4_cache.h): the e2m1 / e4m3 conversions of src/core/formats.cpp
// ported to the device by the same integer arithmetic (so the codes are the CPU's by construction, whatever the
// hardware's own conversions do), the NVFP4 latent decode of MlaCore::read_latent, the MXFP4 block encoder of
// mxfp4_encode and the MXFP4 key -> FP8 view of mxfp4_key_as_fp8 (src/cpu/mla_core.cpp). Included by the kernels that
// write or read those formats (fp4_cache.cu, mla_glue.cu, dsa_generic.cu). Every fp32 operation is spelled out
// (__fmul_rn, __fdiv_rn, __double2float_rn) so that nvcc cannot contract it into something the CPU does not do.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kestrel::cuda::fp4 {

constexpr uint32_t kF32AbsMask = 0x7FFFFFFFu;
constexpr uint32_t kF32InfBits = 0x7F800000u;
constexpr uint8_t kE4m3NaN = 0x7F;
constexpr uint8_t kE8m0NaN = 0xFF;
constexpr int kNvfp4Block = 16;
constexpr int kMxfp4Block = 32;

// 2^n as fp32 for a normal exponent n (-126..127), and as a double for -1022..1023: exact.
__device__ __forceinline__ float pow2f(int n) { return __int_as_float((n + 127) << 23); }
__device__ __forceinline__ double pow2d(int n) { return __longlong_as_double(static_cast<long long>(n + 1023) << 52); }

// round_magnitude_to_minifloat of src/core/formats.cpp: a finite fp32 magnitude (bits without the sign) rounded to
// nearest even on the grid of a float with mant_bits stored mantissa bits, bias `bias`, subnormals and no upper
// limit; returns the unsigned code, which the caller saturates.
__device__ __forceinline__ uint32_t round_magnitude(uint32_t abs_bits, int mant_bits, int bias) {
  const int exp_field = static_cast<int>(abs_bits >> 23);
  uint32_t significand = abs_bits & 0x007FFFFFu;
  int exponent = 1 - 127;
  if (exp_field != 0) {
    significand |= 1u << 23;
    exponent = exp_field - 127;
  }
  const int min_normal_exponent = 1 - bias;
  const bool normal = exponent >= min_normal_exponent;
  const int shift = max(exponent, min_normal_exponent) - exponent + 23 - mant_bits;
  if (shift >= 25) return 0;
  uint32_t quanta = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (remainder > half || (remainder == half && (quanta & 1u))) ++quanta;
  if (!normal) return quanta;
  return (static_cast<uint32_t>(exponent + bias - 1) << mant_bits) + quanta;
}

// f32_to_e4m3: saturating (+-inf -> +-448), every NaN -> 0x7F, -0 stays -0.
__device__ __forceinline__ uint8_t e4m3_code(float x) {
  const uint32_t bits = __float_as_uint(x), abs_bits = bits & kF32AbsMask;
  if (abs_bits > kF32InfBits) return kE4m3NaN;
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if (abs_bits == kF32InfBits) return sign | 0x7E;
  return sign | static_cast<uint8_t>(min(round_magnitude(abs_bits, 3, 7), 0x7Eu));
}

// f32_to_e2m1: saturating to +-6 (+-inf included); NaN -> +6 (0x7). The 4-bit code in the low nibble.
__device__ __forceinline__ uint8_t e2m1_code(float x) {
  const uint32_t bits = __float_as_uint(x), abs_bits = bits & kF32AbsMask;
  if (abs_bits > kF32InfBits) return 0x7;
  const uint8_t sign = static_cast<uint8_t>((bits >> 28) & 0x8u);
  if (abs_bits == kF32InfBits) return sign | 0x7;
  return sign | static_cast<uint8_t>(min(round_magnitude(abs_bits, 1, 1), 0x7u));
}

// e4m3_to_f32 (NaN for 0x7F / 0xFF) and e2m1_to_f32 (only the low nibble read), exactly.
__device__ __forceinline__ float e4m3_value(uint32_t code) {
  const uint32_t mag = code & 0x7Fu;
  if (mag == 0x7Fu) return __int_as_float(0x7FC00000);
  const int e = static_cast<int>(mag >> 3), m = static_cast<int>(mag & 7u);
  const float v = e ? __fmul_rn(static_cast<float>(8 + m), pow2f(e - 10)) : __fmul_rn(static_cast<float>(m), pow2f(-9));
  return (code & 0x80u) ? -v : v;
}
__device__ __forceinline__ float e2m1_value(uint32_t code) {
  const int e = static_cast<int>((code >> 1) & 3u), m = static_cast<int>(code & 1u);
  const float v = e ? __fmul_rn(static_cast<float>(2 + m), pow2f(e - 2)) : 0.5f * static_cast<float>(m);
  return (code & 0x8u) ? -v : v;
}

// Value i (0 <= i < C + R) of an NVFP4 latent entry, as MlaCore::read_latent decodes it: nvfp4_decode with the
// tensor scale kv_scale for i < C (e2m1 * fp32(e4m3(block scale) * kv_scale)), e4m3 * kv_scale for the tail.
__device__ __forceinline__ float nvfp4_latent_value(const uint8_t* entry, int i, int C, float kv_scale) {
  if (i < C) {
    const uint32_t nibble = (static_cast<uint32_t>(entry[i >> 1]) >> ((i & 1) * 4)) & 0xFu;
    const float block_scale = __fmul_rn(e4m3_value(entry[C / 2 + i / kNvfp4Block]), kv_scale);
    return __fmul_rn(e2m1_value(nibble), block_scale);
  }
  return __fmul_rn(e4m3_value(entry[C / 2 + C / kNvfp4Block + (i - C)]), kv_scale);
}

// mxfp4_encode of one block of 32 values by a warp, lane l holding value l (all 32 finite): exponent e =
// clamp(floor(log2 amax) - 2, -127, 127) read off amax's exponent field (a zero or subnormal amax reads as -127), code
// = e2m1(fp32(v * 2^-e)) (the product is exact in double, so its one rounding to fp32 is std::ldexp's). The even
// lanes write byte l / 2 of packed (their code in the low nibble, the next lane's in the high one), lane 0 writes
// e + 127 to *exponent.
__device__ __forceinline__ void mxfp4_encode_block_warp(float v, uint8_t* packed, uint8_t* exponent) {
  const int lane = threadIdx.x & 31;
  float amax = fabsf(v);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
  const int amax_log2 = static_cast<int>(__float_as_uint(amax) >> 23) - 127;
  const int e = min(max(amax_log2 - 2, -127), 127);
  const uint32_t code = e2m1_code(__double2float_rn(static_cast<double>(v) * pow2d(-e)));
  const uint32_t next = __shfl_down_sync(0xFFFFFFFFu, code, 1);
  if ((lane & 1) == 0) packed[lane / 2] = static_cast<uint8_t>(code | (next << 4));
  if (lane == 0) *exponent = static_cast<uint8_t>(e + 127);
}

// mxfp4_key_as_fp8 by one thread: the D values of an MXFP4 key (D / 2 packed bytes, D / 32 E8M0 exponents) as FP8
// codes with one power-of-two scale, returned: with e_max the largest exponent, code i = e4m3(e2m1_i * 2^(e_b - e_max +
// 6)) (e4m3 rounds only where e_b < e_max - 14) and scale 2^(e_max - 127 - 6) (an fp32 subnormal for e_max < 7).
// The products are exact in double and rounded to fp32 once, as std::ldexp rounds. codes: D bytes, 4-byte aligned,
// written as words. A key with an exponent 0xFF (the E8M0 NaN, which only a non-finite key written by
// index_key_write_mxfp4 has) gives NaN codes (0x7F) and a NaN scale.
__device__ __forceinline__ float mxfp4_key_as_fp8(const uint8_t* packed, const uint8_t* exponents, int D,
                                                  uint8_t* codes) {
  int e_max = 0;
  for (int b = 0; b < D / kMxfp4Block; ++b) e_max = max(e_max, static_cast<int>(exponents[b]));
  uint32_t* words = reinterpret_cast<uint32_t*>(codes);
  if (e_max == kE8m0NaN) {
    for (int w = 0; w < D / 4; ++w) words[w] = 0x7F7F7F7Fu;
    return __int_as_float(0x7FC00000);
  }
  for (int w = 0; w < D / 4; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 4 * w + j;
      const uint32_t nibble = (static_cast<uint32_t>(packed[i >> 1]) >> ((i & 1) * 4)) & 0xFu;
      const int shift = static_cast<int>(exponents[i / kMxfp4Block]) - e_max + 6;
      const float v = __double2float_rn(static_cast<double>(e2m1_value(nibble)) * pow2d(shift));
      word |= static_cast<uint32_t>(e4m3_code(v)) << (8 * j);
    }
    words[w] = word;
  }
  return __double2float_rn(pow2d(e_max - 127 - 6));
}

}  // namespace kestrel::cuda::fp4
