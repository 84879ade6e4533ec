// Number-format tests: hand-worked codes, every code of the small formats checked against its defining formula,
// and sampled inputs checked against a brute-force nearest-value search (ties to the even code).
#include "core/formats.h"

#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
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
      const uint16_t tie_winner = below % 2 == 0 ? below : above;
      const uint16_t expected = d_below < d_above ? below : d_above < d_below ? above : tie_winner;
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

// ---- FP8 block with a ue8m0 scale ----

TEST(QuantizeFp8Ue8m0, AllZeroBlockUsesTheAmaxFloor) {
  std::vector<float> x(128, 0.0f);
  x[5] = -0.0f;
  std::vector<uint8_t> codes(128, 0xAA);
  // amax is floored at 1e-4; 1e-4/448 = 2.23e-7 rounds up to 2^-22 = 2.38e-7.
  EXPECT_EQ(quantize_fp8_ue8m0(x.data(), 128, codes.data()), pow2f(-22));
  for (int i = 0; i < 128; ++i) EXPECT_EQ(codes[i], i == 5 ? 0x80 : 0x00) << i;
}

TEST(QuantizeFp8Ue8m0, SmallBlockBelowTheFloor) {
  // amax 5e-5 < 1e-4, so s = 2^-22 as for zeros; 5e-5 * 2^22 = 209.7, nearest e4m3 is 208 = 1.625 * 2^7: 0x75.
  const float x[4] = {5e-5f, -5e-5f, 0.0f, 1e-6f};  // 1e-6 * 2^22 = 4.19: nearest is 4 = 0x48
  uint8_t codes[4];
  EXPECT_EQ(quantize_fp8_ue8m0(x, 4, codes), pow2f(-22));
  EXPECT_EQ(codes[0], 0x75);
  EXPECT_EQ(codes[1], 0xF5);
  EXPECT_EQ(codes[2], 0x00);
  EXPECT_EQ(codes[3], 0x48);
}

TEST(QuantizeFp8Ue8m0, HandWorkedBlocks) {
  {
    // fp32(1/448) * 448 is exactly 1, so amax 448 gives s = 1 and 448 maps to the top code.
    const float x[5] = {448.0f, -224.0f, 1.0f, 0.5f, 3e-3f};
    uint8_t codes[5];
    EXPECT_EQ(quantize_fp8_ue8m0(x, 5, codes), 1.0f);
    EXPECT_EQ(codes[0], 0x7E);
    EXPECT_EQ(codes[1], 0xF6);
    EXPECT_EQ(codes[2], 0x38);
    EXPECT_EQ(codes[3], 0x30);
    EXPECT_EQ(codes[4], 0x02);  // 3e-3 = 1.536 * 2^-9: subnormal code 2
  }
  {
    // One ulp above 448: amax * fp32(1/448) > 1, so s doubles and the block tops out at 224 (0x76), not 448.
    const float x[2] = {std::nextafter(448.0f, 1e9f), 1.0f};
    uint8_t codes[2];
    EXPECT_EQ(quantize_fp8_ue8m0(x, 2, codes), 2.0f);
    EXPECT_EQ(codes[0], 0x76);
    EXPECT_EQ(codes[1], 0x30);
  }
  {
    // 7 * fp32(1/448) rounds to exactly 2^-6, so 7 / s = 448 exactly and -3.5 / s = -224.
    const float x[2] = {7.0f, -3.5f};
    uint8_t codes[2];
    EXPECT_EQ(quantize_fp8_ue8m0(x, 2, codes), pow2f(-6));
    EXPECT_EQ(codes[0], 0x7E);
    EXPECT_EQ(codes[1], 0xF6);
    float out[2];
    dequantize_fp8(codes, 2, pow2f(-6), out);
    EXPECT_EQ(out[0], 7.0f);
    EXPECT_EQ(out[1], -3.5f);
  }
}

