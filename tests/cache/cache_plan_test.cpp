// The cache planner: hand-worked layouts of a tiny hybrid model and of the full-size K3.1 Pro, the automatic
// choice of B, DCP row counts and the errors of inconsistent options.
#include <gtest/gtest.h>

#include "cache/cache_plan.h"
#include "core/error.h"

namespace kestrel {
namespace {

// Layers K K A K K A (K: KDA, A: attention), as the tiny kimi_k3 preset: fp32 latent 80 floats = 320 B and FP8
// index keys of 32 values = 36 B per token; KDA state 2 heads x 32 x 32 fp32 + 3 conv histories of 3 x 64 fp32.
std::vector<LayerCacheSpec> tiny_layers() {
  const LayerCacheSpec kda{0, 0, 2 * 32 * 32 * 4 + 3 * 3 * 64 * 4};
  const LayerCacheSpec mla{320, 36, 0};
  return {kda, kda, mla, kda, kda, mla};
}

TEST(CachePlan, TinyHybridLayout) {
  const CachePlan p = plan_cache(tiny_layers(), {.block_size = 64, .min_block_size = 64});
  EXPECT_EQ(p.block_size, 64);
  EXPECT_EQ(p.token_bytes, 2 * 356);
  EXPECT_EQ(p.token_row_bytes, 64 * 712);  // 45,568
  EXPECT_EQ(p.state_layer_bytes, 10496);
  EXPECT_EQ(p.row_bytes, 45568);
  EXPECT_EQ(p.layers_per_state_row, 4);  // 4 x 10,496 = 41,984 <= 45,568 < 5 x 10,496
  EXPECT_EQ(p.state_rows_per_request, 1);
  EXPECT_EQ(p.page_offset, (std::vector<int64_t>{-1, -1, 0, -1, -1, 64 * 356}));
  EXPECT_EQ(p.state_row, (std::vector<int>{0, 0, -1, 0, 0, -1}));
  EXPECT_EQ(p.state_offset, (std::vector<int64_t>{0, 10496, -1, 20992, 31488, -1}));
  EXPECT_EQ(p.token_row_padding(), 0);
  EXPECT_EQ(p.state_padding_per_request(), 45568 - 41984);
  EXPECT_EQ(p.token_rows_for(0), 0);
  EXPECT_EQ(p.token_rows_for(64), 1);
  EXPECT_EQ(p.token_rows_for(65), 2);
  EXPECT_EQ(p.rows_per_request(200), 4 + 1);
}

TEST(CachePlan, StateLargerThanTokenRowGroupsOneLayerPerRow) {
  // K3.1 Pro at TP8, FP8 latent + FP8 keys: 24 attention layers of 576 + 132 B, 69 KDA layers of 20 heads:
  // 20 x 128 x 128 x 4 = 1,310,720 B of state + 3 x 3 x 2,560 x 4 = 92,160 B of conv history.
  std::vector<LayerCacheSpec> layers;
  for (int l = 0; l < 93; ++l)
    layers.push_back(l % 4 == 3 || l == 92 ? LayerCacheSpec{576, 132, 0} : LayerCacheSpec{0, 0, 1402880});
  const CachePlan p64 = plan_cache(layers, {.block_size = 64, .min_block_size = 64});
  EXPECT_EQ(p64.num_token_layers, 24);
  EXPECT_EQ(p64.num_state_layers, 69);
  EXPECT_EQ(p64.token_bytes, 16992);
  EXPECT_EQ(p64.token_row_bytes, 1087488);
  EXPECT_EQ(p64.row_bytes, 1402880);
  EXPECT_EQ(p64.token_row_padding(), 315392);
  EXPECT_EQ(p64.layers_per_state_row, 1);
  EXPECT_EQ(p64.state_rows_per_request, 69);
  // A 1M-token request: 16,384 token rows + 69 state rows; 22.4% of those bytes are padding.
  EXPECT_EQ(p64.rows_per_request(1 << 20), 16384 + 69);
  EXPECT_NEAR(p64.padding_fraction(1 << 20), 1.0 - (1048576.0 * 16992 + 69.0 * 1402880) / (16453.0 * 1402880), 1e-12);
  EXPECT_NEAR(p64.padding_fraction(1 << 20), 0.2239, 1e-4);

  // Automatic: B = 128 fills 2,174,976-B rows with tokens (0.30% padding, from one 1.40 MB state per row);
  // B = 256 pads 0.02% (three states per row), within one point of it, so the smaller B wins.
  const CachePlan a = plan_cache(layers, {.min_block_size = 64, .max_block_size = 1024, .max_model_len = 1 << 20});
  EXPECT_EQ(a.block_size, 128);
  EXPECT_EQ(a.row_bytes, 2174976);
  EXPECT_EQ(a.layers_per_state_row, 1);

  // DCP8: each GPU holds 131,072 tokens of a 1M request; B = 64 would pad token rows by 22% again, B = 256
  // packs three states per 4,349,952-B row.
  const CachePlan d =
      plan_cache(layers, {.min_block_size = 64, .max_block_size = 1024, .dcp = 8, .max_model_len = 1 << 20});
  EXPECT_EQ(d.block_size, 256);
  EXPECT_EQ(d.layers_per_state_row, 3);
  EXPECT_EQ(d.state_rows_per_request, 23);
  EXPECT_EQ(d.token_rows_for(1 << 20), 512);
  EXPECT_EQ(d.token_rows_for(8 * 256 + 1), 2);  // 257 local tokens on the first GPU
}

TEST(CachePlan, AttentionOnlyModelHasNoStateRows) {
  const std::vector<LayerCacheSpec> layers(3, LayerCacheSpec{656, 132, 0});
  const CachePlan p = plan_cache(layers, {.min_block_size = 16, .max_block_size = 64, .max_model_len = 4096});
  EXPECT_EQ(p.block_size, 16);  // no padding at any B: the smallest
  EXPECT_EQ(p.row_bytes, 16 * 3 * 788);
  EXPECT_EQ(p.state_rows_per_request, 0);
  EXPECT_EQ(p.rows_per_request(17), 2);
  EXPECT_EQ(p.padding_fraction(32), 0.0);
}

TEST(CachePlan, InconsistentOptionsAreErrors) {
  EXPECT_THROW(plan_cache(tiny_layers(), {.block_size = 48}), Error);                        // not a power of two
  EXPECT_THROW(plan_cache(tiny_layers(), {.block_size = 32, .min_block_size = 64}), Error);  // below the KDA chunk
  EXPECT_THROW(plan_cache(tiny_layers(), {.min_block_size = 64}), Error);                    // auto needs a length
  std::vector<LayerCacheSpec> mixed = tiny_layers();
  mixed[0].state_bytes += 4;
  EXPECT_THROW(plan_cache(mixed, {.block_size = 64}), Error);
  mixed = tiny_layers();
  mixed[2].state_bytes = 8;
  EXPECT_THROW(plan_cache(mixed, {.block_size = 64}), Error);
}

}  // namespace
}  // namespace kestrel
