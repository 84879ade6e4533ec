#include "core/dummy_weights.h"

#include <cfloat>
#include <cmath>

#include "core/error.h"

namespace kestrel {

namespace {

constexpr float kMinQuantisedAmplitude = 0x1p-100f, kMaxQuantisedAmplitude = 0x1p100f;
constexpr float kF16Max = 65504.0f;
constexpr float kBf16Max = 0x1.FEp127f;  // the largest finite bf16
constexpr float kE4m3Max = 448.0f, kE2m1Max = 6.0f;
constexpr int64_t kMxfp4Block = 32;
constexpr uint64_t kValueStream = 0, kExponentStream = 1;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t checked_numel(const DummySpec& spec) {
  int64_t n = 1;
  for (int64_t d : spec.shape) {
    KESTREL_CHECK(d >= 0, "dummy weights: shape {} has a negative dimension", shape_text(spec.shape));
    KESTREL_CHECK(!__builtin_mul_overflow(n, d, &n), "dummy weights: shape {} overflows int64",
                  shape_text(spec.shape));
  }
  int64_t bytes = 0;
  KESTREL_CHECK(!__builtin_mul_overflow(n, static_cast<int64_t>(dtype_size(spec.dtype)), &bytes),
                "dummy weights: {} {} is more bytes than int64 counts", dtype_name(spec.dtype), shape_text(spec.shape));
  return n;
}

void require_dtype(const DummySpec& spec, std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (spec.dtype == d) return;
  std::string names;
  for (DType d : allowed) names += std::string(names.empty() ? "" : " or ") + dtype_name(d);
  fail("dummy weights: layout {} needs dtype {}, got {}", dummy_layout_name(spec.layout), names,
       dtype_name(spec.dtype));
}

void require_matrix(const DummySpec& spec, const char* what) {
  KESTREL_CHECK(spec.shape.size() >= 2, "dummy weights: layout {} needs a shape [..., {}], got {}",
                dummy_layout_name(spec.layout), what, shape_text(spec.shape));
}

void require_quantised_range(const DummySpec& spec) {
  KESTREL_CHECK(spec.offset == 0.0f, "dummy weights: layout {} takes offset 0, got {}", dummy_layout_name(spec.layout),
                spec.offset);
  KESTREL_CHECK(spec.amplitude >= kMinQuantisedAmplitude && spec.amplitude <= kMaxQuantisedAmplitude,
                "dummy weights: layout {} needs an amplitude in [2^-100, 2^100], got {}",
                dummy_layout_name(spec.layout), spec.amplitude);
}

// s0: the smallest power of two with fl(A / s0) <= 448 (so that FP8 codes never saturate).
uint32_t fp8_smallest_scale_bits(float amplitude) {
  int e = std::ilogb(amplitude / kE4m3Max) - 1;
  while (amplitude * std::ldexp(1.0f, -e) > kE4m3Max) ++e;
  return dummy::f32_bits(std::ldexp(1.0f, e));
}

// e0: the biased exponent of the largest power of two p with 6 p <= A.
int32_t mxfp4_top_exponent(float amplitude) {
  int e = std::ilogb(amplitude / kE2m1Max) + 1;
  while (kE2m1Max * std::ldexp(1.0f, e) > amplitude) --e;
  return e + 127;
}

uint64_t stream_base(const DummySpec& spec, uint64_t stream) {
  return dummy::mix64(dummy::mix64(dummy::mix64(spec.seed) ^ spec.key) + stream * dummy::kGolden);
}

}  // namespace

const char* dummy_layout_name(DummyLayout layout) {
  switch (layout) {
    case DummyLayout::plain: return "plain";
    case DummyLayout::fp8_codes: return "fp8_codes";
    case DummyLayout::fp8_scales: return "fp8_scales";
    case DummyLayout::mxfp4_codes: return "mxfp4_codes";
    case DummyLayout::mxfp4_scales: return "mxfp4_scales";
  }
  fail("invalid DummyLayout value {}", static_cast<int>(layout));
}

uint64_t tensor_key(std::string_view name) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a 64: offset basis, then xor and multiply by the FNV prime
  for (unsigned char c : name) h = (h ^ c) * 0x100000001B3ull;
  return dummy::mix64(h);
}

