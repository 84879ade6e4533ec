// The quantised cache formats as one MLA layer stores and reads them in its pages: NVFP4 latent, FP8 latent,
// FP8 and MXFP4 index keys; the page layout (B latent entries, then B key values, then B key scales) at the rows
// a block table names; MXFP4 keys re-expressed exactly for the FP8 indexer dot.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/formats.h"
#include "../cpu/mla_test_layer.h"
#include "model/weights.h"
#include "tiny_models.h"

namespace kestrel {
namespace {

double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

TEST(Mxfp4Key, ReExpressedAsFp8Exactly) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  const int D = 128;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> k(D);
    for (int i = 0; i < D; ++i) k[i] = nd(rng) * (i < 32 ? 8.0f : 1.0f) * (trial % 7 + 1) / 3.0f;
    std::vector<uint8_t> packed(D / 2), exps(D / 4), codes(D);
    mxfp4_encode(k.data(), D, packed.data(), exps.data());
    std::vector<float> decoded(D);
    mxfp4_decode(packed.data(), exps.data(), D, decoded.data());
    const float scale = mxfp4_key_as_fp8(packed.data(), exps.data(), D, codes.data());
    EXPECT_EQ(scale, std::exp2(*std::max_element(exps.begin(), exps.end()) - 133.0f));
    for (int i = 0; i < D; ++i) ASSERT_EQ(e4m3_to_f32(codes[i]) * scale, decoded[i]) << "trial " << trial << " i " << i;
  }
  // Blocks 20 binades apart: the small block's values fall below e4m3's range and round (to zero here).
  std::vector<float> k(D, 1.0f);
  for (int i = 32; i < 64; ++i) k[i] = 1e-6f;
  std::vector<uint8_t> packed(D / 2), exps(D / 4), codes(D);
  mxfp4_encode(k.data(), D, packed.data(), exps.data());
  mxfp4_key_as_fp8(packed.data(), exps.data(), D, codes.data());
  EXPECT_EQ(e4m3_to_f32(codes[40]), 0.0f);
  EXPECT_GT(e4m3_to_f32(codes[0]), 0.0f);
}

// One MLA layer of the tiny kimi_k3 in two formats, fed the same inputs, each with pages in rows 3, 0, 2 of its
// own zeroed pool (block size 16), so that the block table and slots are really translated.
struct PagedLayer {
  const MlaCore& layer;
  int B = 16;
  std::vector<uint8_t> pool;
  std::vector<int32_t> table = {3, 0, 2};
  std::vector<int64_t> slots;
  explicit PagedLayer(const MlaCore& l) : layer(l) {
    pool.assign(4 * row_bytes(), 0);
  }
  int64_t row_bytes() const { return B * (layer.latent_bytes() + layer.index_key_bytes()); }
  TokenPages pages(int64_t pos0, int64_t T) {
    slots.resize(T);
    for (int64_t t = 0; t < T; ++t) slots[t] = int64_t{table[(pos0 + t) / B]} * B + (pos0 + t) % B;
    return TokenPages{pool.data(), row_bytes(), B, table.data(), slots.data(), pos0};
  }
};

class LayerFormats : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::tiny_dir(Arch::kimi_k3);
    cfg_ = ModelConfig::load(dir_ + "/config.json");
    while (cfg_.layer_kinds[layer_] != LayerKind::mla) ++layer_;
    in_ = std::make_unique<test::MlaInputs>(cfg_, T, 4);
  }
  const MlaCore* make(LatentCacheDtype latent, IndexKeyDtype keys) {
    layers_.push_back(std::make_unique<test::MlaLayer>(dir_, cfg_, latent, keys));
    return layers_.back()->core;
  }
  // Runs 30 tokens as a prompt of 20 and a second step of 10; returns the output and the cached latent rows.
  std::vector<float> run(const MlaCore& l, PagedLayer& p, std::vector<float>* latent = nullptr) {
    std::vector<float> y(T * cfg_.num_attention_heads * cfg_.v_head_dim);
    in_->run(l, 0, 20, p.pages(0, 20), y);
    in_->run(l, 20, T - 20, p.pages(20, T - 20), y);
    if (latent) {
      latent->resize(T * (cfg_.kv_lora_rank + cfg_.qk_rope_head_dim));
      l.read_latent(p.pages(0, 0), T, latent->data());
    }
    return y;
  }

  static constexpr int64_t T = 30;
  std::string dir_;
  ModelConfig cfg_;
  int layer_ = 0;
  std::unique_ptr<test::MlaInputs> in_;
  std::vector<std::unique_ptr<test::MlaLayer>> layers_;
};

