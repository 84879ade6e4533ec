#include "model/dspark.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/basic.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace kestrel {

namespace {

using nlohmann::json;

int64_t positive_int(const json& j, const char* k, const std::string& where, int64_t limit = int64_t{1} << 30) {
  KESTREL_CHECK(j.contains(k), "{}: missing field '{}'", where, k);
  const json& v = j.at(k);
  KESTREL_CHECK(v.is_number_integer(), "{}: field '{}' must be an integer, got {}", where, k, v.dump());
  const int64_t x = v.get<int64_t>();
  KESTREL_CHECK(x > 0 && x <= limit, "{}: field '{}' must be in [1, {}], got {}", where, k, limit, x);
  return x;
}

}  // namespace

DsparkConfig DsparkConfig::from_json(const json& j, const std::string& where) {
  KESTREL_CHECK(j.is_object(), "{}: the top level must be a JSON object", where);
  KESTREL_CHECK(j.contains("model_type") && j.at("model_type") == "dspark",
                "{}: field 'model_type' must be \"dspark\" (a DSpark drafter), got {}", where,
                j.contains("model_type") ? j.at("model_type").dump() : std::string("nothing"));
  DsparkConfig c;
  c.vocab_size = positive_int(j, "vocab_size", where, int64_t{1} << 24);
  c.hidden_size = positive_int(j, "hidden_size", where, 65536);
  c.intermediate_size = positive_int(j, "intermediate_size", where, 1 << 20);
  c.num_attention_heads = static_cast<int>(positive_int(j, "num_attention_heads", where, 1024));
  c.head_dim = static_cast<int>(positive_int(j, "head_dim", where, 1024));
  KESTREL_CHECK(c.head_dim % 2 == 0, "{}: field 'head_dim' must be even (RoPE pairs), got {}", where, c.head_dim);
  if (j.contains("rms_norm_eps")) {
    KESTREL_CHECK(j.at("rms_norm_eps").is_number() && j.at("rms_norm_eps").get<double>() > 0,
                  "{}: field 'rms_norm_eps' must be a positive number", where);
    c.rms_norm_eps = j.at("rms_norm_eps").get<float>();
  }
  if (j.contains("rope_theta")) {
    KESTREL_CHECK(j.at("rope_theta").is_number() && j.at("rope_theta").get<double>() > 0,
                  "{}: field 'rope_theta' must be a positive number", where);
    c.rope_theta = j.at("rope_theta").get<double>();
  }
  c.block_size = static_cast<int>(positive_int(j, "dspark_block_size", where, 32));
  c.markov_rank = static_cast<int>(positive_int(j, "dspark_markov_rank", where, 65536));
  KESTREL_CHECK(j.contains("dspark_target_layer_ids") && j.at("dspark_target_layer_ids").is_array() &&
                    !j.at("dspark_target_layer_ids").empty(),
                "{}: field 'dspark_target_layer_ids' must be a non-empty list of layer indices", where);
  for (const json& v : j.at("dspark_target_layer_ids")) {
    KESTREL_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < 4096,
                  "{}: field 'dspark_target_layer_ids' must hold layer indices >= 0, got {}", where, v.dump());
    c.target_layer_ids.push_back(v.get<int>());
  }
  KESTREL_CHECK(j.contains("dspark_noise_token_id") && j.at("dspark_noise_token_id").is_number_integer(),
                "{}: field 'dspark_noise_token_id' must be an integer token id", where);
  const int64_t noise = j.at("dspark_noise_token_id").get<int64_t>();
  KESTREL_CHECK(noise >= 0 && noise < c.vocab_size, "{}: field 'dspark_noise_token_id' {} is outside the vocabulary "
                                                    "(0..{})", where, noise, c.vocab_size - 1);
  c.noise_token_id = static_cast<int32_t>(noise);
  return c;
}

json DsparkConfig::to_json() const {
  return json{{"architectures", {"DSparkDraftModel"}},
              {"model_type", "dspark"},
              {"vocab_size", vocab_size},
              {"hidden_size", hidden_size},
              {"intermediate_size", intermediate_size},
              {"num_attention_heads", num_attention_heads},
              {"num_key_value_heads", 1},
              {"head_dim", head_dim},
              {"rms_norm_eps", rms_norm_eps},
              {"rope_theta", rope_theta},
              {"dspark_block_size", block_size},
              {"dspark_markov_rank", markov_rank},
              {"dspark_target_layer_ids", target_layer_ids},
              {"dspark_noise_token_id", noise_token_id}};
}

