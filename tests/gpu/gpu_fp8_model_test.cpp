// The GPU engine on a checkpoint with FP8 block-scaled linear weights (WeightQuant::fp8_block) against the CPU
// reference: decode steps of up to 8 tokens run the FP8 kernel (gemm_fp8.h), larger steps cuBLASLt on the bf16
// copy. The model is the tiny kimi_linear preset with every linear layer re-stored in FP8 (blocks of 32, so that
// most weights have several scale blocks in both directions) -- DeepSeek-V3.2, the architecture whose checkpoints
// are FP8, does not run on the GPU yet. The scales are powers of two, so that code * scale is also a bf16 value:
// both paths then compute the reference's function, and the comparison can be as tight as for bf16 checkpoints
// (the kernel's own test covers general scales, against the exact product). Runs only where a CUDA device is
// visible.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <string>

#include <nlohmann/json.hpp>

#include "core/formats.h"
#include "engine/engine.h"
#include "gpu/gpu_runner.h"
#include "kernels/cuda/runtime.h"
#include "model/make_model.h"
#include "model/model.h"
#include "cpu_reference.h"
#include "model/safetensors.h"

namespace kestrel {
namespace {

constexpr int kBlock = 32;
// Typical-position bounds (median and 90th percentile of logit error / row max), as the bf16 engine tests: the
// weights are the same values on both sides, and what is left (fp32 sums in other orders, bf16 roundings of
// activations that a last-bit difference tips, amplified by the random model) is the same as there; a wrong
// kernel (a scale of the wrong block, codes in the wrong order) moves every decode position by O(1).
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

void expect_typical(std::vector<float> r, const std::string& what) {
  ASSERT_FALSE(r.empty()) << what;
  std::sort(r.begin(), r.end());
  const float median = r[r.size() / 2], p90 = r[r.size() * 9 / 10];
  EXPECT_LE(median, kMedianBound) << what;
  EXPECT_LE(p90, kP90Bound) << what;
  std::printf("[ fp8 %s ] %zu positions: median %.3g, 90th %.3g, max %.3g\n", what.c_str(), r.size(), median, p90,
              r.back());
}

TEST(GpuFp8Model, PromptsAndDecodesMatchCpu) {
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
  ModelOptions o;
  o.latent_cache = LatentCacheDtype::fp8;  // the GPU's latent format
  o.bf16_activations = true;               // the GPU's numerics
  o.keep_fp8_weights = true;
  const auto m = Model::load(fp8_model_dir(), o);
  ASSERT_EQ(m->config().weight_quant, WeightQuant::fp8_block);
  const Linear& gate = m->layers()[0].dense->gate;
  ASSERT_TRUE(gate.fp8.has_value());
  EXPECT_EQ(gate.fp8->block, kBlock);
  const int64_t V = m->config().vocab_size;

  EngineConfig cfg;
  cfg.max_num_batched_tokens = 128;
  cfg.max_num_seqs = 8;
  cfg.max_model_len = 1024;
  auto gpu = gpu::GpuBackend::attach(*m, cfg, 0.1, nullptr);
  Engine e(*m, cfg);
  // The prompts run in one step of 28 tokens (cuBLASLt); then decode steps of 3, 2 and 1 sequences (FP8 kernel).
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
  std::vector<float> all, decode_rows;
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
    // Rows computed from the same inputs on both sides: up to the first differing greedy token.
    const int64_t last = std::min<int64_t>(P - 1 + same, P + max_tokens[i] - 2);
    for (int64_t p = got.logits_first; p <= last; ++p) {
      const float err = gpu_test::row_error(got.logits.data() + (p - got.logits_first) * V, ref.data() + p * V, V);
      all.push_back(err);
      if (p >= P) decode_rows.push_back(err);  // the rows of generated tokens come from decode steps
    }
  }
  expect_typical(all, "all positions");
  expect_typical(decode_rows, "decode steps");
}

}  // namespace
}  // namespace kestrel
