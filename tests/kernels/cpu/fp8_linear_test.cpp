// The FP8 block-scaled linear of the CPU reference (fp8_linear.h): the activation quantizer bit for bit against a
// plain scalar transcription of the rule (zero, tiny, subnormal, NaN and infinite groups, partial last groups,
// strided rows), values worked out by hand, the product bit for bit against a naive exact-sum loop, batch invariance,
// NaN propagation, and the expert FFN as its composition.
#include "kernels/cpu/fp8_linear.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/basic.h"

namespace kestrel::cpu {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// The rule as written in fp8_linear.h, one element at a time: amax by comparisons that skip NaN, the floor, the
// division, the clamp to +-448, then round to nearest even.
void scalar_quantize(const float* x, int64_t M, int64_t K, int64_t ldx, std::vector<uint8_t>& codes,
                     std::vector<float>& scales) {
  const int64_t G = (K + 127) / 128;
  codes.assign(static_cast<size_t>(M * K), 0);
  scales.assign(static_cast<size_t>(M * G), 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float amax = 0.0f;
      for (int64_t k = 128 * g; k < std::min(K, 128 * g + 128); ++k) {
        const float a = std::fabs(x[m * ldx + k]);
        if (a > amax) amax = a;
      }
      const float s = (amax > 1e-10f ? amax : 1e-10f) / 448.0f;
      scales[m * G + g] = s;
      for (int64_t k = 128 * g; k < std::min(K, 128 * g + 128); ++k) {
        const float q = x[m * ldx + k] / s;
        codes[m * K + k] = f32_to_e4m3(std::isnan(q) ? q : std::clamp(q, -448.0f, 448.0f));
      }
    }
}

// Rows of 300 columns (groups of 128, 128 and 44) in a stride of 333, each group of a different kind.
std::vector<float> varied_rows(int64_t M, int64_t K, int64_t ldx, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 9), exponent(-30, 30);
  std::vector<float> x(static_cast<size_t>(M * ldx), 1234.5f);  // the columns past K must not be read
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g * 128 < K; ++g) {
      const int k = kind(rng);
      const float magnitude = std::ldexp(1.0f, exponent(rng));
      for (int64_t c = 128 * g; c < std::min(K, 128 * g + 128); ++c) {
        float v = normal(rng) * magnitude;
        if (k == 0) v = 0.0f;                                           // zero group: the floor
        if (k == 1) v = normal(rng) * 1e-12f;                           // below the floor
        if (k == 2) v = normal(rng) * std::numeric_limits<float>::denorm_min() * 1000.0f;  // fp32 subnormals
        if (k == 3 && c == 128 * g + 5) v = kNaN;                       // one NaN
        if (k == 4 && c == 128 * g + 7) v = (m % 2) ? -kInf : kInf;     // one infinity
        if (k == 5) v = std::ldexp(normal(rng), exponent(rng));          // wide dynamic range within the group
        x[m * ldx + c] = v;
      }
    }
  return x;
}

bool same_bits(float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); }

