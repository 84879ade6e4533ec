// Whole-model tests of the CPU reference on the tiny presets: loading, consistency between prefill and decode, clear
// errors for broken checkpoints and configs, --hf-overrides, the context length's config keys and dummy weights.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/basic.h"
#include "cpu/cpu_backend.h"
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

class EveryArch : public ::testing::TestWithParam<Arch> {};

TEST_P(EveryArch, LoadsAndProducesFiniteLogits) {
  const auto m = load_cpu_model(tiny_dir(GetParam()));
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
  const auto m_exact = load_cpu_model(tiny_dir(GetParam()), exact);
  const auto full = prefill_logits(*m_exact, ids);
  for (size_t k : {size_t{1}, size_t{37}, size_t{64}, size_t{89}}) {
    const auto split = split_logits(*m_exact, ids, k);
    EXPECT_EQ(0, std::memcmp(full.data(), split.data(), full.size() * sizeof(float))) << "k=" << k;
  }
  const auto m = load_cpu_model(tiny_dir(GetParam()));
  const auto chunked = prefill_logits(*m, ids);
  EXPECT_LT(rel_err(chunked, full), 1e-5);
  const auto chunked_split = split_logits(*m, ids, 64);  // segment boundary on a chunk boundary
  EXPECT_LT(rel_err(chunked_split, full), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Tiny, EveryArch, ::testing::Values(Arch::kimi_k3, Arch::kimi_linear, Arch::deepseek_v32),
                         [](const auto& info) { return std::string(arch_name(info.param)); });

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
    load_cpu_model(dir);
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
      {[](auto& j) { j["linear_attn_config"]["kda_layers"] = {0, 1, 2, 4, 5}; }, "kda_layers"},
      {[](auto& j) { j["linear_attn_config"]["full_attn_layers"] = {3}; }, "6"},
      {[](auto& j) { j["num_experts_per_token"] = 99; }, "experts per token"},
      {[](auto& j) { j["index_head_dim"] = 48; }, "index_head_dim"},
      {[](auto& j) { j["architectures"] = {"DeepseekV32ForCausalLM"}; }, "architectures"},
      // Issue 21: refused before per-layer tables are allocated (this used 8 GB before it failed).
      {[](auto& j) { j["num_hidden_layers"] = 1000000000; }, "'num_hidden_layers' is too large (1000000000; at most 1024)"},
      {[](auto& j) { j["vocab_size"] = int64_t{1} << 40; }, "'vocab_size' is too large"},
      {[](auto& j) { j["num_experts"] = 1000000000; }, "'num_experts' is too large"},
      {[](auto& j) { j["linear_attn_config"]["num_heads"] = 1000000000; }, "linear_attn_config.num_heads' is too large"},
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

// ---- --hf-overrides ----

TEST(HfOverrides, MergeIntoTheConfig) {
  const std::string dir = tiny_dir(Arch::kimi_k3);
  const ModelConfig base = load_model_config(dir);
  const ModelConfig two = load_model_config(dir, {{"num_hidden_layers", 2}});
  EXPECT_EQ(two.num_hidden_layers, 2);
  ASSERT_EQ(two.layer_kinds.size(), 2u);  // the layer lists' entries beyond layer 2 are not there
  EXPECT_EQ(two.layer_kinds[0], base.layer_kinds[0]);
  // Nested objects merge key by key: the other linear_attn_config fields stay.
  const ModelConfig heads = load_model_config(dir, {{"linear_attn_config", {{"short_conv_kernel_size", 3}}}});
  EXPECT_EQ(heads.short_conv_kernel_size, 3);
  EXPECT_EQ(heads.kda_num_heads, base.kda_num_heads);
  // A key the file lacks but Kestrel reads is taken.
  const ModelConfig len = load_model_config(dir, {{"model_max_length", 1000}});
  EXPECT_EQ(len.context_length, 1000);
  // null removes a key, as JSON merge patch: an FP8 config without its quantization_config is a bf16 model.
  const ModelConfig fp8 = preset_config(find_preset(Arch::deepseek_v32, "tiny"));
  ASSERT_EQ(fp8.weight_quant, WeightQuant::fp8_block);
  const ModelConfig plain = ModelConfig::from_json(fp8.to_json(), {{"quantization_config", nullptr}});
  EXPECT_EQ(plain.weight_quant, WeightQuant::none);
  EXPECT_EQ(plain.hidden_size, fp8.hidden_size);
  // The model runs with fewer layers: the checkpoint's later layers are skipped like MTP layers.
  LoadOptions lo;
  lo.hf_overrides = {{"num_hidden_layers", 2}};
  const auto m = load_cpu_model(dir, {}, lo);
  EXPECT_EQ(m->layers().size(), 2u);
  const auto logits = prefill_logits(*m, random_ids(5, 9));
  for (float v : logits) ASSERT_TRUE(std::isfinite(v));
}

TEST(HfOverrides, UnknownKeysAndBadValuesAreNamed) {
  const std::string dir = tiny_dir(Arch::kimi_k3);
  auto expect_error = [&](const nlohmann::json& o, const std::string& needle) {
    try {
      load_model_config(dir, o);
      FAIL() << "expected an error mentioning '" << needle << "' for " << o.dump();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error({{"num_hiden_layers", 2}}, "num_hiden_layers");
  expect_error({{"linear_attn_config", {{"num_headz", 2}}}}, "linear_attn_config.num_headz");
  expect_error({{"num_hidden_layers", "two"}}, "num_hidden_layers");
  expect_error({{"hidden_size", -1}}, "hidden_size");
  expect_error(nlohmann::json::array({1, 2}), "--hf-overrides");
}

// ---- the context length ----

TEST(ContextLength, FromTheKeysVllmReads) {
  const std::string dir = tiny_dir(Arch::kimi_linear);
  nlohmann::json j;
  std::ifstream(dir + "/config.json") >> j;
  j.erase("max_position_embeddings");
  EXPECT_EQ(ModelConfig::from_json(j).context_length, 0);
  j["model_max_length"] = 8192;  // what Kimi's config.json has
  ModelConfig c = ModelConfig::from_json(j);
  EXPECT_EQ(c.context_length, 8192);
  EXPECT_EQ(c.context_length_key, "model_max_length");
  j["max_position_embeddings"] = 4096;  // the least of those present, as vLLM
  c = ModelConfig::from_json(j);
  EXPECT_EQ(c.context_length, 4096);
  EXPECT_EQ(c.context_length_key, "max_position_embeddings");
  j.erase("max_position_embeddings");
  j.erase("model_max_length");
  for (const char* key : {"max_seq_len", "seq_length", "max_sequence_length"}) {
    nlohmann::json k = j;
    k[key] = 2048;
    EXPECT_EQ(ModelConfig::from_json(k).context_length, 2048) << key;
  }
}

// ---- --load-format dummy ----

// A directory holding only the config.json of a preset.
std::string config_only(Arch arch, const std::string& name) {
  const std::string dir = fs::temp_directory_path() / ("kestrel_dummy_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(tiny_dir(arch) + "/config.json", dir + "/config.json");
  return dir;
}

TEST(DummyWeights, DeterministicBySeed) {
  for (Arch arch : {Arch::kimi_k3, Arch::kimi_linear, Arch::deepseek_v32}) {
    SCOPED_TRACE(arch_name(arch));
    const std::string dir = config_only(arch, arch_name(arch));
    LoadOptions lo;
    lo.load_format = "dummy";
    lo.seed = 1;
    const auto a = load_cpu_model(dir, {}, lo), b = load_cpu_model(dir, {}, lo);
    lo.seed = 2;
    const auto c = load_cpu_model(dir, {}, lo);
    const auto ids = random_ids(12, 3);
    const auto la = prefill_logits(*a, ids), lb = prefill_logits(*b, ids), lc = prefill_logits(*c, ids);
    EXPECT_EQ(0, std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)));
    EXPECT_GT(rel_err(lc, la), 0.1);
    // Scaled so that activations stay O(1): the logits are neither saturated nor vanishing.
    double ss = 0;
    for (float v : la) {
      ASSERT_TRUE(std::isfinite(v));
      ss += double(v) * v;
    }
    const double rms = std::sqrt(ss / la.size());
    EXPECT_GT(rms, 0.05);
    EXPECT_LT(rms, 50.0);
  }
}

TEST(DummyWeights, NotAFormat) {
  LoadOptions lo;
  lo.load_format = "pickle";
  try {
    load_cpu_model(tiny_dir(Arch::kimi_k3), {}, lo);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--load-format 'pickle'"), std::string::npos) << e.what();
  }
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
