#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "parallel/local_world.h"
#include "parallel/prefill_plan.h"

namespace kestrel::parallel {
namespace {

TEST(CausalPieces, HandWorked) {
  // 10 tokens, W = 2: 4 pieces of 2, the 2 extra tokens go to pieces 0 and 1 (the first pieces of ranks 0 and 1).
  EXPECT_EQ(causal_piece_sizes(10, 2), (std::vector<int64_t>{3, 3, 2, 2}));
  // 3 tokens, W = 2: pieces 0 and 1 first, then piece 3 (rank 0's second piece).
  EXPECT_EQ(causal_piece_sizes(3, 2), (std::vector<int64_t>{1, 1, 0, 1}));
  EXPECT_EQ(causal_piece_sizes(12, 3), (std::vector<int64_t>{2, 2, 2, 2, 2, 2}));
  EXPECT_EQ(causal_piece_sizes(0, 4), (std::vector<int64_t>(8, 0)));

  const std::vector<PrefillRequest> one = {{0, 10}};
  const TokenShardPlan plan(one, 2);
  EXPECT_EQ(std::vector<int64_t>(plan.tokens_of(0).begin(), plan.tokens_of(0).end()),
            (std::vector<int64_t>{0, 1, 2, 8, 9}));
  EXPECT_EQ(std::vector<int64_t>(plan.tokens_of(1).begin(), plan.tokens_of(1).end()),
            (std::vector<int64_t>{3, 4, 5, 6, 7}));
  EXPECT_EQ(plan.causal_work(0), 1 + 2 + 3 + 9 + 10);
  EXPECT_EQ(plan.causal_work(1), 4 + 5 + 6 + 7 + 8);
}

// Every step token is owned exactly once; pieces are contiguous, in request order, with the right positions;
// per request, no two ranks' causal work differs by more than the work of the request's last token, which is at
// most the work of one piece whenever pieces hold at least one token.
TEST(CausalPieces, CoverExactlyOnceAndBalanceWork) {
  for (int W = 1; W <= 8; ++W) {
    for (int64_t tokens = 0; tokens <= 300; tokens += (tokens < 40 ? 1 : 13)) {
      for (int64_t start : {0, 1, 5, 1000}) {
        const std::vector<PrefillRequest> reqs = {{start, tokens}};
        const TokenShardPlan plan(reqs, W);
        std::vector<int> owner(tokens, -1);
        int64_t max_piece_work = 0;
        for (int r = 0; r < W; ++r) {
          const auto pieces = plan.pieces_of(r);
          ASSERT_EQ(pieces.size(), 2u);
          int64_t at = 0;
          for (const TokenPiece& p : pieces) {
            EXPECT_EQ(p.first_position, start + p.first_token);
            for (int64_t i = 0; i < p.count; ++i) {
              ASSERT_EQ(plan.tokens_of(r)[at++], p.first_token + i);
              ASSERT_EQ(owner[p.first_token + i], -1) << "token owned twice";
              owner[p.first_token + i] = r;
            }
            max_piece_work = std::max(max_piece_work, p.count * (2 * p.first_position + p.count + 1) / 2);
          }
        }
        for (int64_t t = 0; t < tokens; ++t) ASSERT_GE(owner[t], 0) << "token " << t << " not owned";
        int64_t lo = INT64_MAX, hi = 0;
        for (int r = 0; r < W; ++r) {
          lo = std::min(lo, plan.causal_work(r));
          hi = std::max(hi, plan.causal_work(r));
        }
        EXPECT_LE(hi - lo, start + tokens) << "W=" << W << " tokens=" << tokens << " start=" << start;
        if (tokens >= 2 * W) {
          EXPECT_LE(hi - lo, max_piece_work);
        }
      }
    }
  }
}

TEST(CausalPieces, SeveralRequestsInOneStep) {
  const std::vector<PrefillRequest> reqs = {{0, 17}, {100, 5}, {3, 0}, {0, 64}};
  const int W = 4;
  const TokenShardPlan plan(reqs, W);
  EXPECT_EQ(plan.step_tokens(), 17 + 5 + 64);
  std::vector<int> seen(plan.step_tokens(), 0);
  for (int r = 0; r < W; ++r) {
    ASSERT_EQ(plan.pieces_of(r).size(), 2 * reqs.size());
    for (int64_t t : plan.tokens_of(r)) ++seen[t];
    // In request order: piece r, then piece 2W-1-r of each request.
    for (size_t q = 0; q < reqs.size(); ++q) {
      EXPECT_EQ(plan.pieces_of(r)[2 * q].request, static_cast<int64_t>(q));
      EXPECT_LE(plan.pieces_of(r)[2 * q].first_token, plan.pieces_of(r)[2 * q + 1].first_token);
    }
  }
  for (int s : seen) EXPECT_EQ(s, 1);
  EXPECT_EQ(plan.pieces_of(0)[2].first_position, 100);  // request 1 starts after 100 cached positions
}

// Fills the full [T, H, D] step tensor with values that say which token, head and element they are.
float value_of(int64_t t, int h, int d) { return static_cast<float>(t * 1000 + h * 10 + d); }

TEST(AllToAllLayouts, HeadRangesPartitionTheHeads) {
  EXPECT_EQ(head_range(8, 4, 1).begin, 2);
  EXPECT_EQ(head_range(8, 4, 1).end, 4);
  // 4 heads over 3 ranks: 1, 1, 2.
  EXPECT_EQ(head_range(4, 3, 0).count(), 1);
  EXPECT_EQ(head_range(4, 3, 1).begin, 1);
  EXPECT_EQ(head_range(4, 3, 2).begin, 2);
  EXPECT_EQ(head_range(4, 3, 2).end, 4);
  for (int W = 1; W <= 8; ++W)
    for (int H = 1; H <= 20; ++H) {
      int next = 0;
      for (int r = 0; r < W; ++r) {
        const HeadRange hr = head_range(H, W, r);
        EXPECT_EQ(hr.begin, next);
        EXPECT_TRUE(hr.count() == H / W || hr.count() == H / W + 1) << "H=" << H << " W=" << W << " r=" << r;
        next = hr.end;
      }
      EXPECT_EQ(next, H);
    }
}

TEST(AllToAllLayouts, HeadToTokenGivesOwnTokensAllHeadsAndRoundTrips) {
  const std::vector<PrefillRequest> reqs = {{0, 13}, {40, 29}, {7, 3}};
  for (int W = 1; W <= 8; ++W) {
    // Heads divisible by W, not divisible, and fewer heads than ranks (some ranks hold none).
    for (int H : {2 * W, 2 * W + 1, 4, 3}) {
      const int D = 3;
      const TokenShardPlan plan(reqs, W);
      LocalWorld(W).run([&](Communicator& comm) {
        const int me = comm.rank();
        const HeadRange mine_h = head_range(H, W, me);
        std::vector<float> head_sharded;
        for (int64_t t = 0; t < plan.step_tokens(); ++t)
          for (int h = mine_h.begin; h < mine_h.end; ++h)
            for (int d = 0; d < D; ++d) head_sharded.push_back(value_of(t, h, d));
        const std::vector<float> token_sharded = head_to_token_sharded(comm, plan, head_sharded, H, D);
        const auto mine = plan.tokens_of(me);
        ASSERT_EQ(token_sharded.size(), mine.size() * H * D);
        for (size_t i = 0; i < mine.size(); ++i)
          for (int h = 0; h < H; ++h)
            for (int d = 0; d < D; ++d)
              ASSERT_EQ(token_sharded[(i * H + h) * D + d], value_of(mine[i], h, d)) << "W=" << W << " H=" << H;
        EXPECT_EQ(token_to_head_sharded(comm, plan, token_sharded, H, D), head_sharded);
      });
    }
  }
}

TEST(AllToAllLayouts, RejectsInputsOfTheWrongSize) {
  const std::vector<PrefillRequest> reqs = {{0, 4}};
  const TokenShardPlan plan(reqs, 3);
  LocalWorld(3).run([&](Communicator& comm) {
    // 4 heads over 3 ranks hold 1, 1 and 2 heads of the 4 tokens: 4, 4 and 8 values. 3 heads' worth is wrong on
    // every rank, so each one fails before the collective.
    const std::vector<float> x(4 * 3);
    EXPECT_THROW(head_to_token_sharded(comm, plan, x, 4, 1), Error);
    EXPECT_THROW(token_to_head_sharded(comm, plan, x, 4, 1), Error);
  });
}

TEST(GatheredContext, WorkspaceEqualsTheUnshardedContexts) {
  const std::vector<PrefillRequest> reqs = {{0, 5}, {37, 4}, {3, 1}, {100, 0}};
  const size_t row_bytes = 6;
  // Position p of request q holds bytes that name (q, p, byte).
  auto byte_of = [](int64_t q, int64_t p, size_t b) { return static_cast<uint8_t>(q * 71 + p * 13 + b * 3 + 1); };
  for (int W = 1; W <= 8; ++W) {
    const GatheredContextPlan plan(reqs, W);
    int64_t total = 0;
    for (const auto& r : reqs) total += r.start + r.tokens;
    ASSERT_EQ(plan.workspace_rows(), total);
    std::vector<uint8_t> step;
    for (size_t q = 0; q < reqs.size(); ++q)
      for (int64_t i = 0; i < reqs[q].tokens; ++i)
        for (size_t b = 0; b < row_bytes; ++b) step.push_back(byte_of(q, reqs[q].start + i, b));
    LocalWorld(W).run([&](Communicator& comm) {
      const int me = comm.rank();
      // This rank's cache: its DCP shard of every request's cached positions, in local order.
      std::vector<uint8_t> mine;
      for (size_t q = 0; q < reqs.size(); ++q)
        for (int64_t p = me; p < reqs[q].start; p += W)
          for (size_t b = 0; b < row_bytes; ++b) mine.push_back(byte_of(q, p, b));
      const std::vector<uint8_t> ws = gather_context(comm, plan, mine, step, row_bytes);
      ASSERT_EQ(ws.size(), total * row_bytes);
      for (size_t q = 0; q < reqs.size(); ++q)
        for (int64_t p = 0; p < reqs[q].start + reqs[q].tokens; ++p)
          for (size_t b = 0; b < row_bytes; ++b)
            ASSERT_EQ(ws[(plan.workspace_offset(q) + p) * row_bytes + b], byte_of(q, p, b))
                << "W=" << W << " request " << q << " position " << p;
    });
  }
}

}  // namespace
}  // namespace kestrel::parallel
