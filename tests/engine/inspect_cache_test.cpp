// kestrel inspect-cache: the K3.1 Pro numbers of spec MODEL.md / CACHE.md (13,824 / 16,992 / 10,080 B per token
// per GPU) and the capacity of a 64 GiB per-GPU budget at TP8 and at DCP8, worked out by hand below.
#include <gtest/gtest.h>

#include "core/error.h"
#include "engine/cache_report.h"
#include "model/make_model.h"

namespace kestrel {
namespace {

CacheReport k31_report(CacheReportOptions o) {
  return inspect_cache(preset_config(find_preset(Arch::kimi_k3, "k3.1-pro")), "k3.1-pro", o);
}

bool contains(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

TEST(InspectCache, K31ProBytesPerTokenPerGpu) {
  const CacheReport r = k31_report({});
  ASSERT_EQ(r.formats.size(), 3u);
  // 24 attention layers: 24 x 576, 24 x (576 + 132), 24 x (352 + 68).
  EXPECT_EQ(r.formats[0].token_bytes, 13824);
  EXPECT_EQ(r.formats[1].token_bytes, 16992);
  EXPECT_EQ(r.formats[2].token_bytes, 10080);
  EXPECT_EQ(r.formats[2].latent_bytes, 352);
  EXPECT_EQ(r.formats[2].index_key_bytes, 68);
  const std::string text = format_cache_report(r);
  for (const char* n : {"13,824 B per token", "16,992 B per token", "10,080 B per token"})
    EXPECT_TRUE(contains(text, n)) << n << " missing from\n" << text;
}

TEST(InspectCache, CapacityAtTp8AndDcp8) {
  CacheReportOptions o;
  o.tp = 8;
  o.cache_gib = 64;
  const CacheReport r = k31_report(o);
  ASSERT_EQ(r.configs.size(), 2u);  // TP8 (selected) and TP8 + DCP8
  const CapacityLine& tp = r.configs[0];
  const CapacityLine& dcp = r.configs[1];
  ASSERT_EQ(tp.tp, 8);
  ASSERT_EQ(tp.dcp, 1);
  ASSERT_EQ(dcp.dcp, 8);
  // KDA at TP8: 20 of 160 heads: 20 x 128 x 128 x 4 B of state + 3 x 3 x 2,560 x 4 B of conv history = 1,402,880 B
  // per layer, 69 layers = 96,798,720 B per request.
  EXPECT_EQ(tp.plan.state_layer_bytes, 1402880);
  EXPECT_EQ(tp.state_bytes_per_request, 96798720);
  // TP8: B = 128 (64 would pad token rows by 22%), rows of 128 x 16,992 = 2,174,976 B, one state per row.
  // 64 GiB / 2,174,976 B = 31,595 rows; one request: (31,595 - 69) x 128 = 4,035,328 tokens; a 1M request needs
  // 8,192 + 69 rows: 3 fit.
  EXPECT_EQ(tp.plan.block_size, 128);
  EXPECT_EQ(tp.plan.row_bytes, 2174976);
  EXPECT_EQ(tp.rows, 31595);
  EXPECT_EQ(tp.tokens, 4035328);
  EXPECT_EQ(tp.requests, 3);
  // DCP8: each GPU holds 1 of 8 tokens (2,124 B per token per GPU); B = 256, rows of 4,349,952 B holding three
  // states; 15,797 rows; (15,797 - 23) x 256 x 8 = 32,305,152 tokens; a 1M request needs 512 + 23 rows: 29 fit.
  EXPECT_EQ(dcp.plan.token_bytes / 8, 2124);
  EXPECT_EQ(dcp.plan.block_size, 256);
  EXPECT_EQ(dcp.plan.row_bytes, 4349952);
  EXPECT_EQ(dcp.plan.layers_per_state_row, 3);
  EXPECT_EQ(dcp.rows, 15797);
  EXPECT_EQ(dcp.tokens, 32305152);
  EXPECT_EQ(dcp.requests, 29);
  const std::string text = format_cache_report(r);
  EXPECT_TRUE(contains(text, "3 full 1,048,576-token requests")) << text;
  EXPECT_TRUE(contains(text, "29 full 1,048,576-token requests")) << text;
  EXPECT_TRUE(contains(text, "TP8 + DCP8")) << text;
}

TEST(InspectCache, OtherArchitecturesAndErrors) {
  // DeepSeek-V3.2: 61 layers of its 656-B FP8 latent (+ 132-B keys); no NVFP4 latent is defined for it.
  const CacheReport ds = inspect_cache(preset_config(find_preset(Arch::deepseek_v32, "deepseek-v3.2")), "ds", {});
  EXPECT_EQ(ds.formats[1].token_bytes, 61 * (656 + 132));
  EXPECT_FALSE(ds.formats[2].defined);
  EXPECT_EQ(ds.configs[0].plan.state_rows_per_request, 0);
  // Kimi Linear has no indexer: no index keys.
  const CacheReport kl =
      inspect_cache(preset_config(find_preset(Arch::kimi_linear, "kimi-linear-48b")), "kl", {});
  EXPECT_EQ(kl.formats[1].token_bytes, 7 * 576);
  CacheReportOptions bad;
  bad.tp = 8;
  bad.dcp = 3;
  EXPECT_THROW(k31_report(bad), Error);
  bad.dcp = 1;
  bad.tp = 7;  // 160 KDA heads do not split over 7 GPUs
  EXPECT_THROW(k31_report(bad), Error);
}

}  // namespace
}  // namespace kestrel
