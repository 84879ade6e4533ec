// The model's one graph: a backend runs exactly the ops of Model::graph (the trace of a real step on the CPU backend
// equals the graph traced with no backend at all, and has the architecture's layer pattern); dummy weights come to
// the backend in the shapes and stored formats of the checkpoint make-model writes for the same config. The GPU tests
// (tests/gpu) compare the CUDA backend's trace with the CPU's.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <regex>

#include "cpu/cpu_backend.h"
#include "model/make_model.h"
#include "model/model.h"
#include "model/trace_backend.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;

std::string tiny_dir(Arch arch) {
  const std::string dir = fs::temp_directory_path() / ("kestrel_trace_test_" + std::string(arch_name(arch)) + "_" +
                                                       std::to_string(::getpid()));
  if (!fs::exists(dir + "/config.json")) make_model(find_preset(arch, "tiny"), dir, 11);
  return dir;
}

struct Traced {
  std::unique_ptr<Model> model;
  TraceBackend* trace = nullptr;
};

Traced load_traced(const std::string& dir, const LoadOptions& lo = {}) {
  auto tb = std::make_unique<TraceBackend>(std::make_unique<CpuBackend>());
  TraceBackend* raw = tb.get();
  return {Model::load(dir, {}, std::move(tb), lo), raw};
}

class EveryArch : public ::testing::TestWithParam<Arch> {};

TEST_P(EveryArch, BackendRunsTheModelsGraph) {
  Traced t = load_traced(tiny_dir(GetParam()));
  const Model& m = *t.model;
  const ModelConfig& cfg = m.config();
  t.trace->clear();
  const std::vector<int32_t> ids = {3, 1, 4, 1, 5, 9, 2, 6};
  SequenceState s = m.new_sequence();
  std::vector<float> logits(ids.size() * cfg.vocab_size);
  m.forward(s, ids.data(), static_cast<int64_t>(ids.size()), logits.data());
  std::vector<std::string> ran = t.trace->calls();
  ASSERT_FALSE(ran.empty());
  EXPECT_EQ(ran.front(), "run_step");
  ran.erase(ran.begin());
  EXPECT_EQ(ran, trace_graph(m, static_cast<int64_t>(ids.size())));

  // The decoder's pattern: every layer in order, its mixer as the config says, the logits last.
  int layer = -1, mla = 0, kda = 0, moe = 0;
  for (const std::string& line : ran) {
    if (line.rfind("begin_layer ", 0) == 0) EXPECT_EQ(std::stoi(line.substr(12)), ++layer);
    mla += line.rfind("mla_attention ", 0) == 0;
    kda += line.rfind("kda ", 0) == 0;
    moe += line.rfind("moe ", 0) == 0;
  }
  EXPECT_EQ(layer + 1, cfg.num_hidden_layers);
  EXPECT_EQ(mla, cfg.num_layers_of(LayerKind::mla));
  EXPECT_EQ(kda, cfg.num_layers_of(LayerKind::kda));
  int moe_layers = 0;
  for (int l = 0; l < cfg.num_hidden_layers; ++l) moe_layers += cfg.is_moe_layer(l);
  EXPECT_EQ(moe, moe_layers);
  EXPECT_EQ(ran.back().rfind("logits ", 0), 0u) << ran.back();
}

// The weights' set-up calls with the dtypes of plain tensors left out (a real checkpoint may store a norm in F32 or
// BF16; the dummy's choice is BF16): shapes, the order of the weights and which are FP8 or MXFP4 remain.
std::vector<std::string> weight_calls(const std::vector<std::string>& calls) {
  static const std::regex plain(R"(\]\s*(F32|BF16|F16|F64))");
  std::vector<std::string> out;
  for (const std::string& c : calls) {
    if (c == "run_step") break;
    out.push_back(std::regex_replace(c, plain, "]"));
  }
  return out;
}

TEST_P(EveryArch, DummyWeightsHaveTheCheckpointsShapesAndFormats) {
  const std::string dir = tiny_dir(GetParam());
  const Traced real = load_traced(dir);
  LoadOptions lo;
  lo.load_format = "dummy";
  const Traced dummy = load_traced(dir, lo);
  const std::vector<std::string> a = weight_calls(real.trace->calls()), b = weight_calls(dummy.trace->calls());
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "call " << i;
  // The tiny presets cover every stored format: FP8 block-scaled (deepseek_v32), MXFP4 experts (kimi_k3).
  const std::string all = [&] {
    std::string s;
    for (const std::string& c : b) s += c + "\n";
    return s;
  }();
  if (GetParam() == Arch::deepseek_v32) EXPECT_NE(all.find("F8_E4M3+"), std::string::npos);
  if (GetParam() == Arch::kimi_k3) EXPECT_NE(all.find("U8+"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Tiny, EveryArch, ::testing::Values(Arch::kimi_k3, Arch::kimi_linear, Arch::deepseek_v32),
                         [](const auto& info) { return std::string(arch_name(info.param)); });

}  // namespace
}  // namespace kestrel