void check_dspark_against(const DsparkConfig& d, const ModelConfig& t, const std::string& where) {
  KESTREL_CHECK(d.vocab_size == t.vocab_size,
                "{}: the DSpark drafter's 'vocab_size' {} does not match the target's vocabulary of {} tokens (a drafter "
                "proposes the target's token ids)",
                where, d.vocab_size, t.vocab_size);
  KESTREL_CHECK(d.hidden_size == t.hidden_size,
                "{}: the DSpark drafter's 'hidden_size' {} does not match the target's {} (it shares the target's "
                "embedding width)",
                where, d.hidden_size, t.hidden_size);
  for (int l : d.target_layer_ids)
    KESTREL_CHECK(l < t.num_hidden_layers, "{}: 'dspark_target_layer_ids' names layer {}, the target has {} layers",
                  where, l, t.num_hidden_layers);
}

std::unique_ptr<DsparkModel> DsparkModel::load(const std::string& dir, const ModelConfig* target) {
  const std::string where = dir + "/config.json";
  std::ifstream in(where);
  KESTREL_CHECK(static_cast<bool>(in), "--speculative-config: 'model' {}: cannot open {}", dir, where);
  json j;
  try {
    j = json::parse(in);
  } catch (const json::parse_error& e) {
    fail("{}: not valid JSON: {}", where, e.what());
  }
  auto m = std::unique_ptr<DsparkModel>(new DsparkModel());
  m->cfg_ = DsparkConfig::from_json(j, where);
  const DsparkConfig& c = m->cfg_;
  if (target) check_dspark_against(c, *target, where);
  const Checkpoint ckpt(dir);
  std::set<std::string> used;
  auto get = [&](const std::string& name, std::vector<int64_t> shape) {
    KESTREL_CHECK(ckpt.has(name), "{}: tensor '{}' is missing from the DSpark drafter", dir, name);
    const TensorView& t = ckpt.get(name);
    KESTREL_CHECK(t.shape == shape, "{}: tensor '{}' has shape {}, the config needs {}", dir, name,
                  json(t.shape).dump(), json(shape).dump());
    used.insert(name);
    return decode_to_f32(t.dtype, t.bytes, name);
  };
  const int64_t V = c.vocab_size, D = c.hidden_size, H = c.num_attention_heads, hd = c.head_dim;
  const int64_t F = c.intermediate_size, nT = static_cast<int64_t>(c.target_layer_ids.size());
  m->embed_ = get("embed.weight", {V, D});
  m->head_ = get("head.weight", {V, D});
  m->main_proj_ = get("mtp.0.main_proj.weight", {D, nT * D});
  m->main_norm_ = get("mtp.0.main_norm.weight", {D});
  for (int64_t i = 0; i < nT; ++i) {
    const std::string p = "mtp." + std::to_string(i) + ".";
    Layer L;
    L.attn_norm = get(p + "attn_norm.weight", {D});
    L.wq = get(p + "attn.wq.weight", {H * hd, D});
    L.wk = get(p + "attn.wk.weight", {hd, D});
    L.wv = get(p + "attn.wv.weight", {hd, D});
    L.wo = get(p + "attn.wo.weight", {D, H * hd});
    L.ffn_norm = get(p + "ffn_norm.weight", {D});
    L.w1 = get(p + "ffn.w1.weight", {F, D});
    L.w2 = get(p + "ffn.w2.weight", {D, F});
    L.w3 = get(p + "ffn.w3.weight", {F, D});
    m->layers_.push_back(std::move(L));
  }
  const std::string last = "mtp." + std::to_string(nT - 1) + ".";
  m->norm_ = get(last + "norm.weight", {D});
  m->markov_w1_ = get(last + "markov_head.markov_w1.weight", {V, c.markov_rank});
  m->markov_w2_ = get(last + "markov_head.markov_w2.weight", {V, c.markov_rank});
  if (ckpt.has(last + "confidence_head.proj.weight")) used.insert(last + "confidence_head.proj.weight");
  std::vector<std::string> extra;
  for (const std::string& n : ckpt.names())
    if (!used.count(n)) extra.push_back(n);
  KESTREL_CHECK(extra.empty(), "{}: {} unexpected tensor(s) in the DSpark drafter, e.g. '{}'", dir, extra.size(),
                extra.empty() ? "" : extra[0]);
  m->inv_freq_ = cpu::rope_inv_freq(c.head_dim, c.rope_theta, nullptr);
  return m;
}

