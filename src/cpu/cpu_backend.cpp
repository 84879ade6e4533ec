#include "cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/basic.h"
#include "kernels/cpu/fp8_linear.h"
#include "model/weights.h"

namespace kestrel {

std::unique_ptr<Model> load_cpu_model(const std::string& dir, const ModelOptions& opts, const LoadOptions& lo) {
  return Model::load(dir, opts, std::make_unique<CpuBackend>(), lo);
}

namespace {

// The stored bytes of t: the checkpoint's, or the dummy generator's.
std::vector<uint8_t> stored_bytes(const StoredTensor& t) {
  if (t.dummy) {
    std::vector<uint8_t> b(dummy_bytes(*t.dummy));
    fill_dummy(*t.dummy, b);
    return b;
  }
  return std::vector<uint8_t>(t.bytes.begin(), t.bytes.end());
}

}  // namespace

void CpuBackend::configure(const ModelConfig& cfg, const ModelOptions& opts) {
  cfg_ = cfg;
  opts_ = opts;
  if (cfg_.use_rope)
    inv_freq_ = cpu::rope_inv_freq(cfg_.qk_rope_head_dim, cfg_.rope_theta, cfg_.yarn ? &*cfg_.yarn : nullptr);
}

Tensor CpuBackend::values(const StoredTensor& t, const std::vector<int64_t>& shape) {
  const std::vector<uint8_t> bytes = stored_bytes(t);
  Tensor out;
  out.shape = shape;
  out.data = decode_to_f32(t.dtype, bytes, t.name);
  KESTREL_CHECK(out.numel() == Tensor::numel_of(shape), "tensor '{}' has {} values, expected {}", t.name, out.numel(),
                Tensor::numel_of(shape));
  weight_bytes_ += out.data.size() * sizeof(float);
  return out;
}

CpuLinear CpuBackend::decode(std::span<const StoredLinear> parts) {
  KESTREL_CHECK(!parts.empty(), "a linear weight needs at least one part");
  const int64_t in = parts[0].in;
  int64_t out = 0;
  for (const StoredLinear& p : parts) {
    KESTREL_CHECK(p.in == in, "stacked weights '{}' and '{}' have different input widths", parts[0].weight.name,
                  p.weight.name);
    out += p.out;
  }
  CpuLinear l;
  l.w = Tensor({out, in});
  int64_t row0 = 0;
  for (const StoredLinear& p : parts) {
    float* w = l.w.ptr() + row0 * in;
    CpuLinear::Part part{row0, p.out, std::nullopt};
    const int64_t n = p.out * in;
    switch (p.format) {
      case WeightFormat::plain: {
        const std::vector<float> v = decode_to_f32(p.weight.dtype, stored_bytes(p.weight), p.weight.name);
        std::copy_n(v.data(), n, w);
        break;
      }
      case WeightFormat::mxfp4: {
        const std::vector<uint8_t> packed = stored_bytes(p.weight), scales = stored_bytes(p.scales);
        mxfp4_decode(packed.data(), scales.data(), n, w);
        break;
      }
      case WeightFormat::fp8_block: {
        CpuLinear::Fp8 f{stored_bytes(p.weight), decode_to_f32(DType::F32, stored_bytes(p.scales), p.scales.name),
                         p.block};
        fp8_block_decode(f.codes.data(), f.scales.data(), p.out, in, p.block, w);
        weight_bytes_ += f.codes.size() + f.scales.size() * sizeof(float);
        part.fp8 = std::move(f);
        break;
      }
    }
    l.parts.push_back(std::move(part));
    row0 += p.out;
  }
  weight_bytes_ += l.w.data.size() * sizeof(float);
  return l;
}

EmbeddingW CpuBackend::add_embedding(const StoredTensor& table) {
  embeddings_.push_back(values(table, {cfg_.vocab_size, cfg_.hidden_size}));
  return EmbeddingW{static_cast<int32_t>(embeddings_.size() - 1)};
}

LinearW CpuBackend::tied_head(EmbeddingW table) {
  auto l = std::make_shared<CpuLinear>();
  l->w = embeddings_.at(table.id);
  l->parts.push_back({0, l->w.dim(0), std::nullopt});
  weight_bytes_ += l->w.data.size() * sizeof(float);
  linears_.push_back(l);
  return LinearW{static_cast<int32_t>(linears_.size() - 1), l->out(), l->in()};
}

LinearW CpuBackend::add_linear(std::span<const StoredLinear> parts) {
  linears_.push_back(std::make_shared<CpuLinear>(decode(parts)));
  add_sites(parts, static_cast<int32_t>(linears_.size() - 1), -1, 0, 0);
  const CpuLinear& l = *linears_.back();
  return LinearW{static_cast<int32_t>(linears_.size() - 1), l.out(), l.in()};
}

VecW CpuBackend::add_vector(const StoredTensor& t) {
  vectors_.push_back(values(t, t.shape));
  return VecW{static_cast<int32_t>(vectors_.size() - 1), vectors_.back().numel()};
}

MlaAttnW CpuBackend::add_mla_attention(const MlaAttnSpec& spec) {
  std::optional<MlaIndexerWeights> ix;
  if (spec.indexer) {
    const MlaAttnSpec::Indexer& s = *spec.indexer;
    ix = MlaIndexerWeights{decode(std::span(&s.wq_b, 1)).w, decode(std::span(&s.wk, 1)).w,
                           decode(std::span(&s.weights_proj, 1)).w, values(s.k_norm_w, s.k_norm_w.shape),
                           values(s.k_norm_b, s.k_norm_b.shape)};
  }
  mla_.push_back(std::make_unique<MlaCore>(cfg_, decode(std::span(&spec.kv_b, 1)).w, spec.kv_scale, std::move(ix),
                                           opts_.latent_cache, opts_.index_keys, opts_.gpu_numerics));
  return MlaAttnW{static_cast<int32_t>(mla_.size() - 1)};
}

KdaW CpuBackend::add_kda(const KdaSpec& s) {
  kda_.push_back(std::make_unique<KdaCore>(cfg_, values(s.conv_q, s.conv_q.shape), values(s.conv_k, s.conv_k.shape),
                                           values(s.conv_v, s.conv_v.shape), values(s.A_log, s.A_log.shape),
                                           values(s.dt_bias, s.dt_bias.shape), values(s.o_norm, s.o_norm.shape)));
  return KdaW{static_cast<int32_t>(kda_.size() - 1)};
}

MoeW CpuBackend::add_moe(const MoeSpec& s) {
  Moe m;
  m.routing = cpu::MoeRouting{s.n_experts, s.top_k, s.n_group, s.topk_group, s.renormalize, s.scaling};
  m.router = values(s.router, s.router.shape);
  if (s.bias) m.bias = values(*s.bias, s.bias->shape);
  // FP8 experts of shapes the GPU's FP8 expert kernels do not take run on their decoded values (fp8_experts_stay_fp8).
  const bool keep_fp8 = fp8_experts_stay_fp8(cfg_);
  for (int e = 0; e < s.n_experts; ++e) {
    for (auto [from, to] : {std::pair{&s.gate, &m.gate}, std::pair{&s.up, &m.up}, std::pair{&s.down, &m.down}}) {
      to->push_back(decode(std::span(&(*from)[e], 1)));
      add_sites(std::span(&(*from)[e], 1), -1, static_cast<int32_t>(moe_.size()), e,
                from == &s.gate ? 0 : from == &s.up ? 1 : 2);
      if (!keep_fp8)
        for (CpuLinear::Part& p : to->back().parts) p.fp8.reset();
    }
  }
  moe_.push_back(std::move(m));
  return MoeW{static_cast<int32_t>(moe_.size() - 1)};
}

void CpuBackend::add_sites(std::span<const StoredLinear> parts, int32_t linear, int32_t moe, int expert, int which) {
  int64_t row0 = 0;
  for (const StoredLinear& p : parts) {
    std::string name = p.weight.name;
    for (const char* tail : {".weight_packed", ".weight"}) {
      const std::string t = tail;
      if (name.size() > t.size() && name.compare(name.size() - t.size(), t.size(), t) == 0) {
        name.resize(name.size() - t.size());
        break;
      }
    }
    sites_[name] = Site{linear, moe, expert, which, row0, p.out, p.in};
    row0 += p.out;
  }
}

void CpuBackend::load_lora(int32_t id, const LoraAdapter& adapter) {
  const std::string file = adapter.path + "/adapter_model.safetensors";
  KESTREL_CHECK(adapter.rank >= 1 && adapter.rank <= kMaxLoraRank, "{}: rank {} is outside [1, {}]", adapter.path,
                adapter.rank, kMaxLoraRank);
  Lora l;
  l.scale = adapter.scale;
  for (const auto& [module, m] : adapter.modules) {
    const auto it = sites_.find(module);
    KESTREL_CHECK(it != sites_.end(),
                  "{}: tensor 'base_model.model.{}.lora_A.weight' adapts '{}', which is not a linear layer of this "
                  "model that LoRA can adapt",
                  file, module, module);
    const Site& s = it->second;
    KESTREL_CHECK(m.in == s.in, "{}: tensor 'base_model.model.{}.lora_A.weight' has input width {}, the layer takes {}",
                  file, module, m.in, s.in);
    KESTREL_CHECK(m.out == s.out, "{}: tensor 'base_model.model.{}.lora_B.weight' has output width {}, the layer has {}",
                  file, module, m.out, s.out);
    LoraDelta d{s.row0, s.out, s.in, adapter.rank, m.a, m.b};
    if (s.linear >= 0) l.linear[s.linear].push_back(std::move(d));
    else l.expert[{s.moe, s.expert, s.which}] = std::move(d);
  }
  loras_[id] = std::move(l);
}

const CpuBackend::Lora& CpuBackend::lora(int32_t id) const {
  const auto it = loras_.find(id);
  KESTREL_CHECK(it != loras_.end(), "LoRA adapter {} is not loaded", id);
  return it->second;
}

void CpuBackend::LoraDelta::apply(float scale, const float* x, float* y) const {
  float u[kMaxLoraRank];
  for (int j = 0; j < rank; ++j) {
    const float* aj = a.data() + int64_t{j} * in;
    float acc = 0.0f;
    for (int64_t i = 0; i < in; ++i) acc += aj[i] * x[i];
    u[j] = acc;
  }
  for (int64_t o = 0; o < out; ++o) {
    const float* bo = b.data() + o * rank;
    float acc = 0.0f;
    for (int j = 0; j < rank; ++j) acc += bo[j] * u[j];
    y[row0 + o] += scale * acc;
  }
}

float* CpuBackend::module_weight(const std::string& module, int64_t* out, int64_t* in) {
  const auto it = sites_.find(module);
  KESTREL_CHECK(it != sites_.end(), "'{}' is not a linear layer of the model", module);
  const Site& s = it->second;
  if (out) *out = s.out;
  if (in) *in = s.in;
  if (s.linear >= 0) return linears_.at(s.linear)->w.ptr() + s.row0 * s.in;
  Moe& m = moe_.at(s.moe);
  std::vector<CpuLinear>& v = s.which == 0 ? m.gate : s.which == 1 ? m.up : m.down;
  return v.at(s.expert).w.ptr();
}

std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> CpuBackend::lora_modules() const {
  const std::vector<std::string>& names = lora_target_names();
  std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> out;
  for (const auto& [module, s] : sites_) {
    const size_t dot = module.rfind('.');
    if (dot != std::string::npos && std::find(names.begin(), names.end(), module.substr(dot + 1)) != names.end())
      out.push_back({module, {s.out, s.in}});
  }
  return out;
}

void CpuBackend::linear(const CpuLinear& l, const float* x, int64_t T, float* y) const {
  const int64_t in = l.in(), out = l.out();
  if (!opts_.gpu_numerics) {
    cpu::linear(x, l.w.ptr(), y, T, in, out);
    return;
  }
  // As the GPU takes the input: bf16, or (a part stored in FP8) quantized in groups of 128 (kernels/cpu/fp8_linear.h).
  std::vector<float> rounded;
  auto bf16_input = [&] {
    if (rounded.empty()) {
      rounded.assign(x, x + T * in);
      for (float& v : rounded) v = round_to_bf16(v);
    }
    return rounded.data();
  };
  if (l.parts.size() == 1 && !l.parts[0].fp8) {
    cpu::linear(bf16_input(), l.w.ptr(), y, T, in, out);
    return;
  }
  std::vector<float> part_y;
  for (const CpuLinear::Part& p : l.parts) {
    part_y.resize(static_cast<size_t>(T * p.rows));
    if (p.fp8) KESTREL_CHECK(p.fp8->block == cpu::kFp8Group, "the GPU numerics of FP8 weights need 128 x 128 blocks, not {}",
                             p.fp8->block);
    if (p.fp8)
      cpu::linear_fp8_block(x, T, in, p.fp8->codes.data(), p.fp8->scales.data(), p.rows, part_y.data());
    else
      cpu::linear(bf16_input(), l.w.ptr() + p.row0 * in, part_y.data(), T, in, p.rows);
    for (int64_t t = 0; t < T; ++t) std::copy_n(part_y.data() + t * p.rows, p.rows, y + t * out + p.row0);
  }
}

}  // namespace kestrel
