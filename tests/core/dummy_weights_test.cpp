#include "core/dummy_weights.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/formats.h"

namespace kestrel {
namespace {

std::vector<uint8_t> fill(const DummySpec& spec) {
  std::vector<uint8_t> out(dummy_bytes(spec));
  fill_dummy(spec, out);
  return out;
}

DummySpec plain(DType dtype, std::vector<int64_t> shape, float amplitude, float offset = 0.0f) {
  DummySpec s;
  s.seed = 7;
  s.key = tensor_key("model.layers.0.mlp.up_proj.weight");
  s.dtype = dtype;
  s.shape = std::move(shape);
  s.amplitude = amplitude;
  s.offset = offset;
  return s;
}

// The two parts of one quantised weight [N, K] (FP8 block-scaled or MXFP4).
struct QuantisedSpecs {
  DummySpec codes, scales;
};

QuantisedSpecs fp8_weight(int64_t N, int64_t K, float amplitude, std::vector<int64_t> batch = {}) {
  DummySpec c;
  c.seed = 11;
  c.key = tensor_key("model.layers.3.self_attn.q_b_proj.weight");
  c.amplitude = amplitude;
  DummySpec s = c;
  c.layout = DummyLayout::fp8_codes;
  c.dtype = DType::F8_E4M3;
  c.shape = batch;
  c.shape.insert(c.shape.end(), {N, K});
  s.layout = DummyLayout::fp8_scales;
  s.dtype = DType::F32;
  s.shape = batch;
  s.shape.insert(s.shape.end(), {(N + 127) / 128, (K + 127) / 128});
  return {c, s};
}

QuantisedSpecs mxfp4_weight(int64_t N, int64_t K, float amplitude, DType scale_dtype = DType::U8) {
  DummySpec c;
  c.seed = 5;
  c.key = tensor_key("model.layers.1.mlp.experts.4.down_proj");
  c.amplitude = amplitude;
  DummySpec s = c;
  c.layout = DummyLayout::mxfp4_codes;
  c.dtype = DType::U8;
  c.shape = {N, K / 2};
  s.layout = DummyLayout::mxfp4_scales;
  s.dtype = scale_dtype;
  s.shape = {N, K / 32};
  return {c, s};
}

float f32_at(const std::vector<uint8_t>& b, size_t i) {
  float v;
  std::memcpy(&v, b.data() + 4 * i, 4);
  return v;
}

uint16_t u16_at(const std::vector<uint8_t>& b, size_t i) { return static_cast<uint16_t>(b[2 * i] | b[2 * i + 1] << 8); }

float f16_to_f32(uint16_t h) { return static_cast<float>(std::bit_cast<_Float16>(h)); }

// Decoded values of a plain tensor.
std::vector<float> decode_plain(const DummySpec& spec, const std::vector<uint8_t>& b) {
  std::vector<float> v(b.size() / dtype_size(spec.dtype));
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = spec.dtype == DType::F32    ? f32_at(b, i)
           : spec.dtype == DType::BF16 ? bf16_to_f32(u16_at(b, i))
                                       : f16_to_f32(u16_at(b, i));
  return v;
}

// e4m3(code) * scale of its 128 x 128 tile, for codes [..., N, K].
std::vector<float> decode_fp8(const QuantisedSpecs& w, const std::vector<uint8_t>& codes,
                              const std::vector<uint8_t>& scales) {
  const int64_t N = w.codes.shape[w.codes.shape.size() - 2], K = w.codes.shape.back();
  const int64_t SN = (N + 127) / 128, SK = (K + 127) / 128;
  std::vector<float> v(codes.size());
  for (size_t i = 0; i < codes.size(); ++i) {
    const int64_t m = static_cast<int64_t>(i) / (N * K), r = static_cast<int64_t>(i) / K % N,
                  c = static_cast<int64_t>(i) % K;
    v[i] = e4m3_to_f32(codes[i]) * f32_at(scales, static_cast<size_t>((m * SN + r / 128) * SK + c / 128));
  }
  return v;
}

struct Moments {
  double mean = 0, var = 0;
};
Moments moments(const std::vector<float>& v) {
  Moments m;
  for (float x : v) m.mean += x;
  m.mean /= static_cast<double>(v.size());
  for (float x : v) m.var += (x - m.mean) * (x - m.mean);
  m.var /= static_cast<double>(v.size());
  return m;
}

size_t differing_bytes(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

TEST(DummyWeights, HashesAreSplitmix64AndFnv1a) {
  // splitmix64 from state 0: its first outputs (the reference implementation's published sequence).
  EXPECT_EQ(dummy::stream_bits(0, 0), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(dummy::stream_bits(0, 1), 0x6E789E6AA1B965F4ull);
  EXPECT_EQ(dummy::stream_bits(0, 2), 0x06C45D188009454Full);
  // FNV-1a 64 test vectors ("" and "a"), then the mix.
  EXPECT_EQ(tensor_key(""), dummy::mix64(0xCBF29CE484222325ull));
  EXPECT_EQ(tensor_key("a"), dummy::mix64(0xAF63DC4C8601EC8Cull));
  EXPECT_NE(tensor_key("model.layers.0.mlp.up_proj.weight"), tensor_key("model.layers.0.mlp.down_proj.weight"));
  EXPECT_NE(tensor_key("model.layers.1.mlp.up_proj.weight"), tensor_key("model.layers.0.mlp.up_proj.weight"));
}

TEST(DummyWeights, DeviceConversionsMatchTheHostFormats) {
  // The generator's own encoders (which the GPU runs) against core/formats.h and the compiler's _Float16: every
  // combination of the top 16 fp32 bits up to 65504, with low halves that put the dropped bits of each format just
  // below, at and above its rounding tie.
  const uint32_t lows[] = {0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x7FFF, 0x8000, 0x8001, 0xFFFF};
  for (uint32_t high = 0; high <= 0x477F; ++high) {
    for (uint32_t low : lows) {
      const float magnitude = std::bit_cast<float>(high << 16 | low);
      for (float x : {magnitude, -magnitude}) {
        if (magnitude <= 448.0f) {
          ASSERT_EQ(dummy::e4m3_code(x), f32_to_e4m3(x)) << x;
        }
        if (magnitude <= 6.0f) {
          ASSERT_EQ(dummy::e2m1_code(x), f32_to_e2m1(x)) << x;
        }
        ASSERT_EQ(dummy::bf16_bits(x), f32_to_bf16(x)) << x;
        ASSERT_EQ(dummy::f16_bits(x), std::bit_cast<uint16_t>(static_cast<_Float16>(x))) << x;
      }
    }
  }
  for (uint32_t code = 0; code < 0x7F; ++code) ASSERT_EQ(dummy::e4m3_magnitude(code), e4m3_to_f32(code)) << code;
}

TEST(DummyWeights, PlainValuesFollowTheFormula) {
  // offset + A * u_i, u_i = (2 m + 1 - 2^23) 2^-23 with m the top 23 bits of splitmix64's output i + 1 from the
  // value stream's state: recomputed here from the header's description.
  for (DType d : {DType::F32, DType::BF16, DType::F16}) {
    const DummySpec spec = plain(d, {3, 37}, 0.37f, 0.5f);
    const DummyParams p = dummy_params(spec);
    const std::vector<float> got = decode_plain(spec, fill(spec));
    for (size_t i = 0; i < got.size(); ++i) {
      const uint64_t z = dummy::mix64(p.stream + (i + 1) * 0x9E3779B97F4A7C15ull);
      const float u = static_cast<float>(static_cast<int64_t>(z >> 41) * 2 + 1 - (int64_t{1} << 23)) / 8388608.0f;
      const float v = 0.5f + 0.37f * u;
      const float want = d == DType::F32 ? v : d == DType::BF16 ? round_to_bf16(v) : static_cast<float>(_Float16(v));
      ASSERT_EQ(got[i], want) << dtype_name(d) << " element " << i;
    }
  }
}

TEST(DummyWeights, DeterministicBySeedAndKey) {
  const std::vector<DummySpec> specs = {plain(DType::BF16, {64, 96}, 0.1f), plain(DType::F32, {1000}, 1.0f),
                                        plain(DType::F16, {33, 5}, 2.0f), fp8_weight(300, 200, 0.05f).codes,
                                        fp8_weight(128 * 40, 128 * 40, 0.05f).scales,
                                        mxfp4_weight(40, 64, 0.2f).codes, mxfp4_weight(40, 1024, 0.2f).scales};
  for (const DummySpec& spec : specs) {
    SCOPED_TRACE(dummy_layout_name(spec.layout));
    const std::vector<uint8_t> a = fill(spec);
    EXPECT_EQ(a, fill(spec));
    DummySpec other_seed = spec;
    other_seed.seed += 1;
    DummySpec other_key = spec;
    other_key.key = tensor_key("another.weight");
    // Different streams: most bytes differ; scales take 4 (FP8: one byte or two of the four change) or 2 values.
    const size_t min_differing = spec.layout == DummyLayout::fp8_scales     ? a.size() / 8
                                 : spec.layout == DummyLayout::mxfp4_scales ? a.size() / 4
                                                                            : a.size() / 2;
    EXPECT_GT(differing_bytes(a, fill(other_seed)), min_differing);
    EXPECT_GT(differing_bytes(a, fill(other_key)), min_differing);
  }
}

TEST(DummyWeights, ElementsDependOnlyOnTheirIndex) {
  // Counter-based: a longer tensor of the same seed and key starts with the shorter one's bytes.
  const std::vector<uint8_t> a = fill(plain(DType::BF16, {1001}, 0.1f));
  const std::vector<uint8_t> b = fill(plain(DType::BF16, {7, 1001}, 0.1f));
  EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin()));
}

TEST(DummyWeights, PlainRangeAndMoments) {
  struct Case {
    DType dtype;
    float amplitude, offset, half_ulp;  // half an ulp of the dtype at the largest magnitude
  };
  for (const Case& c : {Case{DType::F32, 0.02f, 0.0f, 0.0f}, Case{DType::BF16, 0.05f, 1.0f, 1.0f / 256},
                        Case{DType::F16, 3.0f, -2.0f, 1.0f / 512}, Case{DType::BF16, 1.0f, 0.0f, 0.0f}}) {
    SCOPED_TRACE(dtype_name(c.dtype));
    const DummySpec spec = plain(c.dtype, {257, 391}, c.amplitude, c.offset);
    const std::vector<float> v = decode_plain(spec, fill(spec));
    for (size_t i = 0; i < v.size(); ++i)
      ASSERT_LE(std::fabs(v[i] - c.offset), c.amplitude + c.half_ulp) << "element " << i << " = " << v[i];
    const Moments m = moments(v);
    const double n = static_cast<double>(v.size()), var = c.amplitude * c.amplitude / 3.0;
    EXPECT_NEAR(m.mean, c.offset, 5 * std::sqrt(var / n));
    EXPECT_NEAR(m.var / var, 1.0, 0.02);
  }
  const DummySpec constant = plain(DType::BF16, {10}, 0.0f, 1.0f);
  for (float x : decode_plain(constant, fill(constant))) EXPECT_EQ(x, 1.0f);
}

TEST(DummyWeights, Fp8CodesAndScalesDecodeWithinTheAmplitude) {
  for (const auto& [N, K, batch] : {std::tuple<int64_t, int64_t, std::vector<int64_t>>{512, 384, {}},
                                    {300, 200, {}}, {130, 257, {3}}, {1, 129, {}}}) {
    // 310: A / s is 310, 155, 77.5, 38.75 for the four scales, each past the midpoint of two e4m3 values, so that
    // rounding to nearest would overshoot A without the step down.
    for (float A : {0.02f, 1.0f, 310.0f}) {
      SCOPED_TRACE(::testing::Message() << N << "x" << K << " batch " << batch.size() << " amplitude " << A);
      const QuantisedSpecs w = fp8_weight(N, K, A, batch);
      const std::vector<uint8_t> codes = fill(w.codes), scales = fill(w.scales);
      // Scales: s0 * 2^r, r in 0..3, s0 the smallest power of two with A / s0 <= 448.
      const float s0 = std::bit_cast<float>(dummy_params(w.scales).fp8_scale_bits);
      EXPECT_LE(A / s0, 448.0f);
      EXPECT_GT(A / (s0 / 2), 448.0f);
      for (size_t i = 0; i < scales.size() / 4; ++i) {
        const float s = f32_at(scales, i);
        ASSERT_TRUE(s == s0 || s == 2 * s0 || s == 4 * s0 || s == 8 * s0) << s;
      }
      const std::vector<float> v = decode_fp8(w, codes, scales);
      for (size_t i = 0; i < v.size(); ++i) {
        ASSERT_NE(codes[i] & 0x7F, 0x7F) << "NaN code at " << i;
        ASSERT_LE(std::fabs(v[i]), A) << "element " << i;
      }
      if (v.size() < 100000) continue;
      // Codes follow their tile's scale: every tile's values reach close to A, whatever its scale (the largest e4m3
      // value at most A / s is at least A / s / 1.125).
      const Moments m = moments(v);
      EXPECT_NEAR(m.mean, 0.0, 5 * A / std::sqrt(3.0 * static_cast<double>(v.size())));
      EXPECT_NEAR(m.var / (A * A / 3.0), 1.0, 0.03);
      for (int64_t ti = 0; ti < N / 128; ++ti)
        for (int64_t tj = 0; tj < K / 128; ++tj) {
          float amax = 0;
          for (int64_t r = ti * 128; r < (ti + 1) * 128; ++r)
            for (int64_t c = tj * 128; c < (tj + 1) * 128; ++c) amax = std::max(amax, std::fabs(v[r * K + c]));
          EXPECT_GT(amax, 0.88f * A) << "tile " << ti << "," << tj;
        }
    }
  }
}

TEST(DummyWeights, BlockExponentsAreSpread) {
  // FP8 tiles take each of s0 * {1, 2, 4, 8} about equally often; MXFP4 blocks each of e0, e0 - 1.
  const QuantisedSpecs f = fp8_weight(128 * 64, 128 * 64, 1.0f);
  const std::vector<uint8_t> scales = fill(f.scales);
  const float s0 = std::bit_cast<float>(dummy_params(f.scales).fp8_scale_bits);
  std::map<float, int> fp8_seen;
  for (size_t i = 0; i < scales.size() / 4; ++i) ++fp8_seen[f32_at(scales, i) / s0];
  ASSERT_EQ(fp8_seen.size(), 4u);
  for (const auto& [ratio, n] : fp8_seen) EXPECT_NEAR(n, 4096 / 4, 4 * std::sqrt(4096 * 0.25 * 0.75)) << ratio;

  const QuantisedSpecs m = mxfp4_weight(64, 2048, 1.0f);
  const int e0 = dummy_params(m.scales).mxfp4_top_exponent;
  int top = 0;
  for (uint8_t e : fill(m.scales)) top += e == e0;
  EXPECT_NEAR(top, 4096 / 2, 4 * std::sqrt(4096 * 0.25));
}

TEST(DummyWeights, Mxfp4CodesAndExponentsDecodeWithinTheAmplitude) {
  for (DType scale_dtype : {DType::U8, DType::F8_E8M0}) {
    for (float A : {0.01f, 0.5f, 7.0f}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(scale_dtype) << " amplitude " << A);
      const QuantisedSpecs w = mxfp4_weight(256, 1024, A, scale_dtype);
      const std::vector<uint8_t> packed = fill(w.codes), exps = fill(w.scales);
      const int e0 = dummy_params(w.scales).mxfp4_top_exponent;
      EXPECT_LE(6.0f * e8m0_to_f32(static_cast<uint8_t>(e0)), A);
      EXPECT_GT(12.0f * e8m0_to_f32(static_cast<uint8_t>(e0)), A);
      for (uint8_t e : exps) ASSERT_TRUE(e == e0 || e == e0 - 1) << int{e};
      std::vector<float> v(packed.size() * 2);
      mxfp4_decode(packed.data(), exps.data(), static_cast<int64_t>(v.size()), v.data());
      for (size_t i = 0; i < v.size(); ++i) ASSERT_LE(std::fabs(v[i]), A) << "element " << i;
      // E[v^2] = E[e2m1(6u)^2] * E[4^-r] * 4^(e0 - 127), with E[4^-r] = (1 + 1/4) / 2 and E[e2m1(6u)^2] integrated
      // over u on a fine grid with formats.h's encoder.
      double e2m1_sq = 0;
      const int grid = 1 << 20;
      for (int k = 0; k < grid; ++k) {
        const float q = e2m1_to_f32(f32_to_e2m1(6.0f * ((k + 0.5f) / grid * 2.0f - 1.0f)));
        e2m1_sq += static_cast<double>(q) * q / grid;
      }
      const double top = e8m0_to_f32(static_cast<uint8_t>(e0));
      const Moments m = moments(v);
      EXPECT_NEAR(m.mean, 0.0, 5 * std::sqrt(e2m1_sq * top * top / static_cast<double>(v.size())));
      EXPECT_NEAR(m.var / (e2m1_sq * 0.625 * top * top), 1.0, 0.03);
    }
  }
}

TEST(DummyWeights, BadSpecsAreRefusedByName) {
  auto message = [](const DummySpec& s) -> std::string {
    try {
      dummy_bytes(s);
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  DummySpec s = plain(DType::U8, {4}, 1.0f);
  EXPECT_NE(message(s).find("layout plain needs dtype F32 or BF16 or F16, got U8"), std::string::npos) << message(s);
  s = plain(DType::F16, {4}, 60000.0f, 6000.0f);
  EXPECT_NE(message(s).find("beyond the range of F16"), std::string::npos) << message(s);
  s = plain(DType::F32, {4}, -1.0f);
  EXPECT_NE(message(s).find("amplitude must be finite and >= 0"), std::string::npos) << message(s);
  s = plain(DType::F32, {4, -1}, 1.0f);
  EXPECT_NE(message(s).find("negative dimension"), std::string::npos) << message(s);
  s = plain(DType::F32, {int64_t{1} << 40, int64_t{1} << 40}, 1.0f);
  EXPECT_NE(message(s).find("overflows int64"), std::string::npos) << message(s);

  QuantisedSpecs f = fp8_weight(256, 256, 0.1f);
  f.codes.shape = {256};
  EXPECT_NE(message(f.codes).find("layout fp8_codes needs a shape [..., N, K], got [256]"), std::string::npos);
  f.codes.shape = {256, 256};
  f.codes.dtype = DType::BF16;
  EXPECT_NE(message(f.codes).find("layout fp8_codes needs dtype F8_E4M3, got BF16"), std::string::npos);
  f.scales.offset = 1.0f;
  EXPECT_NE(message(f.scales).find("layout fp8_scales takes offset 0"), std::string::npos);
  f.scales.offset = 0.0f;
  f.scales.amplitude = 0.0f;
  EXPECT_NE(message(f.scales).find("amplitude in [2^-100, 2^100]"), std::string::npos);

  QuantisedSpecs m = mxfp4_weight(8, 64, 0.1f);
  m.codes.shape = {8, 24};  // K = 48
  EXPECT_NE(message(m.codes).find("need K a multiple of 32"), std::string::npos) << message(m.codes);
  m.scales.dtype = DType::F32;
  EXPECT_NE(message(m.scales).find("layout mxfp4_scales needs dtype U8 or F8_E8M0, got F32"), std::string::npos);

  const DummySpec ok = plain(DType::BF16, {3, 3}, 1.0f);
  std::vector<uint8_t> small(17);
  EXPECT_THROW(fill_dummy(ok, small), Error);
}

}  // namespace
}  // namespace kestrel
