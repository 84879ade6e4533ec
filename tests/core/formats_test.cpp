// Number-format tests: hand-worked codes, every code of the small formats checked against its defining formula,
// and sampled inputs checked against a brute-force nearest-value search (ties to the even code).
#include "core/formats.h"

#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"

namespace kestrel {
namespace {

float pow2f(int k) { return std::ldexp(1.0f, k); }
uint32_t bits_of(float x) { return std::bit_cast<uint32_t>(x); }
float float_of(uint32_t b) { return std::bit_cast<float>(b); }
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

// Value of an e4m3fn code straight from the format's definition (1-4-3, bias 7, subnormals, 0x7F/0xFF NaN).
double e4m3_by_formula(int code) {
  const int s = code >> 7, e = (code >> 3) & 0xF, m = code & 7;
  const double magnitude = e == 0 ? (m / 8.0) * std::pow(2.0, -6) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -magnitude : magnitude;
}

// Value of an e2m1 code from its definition (1-2-1, bias 1, subnormal 0.5).
double e2m1_by_formula(int code) {
  const int s = (code >> 3) & 1, e = (code >> 1) & 3, m = code & 1;
  const double magnitude = e == 0 ? m * 0.5 : (1.0 + m / 2.0) * std::pow(2.0, e - 1);
  return s ? -magnitude : magnitude;
}

// Nearest code among the non-negative codes 0..max_code (values increasing with the code) to |x|, ties to the
// even code, with |x| beyond the largest value saturating; the sign bit is added by the caller.
int nearest_code(double magnitude, const std::vector<double>& value_of_code) {
  int best = 0;
  for (int c = 1; c < static_cast<int>(value_of_code.size()); ++c) {
    const double d_best = std::fabs(magnitude - value_of_code[best]);
    const double d_c = std::fabs(magnitude - value_of_code[c]);
    if (d_c < d_best || (d_c == d_best && (c % 2 == 0))) best = c;
  }
  return best;
}

std::vector<double> code_values(int max_code, double (*value_of)(int)) {
  std::vector<double> values;
  for (int c = 0; c <= max_code; ++c) values.push_back(value_of(c));
  return values;
}

// Sampled non-negative fp32 inputs: a stride through every bit pattern up to `limit`, plus every midpoint
// between consecutive codes of the format and its two fp32 neighbours (where ties are decided).
std::vector<float> sample_inputs(float limit, int max_code, double (*value_of)(int)) {
  std::vector<float> xs;
  for (uint32_t b = 0; b <= bits_of(limit); b += 997) xs.push_back(float_of(b));
  for (int c = 0; c < max_code; ++c) {
    const float mid = static_cast<float>((value_of(c) + value_of(c + 1)) / 2);  // exact: few mantissa bits
    xs.push_back(mid);
    xs.push_back(std::nextafter(mid, 0.0f));
    xs.push_back(std::nextafter(mid, kInf));
  }
  return xs;
}

// ---- bf16 ----

TEST(Bf16, HandWorkedCodes) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(f32_to_bf16(-2.0f), 0xC000);
  // 1 + 2^-8 lies halfway between 1.0 (0x3F80) and 1 + 2^-7 (0x3F81): ties to the even code.
  EXPECT_EQ(f32_to_bf16(1.00390625f), 0x3F80);
  EXPECT_EQ(f32_to_bf16(std::nextafter(1.00390625f, 2.0f)), 0x3F81);
  // 1 + 3*2^-8 lies halfway between 0x3F81 and 0x3F82 (1.015625): the even one wins, rounding up.
  EXPECT_EQ(f32_to_bf16(1.01171875f), 0x3F82);
  EXPECT_EQ(bf16_to_f32(0x3F82), 1.015625f);
  EXPECT_EQ(round_to_bf16(std::nextafter(1.01171875f, 0.0f)), 1.0078125f);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_TRUE(std::signbit(bf16_to_f32(0x8000)));
  EXPECT_EQ(bf16_to_f32(0x8000), 0.0f);
}

TEST(Bf16, InfNaNAndOverflow) {
  EXPECT_EQ(f32_to_bf16(kInf), 0x7F80);
  EXPECT_EQ(f32_to_bf16(-kInf), 0xFF80);
  // A NaN whose payload sits only in the dropped low half must not turn into inf; the sign is kept.
  EXPECT_EQ(f32_to_bf16(float_of(0x7F800001u)), 0x7FC0);
  EXPECT_EQ(f32_to_bf16(float_of(0xFF800001u)), 0xFFC0);
  EXPECT_TRUE(std::isnan(round_to_bf16(kNaN)));
  EXPECT_EQ(f32_to_bf16(float_of(0x7FC12345u)), 0x7FC1);
  // Largest finite bf16 is 0x7F7F = (2 - 2^-7) * 2^127. Below the midpoint to 2^128 it stays; at the midpoint
  // the tie goes to the even code 0x7F80, which is inf; FLT_MAX is above the midpoint.
  EXPECT_EQ(f32_to_bf16(float_of(0x7F7F0000u)), 0x7F7F);
  EXPECT_EQ(f32_to_bf16(float_of(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(f32_to_bf16(float_of(0x7F7F8000u)), 0x7F80);
  EXPECT_EQ(f32_to_bf16(FLT_MAX), 0x7F80);
  EXPECT_EQ(f32_to_bf16(-FLT_MAX), 0xFF80);
}

TEST(Bf16, Subnormals) {
  EXPECT_EQ(f32_to_bf16(pow2f(-133)), 0x0001);  // smallest bf16 subnormal, exact
  EXPECT_EQ(bf16_to_f32(0x0001), pow2f(-133));
  EXPECT_EQ(f32_to_bf16(pow2f(-149)), 0x0000);
  EXPECT_EQ(f32_to_bf16(pow2f(-134)), 0x0000);                       // half of 2^-133: tie to even 0
  EXPECT_EQ(f32_to_bf16(pow2f(-133) + pow2f(-134)), 0x0002);         // 1.5 quanta: tie to even 2
  EXPECT_EQ(f32_to_bf16(pow2f(-134) + pow2f(-149)), 0x0001);         // just above half a quantum
  EXPECT_EQ(f32_to_bf16(-pow2f(-134)), 0x8000);
  // Rounding up out of the subnormal range gives the smallest normal.
  EXPECT_EQ(f32_to_bf16(float_of(0x007FFFFFu)), 0x0080);
}

// Every sampled fp32 goes to the nearer of the two bf16 values around it, the even code on a tie.
TEST(Bf16, NearestEvenOnSampledInputs) {
  for (uint32_t b = 0; b < 0x7F7F0000u; b += 4099) {
    for (const uint32_t sign : {0u, 0x80000000u}) {
      const float x = float_of(b | sign);
      const uint16_t below = static_cast<uint16_t>((b | sign) >> 16);  // same sign, magnitude truncated
      const uint16_t above = static_cast<uint16_t>(below + 1);
      const double d_below = std::fabs(static_cast<double>(x) - bf16_to_f32(below));
      const double d_above = std::fabs(static_cast<double>(x) - bf16_to_f32(above));
      const uint16_t expected = d_below < d_above ? below : d_above < d_below ? above : (below % 2 == 0 ? below : above);
      ASSERT_EQ(f32_to_bf16(x), expected) << "x bits " << std::hex << (b | sign);
    }
  }
}

// ---- e4m3 ----

TEST(E4m3, HandWorkedCodes) {
  EXPECT_EQ(f32_to_e4m3(448.0f), 0x7E);
  EXPECT_EQ(f32_to_e4m3(464.0f), 0x7E);  // would round to 480 (code 0x7F, NaN): satfinite keeps 448
  EXPECT_EQ(f32_to_e4m3(1e9f), 0x7E);
  EXPECT_EQ(f32_to_e4m3(-1e9f), 0xFE);
  EXPECT_EQ(f32_to_e4m3(kInf), 0x7E);
  EXPECT_EQ(f32_to_e4m3(-kInf), 0xFE);
  EXPECT_EQ(f32_to_e4m3(kNaN), 0x7F);
  EXPECT_EQ(f32_to_e4m3(-kNaN), 0x7F);
  EXPECT_EQ(f32_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(f32_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(f32_to_e4m3(pow2f(-9)), 0x01);           // smallest subnormal
  EXPECT_EQ(f32_to_e4m3(pow2f(-10)), 0x00);          // half of it: tie to even 0
  EXPECT_EQ(f32_to_e4m3(-pow2f(-10)), 0x80);
  EXPECT_EQ(f32_to_e4m3(std::nextafter(pow2f(-10), 1.0f)), 0x01);
  EXPECT_EQ(f32_to_e4m3(3 * pow2f(-10)), 0x02);      // 1.5 quanta: tie to even 2
  EXPECT_EQ(f32_to_e4m3(5 * pow2f(-10)), 0x02);      // 2.5 quanta: tie to even 2
  EXPECT_EQ(f32_to_e4m3(7 * pow2f(-9)), 0x07);       // largest subnormal
  EXPECT_EQ(f32_to_e4m3(15 * pow2f(-10)), 0x08);     // 7.5 quanta ties up into the smallest normal
  EXPECT_EQ(f32_to_e4m3(pow2f(-6)), 0x08);           // smallest normal
  EXPECT_EQ(f32_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(f32_to_e4m3(1.0625f), 0x38);             // halfway between 1 and 1.125: even mantissa 0
  EXPECT_EQ(f32_to_e4m3(1.1875f), 0x3A);             // halfway between 1.125 and 1.25: even mantissa 2
  EXPECT_EQ(f32_to_e4m3(1.9375f), 0x40);             // halfway between 1.875 and 2: carries into the exponent
  EXPECT_EQ(f32_to_e4m3(-3.0f), 0xC4);
  EXPECT_EQ(f32_to_e4m3(240.0f), 0x77);
  EXPECT_EQ(f32_to_e4m3(432.0f), 0x7E);              // halfway between 416 and 448: even mantissa 6
  EXPECT_EQ(f32_to_e4m3(420.0f), 0x7D);
  EXPECT_EQ(f32_to_e4m3(1e-30f), 0x00);
  EXPECT_EQ(f32_to_e4m3(pow2f(-149)), 0x00);
}

TEST(E4m3, EveryCodeDecodesByFormulaAndReencodes) {
  for (int code = 0; code < 256; ++code) {
    const float v = e4m3_to_f32(static_cast<uint8_t>(code));
    if ((code & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << code;
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), e4m3_by_formula(code)) << code;
    EXPECT_EQ(std::signbit(v), code >= 0x80) << code;
    EXPECT_EQ(f32_to_e4m3(v), code) << code;
  }
  EXPECT_EQ(e4m3_to_f32(0x7E), kE4m3Max);
  EXPECT_EQ(e4m3_to_f32(0x01), pow2f(-9));
}

TEST(E4m3, NearestEvenOnSampledInputs) {
  const auto values = code_values(0x7E, e4m3_by_formula);
  for (const float x : sample_inputs(600.0f, 0x7E, e4m3_by_formula)) {
    const int expected = nearest_code(x, values);
    ASSERT_EQ(f32_to_e4m3(x), expected) << x;
    ASSERT_EQ(f32_to_e4m3(-x), expected | 0x80) << -x;
  }
}

// ---- e2m1 ----

TEST(E2m1, AllCodes) {
  const float magnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int code = 0; code < 16; ++code) {
    const float v = e2m1_to_f32(static_cast<uint8_t>(code));
    EXPECT_EQ(v, code < 8 ? magnitudes[code] : -magnitudes[code - 8]) << code;
    EXPECT_EQ(static_cast<double>(v), e2m1_by_formula(code)) << code;
    EXPECT_EQ(std::signbit(v), code >= 8) << code;
    EXPECT_EQ(f32_to_e2m1(v), code) << code;
  }
  EXPECT_EQ(e2m1_to_f32(0xF3), 1.5f);  // only the low nibble is read
  EXPECT_EQ(e2m1_to_f32(0x7), kE2m1Max);
}

TEST(E2m1, TiesSaturationAndSpecials) {
  EXPECT_EQ(f32_to_e2m1(0.25f), 0x0);  // 0 | 0.5: even 0
  EXPECT_EQ(f32_to_e2m1(std::nextafter(0.25f, 1.0f)), 0x1);
  EXPECT_EQ(f32_to_e2m1(0.75f), 0x2);  // 0.5 | 1.0: even 1.0
  EXPECT_EQ(f32_to_e2m1(1.25f), 0x2);  // 1.0 | 1.5: even 1.0
  EXPECT_EQ(f32_to_e2m1(1.75f), 0x4);  // 1.5 | 2.0: even 2.0
  EXPECT_EQ(f32_to_e2m1(2.5f), 0x4);   // 2 | 3: even 2
  EXPECT_EQ(f32_to_e2m1(3.5f), 0x6);   // 3 | 4: even 4
  EXPECT_EQ(f32_to_e2m1(5.0f), 0x6);   // 4 | 6: even 4
  EXPECT_EQ(f32_to_e2m1(std::nextafter(5.0f, 9.0f)), 0x7);
  EXPECT_EQ(f32_to_e2m1(-2.5f), 0xC);
  EXPECT_EQ(f32_to_e2m1(-5.0f), 0xE);
  EXPECT_EQ(f32_to_e2m1(7.0f), 0x7);   // past 6 saturates (7 would otherwise round to 8)
  EXPECT_EQ(f32_to_e2m1(1e30f), 0x7);
  EXPECT_EQ(f32_to_e2m1(-100.0f), 0xF);
  EXPECT_EQ(f32_to_e2m1(kInf), 0x7);
  EXPECT_EQ(f32_to_e2m1(-kInf), 0xF);
  EXPECT_EQ(f32_to_e2m1(kNaN), 0x7);
  EXPECT_EQ(f32_to_e2m1(-0.0f), 0x8);
  EXPECT_EQ(f32_to_e2m1(-0.1f), 0x8);
  EXPECT_EQ(f32_to_e2m1(pow2f(-149)), 0x0);
}

TEST(E2m1, NearestEvenOnSampledInputs) {
  const auto values = code_values(0x7, e2m1_by_formula);
  for (const float x : sample_inputs(10.0f, 0x7, e2m1_by_formula)) {
    const int expected = nearest_code(x, values);
    ASSERT_EQ(f32_to_e2m1(x), expected) << x;
    ASSERT_EQ(f32_to_e2m1(-x), expected | 0x8) << -x;
  }
}

// ---- e8m0 and round_up_pow2 ----

TEST(E8m0, Values) {
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(128), 2.0f);
  EXPECT_EQ(e8m0_to_f32(120), 1.0f / 128);
  EXPECT_EQ(e8m0_to_f32(254), pow2f(127));
  EXPECT_EQ(bits_of(e8m0_to_f32(0)), 0x00400000u);  // 2^-127 is an fp32 subnormal
  EXPECT_EQ(bits_of(e8m0_to_f32(1)), 0x00800000u);  // 2^-126
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
}

TEST(RoundUpPow2, HandWorked) {
  EXPECT_EQ(round_up_pow2(1.0f), 1.0f);
  EXPECT_EQ(round_up_pow2(0.5f), 0.5f);
  EXPECT_EQ(round_up_pow2(pow2f(127)), pow2f(127));
  EXPECT_EQ(round_up_pow2(pow2f(-126)), pow2f(-126));
  EXPECT_EQ(round_up_pow2(1.0000001f), 2.0f);  // one ulp above 1
  EXPECT_EQ(round_up_pow2(std::nextafter(2.0f, 0.0f)), 2.0f);
  EXPECT_EQ(round_up_pow2(3.0f), 4.0f);
  EXPECT_EQ(round_up_pow2(0.75f), 1.0f);
  EXPECT_EQ(round_up_pow2(1.5f * pow2f(126)), pow2f(127));
  // 1e-4/448 = 2.232e-7 lies between 2^-23 = 1.192e-7 and 2^-22 = 2.384e-7.
  EXPECT_EQ(round_up_pow2(1e-4f * (1.0f / 448.0f)), pow2f(-22));
  // 1/448 = 2.232e-3 lies between 2^-9 = 1.953e-3 and 2^-8 = 3.906e-3.
  EXPECT_EQ(round_up_pow2(1.0f / 448.0f), pow2f(-8));
  // 0.05/448 = 1.116e-4 lies between 2^-14 = 6.10e-5 and 2^-13 = 1.221e-4.
  EXPECT_EQ(round_up_pow2(0.05f / 448.0f), pow2f(-13));
}

// Subnormal inputs give the smallest normal power of two (the header's "normal fp32 power of two").
TEST(RoundUpPow2, SubnormalInputs) {
  EXPECT_EQ(round_up_pow2(pow2f(-149)), pow2f(-126));
  EXPECT_EQ(round_up_pow2(pow2f(-127)), pow2f(-126));
  EXPECT_EQ(round_up_pow2(float_of(0x007FFFFFu)), pow2f(-126));
  EXPECT_EQ(round_up_pow2(float_of(0x00000003u)), pow2f(-126));
}

TEST(RoundUpPow2, ProperIsSmallestPowerAtOrAbove) {
  for (uint32_t b = 0x00800000u; b < 0x7F000000u; b += 65537) {
    const float s = float_of(b);
    const float p = round_up_pow2(s);
    ASSERT_EQ(bits_of(p) & 0x007FFFFFu, 0u) << s;  // a normal power of two
    ASSERT_GE(p, s);
    ASSERT_LT(p / 2, s);
  }
}

TEST(RoundUpPow2, RejectsInvalidInputs) {
  EXPECT_THROW(round_up_pow2(0.0f), Error);
  EXPECT_THROW(round_up_pow2(-0.0f), Error);
  EXPECT_THROW(round_up_pow2(-1.0f), Error);
  EXPECT_THROW(round_up_pow2(kInf), Error);
  EXPECT_THROW(round_up_pow2(kNaN), Error);
  EXPECT_THROW(round_up_pow2(1.5f * pow2f(127)), Error);  // 2^128 is not finite
}

}  // namespace
}  // namespace kestrel
