// The row pool: one allocation of equal rows; allocation order, reference counts, idle cached rows kept in
// least-recently-used order and evicted only when no free row is left; a random walk checked against a model.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "cache/row_pool.h"
#include "core/error.h"

namespace kestrel {
namespace {

TEST(RowPool, OneAllocationOfEqualRows) {
  RowPool pool(5, 100);
  EXPECT_EQ(pool.row(3) - pool.base(), 300);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pool.base()) % 4096, 0u);
  EXPECT_EQ(pool.num_available(), 5);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(pool.allocate(), i);
  EXPECT_EQ(pool.allocate(), -1);
  EXPECT_EQ(pool.num_referenced(), 5);
  pool.unref(2);
  EXPECT_EQ(pool.allocate(), 2);
  pool.check_consistency();
}

TEST(RowPool, IdleCachedRowsAreEvictedLeastRecentlyUsedFirst) {
  RowPool pool(4, 8);
  std::vector<int32_t> evicted;
  pool.set_eviction_handler([&](int32_t r) { evicted.push_back(r); });
  for (int i = 0; i < 4; ++i) ASSERT_EQ(pool.allocate(), i);
  for (int r : {1, 0, 3}) pool.mark_cached(r);
  pool.unref(1);  // idle order: 1, 0, 3
  pool.unref(0);
  pool.unref(3);
  pool.unref(2);  // not cached: free
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_EQ(pool.num_idle_cached(), 3);
  pool.ref(0);  // a hit: row 0 leaves the idle list; released again it becomes the most recently used
  pool.unref(0);
  EXPECT_EQ(pool.allocate(), 2);  // free rows go first; nothing evicted
  EXPECT_TRUE(evicted.empty());
  EXPECT_EQ(pool.allocate(), 1);
  EXPECT_EQ(pool.allocate(), 3);
  EXPECT_EQ(pool.allocate(), 0);
  EXPECT_EQ(evicted, (std::vector<int32_t>{1, 3, 0}));
  EXPECT_FALSE(pool.is_cached(1));
  pool.check_consistency();
}

TEST(RowPool, DropCachedFreesAnIdleRow) {
  RowPool pool(2, 8);
  const int32_t r = pool.allocate();
  pool.mark_cached(r);
  pool.unref(r);
  EXPECT_EQ(pool.num_idle_cached(), 1);
  pool.drop_cached(r);
  EXPECT_EQ(pool.num_idle_cached(), 0);
  EXPECT_EQ(pool.num_free(), 2);
  pool.check_consistency();
}

TEST(RowPool, MisuseIsAnError) {
  RowPool pool(2, 8);
  EXPECT_THROW(pool.unref(0), Error);  // free row
  EXPECT_THROW(pool.ref(1), Error);    // free row
  EXPECT_THROW(pool.ref(2), Error);    // outside
  EXPECT_THROW(pool.mark_cached(0), Error);
  EXPECT_THROW(RowPool(0, 8), Error);
}

// Random allocate / ref / unref / cache operations against a plain model of reference counts: the pool's lists
// and counts must agree with it after every operation.
TEST(RowPool, RandomWalkMatchesModel) {
  RowPool pool(16, 4);
  std::map<int32_t, int> refs;  // referenced rows
  std::map<int32_t, bool> cached;
  pool.set_eviction_handler([&](int32_t r) {
    ASSERT_TRUE(cached[r]);
    ASSERT_EQ(refs.count(r), 0u);
    cached[r] = false;
  });
  std::mt19937 rng(11);
  for (int step = 0; step < 5000; ++step) {
    const int op = rng() % 4;
    if (op == 0) {
      const int32_t r = pool.allocate();
      if (refs.size() == 16) {
        ASSERT_EQ(r, -1);
      } else {
        ASSERT_GE(r, 0);
        ASSERT_EQ(refs.count(r), 0u);
        refs[r] = 1;
      }
    } else if (!refs.empty()) {
      auto it = refs.begin();
      std::advance(it, rng() % refs.size());
      const int32_t r = it->first;
      if (op == 1) {
        pool.ref(r);
        ++it->second;
      } else if (op == 2) {
        pool.unref(r);
        if (--it->second == 0) refs.erase(it);
      } else {
        pool.mark_cached(r);
        cached[r] = true;
      }
    }
    int32_t idle = 0;
    for (const auto& [r, c] : cached) idle += c && !refs.count(r);
    ASSERT_EQ(pool.num_referenced(), static_cast<int32_t>(refs.size()));
    ASSERT_EQ(pool.num_idle_cached(), idle);
    for (const auto& [r, n] : refs) ASSERT_EQ(pool.ref_count(r), n);
  }
  pool.check_consistency();
}

}  // namespace
}  // namespace kestrel
