#include "model/weights.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "core/formats.h"
#include <algorithm>

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

}  // namespace

std::vector<float> decode_to_f32(const TensorView& v) {
  const int64_t n = v.numel();
  std::vector<float> out(static_cast<size_t>(n));
  const uint8_t* p = v.bytes.data();
  switch (v.dtype) {
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
      fail("tensor '{}' has dtype {}, which is not a floating-point weight type", v.name, dtype_name(v.dtype));
  }
  return out;
}

const TensorView& WeightLoader::view(const std::string& name) {
  if (!ckpt_.has(name)) fail("checkpoint is missing tensor '{}'", name);
  used_.insert(name);
  return ckpt_.get(name);
}

Tensor WeightLoader::get(const std::string& name, const std::vector<int64_t>& shape) {
  const TensorView& v = view(name);
  if (v.shape != shape)
    fail("tensor '{}' has shape {}, expected {}", name, shape_str(v.shape), shape_str(shape));
  Tensor t;
  t.shape = shape;
  t.data = decode_to_f32(v);
  return t;
}

Tensor WeightLoader::linear(const std::string& prefix, int64_t out, int64_t in, std::optional<Fp8BlockWeight>* raw) {
  const std::string packed = prefix + ".weight_packed";
  if (ckpt_.has(packed)) {
    KESTREL_CHECK(in % 32 == 0, "MXFP4 tensor '{}' needs an input width divisible by 32, got {}", packed, in);
    const TensorView& q = view(packed);
    const TensorView& s = view(prefix + ".weight_scale");
    if (q.dtype != DType::U8 || q.shape != std::vector<int64_t>{out, in / 2})
      fail("tensor '{}' must be U8 {}, got {} {}", packed, shape_str({out, in / 2}), dtype_name(q.dtype),
           shape_str(q.shape));
    if ((s.dtype != DType::U8 && s.dtype != DType::F8_E8M0) || s.shape != std::vector<int64_t>{out, in / 32})
      fail("tensor '{}.weight_scale' must be U8 or F8_E8M0 {}, got {} {}", prefix, shape_str({out, in / 32}),
           dtype_name(s.dtype), shape_str(s.shape));
    Tensor t({out, in});
    mxfp4_decode(q.bytes.data(), s.bytes.data(), out * in, t.ptr());
    return t;
  }
  const std::string wname = prefix + ".weight";
  const TensorView& w = view(wname);
  if (w.shape != std::vector<int64_t>{out, in})
    fail("tensor '{}' has shape {}, expected {}", wname, shape_str(w.shape), shape_str({out, in}));
  Tensor t;
  t.shape = {out, in};
  t.data = decode_to_f32(w);
  if (w.dtype != DType::F8_E4M3) return t;

  const std::string sname = prefix + ".weight_scale_inv";
  const TensorView& s = view(sname);
  if (s.dtype != DType::F32) fail("tensor '{}' must be F32, got {}", sname, dtype_name(s.dtype));
  const int64_t block = fp8_block_;
  if (s.shape != std::vector<int64_t>{(out + block - 1) / block, (in + block - 1) / block})
    fail("tensor '{}' has shape {}, expected {} for {}x{} blocks of weight {}", sname, shape_str(s.shape),
         shape_str({(out + block - 1) / block, (in + block - 1) / block}), block, block, shape_str({out, in}));
  const std::vector<float> scales = decode_to_f32(s);
  for (int64_t r = 0; r < out; ++r)
    for (int64_t c = 0; c < in; ++c) t.data[r * in + c] *= scales[(r / block) * s.shape[1] + c / block];
  if (raw) *raw = Fp8BlockWeight{std::vector<uint8_t>(w.bytes.begin(), w.bytes.end()), scales, fp8_block_};
  return t;
}

std::vector<std::string> WeightLoader::unused() const {
  std::vector<std::string> out;
  for (const std::string& n : ckpt_.names())
    if (!used_.count(n)) out.push_back(n);
  return out;
}

}  // namespace kestrel
