// Whole-model tests of the CPU reference on the tiny presets: loading, consistency between prefill and decode,
// DSA with a top-k that covers the context equals dense MLA, and clear errors for broken checkpoints.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/basic.h"
#include "model/make_model.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;

std::string tiny_dir(Arch arch) {
  const std::string dir = fs::temp_directory_path() / ("kestrel_model_test_" + std::string(arch_name(arch)) + "_" +
                                                       std::to_string(::getpid()));
  if (!fs::exists(dir + "/config.json")) make_model(find_preset(arch, "tiny"), dir, 7);
  return dir;
}

// n random byte tokens (ids 0..255 exist in every preset's vocabulary).
std::vector<int32_t> random_ids(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(n);
  for (auto& t : ids) t = static_cast<int32_t>(rng() % 256);
  return ids;
}

double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

std::vector<float> prefill_logits(const Model& m, const std::vector<int32_t>& ids) {
  SequenceState s = m.new_sequence();
  std::vector<float> out(ids.size() * m.config().vocab_size);
  m.forward(s, ids.data(), static_cast<int64_t>(ids.size()), out.data());
  return out;
}

// Prefill of k tokens, then one token at a time.
std::vector<float> split_logits(const Model& m, const std::vector<int32_t>& ids, size_t k) {
  const int64_t V = m.config().vocab_size;
  SequenceState s = m.new_sequence();
  std::vector<float> out(ids.size() * V);
  m.forward(s, ids.data(), static_cast<int64_t>(k), out.data());
  for (size_t t = k; t < ids.size(); ++t) m.forward(s, &ids[t], 1, out.data() + t * V);
  return out;
}

// One MLA layer's pages outside any engine: block j lives in row j, so a position's slot is the position itself.
struct LayerPages {
  explicit LayerPages(const MlaAttention& l) : layer(l) {}
  const MlaAttention& layer;
  int block_size = 64;
  int64_t n = 0;
  std::vector<uint8_t> rows;
  std::vector<int32_t> table;
  std::vector<int64_t> slots;

  int64_t row_bytes() const { return block_size * (layer.latent_bytes() + layer.index_key_bytes()); }
  // The pages of positions [0, n + T) with slots for T new tokens at n...
  TokenPages next(int64_t T) {
    const int64_t blocks = (n + T + block_size - 1) / block_size;
    rows.resize(blocks * row_bytes());
    table.resize(blocks);
    for (int64_t j = 0; j < blocks; ++j) table[j] = static_cast<int32_t>(j);
    slots.resize(T);
    for (int64_t t = 0; t < T; ++t) slots[t] = n + t;
    const TokenPages pages{rows.data(), row_bytes(), block_size, table.data(), slots.data(), n};
    n += T;
    return pages;
  }
};

class EveryArch : public ::testing::TestWithParam<Arch> {};

TEST_P(EveryArch, LoadsAndProducesFiniteLogits) {
  const auto m = Model::load(tiny_dir(GetParam()));
  const auto logits = prefill_logits(*m, random_ids(20, 1));
  for (float v : logits) ASSERT_TRUE(std::isfinite(v));
  // Logits of a random-weight model are O(1)-O(10), not saturated or vanishing.
  double ss = 0;
  for (float v : logits) ss += double(v) * v;
  const double rms = std::sqrt(ss / logits.size());
  EXPECT_GT(rms, 0.05);
  EXPECT_LT(rms, 50.0);
}

// Prefill of n tokens = prefill of k tokens then n-k decode steps. With the KDA recurrence everywhere the two are
// the same computation token for token and must agree bit for bit; with the chunked KDA prefill they agree within
// fp32 rounding (bound 1e-5 relative).
TEST_P(EveryArch, PrefillEqualsPrefillThenDecode) {
  const auto ids = random_ids(90, 2);  // > 64 (a KDA chunk) and > index_topk (16): sparse selection happens
  ModelOptions exact;
  exact.kda_chunked_prefill = false;
  const auto m_exact = Model::load(tiny_dir(GetParam()), exact);
  const auto full = prefill_logits(*m_exact, ids);
  for (size_t k : {size_t{1}, size_t{37}, size_t{64}, size_t{89}}) {
    const auto split = split_logits(*m_exact, ids, k);
    EXPECT_EQ(0, std::memcmp(full.data(), split.data(), full.size() * sizeof(float))) << "k=" << k;
  }
  const auto m = Model::load(tiny_dir(GetParam()));
  const auto chunked = prefill_logits(*m, ids);
  EXPECT_LT(rel_err(chunked, full), 1e-5);
  const auto chunked_split = split_logits(*m, ids, 64);  // segment boundary on a chunk boundary
  EXPECT_LT(rel_err(chunked_split, full), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Tiny, EveryArch, ::testing::Values(Arch::kimi_k3, Arch::kimi_linear, Arch::deepseek_v32),
                         [](const auto& info) { return std::string(arch_name(info.param)); });

// The attention prefix of the first MLA layer of `cfg`.
std::string first_mla_prefix(const ModelConfig& cfg) {
  int layer = 0;
  while (cfg.layer_kinds[layer] != LayerKind::mla) ++layer;
  return "model.layers." + std::to_string(layer) + ".self_attn.";
}

// n standard-normal values from `seed`.
std::vector<float> normal_values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  for (float& v : x) v = nd(rng);
  return x;
}

