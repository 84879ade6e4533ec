#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <mutex>
#include <random>

#include "core/formats.h"
#include "kernels/cpu/attention.h"
#include "parallel/local_world.h"
#include "parallel/topk_merge.h"

namespace kestrel::parallel {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(Bf16OrderKey, HandWorkedValues) {
  EXPECT_EQ(bf16_order_key(0x0000), 0x8000);  // +0
  EXPECT_EQ(bf16_order_key(0x8000), 0x8000);  // -0 ranks as +0
  EXPECT_EQ(bf16_order_key(0x3F80), 0xBF80);  // 1.0
  EXPECT_EQ(bf16_order_key(0xBF80), 0x407F);  // -1.0
  EXPECT_EQ(bf16_order_key(0x7F80), 0xFF80);  // +inf, the largest key
  EXPECT_EQ(bf16_order_key(0xFF7F), 0x0080);  // -max finite, the smallest selectable key
  EXPECT_EQ(bf16_order_key(0xFF80), 0);       // -inf: never a candidate
  EXPECT_EQ(bf16_order_key(0x7FC0), 0);       // NaN: never a candidate, like -inf
  EXPECT_EQ(bf16_order_key(0xFFC1), 0);
  EXPECT_EQ(bf16_order_key(0x7F81), 0);
}

TEST(Bf16OrderKey, UnsignedOrderIsScoreOrderOverAllBf16Values) {
  std::vector<uint16_t> selectable;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float x = bf16_to_f32(static_cast<uint16_t>(b));
    if (std::isnan(x) || x == -kInf) {
      EXPECT_EQ(bf16_order_key(static_cast<uint16_t>(b)), 0) << b;
      continue;
    }
    selectable.push_back(static_cast<uint16_t>(b));
  }
  std::sort(selectable.begin(), selectable.end(),
            [](uint16_t a, uint16_t b) { return bf16_to_f32(a) < bf16_to_f32(b); });
  for (size_t i = 1; i < selectable.size(); ++i) {
    const float a = bf16_to_f32(selectable[i - 1]), b = bf16_to_f32(selectable[i]);
    const uint16_t ka = bf16_order_key(selectable[i - 1]), kb = bf16_order_key(selectable[i]);
    if (a == b)
      EXPECT_EQ(ka, kb) << a;  // only -0 / +0
    else
      EXPECT_LT(ka, kb) << a << " " << b;
    EXPECT_GE(ka, 0x0080);
  }
}

TEST(PackedMerge, PositionShift) {
  EXPECT_EQ(position_shift(0, 4), 0);
  EXPECT_EQ(position_shift(65536, 1), 0);
  EXPECT_EQ(position_shift(65537, 1), 1);
  EXPECT_EQ(position_shift(65536 * 8, 8), 0);      // rank 0 holds local indices 0..65535
  EXPECT_EQ(position_shift(65536 * 8 + 1, 8), 1);  // rank 0 holds local index 65536
  EXPECT_EQ(position_shift(131072 * 8, 8), 1);
  EXPECT_EQ(position_shift(131072 * 8 + 1, 8), 2);
  EXPECT_EQ(position_field(0, 0), 0xFFFF);
  EXPECT_EQ(position_field(65535, 0), 0);
  EXPECT_EQ(position_field(65537, 1), 0xFFFF - 32768);
}

TEST(PackedMerge, CandidatesPerRank) {
  EXPECT_EQ(packed_candidates_per_rank(2048, 8), 384);
  EXPECT_EQ(packed_candidates_per_rank(2048, 2), 1536);
  EXPECT_EQ(packed_candidates_per_rank(2048, 1), 2048);  // capped at k: one rank sends all it can contribute
  EXPECT_EQ(packed_candidates_per_rank(16, 3), 8);
  EXPECT_EQ(packed_candidates_per_rank(64, 3), 32);
  EXPECT_EQ(packed_candidates_per_rank(5, 2), 4);        // ceil(3.75)
  EXPECT_EQ(packed_candidates_per_rank(256, 8), 48);
}