// The header asks for amax * fp32(1/448), not amax / 448. The two do differ in fp32 (example below), but an
// exhaustive run over every positive finite fp32 amax (done once, about 8 s, not part of this suite) found no
// amax whose ue8m0 scale differs between them: s is a power of two, and the product and quotient only differ
// by one ulp away from powers of two. So the choice cannot be seen through this API, and the test pins the
// formula at the boundaries where it matters (amax = 448 * 2^k and its neighbours) and checks the clamp there:
// no scaled value exceeds 448. formats.cpp uses the multiplication (kInvE4m3Max).
TEST(QuantizeFp8Ue8m0, ScaleIsProductRoundedUpAtPowerOfTwoBoundaries) {
  const float one_over_448 = 1.0f / 448.0f;
  const float a = 0x1.000008p+0f;
  EXPECT_NE(a * one_over_448, a / 448.0f);  // 0x1.249254p-9 vs 0x1.249252p-9
  EXPECT_EQ(round_up_pow2(a * one_over_448), round_up_pow2(a / 448.0f));

  for (int k = -12; k <= 20; ++k) {
    const float boundary = 448.0f * pow2f(k);
    float amax = boundary;
    for (int step = 0; step < 32; ++step) amax = std::nextafter(amax, 0.0f);
    for (int step = -32; step <= 32; ++step, amax = std::nextafter(amax, 1e30f)) {
      const float x[3] = {-amax, amax / 3, 0.0f};
      uint8_t codes[3];
      const float s = quantize_fp8_ue8m0(x, 3, codes);
      ASSERT_EQ(s, round_up_pow2(std::max(amax, 1e-4f) * one_over_448)) << amax;
      ASSERT_EQ(s, step <= 0 ? pow2f(k) : pow2f(k + 1)) << amax;
      ASSERT_LE(std::fabs(x[0]) / s, kE4m3Max) << amax;
      ASSERT_EQ(codes[0], f32_to_e4m3(x[0] / s));
    }
  }
}

// Random blocks of 128 at magnitudes from 2^-30 to 2^30: s is the smallest normal power of two >= amax/448
// (amax floored at 1e-4), and every dequantised value is within half an e4m3 spacing of its input: relative
// 2^-4 in the normal range, absolute 2^-10 * s in the subnormal range.
TEST(QuantizeFp8Ue8m0, RandomBlocksStayWithinHalfASpacing) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> magnitude(-30, 30);
  std::vector<float> x(128), out(128);
  std::vector<uint8_t> codes(128);
  for (int trial = 0; trial < 500; ++trial) {
    const float m = pow2f(magnitude(rng));
    float amax = 0.0f;
    for (float& v : x) {
      v = normal(rng) * m;
      amax = std::max(amax, std::fabs(v));
    }
    const float s = quantize_fp8_ue8m0(x.data(), 128, codes.data());
    const double floored = std::max(static_cast<double>(amax), static_cast<double>(1e-4f));
    ASSERT_EQ(bits_of(s) & 0x007FFFFFu, 0u);
    ASSERT_GE(static_cast<double>(s), floored / 448 * (1 - 1e-7));  // fp32(1/448) is 1/448 to 2^-25
    ASSERT_LT(static_cast<double>(s) / 2, floored / 448 * (1 + 1e-7));
    dequantize_fp8(codes.data(), 128, s, out.data());
    for (int i = 0; i < 128; ++i) {
      const double err = std::fabs(static_cast<double>(out[i]) - x[i]);
      ASSERT_LE(err, std::max(std::fabs(x[i]) * 0.0625, std::ldexp(static_cast<double>(s), -10))) << x[i];
    }
  }
}

TEST(QuantizeFp8Ue8m0, RejectsNonFiniteValues) {
  uint8_t codes[2];
  const float with_nan[2] = {1.0f, kNaN};
  const float with_inf[2] = {-kInf, 1.0f};
  EXPECT_THROW(quantize_fp8_ue8m0(with_nan, 2, codes), Error);
  EXPECT_THROW(quantize_fp8_ue8m0(with_inf, 2, codes), Error);
  EXPECT_THROW(quantize_fp8_ue8m0(with_nan, -1, codes), Error);
}

// ---- helpers for the FP4 block formats ----

const float kE2m1Grid[15] = {-6, -4, -3, -2, -1.5f, -1, -0.5f, 0, 0.5f, 1, 1.5f, 2, 3, 4, 6};

