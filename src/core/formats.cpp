// Bit-level emulation of the number formats: every conversion works on the fp32 bit pattern with integer
// arithmetic, so the result does not depend on the host's rounding mode or on compiler floating-point options.
#include "core/formats.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace kestrel {
namespace {

constexpr uint32_t kF32SignMask = 0x80000000u;
constexpr uint32_t kF32AbsMask = 0x7FFFFFFFu;
constexpr uint32_t kF32InfBits = 0x7F800000u;
constexpr uint32_t kF32MantMask = 0x007FFFFFu;
constexpr int kF32MantBits = 23;
constexpr int kF32Bias = 127;

// Rounds a finite fp32 magnitude (bits without the sign) to nearest-even on the grid of a small binary float
// with `mant_bits` stored mantissa bits, exponent bias `bias`, subnormals, and no upper limit; returns the
// unsigned code (exponent field << mant_bits | mantissa). The caller saturates codes past the largest finite
// one. Codes are ordered like the values they encode, so a mantissa that rounds up past its top carries into
// the exponent field by plain addition and the code stays right.
uint32_t round_magnitude_to_minifloat(uint32_t abs_bits, int mant_bits, int bias) {
  const int exp_field = static_cast<int>(abs_bits >> kF32MantBits);
  uint32_t significand = abs_bits & kF32MantMask;
  int exponent = 1 - kF32Bias;  // fp32 subnormal: no implicit bit
  if (exp_field != 0) {
    significand |= 1u << kF32MantBits;
    exponent = exp_field - kF32Bias;
  }
  const int min_normal_exponent = 1 - bias;
  const bool normal = exponent >= min_normal_exponent;
  // The target's quantum at this magnitude is 2^(max(exponent, min_normal_exponent) - mant_bits); the value in
  // quanta is significand >> shift before rounding.
  const int shift = std::max(exponent, min_normal_exponent) - exponent + kF32MantBits - mant_bits;
  // significand < 2^24, so from shift 25 on it is below half a quantum.
  if (shift >= 25) return 0;
  uint32_t quanta = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (remainder > half || (remainder == half && (quanta & 1u))) ++quanta;
  // A normal value's quanta include the implicit leading 1 (1 << mant_bits), which sits one exponent step up.
  if (!normal) return quanta;
  return (static_cast<uint32_t>(exponent + bias - 1) << mant_bits) + quanta;
}

}  // namespace

uint16_t f32_to_bf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  // Setting the top mantissa bit keeps a NaN a NaN even when its payload lies only in the dropped half.
  if ((bits & kF32AbsMask) > kF32InfBits) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  // Adding 0x7FFF plus the lowest kept bit rounds to nearest-even; a carry out of the mantissa bumps the
  // exponent, which is how values near FLT_MAX overflow to inf.
  const uint32_t rounded = bits + 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

