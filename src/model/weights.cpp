#include "model/weights.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "core/dummy_weights.h"
#include "core/error.h"
#include "core/formats.h"

namespace kestrel {

namespace {

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  float v;
  if (exp == 0) v = std::ldexp(static_cast<float>(man), -24);
  else if (exp == 31) v = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else v = std::ldexp(static_cast<float>(man | 0x400u), static_cast<int>(exp) - 25);
  return sign ? -v : v;
}

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

bool float_dtype(DType d) {
  return d == DType::F32 || d == DType::F16 || d == DType::BF16 || d == DType::F64;
}

}  // namespace

std::vector<float> decode_to_f32(DType dtype, std::span<const uint8_t> bytes, const std::string& name) {
  const size_t size = dtype_size(dtype);
  const int64_t n = static_cast<int64_t>(bytes.size() / size);
  std::vector<float> out(static_cast<size_t>(n));
  const uint8_t* p = bytes.data();
  switch (dtype) {
    case DType::F32:
      std::memcpy(out.data(), p, n * sizeof(float));
      break;
    case DType::F64:
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(load<double>(p + 8 * i));
      break;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(load<uint16_t>(p + 2 * i));
      break;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(load<uint16_t>(p + 2 * i));
      break;
    case DType::F8_E4M3:
      for (int64_t i = 0; i < n; ++i) out[i] = e4m3_to_f32(p[i]);
      break;
    default:
      fail("tensor '{}' has dtype {}, which is not a floating-point weight type", name, dtype_name(dtype));
  }
  return out;
}

WeightLoader::WeightLoader(const std::string& dir, const ModelConfig& cfg)
    : cfg_(cfg), ckpt_(std::make_unique<Checkpoint>(dir)) {}

WeightLoader::WeightLoader(const ModelConfig& cfg, uint64_t seed) : cfg_(cfg), seed_(seed) {}

StoredTensor WeightLoader::stored(const std::string& name) {
  if (!ckpt_->has(name)) fail("checkpoint is missing tensor '{}'", name);
  used_.insert(name);
  const TensorView& v = ckpt_->get(name);
  const SafetensorsFile& f = ckpt_->file_of(name);
  StoredTensor t;
  t.name = name;
  t.dtype = v.dtype;
  t.shape = v.shape;
  t.bytes = v.bytes;
  t.file = &f.path();
  t.file_offset = f.file_offset(v);
  return t;
}

StoredTensor WeightLoader::made(const std::string& name, DType dtype, std::vector<int64_t> shape, Init init,
                                DummyLayout layout, const std::string& key_name) const {
  StoredTensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = shape;
  DummySpec d;
  d.seed = seed_;
  d.key = tensor_key(key_name.empty() ? name : key_name);
  d.layout = layout;
  d.dtype = dtype;
  d.shape = std::move(shape);
  // Uniform in center +- a has standard deviation a / sqrt(3).
  d.amplitude = init.stddev * std::sqrt(3.0f);
  d.offset = init.center;
  d.fp8_block = cfg_.weight_block_size;
  t.dummy = std::move(d);
  return t;
}

StoredTensor WeightLoader::tensor(const std::string& name, const std::vector<int64_t>& shape, Init init, DType dtype) {
  if (dummy()) {
    StoredTensor t = made(name, dtype, shape, init);
    handed_ += t.nbytes();
    return t;
  }
  StoredTensor t = stored(name);
  handed_ += t.nbytes();
  if (t.shape != shape) fail("tensor '{}' has shape {}, expected {}", name, shape_str(t.shape), shape_str(shape));
  if (!float_dtype(t.dtype))
    fail("tensor '{}' has dtype {}, which is not a floating-point weight type", name, dtype_name(t.dtype));
  return t;
}

std::optional<StoredTensor> WeightLoader::optional_tensor(const std::string& name, const std::vector<int64_t>& shape,
                                                          Init init, DType dtype, bool dummy_has) {
  if (dummy()) return dummy_has ? std::optional(tensor(name, shape, init, dtype)) : std::nullopt;
  if (!ckpt_->has(name)) return std::nullopt;
  return tensor(name, shape, init, dtype);
}

StoredLinear WeightLoader::linear(const std::string& prefix, int64_t out, int64_t in, Quant q) {
  StoredLinear l = find_linear(prefix, out, in, q);
  handed_ += l.weight.nbytes() + (l.format == WeightFormat::plain ? 0 : l.scales.nbytes());
  return l;
}

