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

// floor(log2(a)) of a finite a > 0, from the exponent field (and, for subnormals, the top mantissa bit).
int floor_log2(float a) {
  const uint32_t bits = std::bit_cast<uint32_t>(a);
  const int exp_field = static_cast<int>(bits >> kF32MantBits);
  if (exp_field != 0) return exp_field - kF32Bias;
  return static_cast<int>(std::bit_width(bits & kF32MantMask)) - 1 + (1 - kF32Bias - kF32MantBits);
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

}  // namespace kestrel