float bf16_to_f32(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

uint8_t f32_to_e4m3(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t abs_bits = bits & kF32AbsMask;
  if (abs_bits > kF32InfBits) return 0x7F;
  const uint8_t sign = static_cast<uint8_t>((bits & kF32SignMask) >> 24);
  if (abs_bits == kF32InfBits) return sign | 0x7E;
  const uint32_t code = round_magnitude_to_minifloat(abs_bits, 3, 7);
  return sign | static_cast<uint8_t>(std::min<uint32_t>(code, 0x7E));
}

float e4m3_to_f32(uint8_t b) {
  const bool negative = (b & 0x80) != 0;
  const int magnitude = b & 0x7F;
  if (magnitude == 0x7F) return std::copysign(std::numeric_limits<float>::quiet_NaN(), negative ? -1.0f : 1.0f);
  const int exp_field = magnitude >> 3;
  const int mantissa = magnitude & 7;
  const float value = exp_field == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                     : std::ldexp(static_cast<float>(8 + mantissa), exp_field - 10);
  return negative ? -value : value;
}

uint8_t f32_to_e2m1(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t abs_bits = bits & kF32AbsMask;
  if (abs_bits > kF32InfBits) return 0x7;
  const uint8_t sign = static_cast<uint8_t>((bits & kF32SignMask) >> 28);
  if (abs_bits == kF32InfBits) return sign | 0x7;
  const uint32_t code = round_magnitude_to_minifloat(abs_bits, 1, 1);
  return sign | static_cast<uint8_t>(std::min<uint32_t>(code, 0x7));
}

// Only the low nibble is read, so callers can pass a packed byte shifted down without masking it.
float e2m1_to_f32(uint8_t code) {
  const bool negative = (code & 0x8) != 0;
  const int exp_field = (code >> 1) & 0x3;
  const int mantissa = code & 0x1;
  const float value = exp_field == 0 ? 0.5f * static_cast<float>(mantissa)
                                     : std::ldexp(static_cast<float>(2 + mantissa), exp_field - 2);
  return negative ? -value : value;
}

float e8m0_to_f32(uint8_t e) {
  if (e == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(e) - kF32Bias);  // e = 0 gives 2^-127, an exact fp32 subnormal
}

// For a subnormal s the answer is 2^-126, the smallest normal power of two, which is what the header promises
// (a normal result) and what DeepSeek's exponent-field rounding gives: a zero exponent field counts as -126.
float round_up_pow2(float s) {
  KESTREL_CHECK(std::isfinite(s) && s > 0.0f, "round_up_pow2 needs a finite value > 0, got {}", s);
  const uint32_t bits = std::bit_cast<uint32_t>(s);
  const uint32_t exp_field = bits >> kF32MantBits;
  if (exp_field == 0) return std::bit_cast<float>(1u << kF32MantBits);
  if ((bits & kF32MantMask) == 0) return s;
  KESTREL_CHECK(exp_field < 254, "round_up_pow2({}): the next power of two, 2^128, is not a finite fp32", s);
  return std::bit_cast<float>((exp_field + 1) << kF32MantBits);
}


namespace {

constexpr float kFp8AmaxFloor = 1e-4f;
constexpr float kInvE4m3Max = 1.0f / kE4m3Max;  // rounded to fp32 once, then multiplied, as DeepSeek's kernel does
constexpr int kMxfp4Block = 32;
constexpr int kNvfp4Block = 16;
constexpr int kE2m1Emax = 2;  // 6 = 1.5 * 2^2

float finite_abs_max(const float* x, int64_t n, const char* what) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    KESTREL_CHECK(std::isfinite(x[i]), "{}: value {} at index {} is not finite", what, x[i], i);
    amax = std::max(amax, std::fabs(x[i]));
  }
  return amax;
}

void put_nibble(uint8_t* packed, int64_t i, uint8_t code) {
  if (i % 2 == 0) {
    packed[i / 2] = code;
  } else {
    packed[i / 2] |= static_cast<uint8_t>(code << 4);
  }
}

uint8_t get_nibble(const uint8_t* packed, int64_t i) {
  return static_cast<uint8_t>(i % 2 == 0 ? packed[i / 2] & 0xF : packed[i / 2] >> 4);
}

}  // namespace

float quantize_fp8_ue8m0(const float* x, int n, uint8_t* codes) {
  KESTREL_CHECK(n >= 0, "quantize_fp8_ue8m0: negative length {}", n);
  const float amax = std::max(finite_abs_max(x, n, "quantize_fp8_ue8m0"), kFp8AmaxFloor);
  const float s = round_up_pow2(amax * kInvE4m3Max);
  // No explicit clamp to +-448: f32_to_e4m3 saturates there, which is the same clamp. s is a power of two, so
  // x / s is exact.
  for (int i = 0; i < n; ++i) codes[i] = f32_to_e4m3(x[i] / s);
  return s;
}

void dequantize_fp8(const uint8_t* codes, int n, float s, float* out) {
  KESTREL_CHECK(n >= 0, "dequantize_fp8: negative length {}", n);
  for (int i = 0; i < n; ++i) out[i] = e4m3_to_f32(codes[i]) * s;
}