uint8_t nibble(const std::vector<uint8_t>& packed, int64_t i) {
  return static_cast<uint8_t>(i % 2 == 0 ? packed[i / 2] & 0xF : packed[i / 2] >> 4);
}

// The code's value is a nearest e2m1 grid point to the scaled input q (ties and saturation included).
void expect_nearest_on_grid(float q, uint8_t code) {
  const double chosen = std::fabs(static_cast<double>(q) - e2m1_to_f32(code));
  for (const float g : kE2m1Grid) ASSERT_LE(chosen, std::fabs(static_cast<double>(q) - g)) << q;
}

// ---- MXFP4 ----

TEST(Mxfp4, PackingAndScaleByHand) {
  std::vector<float> x(32, 0.0f);
  x[0] = 1.0f;   // 0x2
  x[1] = -2.0f;  // 0xC
  x[2] = 6.0f;   // 0x7; amax 6: floor(log2 6) - 2 = 0, scale code 127
  x[3] = 0.5f;   // 0x1
  x[31] = -0.5f; // 0x9, the high nibble of byte 15
  std::vector<uint8_t> packed(16), scales(1);
  mxfp4_encode(x.data(), 32, packed.data(), scales.data());
  EXPECT_EQ(scales[0], 127);
  EXPECT_EQ(packed[0], 0xC2);
  EXPECT_EQ(packed[1], 0x17);
  for (int i = 2; i < 15; ++i) EXPECT_EQ(packed[i], 0x00) << i;
  EXPECT_EQ(packed[15], 0x90);
  std::vector<float> out(32);
  mxfp4_decode(packed.data(), scales.data(), 32, out.data());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(out[i], x[i]) << i;
}

TEST(Mxfp4, SharedExponentByHand) {
  struct Case {
    float amax, other;
    uint8_t scale, amax_code, other_code;
  };
  const Case cases[] = {
      {1.0f, 0.3f, 125, 0x6, 0x2},          // e = 0 - 2: 1 / 0.25 = 4; 0.3 / 0.25 = 1.2 -> 1
      {7.9f, 2.5f, 127, 0x7, 0x4},          // e = 2 - 2: 7.9 saturates to 6; 2.5 ties to 2
      {8.0f, -5.0f, 128, 0x6, 0xC},         // e = 3 - 2: 8 / 2 = 4; -5 / 2 = -2.5 ties to -2
      {pow2f(-126), 0.0f, 0, 0x4, 0x0},     // e = -128 clamps to -127: 2^-126 / 2^-127 = 2
      {3 * pow2f(-128), 0.0f, 0, 0x3, 0x0}, // subnormal amax, floor(log2) = -127: clamped, 1.5
      {pow2f(-130), 0.0f, 0, 0x0, 0x0},     // clamped: 2^-130 / 2^-127 = 0.125 rounds to 0
      {0.0f, 0.0f, 0, 0x0, 0x0},            // all zeros: exponent -127
  };
  for (const Case& c : cases) {
    std::vector<float> x(32, 0.0f);
    x[6] = c.amax;
    x[7] = c.other;
    std::vector<uint8_t> packed(16), scales(1);
    mxfp4_encode(x.data(), 32, packed.data(), scales.data());
    EXPECT_EQ(scales[0], c.scale) << c.amax;
    EXPECT_EQ(packed[3], c.amax_code | (c.other_code << 4)) << c.amax;
  }
}

TEST(Mxfp4, RepresentableValuesRoundTripExactly) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> exponent(-127, 125), code(0, 15), slot(0, 31), top(0, 1);
  const int64_t n = 32 * 64;
  std::vector<float> x(n), out(n);
  std::vector<uint8_t> packed(n / 2), scales(n / 32), packed2(n / 2), scales2(n / 32);
  for (int64_t b = 0; b < n / 32; ++b) {
    scales[b] = static_cast<uint8_t>(exponent(rng) + 127);
    for (int i = 0; i < 32; ++i) {
      const uint8_t c = static_cast<uint8_t>(code(rng));
      packed[(b * 32 + i) / 2] = i % 2 == 0 ? c : static_cast<uint8_t>(packed[(b * 32 + i) / 2] | (c << 4));
    }
    // A 4 or a 6 in the block pins its shared exponent: floor(log2(amax / 2^e)) = 2.
    const int64_t pinned = b * 32 + slot(rng);
    const uint8_t pinned_code = top(rng) ? 0x6 : 0xF;
    packed[pinned / 2] = pinned % 2 == 0 ? static_cast<uint8_t>((packed[pinned / 2] & 0xF0) | pinned_code)
                                         : static_cast<uint8_t>((packed[pinned / 2] & 0x0F) | (pinned_code << 4));
  }
  mxfp4_decode(packed.data(), scales.data(), n, x.data());
  mxfp4_encode(x.data(), n, packed2.data(), scales2.data());
  EXPECT_EQ(scales2, scales);
  EXPECT_EQ(packed2, packed);
  mxfp4_decode(packed2.data(), scales2.data(), n, out.data());
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bits_of(out[i]), bits_of(x[i])) << i;
}