DummyParams dummy_params(const DummySpec& spec) {
  DummyParams p;
  p.layout = spec.layout;
  p.numel = checked_numel(spec);
  p.stream = stream_base(spec, kValueStream);
  p.exponent_stream = stream_base(spec, kExponentStream);
  p.amplitude = spec.amplitude;
  p.offset = spec.offset;
  switch (spec.layout) {
    case DummyLayout::plain: {
      require_dtype(spec, {DType::F32, DType::BF16, DType::F16});
      KESTREL_CHECK(std::isfinite(spec.amplitude) && spec.amplitude >= 0.0f && std::isfinite(spec.offset),
                    "dummy weights: amplitude must be finite and >= 0 and offset finite, got {} and {}",
                    spec.amplitude, spec.offset);
      const float largest = std::fabs(spec.offset) + spec.amplitude;
      const float dtype_max = spec.dtype == DType::F16 ? kF16Max : spec.dtype == DType::BF16 ? kBf16Max : FLT_MAX;
      KESTREL_CHECK(std::isfinite(largest) && largest <= dtype_max,
                    "dummy weights: offset {} +- amplitude {} is beyond the range of {}", spec.offset, spec.amplitude,
                    dtype_name(spec.dtype));
      p.word = spec.dtype == DType::F32 ? DummyWord::f32 : spec.dtype == DType::BF16 ? DummyWord::bf16 : DummyWord::f16;
      break;
    }
    case DummyLayout::fp8_codes:
    case DummyLayout::fp8_scales: {
      require_dtype(spec, {spec.layout == DummyLayout::fp8_codes ? DType::F8_E4M3 : DType::F32});
      require_matrix(spec, spec.layout == DummyLayout::fp8_codes ? "N, K" : "ceil(N / block), ceil(K / block)");
      require_quantised_range(spec);
      KESTREL_CHECK(spec.fp8_block > 0, "dummy weights: fp8_block must be > 0, got {}", spec.fp8_block);
      p.word = spec.layout == DummyLayout::fp8_codes ? DummyWord::byte : DummyWord::f32;
      p.fp8_scale_bits = fp8_smallest_scale_bits(spec.amplitude);
      if (spec.layout == DummyLayout::fp8_codes) {
        p.rows = spec.shape[spec.shape.size() - 2];
        p.cols = spec.shape.back();
        p.block = spec.fp8_block;
        p.scale_rows = (p.rows + p.block - 1) / p.block;
        p.scale_cols = (p.cols + p.block - 1) / p.block;
      }
      break;
    }
    case DummyLayout::mxfp4_codes:
    case DummyLayout::mxfp4_scales: {
      if (spec.layout == DummyLayout::mxfp4_codes) {
        require_dtype(spec, {DType::U8});
        require_matrix(spec, "N, K / 2");
        KESTREL_CHECK(spec.shape.back() % (kMxfp4Block / 2) == 0,
                      "dummy weights: MXFP4 codes [..., N, K / 2] need K a multiple of {}, got a last dimension of {}",
                      kMxfp4Block, spec.shape.back());
      } else {
        require_dtype(spec, {DType::U8, DType::F8_E8M0});
        require_matrix(spec, "N, K / 32");
      }
      require_quantised_range(spec);
      p.word = DummyWord::byte;
      p.mxfp4_top_exponent = mxfp4_top_exponent(spec.amplitude);
      break;
    }
    default: fail("invalid DummyLayout value {}", static_cast<int>(spec.layout));
  }
  return p;
}

size_t dummy_bytes(const DummySpec& spec) {
  return static_cast<size_t>(dummy_params(spec).numel) * dtype_size(spec.dtype);
}

void fill_dummy(const DummySpec& spec, std::span<uint8_t> out) {
  const DummyParams p = dummy_params(spec);
  const size_t width = dtype_size(spec.dtype);
  KESTREL_CHECK(out.size() == static_cast<size_t>(p.numel) * width,
                "dummy weights: {} {} {} is {} bytes, the output has {}", dummy_layout_name(spec.layout),
                dtype_name(spec.dtype), shape_text(spec.shape), static_cast<size_t>(p.numel) * width, out.size());
  uint8_t* dst = out.data();
#pragma omp parallel for schedule(static) if (p.numel > (1 << 16))
  for (int64_t i = 0; i < p.numel; ++i) {
    const uint32_t w = dummy_word(p, i);
    for (size_t b = 0; b < width; ++b) dst[static_cast<size_t>(i) * width + b] = static_cast<uint8_t>(w >> (8 * b));
  }
}

}  // namespace kestrel