// ---- harness: W simulated ranks, each holding the DCP shard (position t on rank t mod W) of every row ----

using Rows = std::vector<std::vector<float>>;

struct MergeRun {
  std::vector<std::vector<std::vector<int64_t>>> positions;  // [rank][row]: selected positions in the order returned
  std::vector<MergeStats> stats;                              // per rank
  std::vector<std::vector<int32_t>> global;                   // generic merge: [rank] -> [rows, k]
  double seconds = 0;
};

enum class Merge { kPacked, kGeneric };

MergeRun run_merge(const Rows& rows, int W, int k, Merge which) {
  MergeRun run;
  run.positions.resize(W);
  run.stats.resize(W);
  run.global.resize(W);
  const auto start = std::chrono::steady_clock::now();
  LocalWorld(W).run([&](Communicator& comm) {
    const int me = comm.rank();
    std::vector<float> values;
    std::vector<int64_t> offsets{0}, lengths;
    for (const auto& row : rows) {
      for (size_t t = me; t < row.size(); t += W) values.push_back(row[t]);
      offsets.push_back(static_cast<int64_t>(values.size()));
      lengths.push_back(static_cast<int64_t>(row.size()));
    }
    const RaggedScores scores{values, offsets, lengths};
    const LocalSelection sel = which == Merge::kPacked
                                   ? packed_topk_merge(comm, scores, k, &run.stats[me])
                                   : generic_topk_merge(comm, scores, k, &run.stats[me], &run.global[me]);
    ASSERT_EQ(sel.row_offsets.size(), rows.size() + 1);
    run.positions[me].resize(rows.size());
    for (size_t i = 0; i < rows.size(); ++i)
      for (int32_t l : sel.row(static_cast<int64_t>(i))) run.positions[me][i].push_back(int64_t{l} * W + me);
  });
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return run;
}

std::vector<int32_t> reference_topk(const std::vector<float>& row, int k, bool round_bf16) {
  std::vector<float> s(row);
  if (round_bf16)
    for (float& x : s) x = round_to_bf16(x);
  std::vector<int32_t> out(k);
  cpu::topk_indices(s.data(), static_cast<int64_t>(s.size()), k, out.data());
  return out;
}

// Every rank's selection is exactly the reference's positions of that rank, in the reference's order.
void expect_equals_reference(const Rows& rows, const MergeRun& run, int W, int k, bool round_bf16,
                             const std::string& what) {
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::vector<int32_t> ref = reference_topk(rows[i], k, round_bf16);
    for (int r = 0; r < W; ++r) {
      std::vector<int64_t> expected;
      for (int32_t p : ref)
        if (p >= 0 && p % W == r) expected.push_back(p);
      ASSERT_EQ(run.positions[r][i], expected) << what << " W=" << W << " k=" << k << " row " << i << " (length "
                                               << rows[i].size() << ") rank " << r;
    }
  }
}

// Score rows with heavy ties: exact zeros of both signs, a few repeated values, values that collide after bf16
// rounding, -inf padding, NaN, rows shorter and longer than k.
Rows make_rows(std::mt19937& rng, int count, int k, bool heavy_ties) {
  Rows rows;
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float pool[] = {0.5f, -0.25f, 1.0f, 3.0f, 1.00390625f /* = 1 + 2^-8, rounds to bf16 1.0 */, kInf};
  for (int i = 0; i < count; ++i) {
    const double f = std::array{0.0, 0.3, 0.9, 1.0, 1.1, 1.6, 3.0, 5.0}[rng() % 8];
    const int n = static_cast<int>(f * k) + static_cast<int>(rng() % 7);
    std::vector<float> row(n);
    for (float& x : row) {
      const float c = u(rng);
      if (!heavy_ties)
        x = normal(rng);
      else if (c < 0.45f)
        x = (rng() % 2) ? 0.0f : -0.0f;
      else if (c < 0.75f)
        x = pool[rng() % 5];
      else if (c < 0.78f)
        x = (rng() % 4 == 0) ? kNaN : -kInf;
      else if (c < 0.79f)
        x = pool[5];
      else
        x = std::ldexp(1.0f, -3) * static_cast<float>(rng() % 16) + 1e-4f * normal(rng);
    }
    if (rng() % 3 == 0)  // -inf padding at the tail, as for positions beyond a row's causal range
      std::fill(row.begin() + static_cast<std::ptrdiff_t>(n * u(rng)), row.end(), -kInf);
    rows.push_back(std::move(row));
  }
  rows.push_back({});  // an empty row
  return rows;
}