// Bound for random inputs: with e = floor(log2 amax) - 2, amax / 2^e lies in [4, 8). A value that fits under
// 6 * 2^e is off by at most half the widest e2m1 spacing (2, between 4 and 6), i.e. 2^e <= amax / 4; a value
// past 6 * 2^e is clipped by |x| - 6 * 2^e < (8 - 6) / 8 * amax. So |error| <= amax / 4 in every block, and each
// code is a nearest grid point to x / 2^e.
TEST(Mxfp4, RandomInputsStayWithinTheBlockBound) {
  std::mt19937 rng(99);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> magnitude(-40, 40);
  const int64_t n = 32 * 400;
  std::vector<float> x(n), out(n);
  std::vector<uint8_t> packed(n / 2), scales(n / 32);
  for (int64_t b = 0; b < n / 32; ++b) {
    const float m = pow2f(magnitude(rng));
    for (int i = 0; i < 32; ++i) x[b * 32 + i] = normal(rng) * m;
  }
  mxfp4_encode(x.data(), n, packed.data(), scales.data());
  mxfp4_decode(packed.data(), scales.data(), n, out.data());
  for (int64_t b = 0; b < n / 32; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    const double scale = e8m0_to_f32(scales[b]);
    ASSERT_LE(4 * scale, amax);
    ASSERT_GT(8 * scale, amax);
    for (int i = 0; i < 32; ++i) {
      const int64_t j = b * 32 + i;
      ASSERT_LE(std::fabs(static_cast<double>(out[j]) - x[j]), amax / 4.0) << j;
      expect_nearest_on_grid(static_cast<float>(x[j] / scale), nibble(packed, j));
    }
  }
}

TEST(Mxfp4, RejectsBadLengthsAndNonFiniteValues) {
  std::vector<float> x(64, 1.0f), out(64);
  std::vector<uint8_t> packed(32), scales(2);
  EXPECT_THROW(mxfp4_encode(x.data(), 48, packed.data(), scales.data()), Error);
  EXPECT_THROW(mxfp4_decode(packed.data(), scales.data(), 16, out.data()), Error);
  x[40] = kInf;
  EXPECT_THROW(mxfp4_encode(x.data(), 64, packed.data(), scales.data()), Error);
}

// ---- NVFP4 ----

TEST(Nvfp4, PackingAndScalesByHand) {
  {
    // tensor scale 1, amax 6: block scale e4m3(6 / 6) = 1.0 = 0x38.
    std::vector<float> x(16, 0.0f);
    x[0] = 6.0f;    // 0x7
    x[1] = -0.5f;   // 0x9
    x[2] = 1.5f;    // 0x3
    x[3] = 2.9f;    // 3 = 0x5
    std::vector<uint8_t> packed(8), scales(1);
    nvfp4_encode(x.data(), 16, 1.0f, packed.data(), scales.data());
    EXPECT_EQ(scales[0], 0x38);
    EXPECT_EQ(packed[0], 0x97);
    EXPECT_EQ(packed[1], 0x53);
    for (int i = 2; i < 8; ++i) EXPECT_EQ(packed[i], 0x00);
  }
  {
    // tensor scale 0.5, amax 12: e4m3(12 / 3) = 4 = 0x48; block scale 4 * 0.5 = 2.
    std::vector<float> x(32, 0.0f);
    x[16] = 12.0f;  // 6 = 0x7
    x[17] = -5.0f;  // -2.5 ties to -2 = 0xC
    x[18] = 0.7f;   // 0.35 -> 0.5 = 0x1
    std::vector<uint8_t> packed(16), scales(2);
    nvfp4_encode(x.data(), 32, 0.5f, packed.data(), scales.data());
    EXPECT_EQ(scales[0], 0x00);  // the all-zero first block
    EXPECT_EQ(scales[1], 0x48);
    EXPECT_EQ(packed[8], 0xC7);
    EXPECT_EQ(packed[9], 0x01);
    std::vector<float> out(32);
    nvfp4_decode(packed.data(), scales.data(), 32, 0.5f, out.data());
    EXPECT_EQ(out[16], 12.0f);
    EXPECT_EQ(out[17], -4.0f);
    EXPECT_EQ(out[18], 1.0f);
    EXPECT_EQ(out[0], 0.0f);
  }
}