void mxfp4_encode(const float* x, int64_t n, uint8_t* packed, uint8_t* scales) {
  KESTREL_CHECK(n >= 0 && n % kMxfp4Block == 0, "mxfp4_encode: length {} is not a multiple of {}", n, kMxfp4Block);
  for (int64_t b = 0; b < n / kMxfp4Block; ++b) {
    const float* block = x + b * kMxfp4Block;
    const float amax = finite_abs_max(block, kMxfp4Block, "mxfp4_encode");
    // floor(log2(amax)) from the exponent field. A zero or subnormal amax reads as -127 rather than lower, which
    // the clamp hides: such blocks get exponent -127 either way, zero blocks included as the OCP rule asks. The
    // upper clamp never binds for a finite amax.
    const int amax_log2 = static_cast<int>(std::bit_cast<uint32_t>(amax) >> kF32MantBits) - kF32Bias;
    const int exponent = std::clamp(amax_log2 - kE2m1Emax, -127, 127);
    scales[b] = static_cast<uint8_t>(exponent + 127);
    for (int i = 0; i < kMxfp4Block; ++i) {
      // ldexp is the correctly rounded x / 2^exponent; it only rounds where the result is far below 0.25, which
      // e2m1 sends to zero either way.
      put_nibble(packed, b * kMxfp4Block + i, f32_to_e2m1(std::ldexp(block[i], -exponent)));
    }
  }
}

void mxfp4_decode(const uint8_t* packed, const uint8_t* scales, int64_t n, float* out) {
  KESTREL_CHECK(n >= 0 && n % kMxfp4Block == 0, "mxfp4_decode: length {} is not a multiple of {}", n, kMxfp4Block);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = e2m1_to_f32(get_nibble(packed, i)) * e8m0_to_f32(scales[i / kMxfp4Block]);
  }
}

void nvfp4_encode(const float* x, int64_t n, float tensor_scale, uint8_t* packed, uint8_t* scales) {
  KESTREL_CHECK(n >= 0 && n % kNvfp4Block == 0, "nvfp4_encode: length {} is not a multiple of {}", n, kNvfp4Block);
  // The largest block scale is 448 * tensor_scale; it must be finite, or zeros would decode as 0 * inf.
  KESTREL_CHECK(std::isfinite(tensor_scale) && tensor_scale > 0.0f && std::isfinite(kE4m3Max * tensor_scale),
                "nvfp4_encode: tensor scale must be finite, > 0 and at most FLT_MAX / 448, got {}", tensor_scale);
  const float block_scale_unit = kE2m1Max * tensor_scale;
  for (int64_t b = 0; b < n / kNvfp4Block; ++b) {
    const float* block = x + b * kNvfp4Block;
    const float amax = finite_abs_max(block, kNvfp4Block, "nvfp4_encode");
    const uint8_t scale_code = f32_to_e4m3(amax / block_scale_unit);
    scales[b] = scale_code;
    const float block_scale = e4m3_to_f32(scale_code) * tensor_scale;
    for (int i = 0; i < kNvfp4Block; ++i) {
      const uint8_t code = block_scale == 0.0f ? 0 : f32_to_e2m1(block[i] / block_scale);
      put_nibble(packed, b * kNvfp4Block + i, code);
    }
  }
}

void nvfp4_decode(const uint8_t* packed, const uint8_t* scales, int64_t n, float tensor_scale, float* out) {
  KESTREL_CHECK(n >= 0 && n % kNvfp4Block == 0, "nvfp4_decode: length {} is not a multiple of {}", n, kNvfp4Block);
  for (int64_t i = 0; i < n; ++i) {
    const float block_scale = e4m3_to_f32(scales[i / kNvfp4Block]) * tensor_scale;
    out[i] = e2m1_to_f32(get_nibble(packed, i)) * block_scale;
  }
}

void fp8_block_decode(const uint8_t* codes, const float* scales, int64_t out, int64_t in, int64_t block, float* w) {
  const int64_t cb = (in + block - 1) / block;
  for (int64_t r = 0; r < out; ++r)
    for (int64_t c = 0; c < in; ++c) w[r * in + c] = e4m3_to_f32(codes[r * in + c]) * scales[(r / block) * cb + c / block];
}

}  // namespace kestrel
