// The CPU backend's MLA attention on the tiny presets' first MLA layer: DSA with a top-k that covers the context
// equals dense MLA bit for bit; the FP8 latent stays close to the fp32 one; the bf16 latent caches bf16 values.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "core/formats.h"
#include "cpu/cpu_backend.h"
#include "model/make_model.h"
#include "model/model.h"
#include "model/weights.h"
#include "mla_test_layer.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;

std::string tiny_dir(Arch arch) {
  const std::string dir = fs::temp_directory_path() / ("kestrel_mla_core_test_" + std::string(arch_name(arch)) +
                                                       "_" + std::to_string(::getpid()));
  if (!fs::exists(dir + "/config.json")) make_model(find_preset(arch, "tiny"), dir, 7);
  return dir;
}

double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

using test::MlaInputs;
using Layer = test::MlaLayer;

// One MLA layer's pages outside any engine: block j lives in row j, so a position's slot is the position itself.
struct LayerPages {
  explicit LayerPages(const MlaCore& l) : layer(l) {}
  const MlaCore& layer;
  int block_size = 64;
  int64_t n = 0;
  std::vector<uint8_t> rows;
  std::vector<int32_t> table;
  std::vector<int64_t> slots;

  int64_t row_bytes() const { return block_size * (layer.latent_bytes() + layer.index_key_bytes()); }
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

// A DSA layer whose index_topk covers the whole context selects every causal token and must equal dense MLA over
// the same weights, bit for bit (the selected rows are visited in position order).
TEST(MlaCore, TopkCoveringContextEqualsDenseMla) {
  for (Arch arch : {Arch::kimi_k3, Arch::deepseek_v32}) {
    const std::string dir = tiny_dir(arch);
    ModelConfig sparse = load_model_config(dir);
    sparse.index_topk = 4096;
    ModelConfig dense = sparse;
    dense.has_indexer = false;
    const Layer a(dir, sparse, LatentCacheDtype::auto_fp32), b(dir, dense, LatentCacheDtype::auto_fp32);
    const int64_t T = 70, Ho = int64_t{sparse.num_attention_heads} * sparse.v_head_dim;
    const MlaInputs in(sparse, T, 3);
    std::vector<float> ya(T * Ho), yb(T * Ho);
    LayerPages ca{*a.core}, cb{*b.core};
    in.run(*a.core, 0, 40, ca.next(40), ya);  // prefill then a second chunk, so both paths read cached rows
    in.run(*a.core, 40, T - 40, ca.next(T - 40), ya);
    in.run(*b.core, 0, 40, cb.next(40), yb);
    in.run(*b.core, 40, T - 40, cb.next(T - 40), yb);
    EXPECT_EQ(0, std::memcmp(ya.data(), yb.data(), ya.size() * sizeof(float))) << arch_name(arch);

    // With the tiny preset's top-16 the layer really is sparse at 70 tokens: the outputs must differ.
    sparse.index_topk = 16;
    const Layer c(dir, sparse, LatentCacheDtype::auto_fp32);
    LayerPages cc{*c.core};
    std::vector<float> yc(T * Ho);
    in.run(*c.core, 0, T, cc.next(T), yc);
    EXPECT_GT(rel_err(yc, yb), 1e-4) << arch_name(arch);
    EXPECT_EQ(0, std::memcmp(yc.data(), yb.data(), 16 * Ho * sizeof(float)))  // first 16 tokens: dense regime
        << arch_name(arch);
  }
}

// The FP8 and bf16 latent caches round what attention reads: one MLA layer's output stays close to the fp32
// cache's but is not identical, and every cached value has the format's precision.
TEST(MlaCore, RoundedLatentCachesStayClose) {
  struct Format {
    LatentCacheDtype d;
    double lo, hi;
    int bits;  // significant bits of a cached value of c
  };
  for (Arch arch : {Arch::kimi_k3, Arch::deepseek_v32})
    for (const Format f : {Format{LatentCacheDtype::fp8, 1e-4, 0.08, 4}, Format{LatentCacheDtype::bf16, 1e-6, 0.01, 8}}) {
      SCOPED_TRACE(std::string(arch_name(arch)) + " " + latent_cache_dtype_name(f.d));
      const std::string dir = tiny_dir(arch);
      const ModelConfig cfg = load_model_config(dir);
      const Layer ref(dir, cfg, LatentCacheDtype::auto_fp32), rounded(dir, cfg, f.d);
      const int64_t T = 30, Ho = int64_t{cfg.num_attention_heads} * cfg.v_head_dim;
      const MlaInputs in(cfg, T, 5);
      std::vector<float> ya(T * Ho), yb(T * Ho);
      LayerPages ca{*ref.core}, cb{*rounded.core};
      in.run(*ref.core, 0, T, ca.next(T), ya);
      const TokenPages pages = cb.next(T);
      in.run(*rounded.core, 0, T, pages, yb);
      const double e = rel_err(yb, ya);
      EXPECT_GT(e, f.lo);
      EXPECT_LT(e, f.hi);
      const int C = cfg.kv_lora_rank, R = cfg.qk_rope_head_dim;
      std::vector<float> cached(T * (C + R));
      rounded.core->read_latent(pages, T, cached.data());
      for (int64_t t = 0; t < T; ++t)
        for (int i = 0; i < C; ++i) {
          const float v = cached[t * (C + R) + i];
          int e2;
          const float m = std::frexp(v, &e2);
          const float scaled = std::ldexp(m, f.bits);
          ASSERT_EQ(scaled, std::round(scaled)) << "value " << v << " has more than " << f.bits << " significant bits";
          if (f.d == LatentCacheDtype::bf16) ASSERT_EQ(v, round_to_bf16(in.kv[t * (C + R) + i]));
        }
    }
}

}  // namespace
}  // namespace kestrel