// A DSA layer whose index_topk covers the whole context selects every causal token and must equal dense MLA over
// the same weights, bit for bit (the selected rows are visited in position order).
TEST(Dsa, TopkCoveringContextEqualsDenseMla) {
  for (Arch arch : {Arch::kimi_k3, Arch::deepseek_v32}) {
    const std::string dir = tiny_dir(arch);
    ModelConfig sparse = ModelConfig::load(dir + "/config.json");
    sparse.index_topk = 4096;
    ModelConfig dense = sparse;
    dense.has_indexer = false;
    const std::string prefix = first_mla_prefix(sparse);
    WeightLoader w(dir, sparse.weight_block_size);
    const MlaAttention a(sparse, w, prefix, LatentCacheDtype::auto_fp32);
    const MlaAttention b(dense, w, prefix, LatentCacheDtype::auto_fp32);
    const int64_t T = 70, D = sparse.hidden_size;
    const std::vector<float> x = normal_values(T * D, 3);
    std::vector<float> ya(T * D), yb(T * D);
    LayerPages ca{a}, cb{b};
    a.forward(x.data(), 40, ca.next(40), ya.data());  // prefill then a second chunk, so both paths read cached rows
    a.forward(x.data() + 40 * D, T - 40, ca.next(T - 40), ya.data() + 40 * D);
    b.forward(x.data(), 40, cb.next(40), yb.data());
    b.forward(x.data() + 40 * D, T - 40, cb.next(T - 40), yb.data() + 40 * D);
    EXPECT_EQ(0, std::memcmp(ya.data(), yb.data(), ya.size() * sizeof(float))) << arch_name(arch);

    // With the tiny preset's top-16 the layer really is sparse at 70 tokens: the outputs must differ.
    sparse.index_topk = 16;
    const MlaAttention c(sparse, w, prefix, LatentCacheDtype::auto_fp32);
    LayerPages cc{c};
    std::vector<float> yc(T * D);
    c.forward(x.data(), T, cc.next(T), yc.data());
    EXPECT_GT(rel_err(yc, yb), 1e-4) << arch_name(arch);
    EXPECT_EQ(0, std::memcmp(yc.data(), yb.data(), 16 * D * sizeof(float)))  // first 16 tokens: dense regime
        << arch_name(arch);
  }
}

// The FP8 latent cache rounds what attention reads: one MLA layer's output stays close to the fp32 cache's (e4m3
// keeps 3 mantissa bits: a few percent), but is not identical. Whole-model logits are not compared: MoE routing
// and top-k selection are discontinuous, so a small perturbation can legitimately flip an expert.
TEST(Model, Fp8LatentCacheStaysClose) {
  for (Arch arch : {Arch::kimi_k3, Arch::deepseek_v32}) {
    const std::string dir = tiny_dir(arch);
    const ModelConfig cfg = ModelConfig::load(dir + "/config.json");
    const std::string prefix = first_mla_prefix(cfg);
    WeightLoader w(dir, cfg.weight_block_size);
    const MlaAttention ref(cfg, w, prefix, LatentCacheDtype::auto_fp32);
    const MlaAttention fp8(cfg, w, prefix, LatentCacheDtype::fp8);
    const int64_t T = 30, D = cfg.hidden_size;
    const std::vector<float> x = normal_values(T * D, 5);
    std::vector<float> ya(T * D), yb(T * D);
    LayerPages ca{ref}, cb{fp8};
    ref.forward(x.data(), T, ca.next(T), ya.data());
    const TokenPages fp8_pages = cb.next(T);
    fp8.forward(x.data(), T, fp8_pages, yb.data());
    const double e = rel_err(yb, ya);
    EXPECT_GT(e, 1e-4) << arch_name(arch);
    EXPECT_LT(e, 0.08) << arch_name(arch);
    // Every cached value is an e4m3 value times the layer's scale (kimi) or its tile's power-of-two scale
    // (deepseek, whose k_pe tail is bf16 instead).
    const int C = cfg.kv_lora_rank;
    std::vector<float> cached(T * (C + cfg.qk_rope_head_dim));
    fp8.read_latent(fp8_pages, T, cached.data());
    for (int64_t t = 0; t < T; ++t)
      for (int i = 0; i < C; ++i) {
        const float v = cached[t * (C + cfg.qk_rope_head_dim) + i];
        int e2;
        const float m = std::frexp(v, &e2);
        EXPECT_EQ(m * 16.0f, std::round(m * 16.0f)) << "value " << v << " has more than e4m3's 4 significant bits";
      }
  }
}

