// The GPU engine on a checkpoint with FP8 block-scaled linear weights (WeightQuant::fp8_block, 128 x 128 blocks)
// against the CPU reference with the GPU's numerics: every FP8 linear layer runs cuBLASLt's block-scaled FP8 product
// on activations quantized in groups of 128 (kernels/cuda/gemm_fp8_block.h) at every step size, decode and prefill,
// and the reference quantizes the same way (kernels/cpu/fp8_linear.h). The model is the tiny kimi_linear preset
// with every linear layer re-stored in FP8; its experts are narrower than 128, so both sides run them on their
// decoded values (fp8_experts_stay_fp8). The scales are powers of two, as DeepSeek-V3.2's. Runs only where a CUDA
// device is visible.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <regex>
#include <string>

#include <nlohmann/json.hpp>

#include "core/formats.h"
#include "engine/engine.h"
#include "gpu/cuda_backend.h"
#include "gpu_models.h"
#include "kernels/cuda/runtime.h"
#include "model/make_model.h"
#include "model/model.h"
#include "cpu_reference.h"
#include "model/safetensors.h"

namespace kestrel {
namespace {

constexpr int kBlock = 128;
// The first layer alone: every position within this fraction of the row's largest |logit| (as the bf16 engine's
// few-token bound), except at a routing near-tie (gpu_model_test's kNearTieMargin).
constexpr float kLogitBound = 2e-2f, kNearTieMargin = 2e-2f;
// The whole model: typical-position bounds (median and 90th percentile of logit error / row max), or twice the
// distance of the two CPU references where that is larger. FP8 activations amplify what the bf16 runs leave: an
// input within rounding noise d of an e4m3 code boundary (the codes are 2^-4..2^-3 of their value apart, s) tips to
// the other code, so a layer's input error d becomes one of about sqrt(d * s) at its output, against sqrt(d * 2^-8)
// for bf16; after a few layers it is of the size of the quantization's own effect -- which is the distance of the
// reference with FP8 activations from the one without (gpu_numerics off: the decoded weights, fp32 activations). A
// wrong kernel (a scale of the wrong block, codes in the wrong order) moves every position by O(1).
constexpr float kMedianBound = 1e-2f, kP90Bound = 5e-2f;

// The weight w [out, in] as e4m3 codes with power-of-two block scales: scale = the least power of two with
// amax / scale <= 448, so every w / scale is exact and e4m3 rounds it once.
void store_fp8(std::map<std::string, TensorData>& tensors, const std::string& name) {
  TensorData& t = tensors.at(name);
  ASSERT_EQ(t.dtype, DType::BF16) << name;
  ASSERT_EQ(t.shape.size(), 2u) << name;
  const int64_t out = t.shape[0], in = t.shape[1], rb = (out + kBlock - 1) / kBlock, cb = (in + kBlock - 1) / kBlock;
  std::vector<float> w(static_cast<size_t>(out * in));
  for (size_t i = 0; i < w.size(); ++i) w[i] = bf16_to_f32(static_cast<uint16_t>(t.bytes[2 * i] | t.bytes[2 * i + 1] << 8));
  TensorData codes{DType::F8_E4M3, {out, in}, std::vector<uint8_t>(w.size())};
  std::vector<float> scales(static_cast<size_t>(rb * cb));
  for (int64_t i = 0; i < rb; ++i)
    for (int64_t j = 0; j < cb; ++j) {
      float amax = 0.0f;
      for (int64_t r = i * kBlock; r < std::min(out, (i + 1) * kBlock); ++r)
        for (int64_t c = j * kBlock; c < std::min(in, (j + 1) * kBlock); ++c) amax = std::max(amax, std::fabs(w[r * in + c]));
      float s = 1.0f;
      while (amax / s > kE4m3Max) s *= 2.0f;
      while (amax > 0.0f && amax / (s / 2.0f) <= kE4m3Max) s /= 2.0f;
      scales[i * cb + j] = s;
      for (int64_t r = i * kBlock; r < std::min(out, (i + 1) * kBlock); ++r)
        for (int64_t c = j * kBlock; c < std::min(in, (j + 1) * kBlock); ++c)
          codes.bytes[r * in + c] = f32_to_e4m3(w[r * in + c] / s);
    }
  TensorData st{DType::F32, {rb, cb}, std::vector<uint8_t>(scales.size() * sizeof(float))};
  std::memcpy(st.bytes.data(), scales.data(), st.bytes.size());
  t = std::move(codes);
  tensors[name.substr(0, name.size() - 7) + ".weight_scale_inv"] = std::move(st);  // "<prefix>.weight"
}

// The tiny kimi_linear checkpoint with every linear layer's weight (*_proj, *_proj_with_mqa, experts' w1/w2/w3;
// not the router, the embedding or the LM head) stored in FP8.
std::string fp8_model_dir() {
  static std::string made;
  if (!made.empty()) return made;
  const std::string dir =
      std::filesystem::temp_directory_path() / ("kestrel_gpu_fp8_test_" + std::to_string(::getpid()));
  make_model(find_preset(Arch::kimi_linear, "tiny"), dir, 11);
  std::map<std::string, TensorData> tensors;
  {
    const SafetensorsFile f(dir + "/model.safetensors");
    for (const std::string& name : f.names()) {
      const TensorView& v = f.get(name);
      tensors[name] = TensorData{v.dtype, v.shape, std::vector<uint8_t>(v.bytes.begin(), v.bytes.end())};
    }
  }
  const std::regex linear_re(R"(.*(_proj|_proj_with_mqa|\.w[123])\.weight)");
  std::vector<std::string> names;
  for (const auto& [name, t] : tensors)
    if (std::regex_match(name, linear_re)) names.push_back(name);
  for (const std::string& n : names) store_fp8(tensors, n);
  write_checkpoint(dir, tensors, int64_t{2} << 30);
  nlohmann::json cfg;
  std::ifstream(dir + "/config.json") >> cfg;
  cfg["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {kBlock, kBlock}}};
  std::ofstream(dir + "/config.json") << cfg.dump(2) << "\n";
  made = dir;
  return made;
}

std::vector<int32_t> random_prompt(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(n);
  for (auto& t : ids) t = static_cast<int32_t>(rng() % 256);
  return ids;
}

struct Typical {
  float median, p90, max;
};
Typical typical(std::vector<float> r) {
  std::sort(r.begin(), r.end());
  return {r[r.size() / 2], r[r.size() * 9 / 10], r.back()};
}

void expect_typical(const std::vector<float>& r, const std::vector<float>& spread, const std::string& what) {
  ASSERT_FALSE(r.empty()) << what;
  ASSERT_EQ(r.size(), spread.size()) << what;
  const Typical got = typical(r), apart = typical(spread);
  const float median_bound = std::max(kMedianBound, 2 * apart.median), p90_bound = std::max(kP90Bound, 2 * apart.p90);
  EXPECT_LE(got.median, median_bound) << what;
  EXPECT_LE(got.p90, p90_bound) << what;
  std::printf("[ fp8 %s ] %zu positions: median %.3g (bound %.3g), 90th %.3g (bound %.3g), max %.3g; the CPU "
              "references with and without FP8 activations: median %.3g, 90th %.3g apart\n",
              what.c_str(), r.size(), got.median, median_bound, got.p90, p90_bound, got.max, apart.median, apart.p90);
}

// The logits of a model over ids, one forward pass.
std::vector<float> forward_logits(const Model& m, const std::vector<int32_t>& ids) {
  std::vector<float> out(ids.size() * static_cast<size_t>(m.config().vocab_size));
  SequenceState st = m.new_sequence();
  m.forward(st, ids.data(), static_cast<int64_t>(ids.size()), out.data());
  return out;
}

TEST(GpuFp8Model, PromptsAndDecodesMatchCpu) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  ModelOptions o;
  o.latent_cache = LatentCacheDtype::fp8;
  const auto m = gpu_test::cpu_reference_model(fp8_model_dir(), o);
  ASSERT_EQ(m->config().weight_quant, WeightQuant::fp8_block);
  const int64_t V = m->config().vocab_size;

  EngineConfig cfg;
  cfg.max_num_batched_tokens = 128;
  cfg.max_num_seqs = 8;
  cfg.max_model_len = 1024;
  gpu_test::GpuEngineRun run = gpu_test::gpu_engine(fp8_model_dir(), o, cfg, 0.05, nullptr);
  ASSERT_GT(run.backend().weight_bytes(), 0u);
  Engine& e = *run.engine;
  // The prompts run in one step of 28 tokens; then decode steps of 3, 2 and 1 sequences.
  const std::vector<std::vector<int32_t>> prompts = {random_prompt(20, 1), random_prompt(7, 2), random_prompt(1, 3)};
  const int max_tokens[] = {6, 10, 14};
  for (size_t i = 0; i < prompts.size(); ++i) {
    SamplingParams sp;
    sp.max_tokens = max_tokens[i];
    sp.ignore_eos = true;
    e.add_request(prompts[i], sp, 0, /*keep_logits=*/true);
  }
  const std::vector<RequestOutput> done = e.run_to_completion();
  ASSERT_EQ(done.size(), prompts.size());
  const auto plain = gpu_test::cpu_reference_model(fp8_model_dir(), o, false);
  std::vector<float> all, decode_rows, all_apart, decode_apart;
  for (const RequestOutput& r : done) {
    const size_t i = std::find(prompts.begin(), prompts.end(), r.prompt) - prompts.begin();
    ASSERT_LT(i, prompts.size());
    const Completion& got = r.completions.at(0);
    const gpu_test::Reference reference = gpu_test::cpu_alone(*m, prompts[i], max_tokens[i]);
    const std::vector<float>& ref = reference.logits;
    const std::vector<int32_t>& ref_tokens = reference.tokens;
    int64_t same = 0;
    while (same < static_cast<int64_t>(std::min(got.token_ids.size(), ref_tokens.size())) &&
           got.token_ids[same] == ref_tokens[same])
      ++same;
    std::printf("[ fp8 request %zu ] %lld/%zu greedy tokens agree\n", i, static_cast<long long>(same), ref_tokens.size());
    const int64_t P = static_cast<int64_t>(prompts[i].size());
    // The reference without FP8 activations over the same tokens.
    std::vector<int32_t> ids = prompts[i];
    ids.insert(ids.end(), ref_tokens.begin(), ref_tokens.end());
    const std::vector<float> unquantized = forward_logits(*plain, ids);
    // Rows computed from the same inputs on both sides: up to the first differing greedy token.
    const int64_t last = std::min<int64_t>(P - 1 + same, P + max_tokens[i] - 2);
    for (int64_t p = got.logits_first; p <= last; ++p) {
      const float err = gpu_test::row_error(got.logits.data() + (p - got.logits_first) * V, ref.data() + p * V, V);
      const float apart = gpu_test::row_error(unquantized.data() + p * V, ref.data() + p * V, V);
      all.push_back(err);
      all_apart.push_back(apart);
      if (p >= P) {  // the rows of generated tokens come from decode steps
        decode_rows.push_back(err);
        decode_apart.push_back(apart);
      }
    }
  }
  expect_typical(all, all_apart, "all positions");
  expect_typical(decode_rows, decode_apart, "decode steps");
}

// The FP8 model cut after each of its layers (the same weights, num_hidden_layers = k), a few tokens of one request:
// the first layer is held to kLogitBound at every position (its FP8 inputs are the two sides' embedding and norm, equal
// to fp32 rounding, so they quantize to the same codes); the deeper cuts are printed, to show where and how fast the
// difference grows (the whole model's bound is the test above).
TEST(GpuFp8Model, FirstLayerMatchesCpuAtEveryPosition) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  ModelOptions o;
  o.latent_cache = LatentCacheDtype::fp8;
  const std::string src = fp8_model_dir();
  nlohmann::json j;
  std::ifstream(src + "/config.json") >> j;
  const int L = j["num_hidden_layers"].get<int>();
  for (int k = 1; k <= L; ++k) {
    const std::string dir = src + "_layers" + std::to_string(k);
    std::filesystem::create_directories(dir);
    for (const auto& f : std::filesystem::directory_iterator(src))
      if (f.path().filename() != "config.json")
        std::filesystem::copy_file(f.path(), dir / f.path().filename(), std::filesystem::copy_options::overwrite_existing);
    nlohmann::json cut = j;
    cut["num_hidden_layers"] = k;
    for (const char* key : {"full_attn_layers", "kda_layers"}) {
      nlohmann::json kept = nlohmann::json::array();
      for (int l : cut["linear_attn_config"][key])
        if (l <= k) kept.push_back(l);
      cut["linear_attn_config"][key] = kept;
    }
    std::ofstream(dir + "/config.json") << cut.dump(2);

    const auto m = gpu_test::cpu_reference_model(dir, o);
    const int64_t V = m->config().vocab_size;
    EngineConfig cfg;
    cfg.max_num_batched_tokens = 128;
    cfg.max_num_seqs = 4;
    cfg.max_model_len = 256;
    gpu_test::GpuEngineRun run = gpu_test::gpu_engine(dir, o, cfg, 0.05, nullptr);
    const std::vector<int32_t> prompt = random_prompt(12, 40 + k);
    SamplingParams sp;
    sp.max_tokens = 3;
    sp.ignore_eos = true;
    run.engine->add_request(prompt, sp, 0, /*keep_logits=*/true);
    const Completion got = run.engine->run_to_completion().at(0).completions.at(0);
    // The reference over the GPU's tokens, with its routing margins.
    std::vector<int32_t> ids = prompt;
    ids.insert(ids.end(), got.token_ids.begin(), got.token_ids.end() - 1);  // the last token's logits were not kept
    std::vector<float> margins;
    const auto& cpu = dynamic_cast<const CpuBackend&>(m->backend());
    cpu.record_route_margins(&margins);
    const std::vector<float> ref = forward_logits(*m, ids);
    cpu.record_route_margins(nullptr);
    margins.resize(ids.size(), std::numeric_limits<float>::infinity());
    float worst = 0.0f;
    int near_ties = 0;
    for (int64_t p = got.logits_first; p < static_cast<int64_t>(ids.size()); ++p) {
      const float err = gpu_test::row_error(got.logits.data() + (p - got.logits_first) * V, ref.data() + p * V, V);
      worst = std::max(worst, err);
      const float margin = gpu_test::routing_margin_near(margins, p);
      if (k > 1) continue;
      if (err > kLogitBound && margin < kNearTieMargin) {
        ++near_ties;
        continue;
      }
      EXPECT_LE(err, kLogitBound) << "first layer, position " << p << " (routing margin " << margin << ")";
    }
    if (k == 1) EXPECT_LE(near_ties, 1) << "first layer: routing near-ties";
    std::printf("[ fp8, first %d layer(s) ] largest logit error / row max |logit| over %zu positions: %.3g%s\n", k,
                ids.size() - got.logits_first, worst, k == 1 ? " (held to the bound)" : "");
  }
}

}  // namespace
}  // namespace kestrel
