// The CPU backend's weights: FP8 block-scaled linears keep the checkpoint's codes and block scales (for the GPU
// numerics) and decode to exactly code * scale; stacked parts keep theirs each; weights stored otherwise keep none.
// ModelOptions::gpu_numerics rounds linear inputs to bf16, and only then.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "core/formats.h"
#include "cpu/cpu_backend.h"
#include "kernels/cpu/basic.h"
#include "model/make_model.h"
#include "model/model.h"
#include "model/safetensors.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;

std::string tiny_dir(Arch arch) {
  const std::string dir = fs::temp_directory_path() / ("kestrel_cpu_weights_test_" + std::string(arch_name(arch)) +
                                                       "_" + std::to_string(::getpid()));
  if (!fs::exists(dir + "/config.json")) make_model(find_preset(arch, "tiny"), dir, 5);
  return dir;
}

const CpuBackend& cpu_of(const Model& m) { return dynamic_cast<const CpuBackend&>(m.backend()); }

// Part `part` of a linear agrees with the checkpoint's tensors, and the fp32 weight is code * scale, bit for bit.
void expect_part_of(const CpuLinear& l, size_t part, const Checkpoint& ckpt, const std::string& prefix, int block) {
  SCOPED_TRACE(prefix);
  ASSERT_LT(part, l.parts.size());
  const CpuLinear::Part& p = l.parts[part];
  ASSERT_TRUE(p.fp8.has_value());
  const CpuLinear::Fp8& f = *p.fp8;
  const TensorView& codes = ckpt.get(prefix + ".weight");
  const TensorView& scales = ckpt.get(prefix + ".weight_scale_inv");
  ASSERT_EQ(codes.dtype, DType::F8_E4M3);
  EXPECT_EQ(f.block, block);
  ASSERT_EQ(f.codes.size(), codes.bytes.size());
  EXPECT_EQ(std::memcmp(f.codes.data(), codes.bytes.data(), codes.bytes.size()), 0);
  ASSERT_EQ(f.scales.size() * sizeof(float), scales.bytes.size());
  EXPECT_EQ(std::memcmp(f.scales.data(), scales.bytes.data(), scales.bytes.size()), 0);
  const int64_t in = l.in(), cols = (in + block - 1) / block;
  ASSERT_EQ(static_cast<int64_t>(f.scales.size()), (p.rows + block - 1) / block * cols);
  for (int64_t r = 0; r < p.rows; ++r)
    for (int64_t c = 0; c < in; ++c) {
      const float want = e4m3_to_f32(f.codes[r * in + c]) * f.scales[(r / block) * cols + c / block];
      ASSERT_EQ(l.w.ptr()[(p.row0 + r) * in + c], want) << "at " << r << ", " << c;
    }
}

TEST(CpuWeights, Fp8KeptAsStoredPerPart) {
  const std::string dir = tiny_dir(Arch::deepseek_v32);
  const Checkpoint ckpt(dir);
  const auto m = load_cpu_model(dir);
  const int block = m->config().weight_block_size;
  const FfnWeights& dense = *m->layers()[0].dense;  // layer 0 is dense (first_k_dense_replace = 1)
  const CpuLinear& gate_up = cpu_of(*m).linear_weight(dense.gate_up);
  ASSERT_EQ(gate_up.parts.size(), 2u);
  EXPECT_EQ(gate_up.parts[1].row0, m->config().intermediate_size);
  expect_part_of(gate_up, 0, ckpt, "model.layers.0.mlp.gate_proj", block);
  expect_part_of(gate_up, 1, ckpt, "model.layers.0.mlp.up_proj", block);
  expect_part_of(cpu_of(*m).linear_weight(dense.down), 0, ckpt, "model.layers.0.mlp.down_proj", block);
}

TEST(CpuWeights, NothingKeptForOtherFormats) {
  const auto m = load_cpu_model(tiny_dir(Arch::kimi_linear));  // bf16 weights
  const CpuLinear& gate_up = cpu_of(*m).linear_weight(m->layers()[0].dense->gate_up);
  for (const CpuLinear::Part& p : gate_up.parts) EXPECT_FALSE(p.fp8.has_value());
}

// gpu_numerics: a linear layer multiplies the bf16-rounded input, and only then; the default keeps fp32 inputs.
TEST(CpuWeights, GpuNumericsRoundLinearInputs) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  const int64_t in = 37, out = 5, T = 3;
  CpuLinear l;
  l.w = Tensor({out, in});
  l.parts.push_back({0, out, std::nullopt});
  for (float& w : l.w.data) w = round_to_bf16(nd(rng));
  std::vector<float> x(T * in), rounded(T * in);
  for (int64_t i = 0; i < T * in; ++i) {
    x[i] = nd(rng);
    rounded[i] = round_to_bf16(x[i]);
  }
  const std::string dir = tiny_dir(Arch::kimi_linear);
  CpuBackend plain_be, gpu_be;
  const ModelConfig cfg = load_model_config(dir);
  ModelOptions gpu;
  gpu.gpu_numerics = true;
  plain_be.configure(cfg, ModelOptions{});
  gpu_be.configure(cfg, gpu);
  std::vector<float> plain(T * out), expect_plain(T * out), bf(T * out), expect_bf(T * out);
  plain_be.linear(l, x.data(), T, plain.data());
  cpu::linear(x.data(), l.w.ptr(), expect_plain.data(), T, in, out);
  gpu_be.linear(l, x.data(), T, bf.data());
  cpu::linear(rounded.data(), l.w.ptr(), expect_bf.data(), T, in, out);
  EXPECT_EQ(plain, expect_plain);
  EXPECT_EQ(bf, expect_bf);
  EXPECT_NE(bf, plain);  // the random inputs are not bf16 values, so rounding them changes the products

  // Loaded with the option, the model's logits move (by bf16 rounding), without it they are the fp32 reference's.
  const auto emulated = load_cpu_model(dir, gpu);
  const auto exact = load_cpu_model(dir);
  const int32_t id = 7;
  const int64_t V = cfg.vocab_size;
  std::vector<float> a(V), b(V);
  SequenceState sa = emulated->new_sequence(), sb = exact->new_sequence();
  emulated->forward(sa, &id, 1, a.data());
  exact->forward(sb, &id, 1, b.data());
  double num = 0, den = 0;
  for (int64_t v = 0; v < V; ++v) {
    num += (double(a[v]) - b[v]) * (double(a[v]) - b[v]);
    den += double(b[v]) * b[v];
  }
  EXPECT_GT(std::sqrt(num / den), 1e-5);
  EXPECT_LT(std::sqrt(num / den), 0.05);
}

}  // namespace
}  // namespace kestrel