TEST(Nvfp4, ZeroAndRoundedScales) {
  std::vector<float> x(16, 0.0f);
  std::vector<uint8_t> packed(8), scales(1);
  std::vector<float> out(16);
  // A block scale that rounds to zero (amax / 6 = 2^-12 < 2^-10, half the smallest e4m3 subnormal) encodes zeros,
  // negative values included.
  x[0] = 6 * pow2f(-12);
  x[1] = -6 * pow2f(-12);
  nvfp4_encode(x.data(), 16, 1.0f, packed.data(), scales.data());
  EXPECT_EQ(scales[0], 0x00);
  for (const uint8_t byte : packed) EXPECT_EQ(byte, 0x00);
  nvfp4_decode(packed.data(), scales.data(), 16, 1.0f, out.data());
  for (const float v : out) EXPECT_EQ(v, 0.0f);
  // amax 6.375: 6.375 / 6 = 1.0625 ties to 1.0 in e4m3, so the block scale is 1 and 6.375 clips to 6.
  x[0] = 6.375f;
  x[1] = -1.25f;  // ties to -1
  nvfp4_encode(x.data(), 16, 1.0f, packed.data(), scales.data());
  EXPECT_EQ(scales[0], 0x38);
  EXPECT_EQ(packed[0], 0xA7);
}

// Decoding multiplies the e2m1 value by the decoded block scale sb = e4m3 * tensor_scale (rounded to fp32 first),
// the same sb the encoder divides by; multiplying the two small values first would round differently here.
TEST(Nvfp4, DecodeMultipliesByTheRoundedBlockScale) {
  const float tensor_scale = 0.1f;
  std::vector<uint8_t> packed(8, 0x00), scales(1, 0x3B);  // 0x3B = 1.375
  packed[0] = 0x05;                                        // element 0: 3.0
  std::vector<float> out(16);
  nvfp4_decode(packed.data(), scales.data(), 16, tensor_scale, out.data());
  const float block_scale = 1.375f * tensor_scale;
  ASSERT_NE(3.0f * block_scale, (3.0f * 1.375f) * tensor_scale);
  EXPECT_EQ(out[0], 3.0f * block_scale);
  EXPECT_EQ(out[1], 0.0f);
}

TEST(Nvfp4, RepresentableValuesRoundTripExactly) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> scale_code(0x08, 0x7E), code(0, 15), slot(0, 15), tensor_exp(-20, 20);
  const int64_t n = 16 * 64;
  std::vector<float> x(n), out(n);
  std::vector<uint8_t> packed(n / 2), scales(n / 16), packed2(n / 2), scales2(n / 16);
  for (int trial = 0; trial < 8; ++trial) {
    const float tensor_scale = pow2f(tensor_exp(rng));
    for (int64_t b = 0; b < n / 16; ++b) {
      scales[b] = static_cast<uint8_t>(scale_code(rng));
      for (int i = 0; i < 16; i += 2) {
        packed[(b * 16 + i) / 2] = static_cast<uint8_t>(code(rng) | (code(rng) << 4));
      }
      const int64_t pinned = b * 16 + slot(rng);  // a +-6 makes amax = 6 * block scale
      packed[pinned / 2] = pinned % 2 == 0 ? static_cast<uint8_t>((packed[pinned / 2] & 0xF0) | 0x7)
                                           : static_cast<uint8_t>((packed[pinned / 2] & 0x0F) | 0xF0);
    }
    nvfp4_decode(packed.data(), scales.data(), n, tensor_scale, x.data());
    nvfp4_encode(x.data(), n, tensor_scale, packed2.data(), scales2.data());
    ASSERT_EQ(scales2, scales);
    ASSERT_EQ(packed2, packed);
    nvfp4_decode(packed2.data(), scales2.data(), n, tensor_scale, out.data());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bits_of(out[i]), bits_of(x[i])) << i;
  }
}

