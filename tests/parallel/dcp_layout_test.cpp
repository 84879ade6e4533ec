#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"
#include "parallel/dcp_layout.h"

namespace kestrel::parallel {
namespace {

TEST(DcpLayout, HandWorked) {
  // W = 3, B = 2: position 10 is on rank 1 at local index 3, block 1, offset 1.
  EXPECT_EQ(dcp_owner(10, 3), 1);
  EXPECT_EQ(dcp_local_index(10, 3), 3);
  EXPECT_EQ(dcp_position(3, 1, 3), 10);
  const DcpSlot slot = dcp_slot(10, 3, 2);
  EXPECT_EQ(slot.rank, 1);
  EXPECT_EQ(slot.local_block, 1);
  EXPECT_EQ(slot.offset, 1);
  // 10 positions over 3 ranks: 0,3,6,9 | 1,4,7 | 2,5,8.
  EXPECT_EQ(dcp_local_count(10, 0, 3), 4);
  EXPECT_EQ(dcp_local_count(10, 1, 3), 3);
  EXPECT_EQ(dcp_local_count(10, 2, 3), 3);
  EXPECT_EQ(dcp_local_count(1, 2, 3), 0);
  EXPECT_EQ(dcp_local_blocks(10, 0, 3, 2), 2);
  EXPECT_EQ(dcp_local_blocks(10, 1, 3, 2), 2);
  EXPECT_EQ(dcp_local_blocks(0, 1, 3, 2), 0);
  const std::vector<int32_t> table = {7, 4};
  EXPECT_EQ(dcp_physical_row(table, 10, 3, 2), 4 * 2 + 1);
  EXPECT_EQ(dcp_physical_row(table, 1, 3, 2), 7 * 2 + 0);
  EXPECT_THROW(dcp_physical_row(table, 13, 3, 2), Error);  // local index 4 needs block 2
  EXPECT_THROW(dcp_owner(-1, 3), Error);
  EXPECT_THROW(dcp_owner(1, 0), Error);
}

TEST(DcpLayout, EveryPositionHasExactlyOneHomeAndCountsAddUp) {
  for (int W = 1; W <= 8; ++W) {
    for (int B : {1, 3, 64}) {
      for (int64_t len : {0, 1, 7, 64, 65, 1000}) {
        std::vector<std::vector<int>> seen(W);  // per rank: how often each local row is used
        for (int r = 0; r < W; ++r) seen[r].assign(dcp_local_blocks(len, r, W, B) * B, 0);
        for (int64_t t = 0; t < len; ++t) {
          const DcpSlot s = dcp_slot(t, W, B);
          ASSERT_EQ(dcp_position(s.local_block * B + s.offset, s.rank, W), t);
          ASSERT_LT(s.local_block, dcp_local_blocks(len, s.rank, W, B));
          ++seen[s.rank][s.local_block * B + s.offset];
        }
        int64_t total = 0;
        for (int r = 0; r < W; ++r) {
          const int64_t n = dcp_local_count(len, r, W);
          total += n;
          for (int64_t i = 0; i < static_cast<int64_t>(seen[r].size()); ++i)
            ASSERT_EQ(seen[r][i], i < n ? 1 : 0) << "W=" << W << " B=" << B << " len=" << len << " rank " << r;
        }
        EXPECT_EQ(total, len);
      }
    }
  }
}

}  // namespace
}  // namespace kestrel::parallel