TEST(Fp8Linear, QuantizeMatchesScalarRule) {
  std::mt19937 rng(7);
  const int64_t M = 64, K = 300, ldx = 333, G = fp8_groups(K);
  const std::vector<float> x = varied_rows(M, K, ldx, rng);
  std::vector<uint8_t> codes(M * K), want_codes;
  std::vector<float> scales(M * G), want_scales;
  quantize_fp8_groups(x.data(), M, K, ldx, codes.data(), scales.data());
  scalar_quantize(x.data(), M, K, ldx, want_codes, want_scales);
  for (int64_t i = 0; i < M * G; ++i) ASSERT_TRUE(same_bits(scales[i], want_scales[i])) << "scale " << i;
  for (int64_t i = 0; i < M * K; ++i) ASSERT_EQ(codes[i], want_codes[i]) << "code " << i;

  // Properties of the rule on the same data: every finite group whose amax is above the floor encodes its amax as
  // +-448 exactly (the quotient can exceed 448 by rounding only, and saturates there); NaN and infinite inputs give
  // the NaN code; a group with an infinity has an infinite scale and codes 0 for its finite values.
  int saturated = 0, nan_codes = 0, infinite_groups = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float s = scales[m * G + g];
      float amax = 0.0f;
      for (int64_t k = 128 * g; k < std::min(K, 128 * g + 128); ++k) amax = std::fmax(amax, std::fabs(x[m * ldx + k]));
      if (std::isinf(amax)) {
        ++infinite_groups;
        EXPECT_TRUE(std::isinf(s));
      }
      for (int64_t k = 128 * g; k < std::min(K, 128 * g + 128); ++k) {
        const float v = x[m * ldx + k];
        const uint8_t c = codes[m * K + k];
        if (std::isnan(v) || std::isinf(v)) {
          EXPECT_EQ(c, 0x7F) << "row " << m << " col " << k;
          ++nan_codes;
        } else if (std::isinf(amax)) {
          EXPECT_EQ(c & 0x7F, 0) << "row " << m << " col " << k;
        } else if (amax > 1e-10f && std::fabs(v) == amax) {
          EXPECT_EQ(c & 0x7F, 0x7E) << "row " << m << " col " << k;
          ++saturated;
        }
      }
    }
  EXPECT_GT(saturated, 50);
  EXPECT_GT(nan_codes, 5);
  EXPECT_GT(infinite_groups, 2);
}

TEST(Fp8Linear, QuantizeByHand) {
  // Group 0: amax 448 gives s = 1, so the codes are e4m3(x) itself. Group 1 (2 columns): all zero, the floor.
  std::vector<float> x(130, 0.0f);
  x[0] = 448.0f;
  x[1] = -224.0f;
  x[2] = 1.0f;
  x[3] = 0.001f;  // 0.512 of the smallest subnormal 2^-9: rounds up to it
  x[4] = 0.0009765625f;  // exactly half of 2^-9: ties to even, 0
  std::vector<uint8_t> codes(130);
  std::vector<float> scales(2);
  quantize_fp8_groups(x.data(), 1, 130, 130, codes.data(), scales.data());
  EXPECT_EQ(scales[0], 1.0f);
  EXPECT_EQ(scales[1], 1e-10f / 448.0f);
  EXPECT_EQ(codes[0], 0x7E);
  EXPECT_EQ(codes[1], 0xF6);
  EXPECT_EQ(codes[2], 0x38);
  EXPECT_EQ(codes[3], 0x01);
  EXPECT_EQ(codes[4], 0x00);
  EXPECT_EQ(codes[128], 0x00);
  EXPECT_EQ(codes[129], 0x00);
  EXPECT_EQ(fp8_group_scale(0.0f), 1e-10f / 448.0f);
  EXPECT_EQ(fp8_group_scale(56.0f), 0.125f);
}

// A naive transcription of the product: the group sum accumulated in double in k order (exact), then the fp32 steps.
std::vector<float> naive_linear(const std::vector<uint8_t>& xc, const std::vector<float>& xs, int64_t M, int64_t K,
                                const std::vector<uint8_t>& wc, const std::vector<float>& ws, int64_t N) {
  const int64_t G = (K + 127) / 128;
  std::vector<float> y(static_cast<size_t>(M * N));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int64_t g = 0; g < G; ++g) {
        double sum = 0.0;
        for (int64_t k = 128 * g; k < std::min(K, 128 * g + 128); ++k)
          sum += static_cast<double>(e4m3_to_f32(xc[m * K + k])) * e4m3_to_f32(wc[n * K + k]);
        const float s = xs[m * G + g] * ws[(n / 128) * G + g];
        acc = acc + s * static_cast<float>(sum);
      }
      y[m * N + n] = acc;
    }
  return y;
}

// Random non-NaN codes and positive scales spread over a wide range.
void random_operand(int64_t rows, int64_t K, std::mt19937& rng, std::vector<uint8_t>& codes, std::vector<float>& scales,
                    int64_t scale_rows) {
  std::uniform_int_distribution<int> byte(0, 255), exponent(-20, 10);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  codes.resize(static_cast<size_t>(rows * K));
  for (uint8_t& c : codes) {
    do c = static_cast<uint8_t>(byte(rng));
    while ((c & 0x7F) == 0x7F);
  }
  scales.resize(static_cast<size_t>(scale_rows * ((K + 127) / 128)));
  for (float& s : scales) s = std::ldexp(mantissa(rng), exponent(rng));
}