void expect_same_decisions_on_every_rank(const MergeRun& run) {
  for (size_t r = 1; r < run.stats.size(); ++r) {
    EXPECT_EQ(run.stats[r].collectives, run.stats[0].collectives);
    EXPECT_EQ(run.stats[r].resends, run.stats[0].resends);
    EXPECT_EQ(run.stats[r].tie_rows, run.stats[0].tie_rows);
  }
}

TEST(PackedMerge, EqualsSingleRankTopKOnRandomRowsWithHeavyTies) {
  std::mt19937 rng(1234);
  for (int k : {16, 64, 256, 2048}) {
    const int count = k <= 64 ? 120 : (k == 256 ? 40 : 10);
    for (bool heavy : {true, false}) {
      const Rows rows = make_rows(rng, count, k, heavy);
      for (int W : {2, 3, 4, 8}) {
        const MergeRun run = run_merge(rows, W, k, Merge::kPacked);
        expect_equals_reference(rows, run, W, k, true, heavy ? "packed, heavy ties" : "packed, normal scores");
        expect_same_decisions_on_every_rank(run);
        const MergeStats& s = run.stats[0];
        std::printf("packed  %-6s W=%d k=%4d rows=%3lld: resends %3lld (%5.1f%% of row-ranks), tie rounds on %5.1f%% "
                    "of rows, %d collectives\n",
                    heavy ? "ties" : "normal", W, k, static_cast<long long>(s.rows),
                    static_cast<long long>(s.resends), 100.0 * s.resends / (s.rows * W), 100.0 * s.tie_rows / s.rows,
                    static_cast<int>(s.collectives));
      }
    }
  }
}

TEST(PackedMerge, OneRankHoldingTheWholeTopKForcesResend) {
  // Rank 0's tokens all outscore everyone else's: rank 0 holds all k of the top-k but sent only k' < k.
  for (int W : {2, 3, 4, 8}) {
    for (int k : {16, 64, 256, 2048}) {
      Rows rows;
      for (int i = 0; i < 3; ++i) {
        std::vector<float> row(static_cast<size_t>(W) * k + 5 * i);
        for (size_t t = 0; t < row.size(); ++t)
          row[t] = (t % W == 0) ? 100.0f + static_cast<float>((t * 7 + i) % 13) : static_cast<float>(t % 5);
        rows.push_back(std::move(row));
      }
      const MergeRun run = run_merge(rows, W, k, Merge::kPacked);
      expect_equals_reference(rows, run, W, k, true, "forced resend");
      EXPECT_EQ(run.stats[0].resends, 3) << W << " " << k;
      EXPECT_EQ(run.stats[0].resend_rounds, 1);
      EXPECT_EQ(run.positions[0][0].size(), static_cast<size_t>(k));
      for (int r = 1; r < W; ++r) EXPECT_TRUE(run.positions[r][0].empty());
    }
  }
}

