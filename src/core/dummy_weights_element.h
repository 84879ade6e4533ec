// The element generator behind dummy weights (dummy_weights.h). The host fill (dummy_weights.cpp) and the CUDA fill
// (kernels/cuda/dummy_weights.cu) both call dummy_word, so they write the same bytes. Only integer arithmetic and
// explicitly rounded fp32 products and sums are used: no result depends on a compiler contracting a * b + c, and
// nvcc's device code gets the same bits as the host.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KESTREL_HD __host__ __device__ __forceinline__
#else
#define KESTREL_HD inline
#endif

namespace kestrel {

// What the bytes of one stored tensor (one part of a quantised weight) encode; dummy_weights.h has the meaning.
enum class DummyLayout : uint8_t { plain, fp8_codes, fp8_scales, mxfp4_codes, mxfp4_scales };

// The width and encoding of one output element.
enum class DummyWord : uint8_t { f32, bf16, f16, byte };

// Everything the generator of one element needs; made (and checked) once per tensor by dummy_params.
struct DummyParams {
  DummyLayout layout = DummyLayout::plain;
  DummyWord word = DummyWord::f32;
  int64_t numel = 0;
  uint64_t stream = 0;           // values and codes
  uint64_t exponent_stream = 0;  // block scale exponents
  float amplitude = 0.0f, offset = 0.0f;
  // fp8_codes: each matrix is [rows, cols] = [N, K], cut into block x block tiles; the scales are [scale_rows,
  // scale_cols] = [ceil(N / block), ceil(K / block)] per matrix.
  int64_t rows = 0, cols = 0, block = 0, scale_rows = 0, scale_cols = 0;
  uint32_t fp8_scale_bits = 0;    // fp32 bits of s0, the smallest block scale (a power of two)
  int32_t mxfp4_top_exponent = 0;  // the largest block's E8M0 exponent (biased)
};

namespace dummy {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;  // splitmix64's increment
constexpr int kF32MantBits = 23;

// splitmix64's output function (Steele, Lea, Flood 2014).
KESTREL_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Element i of the counter-based stream `base`: splitmix64's output i + 1 from state `base`, so any element can be
// computed alone.
KESTREL_HD uint64_t stream_bits(uint64_t base, uint64_t i) { return mix64(base + (i + 1) * kGolden); }

KESTREL_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

KESTREL_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

KESTREL_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

KESTREL_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// A value in (-1, 1) from the top 23 bits: the odd multiples of 2^-23, each equally likely, so the distribution is
// symmetric about 0 and its mean over all 2^23 values is exactly 0. The integer is below 2^24: exact in fp32.
KESTREL_HD float symmetric_unit(uint64_t bits) {
  const int32_t m = static_cast<int32_t>(bits >> 41);
  return static_cast<float>(2 * m + 1 - (int32_t{1} << 23)) * 0x1p-23f;
}

// Round-to-nearest-even of a finite fp32 magnitude (bits without sign) onto a small binary float with `mant_bits`
// mantissa bits and exponent bias `bias`, with subnormals and no upper limit (callers keep values in range): the
// unsigned code, exponent field << mant_bits | mantissa. The same rule as formats.cpp's encoders.
KESTREL_HD uint32_t round_to_minifloat(uint32_t abs_bits, int mant_bits, int bias) {
  const int exp_field = static_cast<int>(abs_bits >> kF32MantBits);
  uint32_t significand = abs_bits & 0x007FFFFFu;
  int exponent = -126;
  if (exp_field != 0) {
    significand |= 1u << kF32MantBits;
    exponent = exp_field - 127;
  }
  const int min_normal_exponent = 1 - bias;
  const bool normal = exponent >= min_normal_exponent;
  const int shift = (normal ? 0 : min_normal_exponent - exponent) + kF32MantBits - mant_bits;
  if (shift >= 25) return 0;  // below half the smallest quantum
  uint32_t quanta = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (remainder > half || (remainder == half && (quanta & 1u))) ++quanta;
  if (!normal) return quanta;
  return (static_cast<uint32_t>(exponent + bias - 1) << mant_bits) + quanta;
}

KESTREL_HD uint32_t bf16_bits(float x) {  // finite x
  const uint32_t b = f32_bits(x);
  return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

KESTREL_HD uint32_t f16_bits(float x) {  // finite x within +-65504
  const uint32_t b = f32_bits(x);
  return ((b >> 16) & 0x8000u) | round_to_minifloat(b & 0x7FFFFFFFu, 10, 15);
}

KESTREL_HD uint32_t e4m3_code(float x) {  // |x| <= 448
  const uint32_t b = f32_bits(x);
  return ((b >> 24) & 0x80u) | round_to_minifloat(b & 0x7FFFFFFFu, 3, 7);
}

KESTREL_HD float e4m3_magnitude(uint32_t code) {  // code without the sign bit, not the NaN code 0x7F
  const uint32_t exp_field = code >> 3, mantissa = code & 7u;
  if (exp_field == 0) return mul_rn(static_cast<float>(mantissa), 0x1p-9f);
  return bits_f32(((exp_field + 120u) << kF32MantBits) | (mantissa << 20));
}

KESTREL_HD uint32_t e2m1_code(float x) {  // |x| <= 6
  const uint32_t b = f32_bits(x);
  return ((b >> 28) & 0x8u) | round_to_minifloat(b & 0x7FFFFFFFu, 1, 1);
}

// The block exponent shifts: FP8 block b's scale is s0 * 2^r with r in 0..3, MXFP4 block b's exponent is the top
// exponent minus r with r in 0..1 (so that the scales of a dummy checkpoint vary as a real one's do).
KESTREL_HD uint32_t fp8_block_shift(const DummyParams& p, uint64_t b) {
  return static_cast<uint32_t>(stream_bits(p.exponent_stream, b) >> 62);
}
KESTREL_HD uint32_t mxfp4_block_shift(const DummyParams& p, uint64_t b) {
  return static_cast<uint32_t>(stream_bits(p.exponent_stream, b) >> 63);
}

// a / b, by a 32-bit division when both fit (several times fewer instructions than a 64-bit one on a GPU).
KESTREL_HD uint64_t quotient(uint64_t a, uint64_t b) {
  if ((a | b) <= 0xFFFFFFFFull) return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
  return a / b;
}

KESTREL_HD float unit(const DummyParams& p, uint64_t i) { return symmetric_unit(stream_bits(p.stream, i)); }

KESTREL_HD uint32_t plain_word(const DummyParams& p, int64_t i) {
  const float v = add_rn(p.offset, mul_rn(p.amplitude, unit(p, i)));
  switch (p.word) {
    case DummyWord::bf16: return bf16_bits(v);
    case DummyWord::f16: return f16_bits(v);
    default: return f32_bits(v);
  }
}

// x = amplitude * u / s, with s = s0 * 2^r the block's scale (dividing by a power of two is exact), rounded to the
// nearest e4m3 code, and one code lower in magnitude when that rounded up past amplitude / s: decoded values
// e4m3(code) * s stay within +-amplitude.
KESTREL_HD uint32_t fp8_code(const DummyParams& p, int64_t i) {
  const uint64_t cols = static_cast<uint64_t>(p.cols), rows = static_cast<uint64_t>(p.rows);
  const uint64_t block = static_cast<uint64_t>(p.block);
  const uint64_t row_total = quotient(static_cast<uint64_t>(i), cols);
  const uint64_t col = static_cast<uint64_t>(i) - row_total * cols;
  const uint64_t matrix = quotient(row_total, rows);
  const uint64_t row = row_total - matrix * rows;
  const uint64_t b = (matrix * static_cast<uint64_t>(p.scale_rows) + quotient(row, block)) *
                         static_cast<uint64_t>(p.scale_cols) +
                     quotient(col, block);
  const uint32_t scale_exponent = (p.fp8_scale_bits >> kF32MantBits) + fp8_block_shift(p, b);
  const float inv_scale = bits_f32((254u - scale_exponent) << kF32MantBits);
  const float limit = mul_rn(p.amplitude, inv_scale);
  const uint32_t code = e4m3_code(mul_rn(mul_rn(p.amplitude, unit(p, i)), inv_scale));
  return e4m3_magnitude(code & 0x7Fu) > limit ? code - 1 : code;
}

KESTREL_HD uint32_t fp8_scale_word(const DummyParams& p, int64_t b) {
  return p.fp8_scale_bits + (fp8_block_shift(p, static_cast<uint64_t>(b)) << kF32MantBits);
}

// Byte j packs elements 2j (low nibble) and 2j + 1, each e2m1(6 u): uniform over [-6, 6] before rounding, so every
// block's decoded values lie within +-6 * 2^(exponent - 127) <= amplitude.
KESTREL_HD uint32_t mxfp4_byte(const DummyParams& p, int64_t j) {
  const uint64_t e = 2 * static_cast<uint64_t>(j);
  return e2m1_code(mul_rn(6.0f, unit(p, e))) | (e2m1_code(mul_rn(6.0f, unit(p, e + 1))) << 4);
}

KESTREL_HD uint32_t mxfp4_exponent(const DummyParams& p, int64_t j) {
  return static_cast<uint32_t>(p.mxfp4_top_exponent) - mxfp4_block_shift(p, static_cast<uint64_t>(j));
}

}  // namespace dummy

// Output element i of the tensor (i < p.numel), in the low bytes of the result (its width is p.word's).
KESTREL_HD uint32_t dummy_word(const DummyParams& p, int64_t i) {
  switch (p.layout) {
    case DummyLayout::fp8_codes: return dummy::fp8_code(p, i);
    case DummyLayout::fp8_scales: return dummy::fp8_scale_word(p, i);
    case DummyLayout::mxfp4_codes: return dummy::mxfp4_byte(p, i);
    case DummyLayout::mxfp4_scales: return dummy::mxfp4_exponent(p, i);
    default: return dummy::plain_word(p, i);
  }
}

}  // namespace kestrel