void DsparkModel::context(const float* hidden, int64_t n, int64_t p0, std::vector<std::vector<float>>& k,
                          std::vector<std::vector<float>>& v) const {
  const int64_t D = cfg_.hidden_size, hd = cfg_.head_dim, nT = static_cast<int64_t>(cfg_.target_layer_ids.size());
  std::vector<float> x(static_cast<size_t>(n * D));
  cpu::linear(hidden, main_proj_.data(), x.data(), n, nT * D, D);
  cpu::rms_norm(x.data(), main_norm_.data(), x.data(), n, D, cfg_.rms_norm_eps);
  k.resize(layers_.size());
  v.resize(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    const size_t at = k[l].size();
    k[l].resize(at + static_cast<size_t>(n * hd));
    v[l].resize(at + static_cast<size_t>(n * hd));
    cpu::linear(x.data(), layers_[l].wk.data(), k[l].data() + at, n, D, hd);
    cpu::linear(x.data(), layers_[l].wv.data(), v[l].data() + at, n, D, hd);
    for (int64_t t = 0; t < n; ++t) cpu::rope_neox(k[l].data() + at + t * hd, 1, hd, cfg_.head_dim, p0 + t, inv_freq_.data());
  }
}

void DsparkModel::block_logits(const int32_t* ids, int64_t p0, const std::vector<std::vector<float>>& kc,
                               const std::vector<std::vector<float>>& vc, int64_t ctx, float* logits) const {
  const int64_t B = cfg_.block_size, D = cfg_.hidden_size, H = cfg_.num_attention_heads, hd = cfg_.head_dim;
  const int64_t F = cfg_.intermediate_size, V = cfg_.vocab_size, N = ctx + B;
  const float eps = cfg_.rms_norm_eps, scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<float> x(static_cast<size_t>(B * D));
  for (int64_t t = 0; t < B; ++t) {
    KESTREL_CHECK(ids[t] >= 0 && ids[t] < V, "DSpark block token {} is outside the vocabulary", ids[t]);
    std::copy_n(embed_.data() + int64_t{ids[t]} * D, D, x.data() + t * D);
  }
  std::vector<float> a(x.size()), q(static_cast<size_t>(B * H * hd)), kb(static_cast<size_t>(B * hd)), vb(kb.size());
  std::vector<float> o(q.size()), y(x.size()), g(static_cast<size_t>(B * F)), u(g.size()), s(static_cast<size_t>(N));
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    cpu::rms_norm(x.data(), L.attn_norm.data(), a.data(), B, D, eps);
    cpu::linear(a.data(), L.wq.data(), q.data(), B, D, H * hd);
    cpu::linear(a.data(), L.wk.data(), kb.data(), B, D, hd);
    cpu::linear(a.data(), L.wv.data(), vb.data(), B, D, hd);
    for (int64_t t = 0; t < B; ++t) {
      cpu::rope_neox(q.data() + t * H * hd, H, hd, cfg_.head_dim, p0 + t, inv_freq_.data());
      cpu::rope_neox(kb.data() + t * hd, 1, hd, cfg_.head_dim, p0 + t, inv_freq_.data());
    }
    // Every block position attends to the whole context and the whole block (one key/value head for all heads).
    for (int64_t t = 0; t < B; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float* qt = q.data() + (t * H + h) * hd;
        float mx = -INFINITY;
        for (int64_t j = 0; j < N; ++j) {
          const float* kj = j < ctx ? kc[l].data() + j * hd : kb.data() + (j - ctx) * hd;
          s[j] = cpu::dot(qt, kj, hd) * scale;
          mx = std::max(mx, s[j]);
        }
        double den = 0.0;
        for (int64_t j = 0; j < N; ++j) den += (s[j] = std::exp(s[j] - mx));
        float* ot = o.data() + (t * H + h) * hd;
        std::fill_n(ot, hd, 0.0f);
        for (int64_t j = 0; j < N; ++j) {
          const float w = static_cast<float>(s[j] / den);
          const float* vj = j < ctx ? vc[l].data() + j * hd : vb.data() + (j - ctx) * hd;
          for (int64_t i = 0; i < hd; ++i) ot[i] += w * vj[i];
        }
      }
    cpu::linear(o.data(), L.wo.data(), y.data(), B, H * hd, D);
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
    cpu::rms_norm(x.data(), L.ffn_norm.data(), a.data(), B, D, eps);
    cpu::linear(a.data(), L.w1.data(), g.data(), B, D, F);
    cpu::linear(a.data(), L.w3.data(), u.data(), B, D, F);
    cpu::swiglu(g.data(), u.data(), g.data(), B * F);
    cpu::linear(g.data(), L.w2.data(), y.data(), B, F, D);
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
  }
  cpu::rms_norm(x.data(), norm_.data(), a.data(), B, D, eps);
  cpu::linear(a.data(), head_.data(), logits, B, D, V);
}