// Bound for random inputs with a tensor scale that is not a power of two (global amax / (6 * 448), as NVFP4
// quantisers choose it): with the block scale sb as decoded, each code is a nearest grid point to x / sb, so a
// value under 6 * sb is off by at most half the widest spacing, sb; a value past it is clipped by |x| - 6 * sb.
// While amax / (6 * tensor scale) is in e4m3's normal range, sb is within 2^-4 (relative) of amax / 6, so the
// clipping is at most amax * (1 - 1/(1 + 2^-4)) < amax / 16 and the error overall below amax * (1 + 2^-4) / 6.
TEST(Nvfp4, RandomInputsStayWithinTheBlockBound) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> spread(0.05f, 1.0f);
  const int64_t n = 16 * 512;
  std::vector<float> x(n), out(n);
  std::vector<uint8_t> packed(n / 2), scales(n / 16);
  float global_amax = 0.0f;
  for (int64_t b = 0; b < n / 16; ++b) {
    const float m = 3.7f * spread(rng);  // block amaxes within a factor ~60 of each other: normal e4m3 scales
    for (int i = 0; i < 16; ++i) {
      x[b * 16 + i] = normal(rng) * m;
      global_amax = std::max(global_amax, std::fabs(x[b * 16 + i]));
    }
  }
  const float tensor_scale = global_amax / (6.0f * 448.0f);
  nvfp4_encode(x.data(), n, tensor_scale, packed.data(), scales.data());
  nvfp4_decode(packed.data(), scales.data(), n, tensor_scale, out.data());
  for (int64_t b = 0; b < n / 16; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[b * 16 + i]));
    const float sb = e4m3_to_f32(scales[b]) * tensor_scale;
    ASSERT_GE(scales[b], 0x08) << b;  // normal block scale
    ASSERT_LE(std::fabs(6.0 * sb - amax), amax * 0.0625 * 1.0001) << b;
    for (int i = 0; i < 16; ++i) {
      const int64_t j = b * 16 + i;
      const double err = std::fabs(static_cast<double>(out[j]) - x[j]);
      const double bound = std::max<double>(sb, std::fabs(x[j]) - 6.0 * sb) * (1 + 1e-6);  // 1e-6: fp32 product
      ASSERT_LE(err, bound) << j;
      ASSERT_LE(err, amax * (1 + 0.0625) / 6 * (1 + 1e-6)) << j;
      expect_nearest_on_grid(x[j] / sb, nibble(packed, j));
    }
  }
}

TEST(Nvfp4, RejectsBadArguments) {
  std::vector<float> x(32, 1.0f), out(32);
  std::vector<uint8_t> packed(16), scales(2);
  EXPECT_THROW(nvfp4_encode(x.data(), 24, 1.0f, packed.data(), scales.data()), Error);
  EXPECT_THROW(nvfp4_decode(packed.data(), scales.data(), 8, 1.0f, out.data()), Error);
  EXPECT_THROW(nvfp4_encode(x.data(), 32, 0.0f, packed.data(), scales.data()), Error);
  EXPECT_THROW(nvfp4_encode(x.data(), 32, -1.0f, packed.data(), scales.data()), Error);
  EXPECT_THROW(nvfp4_encode(x.data(), 32, kNaN, packed.data(), scales.data()), Error);
  EXPECT_THROW(nvfp4_encode(x.data(), 32, FLT_MAX / 100, packed.data(), scales.data()), Error);
  x[3] = kNaN;
  EXPECT_THROW(nvfp4_encode(x.data(), 32, 1.0f, packed.data(), scales.data()), Error);
}

}  // namespace
}  // namespace kestrel