TEST_F(LayerFormats, Nvfp4LatentIsTheRoundTripOfTheFp32Latent) {
  const auto ref = make(LatentCacheDtype::auto_fp32, IndexKeyDtype::fp8);
  const auto nv = make(LatentCacheDtype::nvfp4, IndexKeyDtype::fp8);
  PagedLayer pr(*ref), pn(*nv);
  std::vector<float> exact, stored;
  const auto y_ref = run(*ref, pr, &exact);
  const auto y_nv = run(*nv, pn, &stored);
  const int C = cfg_.kv_lora_rank, R = cfg_.qk_rope_head_dim;
  EXPECT_EQ(nv->latent_bytes(), C / 2 + C / 16 + R);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = exact.data() + t * (C + R);
    std::vector<uint8_t> packed(C / 2), scales(C / 16);
    std::vector<float> expect(C + R);
    nvfp4_encode(row, C, 1.0f, packed.data(), scales.data());
    nvfp4_decode(packed.data(), scales.data(), C, 1.0f, expect.data());
    for (int i = C; i < C + R; ++i) expect[i] = e4m3_to_f32(f32_to_e4m3(row[i]));
    for (int i = 0; i < C + R; ++i) ASSERT_EQ(stored[t * (C + R) + i], expect[i]) << "token " << t << " value " << i;
  }
  // NVFP4 keeps one mantissa bit: the layer's output moves by some percent, not more.
  const double e = rel_err(y_nv, y_ref);
  EXPECT_GT(e, 1e-4);
  EXPECT_LT(e, 0.2);
}

TEST_F(LayerFormats, PagesHoldLatentsThenKeyValuesThenKeyScales) {
  const auto l = make(LatentCacheDtype::fp8, IndexKeyDtype::fp8);
  PagedLayer p(*l);
  run(*l, p);
  const int64_t B = p.B, Lb = l->latent_bytes(), D = cfg_.index_head_dim;
  EXPECT_EQ(Lb, cfg_.kv_lora_rank + cfg_.qk_rope_head_dim);
  EXPECT_EQ(l->index_key_bytes(), D + 4);
  // 30 = 16 + 14 tokens: block 0 fills row 3, block 1 takes the first 14 slots of row 0; rows 1 and 2 stay zero.
  auto written = [&](int32_t row, int64_t off) { return (row == 3) || (row == 0 && off < 14); };
  for (int32_t row : {0, 1, 2, 3}) {
    const uint8_t* page = p.pool.data() + row * p.row_bytes();
    for (int64_t off = 0; off < B; ++off) {
      float scale;
      std::memcpy(&scale, page + B * Lb + B * D + off * 4, 4);
      bool any_code = false;
      for (int64_t i = 0; i < D; ++i) any_code |= page[B * Lb + off * D + i] != 0;
      bool any_latent = false;
      for (int64_t i = 0; i < Lb; ++i) any_latent |= page[off * Lb + i] != 0;
      if (written(row, off)) {
        int e;
        EXPECT_EQ(std::frexp(scale, &e), 0.5f) << "row " << row << " slot " << off << ": ue8m0 scale " << scale;
        EXPECT_TRUE(any_code && any_latent) << "row " << row << " slot " << off;
      } else {
        EXPECT_EQ(scale, 0.0f) << "row " << row << " slot " << off;
        EXPECT_FALSE(any_code || any_latent) << "row " << row << " slot " << off;
      }
    }
  }
}

TEST_F(LayerFormats, Mxfp4KeysStayCloseToFp8Keys) {
  const auto fp8 = make(LatentCacheDtype::auto_fp32, IndexKeyDtype::fp8);
  const auto mx = make(LatentCacheDtype::auto_fp32, IndexKeyDtype::mxfp4);
  EXPECT_EQ(mx->index_key_bytes(), cfg_.index_head_dim / 2 + cfg_.index_head_dim / 32);
  PagedLayer pa(*fp8), pb(*mx);
  const auto ya = run(*fp8, pa);
  const auto yb = run(*mx, pb);
  // The first index_topk (16) positions attend to everything whatever the keys: identical; later ones may select
  // other tokens, so the outputs differ, within a bound.
  const int64_t D = int64_t{cfg_.num_attention_heads} * cfg_.v_head_dim, dense = cfg_.index_topk;
  EXPECT_EQ(0, std::memcmp(ya.data(), yb.data(), dense * D * sizeof(float)));
  EXPECT_LT(rel_err(yb, ya), 0.5);
}

}  // namespace
}  // namespace kestrel