StoredLinear WeightLoader::find_linear(const std::string& prefix, int64_t out, int64_t in, Quant q) {
  StoredLinear l;
  l.out = out;
  l.in = in;
  const Init init{1.0f / std::sqrt(static_cast<float>(in)), 0.0f};
  const int64_t b = cfg_.weight_block_size;
  if (dummy()) {
    if (q == Quant::expert && cfg_.weight_quant == WeightQuant::mxfp4) {
      KESTREL_CHECK(in % 32 == 0, "MXFP4 weight '{}' needs an input width divisible by 32, got {}", prefix, in);
      l.format = WeightFormat::mxfp4;
      l.weight = made(prefix + ".weight_packed", DType::U8, {out, in / 2}, init, DummyLayout::mxfp4_codes, prefix);
      l.scales = made(prefix + ".weight_scale", DType::U8, {out, in / 32}, init, DummyLayout::mxfp4_scales, prefix);
    } else if (q != Quant::none && cfg_.weight_quant == WeightQuant::fp8_block) {
      l.format = WeightFormat::fp8_block;
      l.block = static_cast<int>(b);
      l.weight = made(prefix + ".weight", DType::F8_E4M3, {out, in}, init, DummyLayout::fp8_codes, prefix);
      l.scales = made(prefix + ".weight_scale_inv", DType::F32, {(out + b - 1) / b, (in + b - 1) / b}, init,
                      DummyLayout::fp8_scales, prefix);
    } else {
      l.weight = made(prefix + ".weight", DType::BF16, {out, in}, init);
    }
    return l;
  }
  const std::string packed = prefix + ".weight_packed";
  if (ckpt_->has(packed)) {
    if (q != Quant::expert) fail("tensor '{}' is MXFP4, which Kestrel reads for routed experts only", packed);
    KESTREL_CHECK(in % 32 == 0, "MXFP4 tensor '{}' needs an input width divisible by 32, got {}", packed, in);
    l.format = WeightFormat::mxfp4;
    l.weight = stored(packed);
    l.scales = stored(prefix + ".weight_scale");
    if (l.weight.dtype != DType::U8 || l.weight.shape != std::vector<int64_t>{out, in / 2})
      fail("tensor '{}' must be U8 {}, got {} {}", packed, shape_str({out, in / 2}), dtype_name(l.weight.dtype),
           shape_str(l.weight.shape));
    if ((l.scales.dtype != DType::U8 && l.scales.dtype != DType::F8_E8M0) ||
        l.scales.shape != std::vector<int64_t>{out, in / 32})
      fail("tensor '{}.weight_scale' must be U8 or F8_E8M0 {}, got {} {}", prefix, shape_str({out, in / 32}),
           dtype_name(l.scales.dtype), shape_str(l.scales.shape));
    return l;
  }
  const std::string wname = prefix + ".weight";
  l.weight = stored(wname);
  if (l.weight.shape != std::vector<int64_t>{out, in})
    fail("tensor '{}' has shape {}, expected {}", wname, shape_str(l.weight.shape), shape_str({out, in}));
  if (l.weight.dtype != DType::F8_E4M3) {
    if (!float_dtype(l.weight.dtype))
      fail("tensor '{}' has dtype {}, which is not a floating-point weight type", wname, dtype_name(l.weight.dtype));
    return l;
  }
  const std::string sname = prefix + ".weight_scale_inv";
  l.format = WeightFormat::fp8_block;
  l.block = static_cast<int>(b);
  l.scales = stored(sname);
  if (l.scales.dtype != DType::F32) fail("tensor '{}' must be F32, got {}", sname, dtype_name(l.scales.dtype));
  if (l.scales.shape != std::vector<int64_t>{(out + b - 1) / b, (in + b - 1) / b})
    fail("tensor '{}' has shape {}, expected {} for {}x{} blocks of weight {}", sname, shape_str(l.scales.shape),
         shape_str({(out + b - 1) / b, (in + b - 1) / b}), b, b, shape_str({out, in}));
  return l;
}

std::vector<std::string> WeightLoader::unused() const {
  std::vector<std::string> out;
  if (!ckpt_) return out;
  for (const std::string& n : ckpt_->names())
    if (!used_.count(n)) out.push_back(n);
  return out;
}

size_t WeightLoader::checkpoint_bytes() const { return ckpt_ ? ckpt_->data_bytes() : 0; }

}  // namespace kestrel
