// ModelOptions::keep_fp8_weights: the FP8 codes and block scales a linear keeps are the checkpoint's own, and its
// fp32 weight is exactly their product; nothing is kept without the option or for a weight stored otherwise.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "core/formats.h"
#include "model/make_model.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;

std::string tiny_dir(Arch arch) {
  const std::string dir = fs::temp_directory_path() / ("kestrel_fp8_weights_test_" + std::string(arch_name(arch)) +
                                                       "_" + std::to_string(::getpid()));
  if (!fs::exists(dir + "/config.json")) make_model(find_preset(arch, "tiny"), dir, 5);
  return dir;
}

// The raw form agrees with the checkpoint's tensors and the fp32 weight is code * scale, bit for bit.
void expect_raw_of(const Linear& l, const Checkpoint& ckpt, const std::string& prefix, int block) {
  SCOPED_TRACE(prefix);
  ASSERT_TRUE(l.fp8.has_value());
  const Fp8BlockWeight& f = *l.fp8;
  const TensorView& codes = ckpt.get(prefix + ".weight");
  const TensorView& scales = ckpt.get(prefix + ".weight_scale_inv");
  ASSERT_EQ(codes.dtype, DType::F8_E4M3);
  EXPECT_EQ(f.block, block);
  ASSERT_EQ(f.codes.size(), codes.bytes.size());
  EXPECT_EQ(std::memcmp(f.codes.data(), codes.bytes.data(), codes.bytes.size()), 0);
  ASSERT_EQ(f.scales.size() * sizeof(float), scales.bytes.size());
  EXPECT_EQ(std::memcmp(f.scales.data(), scales.bytes.data(), scales.bytes.size()), 0);
  const int64_t out = l.out(), in = l.in(), cols = (in + block - 1) / block;
  ASSERT_EQ(static_cast<int64_t>(f.scales.size()), (out + block - 1) / block * cols);
  for (int64_t r = 0; r < out; ++r)
    for (int64_t c = 0; c < in; ++c) {
      const float want = e4m3_to_f32(f.codes[r * in + c]) * f.scales[(r / block) * cols + c / block];
      ASSERT_EQ(l.w.ptr()[r * in + c], want) << "at " << r << ", " << c;
    }
}

TEST(Fp8Weights, KeptAsStoredWhenAsked) {
  const std::string dir = tiny_dir(Arch::deepseek_v32);
  const Checkpoint ckpt(dir);
  ModelOptions o;
  o.keep_fp8_weights = true;
  const auto m = Model::load(dir, o);
  const int block = m->config().weight_block_size;
  const FeedForward& dense = *m->layers()[0].dense;  // layer 0 is dense (first_k_dense_replace = 1)
  expect_raw_of(dense.gate, ckpt, "model.layers.0.mlp.gate_proj", block);
  expect_raw_of(dense.up, ckpt, "model.layers.0.mlp.up_proj", block);
  expect_raw_of(dense.down, ckpt, "model.layers.0.mlp.down_proj", block);
  // The DSA indexer's linears run in fp32 on the GPU: nothing kept.
  const std::optional<Indexer>& ix = m->layers()[0].mla->indexer();
  ASSERT_TRUE(ix.has_value());
  EXPECT_FALSE(ix->wq_b.fp8.has_value());
  EXPECT_FALSE(ix->wk.fp8.has_value());

  // Without the option the same model keeps none, and its weights are the same values.
  const auto plain = Model::load(dir, ModelOptions{});
  const FeedForward& plain_dense = *plain->layers()[0].dense;
  EXPECT_FALSE(plain_dense.gate.fp8.has_value());
  EXPECT_EQ(plain_dense.gate.w.data, dense.gate.w.data);
}

TEST(Fp8Weights, NothingKeptForOtherFormats) {
  const std::string dir = tiny_dir(Arch::kimi_linear);  // bf16 weights
  ModelOptions o;
  o.keep_fp8_weights = true;
  const auto m = Model::load(dir, o);
  EXPECT_FALSE(m->layers()[0].dense->gate.fp8.has_value());
  WeightLoader w(dir, m->config().weight_block_size, false, true);
  std::optional<Fp8BlockWeight> raw;
  const Tensor t = w.linear("model.layers.0.mlp.gate_proj", m->config().intermediate_size, m->config().hidden_size,
                            &raw);
  EXPECT_FALSE(raw.has_value());
  EXPECT_EQ(t.data, m->layers()[0].dense->gate.w.data);
}

}  // namespace
}  // namespace kestrel