// ---- broken checkpoints: each gives an Error that names the problem ----

std::string copy_of_tiny(const std::string& name) {
  const std::string src = tiny_dir(Arch::kimi_k3);
  const std::string dst = fs::temp_directory_path() / ("kestrel_broken_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dst);
  fs::copy(src, dst);
  return dst;
}

void expect_load_error(const std::string& dir, const std::string& needle) {
  try {
    Model::load(dir);
    FAIL() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Rewrites the checkpoint with `edit` applied to its tensor map.
template <typename Edit>
void rewrite_tensors(const std::string& dir, Edit edit) {
  std::map<std::string, TensorData> tensors;
  {
    SafetensorsFile f(dir + "/model.safetensors");
    for (const std::string& n : f.names()) {
      const TensorView& v = f.get(n);
      tensors[n] = TensorData{v.dtype, v.shape, std::vector<uint8_t>(v.bytes.begin(), v.bytes.end())};
    }
  }
  edit(tensors);
  write_safetensors(dir + "/model.safetensors", tensors);
}

TEST(BrokenCheckpoint, MissingTensorIsNamed) {
  const std::string dir = copy_of_tiny("missing");
  rewrite_tensors(dir, [](auto& t) { t.erase("model.layers.2.self_attn.kv_b_proj.weight"); });
  expect_load_error(dir, "model.layers.2.self_attn.kv_b_proj.weight");
}

TEST(BrokenCheckpoint, UnexpectedTensorIsNamed) {
  const std::string dir = copy_of_tiny("unexpected");
  rewrite_tensors(dir, [](auto& t) { t["model.layers.1.self_attn.surprise.weight"] = t.at("model.norm.weight"); });
  expect_load_error(dir, "model.layers.1.self_attn.surprise.weight");
}

TEST(BrokenCheckpoint, WrongShapeIsNamed) {
  const std::string dir = copy_of_tiny("shape");
  rewrite_tensors(dir, [](auto& t) { t.at("model.norm.weight").shape = {32, 2}; });
  expect_load_error(dir, "model.norm.weight");
}

TEST(BrokenCheckpoint, WrongDtypeIsNamed) {
  const std::string dir = copy_of_tiny("dtype");
  rewrite_tensors(dir, [](auto& t) { t.at("model.norm.weight").dtype = DType::I16; });
  expect_load_error(dir, "model.norm.weight");
}

TEST(BrokenCheckpoint, TruncatedFileIsAnError) {
  const std::string dir = copy_of_tiny("truncated");
  const auto size = fs::file_size(dir + "/model.safetensors");
  fs::resize_file(dir + "/model.safetensors", size - 100);
  expect_load_error(dir, "model.safetensors");
}

void rewrite_config(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j;
  std::ifstream(dir + "/config.json") >> j;
  edit(j);
  std::ofstream(dir + "/config.json") << j.dump();
}

TEST(BrokenConfig, ErrorsNameTheField) {
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {[](auto& j) { j.erase("hidden_size"); }, "hidden_size"},
      {[](auto& j) { j["kv_lora_rank"] = "wide"; }, "kv_lora_rank"},
      {[](auto& j) { j["model_type"] = "llama"; }, "llama"},
      {[](auto& j) { j["linear_attn_config"]["kda_layers"] = {1, 2, 4, 5, 9}; }, "kda_layers"},
      {[](auto& j) { j["linear_attn_config"]["full_attn_layers"] = {3}; }, "6"},
      {[](auto& j) { j["num_experts_per_token"] = 99; }, "experts per token"},
      {[](auto& j) { j["index_head_dim"] = 48; }, "index_head_dim"},
      {[](auto& j) { j["architectures"] = {"DeepseekV32ForCausalLM"}; }, "architectures"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string dir = copy_of_tiny("config" + std::to_string(i));
    rewrite_config(dir, cases[i].edit);
    expect_load_error(dir, cases[i].needle);
  }
  const std::string dir = copy_of_tiny("notjson");
  std::ofstream(dir + "/config.json") << "{\"model_type\": ";
  expect_load_error(dir, "config.json");
}

// ModelOptions::bf16_activations (the GPU's numerics): a linear layer then multiplies the bf16-rounded input, and
// only then; the default keeps fp32 inputs.
TEST(Model, Bf16ActivationsRoundLinearInputs) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  const int64_t in = 37, out = 5, T = 3;
  Linear l;
  l.w = Tensor({out, in});
  for (float& w : l.w.data) w = round_to_bf16(nd(rng));
  std::vector<float> x(T * in), rounded(T * in);
  for (int64_t i = 0; i < T * in; ++i) {
    x[i] = nd(rng);
    rounded[i] = round_to_bf16(x[i]);
  }
  std::vector<float> plain(T * out), expect_plain(T * out), bf(T * out), expect_bf(T * out);
  l(x.data(), T, plain.data());
  cpu::linear(x.data(), l.w.ptr(), expect_plain.data(), T, in, out);
  l.bf16_inputs = true;
  l(x.data(), T, bf.data());
  cpu::linear(rounded.data(), l.w.ptr(), expect_bf.data(), T, in, out);
  EXPECT_EQ(plain, expect_plain);
  EXPECT_EQ(bf, expect_bf);
  EXPECT_NE(bf, plain);  // the random inputs are not bf16 values, so rounding them changes the products

  // Loaded with the option, the model's logits move (by bf16 rounding), without it they are the fp32 reference's.
  ModelOptions o;
  o.bf16_activations = true;
  const auto emulated = Model::load(tiny_dir(Arch::kimi_linear), o);
  const auto exact = Model::load(tiny_dir(Arch::kimi_linear));
  // The first position: later ones can differ by far more where a router choice flips.
  const std::vector<int32_t> ids = random_ids(1, 4);
  const double diff = rel_err(prefill_logits(*emulated, ids), prefill_logits(*exact, ids));
  EXPECT_GT(diff, 1e-5);
  EXPECT_LT(diff, 0.05);
}

TEST(Presets, FullSizeParameterCounts) {
  // DeepSeek-V3.2 without its MTP layer: 671B total, 37B active is the published size (the count includes the
  // indexers, ~0.3% more).
  const ParameterCount ds = count_parameters(preset_config(find_preset(Arch::deepseek_v32, "deepseek-v3.2")));
  EXPECT_NEAR(ds.total / 1e9, 671.0, 10.0);
  EXPECT_NEAR(ds.active / 1e9, 37.5, 1.5);
  // Kimi Linear 48B: 49,122,681,728 parameters (kda_kimi_linear.md section 0).
  const ParameterCount kl = count_parameters(preset_config(find_preset(Arch::kimi_linear, "kimi-linear-48b")));
  EXPECT_EQ(kl.total, int64_t{49122681728});
  // K3.1 Pro: the preset's assumptions were chosen to land near 2.8T total / 104B active.
  const ParameterCount k3 = count_parameters(preset_config(find_preset(Arch::kimi_k3, "k3.1-pro")));
  EXPECT_NEAR(k3.total / 1e12, 2.8, 0.05);
  EXPECT_NEAR(k3.active / 1e9, 104.0, 3.0);
  const ModelConfig c = preset_config(find_preset(Arch::kimi_k3, "k3.1-pro"));
  EXPECT_EQ(c.num_layers_of(LayerKind::kda), 69);
  EXPECT_EQ(c.num_layers_of(LayerKind::mla), 24);
}

TEST(Presets, ConfigRoundTripsThroughJson) {
  for (const Preset& p : presets()) {
    const ModelConfig c = preset_config(p);
    const ModelConfig back = ModelConfig::from_json(c.to_json());
    EXPECT_EQ(back.to_json(), c.to_json()) << p.name;
    EXPECT_EQ(back.layer_kinds, c.layer_kinds) << p.name;
  }
}

}  // namespace
}  // namespace kestrel