TEST(PackedMerge, ResendWithTiesAcrossRanksAtTheThreshold) {
  // Rank 1 holds many tokens of score 2; the other ranks hold score-1 tokens; after rank 1 resends, the cut falls
  // among score-1 candidates of three ranks, ordered by position through the packed keys alone.
  const int W = 4, k = 64;
  std::vector<float> row(1000, 0.0f);
  for (size_t t = 0; t < row.size(); ++t) {
    if (t % W == 1 && t < 4 * 50) row[t] = 2.0f;
    if (t % 3 == 0 && t % W != 1) row[t] = 1.0f;
  }
  const MergeRun run = run_merge({row}, W, k, Merge::kPacked);
  expect_equals_reference({row}, run, W, k, true, "resend + ties");
  EXPECT_EQ(run.stats[0].resends, 1);
  EXPECT_EQ(run.stats[0].tie_rounds, 0);
}

TEST(PackedMerge, AllZeroRowsAreDecidedByPosition) {
  // Every score ties: the top-k is positions 0..k-1, ordered across ranks by the position field alone.
  for (int W : {2, 3, 8}) {
    const int k = 64;
    const Rows rows = {std::vector<float>(500, 0.0f), std::vector<float>(500, -0.0f), std::vector<float>(40, 0.0f)};
    const MergeRun run = run_merge(rows, W, k, Merge::kPacked);
    expect_equals_reference(rows, run, W, k, true, "all zeros");
    EXPECT_EQ(run.stats[0].collectives, 1);
    std::vector<int64_t> all;
    for (int r = 0; r < W; ++r) all.insert(all.end(), run.positions[r][0].begin(), run.positions[r][0].end());
    std::sort(all.begin(), all.end());
    ASSERT_EQ(all.size(), static_cast<size_t>(k));
    for (int i = 0; i < k; ++i) EXPECT_EQ(all[i], i);
  }
}

TEST(PackedMerge, RowsLongerThan65536PerRankUseTheTieRoundWhenTheCutSplitsABucket) {
  // W = 2 and 140000 positions: local indices are shifted by 1, so local indices 2j and 2j+1 share a field.
  // All scores are 0 except positions 0 and 16 (-inf): the top-16 is 1..15 and 17, and position 17 (rank 1,
  // local 8) shares its packed key with position 18 (rank 0, local 9), which rank order alone would take.
  const int W = 2, k = 16;
  std::vector<float> row(140000, 0.0f);
  row[0] = row[16] = -kInf;
  const MergeRun run = run_merge({row}, W, k, Merge::kPacked);
  expect_equals_reference({row}, run, W, k, true, "long row, split bucket");
  EXPECT_EQ(run.stats[0].tie_rows, 1);
  EXPECT_EQ(run.stats[0].tie_rounds, 1);
}

TEST(PackedMerge, EqualsSingleRankTopKOnLongRows) {
  std::mt19937 rng(77);
  for (int W : {2, 8}) {
    const int64_t n = 65536LL * W + 40000;
    Rows rows;
    for (int i = 0; i < 3; ++i) {
      std::vector<float> row(n);
      for (float& x : row) {
        const uint32_t c = rng() % 1000;
        x = c < 990 ? 0.0f : (c < 995 ? 1.0f : (c < 997 ? -kInf : 0.5f * static_cast<float>(rng() % 4)));
      }
      rows.push_back(std::move(row));
    }
    for (int k : {16, 64, 256, 2048}) {
      const MergeRun run = run_merge(rows, W, k, Merge::kPacked);
      expect_equals_reference(rows, run, W, k, true, "long rows");
      expect_same_decisions_on_every_rank(run);
      std::printf("packed  long   W=%d k=%4d rows=%3lld (length %lld): resends %lld, tie rounds on %lld rows\n", W, k,
                  static_cast<long long>(run.stats[0].rows), static_cast<long long>(n),
                  static_cast<long long>(run.stats[0].resends), static_cast<long long>(run.stats[0].tie_rows));
    }
  }
}

