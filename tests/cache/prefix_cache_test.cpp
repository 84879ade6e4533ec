// Prefix cache: hash chains, verification against token ids, resumption only where a KDA checkpoint exists,
// eviction of whole checkpoints, and the counters.
#include <gtest/gtest.h>

#include <numeric>

#include "cache/prefix_cache.h"
#include "core/error.h"

namespace kestrel {
namespace {

constexpr int B = 4;

std::vector<int32_t> iota_tokens(int n, int32_t first = 100) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

TEST(BlockHash, ChainDependsOnParentTokensAndExtraKey) {
  const auto t = iota_tokens(12);
  const auto chain = block_hash_chain(t, 3, B, 0);
  ASSERT_EQ(chain.size(), 3u);
  EXPECT_EQ(chain[0], block_hash(kRootBlockHash, std::span(t).first(B), 0));
  EXPECT_EQ(chain[2], block_hash(chain[1], std::span(t).subspan(8, B), 0));
  // Same block contents under another parent, or another extra key (a LoRA id), is another block.
  EXPECT_NE(block_hash(chain[0], std::span(t).subspan(8, B), 0), chain[2]);
  EXPECT_NE(block_hash_chain(t, 3, B, 7)[0], chain[0]);
  auto u = t;
  u[5] = 0;
  const auto chain_u = block_hash_chain(u, 3, B, 0);
  EXPECT_EQ(chain_u[0], chain[0]);
  EXPECT_NE(chain_u[1], chain[1]);
  EXPECT_NE(chain_u[2], chain[2]);  // a change propagates down the chain
  EXPECT_THROW(block_hash_chain(t, 4, B, 0), Error);
}

struct Fixture {
  RowPool pool{32, 16};
  PrefixCache cache;
  explicit Fixture(int checkpoint_rows) : cache(pool, B, checkpoint_rows) {}
  // Caches the first n_blocks blocks of `t` in fresh rows, released afterwards (idle, reusable).
  std::vector<int32_t> cache_blocks(const std::vector<int32_t>& t, int n_blocks) {
    const auto chain = block_hash_chain(t, n_blocks, B, 0);
    std::vector<int32_t> rows;
    for (int j = 0; j < n_blocks; ++j) {
      const int32_t r = pool.allocate();
      EXPECT_TRUE(cache.insert_block(chain[j], j ? chain[j - 1] : kRootBlockHash, std::span(t).subspan(j * B, B), r));
      rows.push_back(r);
    }
    for (int32_t r : rows) pool.unref(r);
    return rows;
  }
  std::vector<int32_t> checkpoint(const std::vector<int32_t>& t, int block, int n_rows) {
    const auto chain = block_hash_chain(t, block + 1, B, 0);
    std::vector<int32_t> rows;
    for (int i = 0; i < n_rows; ++i) rows.push_back(pool.allocate());
    EXPECT_TRUE(cache.insert_checkpoint(chain[block], block ? chain[block - 1] : kRootBlockHash,
                                        std::span(t).subspan(block * B, B), rows));
    for (int32_t r : rows) pool.unref(r);
    return rows;
  }
};

TEST(PrefixCache, WithoutKdaResumesAtDeepestCachedBlock) {
  Fixture f(0);
  const auto t = iota_tokens(14);
  const auto rows = f.cache_blocks(t, 3);
  const auto chain = block_hash_chain(t, 3, B, 0);
  const PrefixHit hit = f.cache.lookup(t, 14, chain);
  EXPECT_EQ(hit.tokens, 12);
  EXPECT_EQ(hit.token_rows, rows);
  EXPECT_TRUE(hit.checkpoint_rows.empty());
  // At most max_tokens: a request must compute at least one token of its own.
  EXPECT_EQ(f.cache.lookup(t, 11, chain).tokens, 8);
  // A prompt that differs inside block 1 hits block 0 only.
  auto u = t;
  u[6] = 1;
  EXPECT_EQ(f.cache.lookup(u, 14, block_hash_chain(u, 3, B, 0)).tokens, 4);
}

TEST(PrefixCache, HitIsVerifiedAgainstTokenIdsNotTrustedOnTheHash) {
  Fixture f(0);
  const auto t = iota_tokens(8);
  const auto chain = block_hash_chain(t, 2, B, 0);
  // Register block 1 under the right hash but with other token ids, as a hash collision would.
  const int32_t r0 = f.pool.allocate(), r1 = f.pool.allocate();
  ASSERT_TRUE(f.cache.insert_block(chain[0], kRootBlockHash, std::span(t).first(B), r0));
  const std::vector<int32_t> other = {9, 9, 9, 9};
  ASSERT_TRUE(f.cache.insert_block(chain[1], chain[0], other, r1));
  EXPECT_EQ(f.cache.lookup(t, 8, chain).tokens, 4);
  // And a wrong parent is a mismatch too.
  Fixture g(0);
  const int32_t s0 = g.pool.allocate();
  ASSERT_TRUE(g.cache.insert_block(chain[0], 12345, std::span(t).first(B), s0));
  EXPECT_EQ(g.cache.lookup(t, 8, chain).tokens, 0);
}

TEST(PrefixCache, KdaResumesOnlyWhereACheckpointExists) {
  Fixture f(2);
  const auto t = iota_tokens(16);
  const auto chain = block_hash_chain(t, 4, B, 0);
  const auto rows = f.cache_blocks(t, 4);
  EXPECT_EQ(f.cache.lookup(t, 16, chain).tokens, 0);  // token rows alone are not enough
  const auto ck = f.checkpoint(t, 1, 2);              // a checkpoint at the end of block 1 (token 8)
  PrefixHit hit = f.cache.lookup(t, 16, chain);
  EXPECT_EQ(hit.tokens, 8);
  EXPECT_EQ(hit.cached_row_tokens, 16);
  EXPECT_EQ(hit.token_rows, std::vector<int32_t>(rows.begin(), rows.begin() + 2));
  EXPECT_EQ(hit.checkpoint_rows, ck);
  f.checkpoint(t, 3, 2);
  EXPECT_EQ(f.cache.lookup(t, 16, chain).tokens, 16);
  EXPECT_EQ(f.cache.lookup(t, 15, chain).tokens, 8);  // block 3's checkpoint lies beyond max_tokens
  // A checkpoint with a missing token row in front of it is unreachable.
  Fixture g(1);
  const int32_t r = g.pool.allocate();
  ASSERT_TRUE(g.cache.insert_block(chain[1], chain[0], std::span(t).subspan(B, B), r));
  g.checkpoint(t, 1, 1);
  EXPECT_EQ(g.cache.lookup(t, 16, chain).tokens, 0);
}

TEST(PrefixCache, EvictingOneRowOfACheckpointDropsAllOfIt) {
  RowPool pool(6, 8);
  PrefixCache cache(pool, B, 3);
  const auto t = iota_tokens(4);
  const auto chain = block_hash_chain(t, 1, B, 0);
  const int32_t tok = pool.allocate();
  ASSERT_TRUE(cache.insert_block(chain[0], kRootBlockHash, t, tok));
  std::vector<int32_t> ck = {pool.allocate(), pool.allocate(), pool.allocate()};
  ASSERT_TRUE(cache.insert_checkpoint(chain[0], kRootBlockHash, t, ck));
  EXPECT_FALSE(cache.insert_checkpoint(chain[0], kRootBlockHash, t, ck));  // already there
  for (int32_t r : ck) pool.unref(r);
  pool.unref(tok);
  EXPECT_EQ(cache.lookup(t, 4, chain).tokens, 4);
  // Idle order is 1, 2, 3 (the checkpoint) then 0 (the token row). After the two free rows, the next allocation
  // evicts the checkpoint's first row, and with it the whole checkpoint: its other rows become free, so the one
  // after that takes a free row and the token row survives.
  std::vector<int32_t> held = {pool.allocate(), pool.allocate()};
  EXPECT_EQ(cache.counters().checkpoints_evicted, 0);
  held.push_back(pool.allocate());
  EXPECT_EQ(held.back(), ck[0]);
  EXPECT_EQ(cache.counters().checkpoints_evicted, 1);
  EXPECT_EQ(cache.num_checkpoints(), 0);
  EXPECT_EQ(pool.num_free(), 2);
  held.push_back(pool.allocate());
  EXPECT_EQ(cache.counters().blocks_evicted, 0);
  EXPECT_EQ(cache.num_cached_blocks(), 1);
  const PrefixHit hit = cache.lookup(t, 4, chain);
  EXPECT_EQ(hit.tokens, 0);
  EXPECT_EQ(hit.cached_row_tokens, 4);
  pool.check_consistency();
  EXPECT_EQ(pool.num_free() + pool.num_idle_cached() + pool.num_referenced(), 6);
}

TEST(PrefixCache, DuplicateBlockLeavesTheSecondRowUnnamed) {
  Fixture f(0);
  const auto t = iota_tokens(4);
  const auto chain = block_hash_chain(t, 1, B, 0);
  const int32_t a = f.pool.allocate(), b = f.pool.allocate();
  EXPECT_TRUE(f.cache.insert_block(chain[0], kRootBlockHash, t, a));
  EXPECT_FALSE(f.cache.insert_block(chain[0], kRootBlockHash, t, b));
  f.pool.unref(b);
  EXPECT_FALSE(f.pool.is_cached(b));
  EXPECT_EQ(f.pool.num_free(), 31);
}

TEST(PrefixCache, CountersRecordUsedLookups) {
  Fixture f(1);
  const auto t = iota_tokens(12);
  const auto chain = block_hash_chain(t, 3, B, 0);
  f.cache_blocks(t, 3);
  f.checkpoint(t, 1, 1);
  const PrefixHit hit = f.cache.lookup(t, 12, chain);
  f.cache.record_use(hit, 12);
  f.cache.record_use(f.cache.lookup(iota_tokens(12, 5000), 12, block_hash_chain(iota_tokens(12, 5000), 3, B, 0)), 12);
  const PrefixCacheCounters& c = f.cache.counters();
  EXPECT_EQ(c.queries, 2);
  EXPECT_EQ(c.query_tokens, 24);
  EXPECT_EQ(c.hit_tokens, 8);
  EXPECT_EQ(c.checkpoints_taken, 1);
  EXPECT_EQ(c.checkpoints_used, 1);
  EXPECT_EQ(c.blocks_registered, 3);
}

}  // namespace
}  // namespace kestrel