TEST(Fp8Linear, ProductMatchesNaiveExactSums) {
  std::mt19937 rng(11);
  struct Shape {
    int64_t M, K, N;
  };
  for (const Shape s : {Shape{1, 1, 1}, Shape{3, 5, 7}, Shape{2, 128, 128}, Shape{17, 130, 129}, Shape{5, 300, 200},
                        Shape{300, 256, 65}, Shape{4, 512, 300}}) {
    SCOPED_TRACE(testing::Message() << "M=" << s.M << " K=" << s.K << " N=" << s.N);
    std::vector<uint8_t> xc, wc;
    std::vector<float> xs, ws;
    random_operand(s.M, s.K, rng, xc, xs, s.M);
    random_operand(s.N, s.K, rng, wc, ws, fp8_groups(s.N));
    std::vector<float> y(static_cast<size_t>(s.M * s.N));
    linear_fp8_block_quantized(xc.data(), xs.data(), s.M, s.K, wc.data(), ws.data(), s.N, y.data());
    const std::vector<float> want = naive_linear(xc, xs, s.M, s.K, wc, ws, s.N);
    for (size_t i = 0; i < y.size(); ++i) ASSERT_TRUE(same_bits(y[i], want[i])) << "element " << i;
  }
}

TEST(Fp8Linear, ProductByHand) {
  // K = 130: group 0 all 56 (s = 0.125, codes 448), group 1 = {28, -56} (s = 0.125, codes 224, -448).
  // Weight row 0 all 1.0, row 1 all -1.0; block scales {0.5, 0.25}.
  // y[0] = 0.0625 * 128 * 448 + 0.03125 * (224 - 448) = 3584 - 7 = 3577; y[1] = -3577.
  std::vector<float> x(130, 56.0f);
  x[128] = 28.0f;
  x[129] = -56.0f;
  std::vector<uint8_t> w(2 * 130, 0x38);
  std::fill(w.begin() + 130, w.end(), uint8_t{0xB8});
  const std::vector<float> ws = {0.5f, 0.25f};
  std::vector<float> y(2);
  linear_fp8_block(x.data(), 1, 130, w.data(), ws.data(), 2, y.data());
  EXPECT_EQ(y[0], 3577.0f);
  EXPECT_EQ(y[1], -3577.0f);

  // The group sum is exact before its one rounding: the products 448^2, 448^2, 2^-18, -448^2, -448^2 sum to 2^-18,
  // where a running fp32 sum in k order would lose the 2^-18 against 2 * 448^2 and end at 0.
  std::vector<uint8_t> xc = {0x7E, 0x7E, 0x01, 0xFE, 0xFE}, wc = {0x7E, 0x7E, 0x01, 0x7E, 0x7E};
  const std::vector<float> one = {1.0f};
  float y1 = 0.0f;
  linear_fp8_block_quantized(xc.data(), one.data(), 1, 5, wc.data(), one.data(), 1, &y1);
  EXPECT_EQ(y1, std::ldexp(1.0f, -18));
}

TEST(Fp8Linear, RowsDoNotDependOnTheBatch) {
  std::mt19937 rng(13);
  const int64_t M = 300, K = 384, N = 70;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(M * K));
  for (float& v : x) v = normal(rng);
  std::vector<uint8_t> wc;
  std::vector<float> ws;
  random_operand(N, K, rng, wc, ws, fp8_groups(N));
  std::vector<float> y(static_cast<size_t>(M * N)), y1(static_cast<size_t>(N));
  linear_fp8_block(x.data(), M, K, wc.data(), ws.data(), N, y.data());
  for (int64_t m : {int64_t{0}, int64_t{1}, int64_t{255}, int64_t{256}, int64_t{299}}) {
    linear_fp8_block(x.data() + m * K, 1, K, wc.data(), ws.data(), N, y1.data());
    ASSERT_EQ(std::memcmp(y1.data(), y.data() + m * N, N * sizeof(float)), 0) << "row " << m;
  }

  // The float form is the quantizer followed by the quantized form.
  std::vector<uint8_t> xc(static_cast<size_t>(M * K));
  std::vector<float> xs(static_cast<size_t>(M * fp8_groups(K))), y2(y.size());
  quantize_fp8_groups(x.data(), M, K, K, xc.data(), xs.data());
  linear_fp8_block_quantized(xc.data(), xs.data(), M, K, wc.data(), ws.data(), N, y2.data());
  EXPECT_EQ(std::memcmp(y.data(), y2.data(), y.size() * sizeof(float)), 0);
}