TEST(PackedMerge, SingleRankAndShortShards) {
  std::mt19937 rng(7);
  const Rows rows = make_rows(rng, 30, 16, true);
  for (int W : {1, 5, 8}) {
    const MergeRun run = run_merge(rows, W, 16, Merge::kPacked);
    expect_equals_reference(rows, run, W, 16, true, "short shards");
    if (W == 1) {
      EXPECT_EQ(run.stats[0].collectives, 1);  // k' = k: one round, never a resend or a tie round
    }
  }
}

TEST(GenericMerge, EqualsSingleRankTopK) {
  std::mt19937 rng(99);
  for (int k : {16, 64, 256, 2048}) {
    const int count = k <= 64 ? 60 : (k == 256 ? 20 : 6);
    for (bool heavy : {true, false}) {
      Rows rows = make_rows(rng, count, k, heavy);
      for (int W : {2, 3, 4, 8}) {
        const MergeRun run = run_merge(rows, W, k, Merge::kGeneric);
        expect_equals_reference(rows, run, W, k, false, "generic");
        for (size_t i = 0; i < rows.size(); ++i) {
          const std::vector<int32_t> ref = reference_topk(rows[i], k, false);
          for (int r = 0; r < W; ++r)
            ASSERT_TRUE(std::equal(ref.begin(), ref.end(), run.global[r].begin() + static_cast<int64_t>(i) * k));
        }
        // On bf16-rounded scores it selects what the packed merge selects.
        Rows rounded = rows;
        for (auto& row : rounded)
          for (float& x : row) x = round_to_bf16(x);
        expect_equals_reference(rounded, run_merge(rounded, W, k, Merge::kGeneric), W, k, false, "generic bf16");
      }
    }
  }
}

TEST(MergeBytes, PackedAgainstGeneric) {
  std::mt19937 rng(5);
  const int k = 2048;
  Rows rows;
  std::normal_distribution<float> normal;
  for (int i = 0; i < 16; ++i) {
    std::vector<float> row(20000);
    for (float& x : row) x = normal(rng);
    rows.push_back(std::move(row));
  }
  for (int W : {2, 4, 8}) {
    const MergeRun packed = run_merge(rows, W, k, Merge::kPacked);
    const MergeRun generic = run_merge(rows, W, k, Merge::kGeneric);
    const MergeStats& p = packed.stats[0];
    const MergeStats& g = generic.stats[0];
    EXPECT_EQ(g.bytes_sent, 16 * k * 8);
    EXPECT_GE(p.bytes_sent, 16 * packed_candidates_per_rank(k, W) * 4);
    std::printf("k=%d W=%d, 16 rows: packed sends %lld B/rank (%lld received, %lld resends, %.2f ms), "
                "generic %lld B/rank (%lld received, %.2f ms): %.1fx fewer bytes\n",
                k, W, static_cast<long long>(p.bytes_sent), static_cast<long long>(p.bytes_received),
                static_cast<long long>(p.resends), packed.seconds * 1e3, static_cast<long long>(g.bytes_sent),
                static_cast<long long>(g.bytes_received), generic.seconds * 1e3,
                static_cast<double>(g.bytes_received) / static_cast<double>(p.bytes_received));
    EXPECT_LT(p.bytes_received, g.bytes_received);
  }
}

TEST(PackedMerge, RejectsBadArguments) {
  LocalWorld(2).run([](Communicator& comm) {
    const std::vector<float> v(4, 1.0f);
    const std::vector<int64_t> ok{0, 4}, bad{0, 3}, length{8}, wrong_length{5};
    EXPECT_THROW(packed_topk_merge(comm, RaggedScores{v, bad, length}, 4), Error);
    EXPECT_THROW(packed_topk_merge(comm, RaggedScores{v, ok, wrong_length}, 4), Error);  // not this rank's share
    EXPECT_THROW(packed_topk_merge(comm, RaggedScores{v, ok, length}, 0), Error);
  });
}

}  // namespace
}  // namespace kestrel::parallel