void DsparkModel::add_markov_bias(int32_t prev, float* logits) const {
  const int64_t V = cfg_.vocab_size, r = cfg_.markov_rank;
  KESTREL_CHECK(prev >= 0 && prev < V, "DSpark Markov head: token {} is outside the vocabulary", prev);
  std::vector<float> bias(static_cast<size_t>(V));
  cpu::linear(markov_w1_.data() + int64_t{prev} * r, markov_w2_.data(), bias.data(), 1, r, V);
  for (int64_t i = 0; i < V; ++i) logits[i] += bias[i];
}

void write_dspark_drafter(const std::string& out, const std::string& target_dir, uint64_t seed, int block_size) {
  const ModelConfig t = ModelConfig::load(target_dir + "/config.json");
  DsparkConfig c;
  c.vocab_size = t.vocab_size;
  c.hidden_size = t.hidden_size;
  c.intermediate_size = 2 * t.hidden_size;
  c.num_attention_heads = 4;
  c.head_dim = 32;
  c.rms_norm_eps = t.rms_norm_eps;
  c.block_size = block_size;
  c.markov_rank = 16;
  for (int l = std::max(0, t.num_hidden_layers - 3); l < t.num_hidden_layers; ++l) c.target_layer_ids.push_back(l);
  c.noise_token_id = static_cast<int32_t>(t.vocab_size - 1);
  // embed and head: the target's own tensors (vLLM's DSpark shares them with the target).
  const Checkpoint target(target_dir);
  auto copy = [&](const std::string& from) {
    const TensorView& v = target.get(from);
    return TensorData{v.dtype, v.shape, std::vector<uint8_t>(v.bytes.begin(), v.bytes.end())};
  };
  write_dspark_drafter(out, c, copy("model.embed_tokens.weight"),
                       copy(t.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight"), seed);
}

void write_dspark_drafter(const std::string& out, const DsparkConfig& c, const TensorData& embed,
                          const TensorData& head, uint64_t seed) {
  std::filesystem::create_directories(out);
  {
    std::ofstream f(out + "/config.json");
    KESTREL_CHECK(static_cast<bool>(f), "cannot write {}/config.json", out);
    f << c.to_json().dump(2) << "\n";
  }
  std::map<std::string, TensorData> w;
  w["embed.weight"] = embed;
  w["head.weight"] = head;
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 0xD5A4Cull;
  auto next = [&] {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float stddev, float center, bool f32) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    const float a = stddev * std::sqrt(3.0f);
    for (float& x : v) x = center + (2.0f * static_cast<float>(next() >> 40) / 16777216.0f - 1.0f) * a;
    TensorData td{f32 ? DType::F32 : DType::BF16, shape, {}};
    td.bytes.resize(static_cast<size_t>(n) * (f32 ? 4 : 2));
    for (int64_t i = 0; i < n; ++i) {
      if (f32) {
        std::memcpy(td.bytes.data() + 4 * i, &v[i], 4);
      } else {
        const uint16_t b = f32_to_bf16(v[i]);
        std::memcpy(td.bytes.data() + 2 * i, &b, 2);
      }
    }
    w[name] = std::move(td);
  };
  const int64_t V = c.vocab_size, D = c.hidden_size, H = c.num_attention_heads, hd = c.head_dim;
  const int64_t F = c.intermediate_size, nT = static_cast<int64_t>(c.target_layer_ids.size());
  auto lin = [&](const std::string& name, int64_t o, int64_t i) {
    add(name, {o, i}, 1.0f / std::sqrt(static_cast<float>(i)), 0.0f, false);
  };
  lin("mtp.0.main_proj.weight", D, nT * D);
  add("mtp.0.main_norm.weight", {D}, 0.05f, 1.0f, true);
  for (int64_t i = 0; i < nT; ++i) {
    const std::string p = "mtp." + std::to_string(i) + ".";
    add(p + "attn_norm.weight", {D}, 0.05f, 1.0f, true);
    lin(p + "attn.wq.weight", H * hd, D);
    lin(p + "attn.wk.weight", hd, D);
    lin(p + "attn.wv.weight", hd, D);
    lin(p + "attn.wo.weight", D, H * hd);
    add(p + "ffn_norm.weight", {D}, 0.05f, 1.0f, true);
    lin(p + "ffn.w1.weight", F, D);
    lin(p + "ffn.w2.weight", D, F);
    lin(p + "ffn.w3.weight", F, D);
  }
  const std::string last = "mtp." + std::to_string(nT - 1) + ".";
  add(last + "norm.weight", {D}, 0.05f, 1.0f, true);
  add(last + "markov_head.markov_w1.weight", {V, c.markov_rank}, 1.0f, 0.0f, false);
  lin(last + "markov_head.markov_w2.weight", V, c.markov_rank);
  lin(last + "confidence_head.proj.weight", 1, D + c.markov_rank);
  write_checkpoint(out, w, int64_t{2} << 30);
}

}  // namespace kestrel