TEST(Fp8Linear, NanActivationPoisonsOnlyItsRow) {
  std::mt19937 rng(17);
  const int64_t M = 4, K = 256, N = 33;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(M * K));
  for (float& v : x) v = normal(rng);
  x[1 * K + 200] = kNaN;
  x[2 * K + 3] = kInf;
  std::vector<uint8_t> wc;
  std::vector<float> ws;
  random_operand(N, K, rng, wc, ws, fp8_groups(N));
  std::vector<float> y(static_cast<size_t>(M * N));
  linear_fp8_block(x.data(), M, K, wc.data(), ws.data(), N, y.data());
  for (int64_t n = 0; n < N; ++n) {
    EXPECT_TRUE(std::isfinite(y[0 * N + n]));
    EXPECT_TRUE(std::isnan(y[1 * N + n]));
    EXPECT_TRUE(std::isnan(y[2 * N + n]));
    EXPECT_TRUE(std::isfinite(y[3 * N + n]));
  }
}

TEST(Fp8Linear, ExpertFfnIsTheComposition) {
  std::mt19937 rng(19);
  const int64_t T = 5, D = 256, F = 128;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T * D));
  for (float& v : x) v = normal(rng);
  std::vector<uint8_t> w13, w2;
  std::vector<float> s13, s2;
  random_operand(2 * F, D, rng, w13, s13, fp8_groups(2 * F));
  random_operand(D, F, rng, w2, s2, fp8_groups(D));
  std::vector<float> y(static_cast<size_t>(T * D));
  expert_ffn_fp8_block(x.data(), T, D, F, w13.data(), s13.data(), w2.data(), s2.data(), y.data());

  std::vector<float> gu(static_cast<size_t>(T * 2 * F)), h(static_cast<size_t>(T * F)), want(y.size());
  linear_fp8_block(x.data(), T, D, w13.data(), s13.data(), 2 * F, gu.data());
  for (int64_t t = 0; t < T; ++t) swiglu(gu.data() + t * 2 * F, gu.data() + t * 2 * F + F, h.data() + t * F, F);
  linear_fp8_block(h.data(), T, F, w2.data(), s2.data(), D, want.data());
  EXPECT_EQ(std::memcmp(y.data(), want.data(), y.size() * sizeof(float)), 0);

  EXPECT_THROW(expert_ffn_fp8_block(x.data(), T, D, 100, w13.data(), s13.data(), w2.data(), s2.data(), y.data()),
               Error);
}

TEST(Fp8Linear, RejectsBadShapes) {
  std::vector<float> x(16, 1.0f), y(16);
  std::vector<uint8_t> c(16);
  std::vector<float> s(16, 1.0f);
  EXPECT_THROW(quantize_fp8_groups(x.data(), 1, 4, 3, c.data(), s.data()), Error);    // ldx < K
  EXPECT_THROW(quantize_fp8_groups(x.data(), -1, 4, 4, c.data(), s.data()), Error);   // negative M
  EXPECT_THROW(linear_fp8_block(x.data(), 1, 0, c.data(), s.data(), 1, y.data()), Error);  // K = 0
  EXPECT_THROW(linear_fp8_block(x.data(), 1, 4, c.data(), s.data(), 0, y.data()), Error);  // N = 0
  EXPECT_NO_THROW(linear_fp8_block(x.data(), 0, 4, c.data(), s.data(), 1, y.data()));      // M = 0: nothing to do
}

}  // namespace
}  // namespace kestrel::cpu
