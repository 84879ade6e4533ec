#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <limits>
#include <mutex>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "parallel/local_world.h"
#include "parallel/lse_combine.h"

namespace kestrel::parallel {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

TEST(LseCombine, HandWorkedTwoParts) {
  // Part 0 has sum exp = 1 over its keys (lse 0) and output [1, 0]; part 1 sum 3 (lse ln 3), output [0, 1].
  // Together: lse = ln 4, o = (1 * [1, 0] + 3 * [0, 1]) / 4.
  const float o0[2] = {1.0f, 0.0f}, o1[2] = {0.0f, 1.0f};
  const float l0[1] = {0.0f}, l1[1] = {std::log(3.0f)};
  const float* outs[2] = {o0, o1};
  const float* lses[2] = {l0, l1};
  float out[2], lse[1];
  lse_combine(2, outs, lses, 1, 2, out, lse);
  EXPECT_NEAR(lse[0], std::log(4.0f), 1e-6f);
  EXPECT_NEAR(out[0], 0.25f, 1e-6f);
  EXPECT_NEAR(out[1], 0.75f, 1e-6f);
}

TEST(LseCombine, EmptyPartsContributeNothingAndAllEmptyGivesZero) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Part 1 is empty (lse -inf); whatever its output holds must not leak in.
  const float o0[3] = {0.5f, -2.0f, 3.0f}, o1[3] = {nan, nan, 1e30f};
  const float l0[1] = {1.75f}, l1[1] = {kNegInf};
  const float* outs[2] = {o0, o1};
  const float* lses[2] = {l0, l1};
  float out[3], lse[1];
  lse_combine(2, outs, lses, 1, 3, out, lse);
  // A single non-empty part comes back bit for bit: weight exp(l - (l + log 1)) = 1.
  EXPECT_EQ(lse[0], 1.75f);
  for (int c = 0; c < 3; ++c) EXPECT_EQ(out[c], o0[c]);

  const float* empty_lses[2] = {l1, l1};
  const float* empty_outs[2] = {o1, o1};
  lse_combine(2, empty_outs, empty_lses, 1, 3, out, lse);
  EXPECT_EQ(lse[0], kNegInf);
  for (int c = 0; c < 3; ++c) EXPECT_EQ(std::bit_cast<uint32_t>(out[c]), 0u);  // +0, not NaN
}

TEST(LseCombine, RejectsNaNAndPlusInfLse) {
  const float o[1] = {0.0f}, bad_nan[1] = {std::numeric_limits<float>::quiet_NaN()},
              bad_inf[1] = {std::numeric_limits<float>::infinity()};
  const float* outs[1] = {o};
  float out[1], lse[1];
  const float* l_nan[1] = {bad_nan};
  const float* l_inf[1] = {bad_inf};
  EXPECT_THROW(lse_combine(1, outs, l_nan, 1, 1, out, lse), Error);
  EXPECT_THROW(lse_combine(1, outs, l_inf, 1, 1, out, lse), Error);
}

struct Problem {
  int H, C, R;
  std::vector<float> q, kv;
  int64_t n;
  float scale;
};

Problem make_problem(std::mt19937& rng, int64_t n) {
  Problem p{4, 16, 8, {}, {}, n, 0.25f};
  std::normal_distribution<float> normal;
  p.q.resize(static_cast<size_t>(p.H) * (p.C + p.R));
  p.kv.resize(static_cast<size_t>(n) * (p.C + p.R));
  for (float& x : p.q) x = 2.0f * normal(rng);
  for (float& x : p.kv) x = normal(rng);
  return p;
}

// Max |a - b| / max |b| over the outputs, and max |a - b| over lse.
void expect_close(const std::vector<float>& out, const std::vector<float>& ref_out, const std::vector<float>& lse,
                  const std::vector<float>& ref_lse, double rel_bound, double lse_bound, const std::string& what) {
  double max_ref = 0, max_diff = 0, max_lse_diff = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_FALSE(std::isnan(out[i])) << what;
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref_out[i])));
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(out[i]) - ref_out[i]));
  }
  for (size_t h = 0; h < lse.size(); ++h) {
    if (ref_lse[h] == kNegInf) {
      EXPECT_EQ(lse[h], kNegInf) << what;
      continue;
    }
    max_lse_diff = std::max(max_lse_diff, std::fabs(static_cast<double>(lse[h]) - ref_lse[h]));
  }
  EXPECT_LE(max_diff, rel_bound * std::max(max_ref, 1e-30)) << what;
  EXPECT_LE(max_lse_diff, lse_bound) << what;
}

// LSE-combining per-shard attention over the DCP shards equals attention over the whole context: W = 1..8,
// contexts shorter than W (empty shards), one token, and an empty context.
TEST(LseCombine, EqualsSingleRankAttentionOverTheUnion) {
  std::mt19937 rng(3);
  double worst = 0;
  for (int W = 1; W <= 8; ++W) {
    for (int64_t n : {0, 1, 3, 7, 64, 301}) {
      const Problem p = make_problem(rng, n);
      const int width = p.C + p.R;
      std::vector<float> ref_out(static_cast<size_t>(p.H) * p.C), ref_lse(p.H);
      cpu::mla_attend_absorbed(p.q.data(), p.H, p.C, p.R, p.kv.data(), n, nullptr, 0, p.scale, ref_out.data(),
                               ref_lse.data());
      std::vector<std::vector<float>> parts_out(W, std::vector<float>(ref_out.size())), parts_lse(W);
      std::vector<const float*> outs(W), lses(W);
      for (int r = 0; r < W; ++r) {
        std::vector<float> shard;
        for (int64_t t = r; t < n; t += W)
          shard.insert(shard.end(), p.kv.begin() + t * width, p.kv.begin() + (t + 1) * width);
        parts_lse[r].resize(p.H);
        cpu::mla_attend_absorbed(p.q.data(), p.H, p.C, p.R, shard.data(), static_cast<int64_t>(shard.size()) / width,
                                 nullptr, 0, p.scale, parts_out[r].data(), parts_lse[r].data());
        outs[r] = parts_out[r].data();
        lses[r] = parts_lse[r].data();
      }
      std::vector<float> out(ref_out.size()), lse(p.H);
      lse_combine(W, outs.data(), lses.data(), p.H, p.C, out.data(), lse.data());
      const std::string what = "W=" + std::to_string(W) + " n=" + std::to_string(n);
      expect_close(out, ref_out, lse, ref_lse, 2e-6, 2e-6, what);
      for (size_t i = 0; i < out.size(); ++i)
        worst = std::max(worst, std::fabs(static_cast<double>(out[i]) - ref_out[i]));
    }
  }
  std::printf("LSE combine vs single-rank attention: worst |diff| %.3g (outputs are O(1))\n", worst);
}

TEST(LseCombine, AllGatherCombineGivesTheSameBitsOnEveryRank) {
  std::mt19937 rng(11);
  const int H = 3, C = 5;
  const int64_t rows = 4;
  for (int W : {1, 2, 3, 8}) {
    // Part r of row i: random output, lse random or -inf (row 2 is empty on every rank).
    std::vector<std::vector<float>> outs(W), lses(W);
    std::normal_distribution<float> normal;
    for (int r = 0; r < W; ++r) {
      outs[r].resize(rows * H * C);
      lses[r].resize(rows * H);
      for (float& x : outs[r]) x = normal(rng);
      for (int64_t i = 0; i < rows; ++i)
        for (int h = 0; h < H; ++h)
          lses[r][i * H + h] = (i == 2 || (r + h) % 3 == 0) ? kNegInf : 3.0f * normal(rng);
    }
    std::vector<std::vector<float>> got_out(W), got_lse(W);
    LocalWorld(W).run([&](Communicator& comm) {
      const int me = comm.rank();
      got_out[me].resize(rows * H * C);
      got_lse[me].resize(rows * H);
      all_gather_lse_combine(comm, outs[me].data(), lses[me].data(), rows, H, C, got_out[me].data(),
                             got_lse[me].data());
    });
    for (int64_t i = 0; i < rows; ++i) {
      std::vector<const float*> o(W), l(W);
      for (int r = 0; r < W; ++r) {
        o[r] = outs[r].data() + i * H * C;
        l[r] = lses[r].data() + i * H;
      }
      std::vector<float> want_out(H * C), want_lse(H);
      lse_combine(W, o.data(), l.data(), H, C, want_out.data(), want_lse.data());
      for (int r = 0; r < W; ++r) {
        for (int j = 0; j < H * C; ++j)
          ASSERT_EQ(std::bit_cast<uint32_t>(got_out[r][i * H * C + j]), std::bit_cast<uint32_t>(want_out[j]));
        for (int h = 0; h < H; ++h)
          ASSERT_EQ(std::bit_cast<uint32_t>(got_lse[r][i * H + h]), std::bit_cast<uint32_t>(want_lse[h]));
      }
      if (i == 2) {
        for (int h = 0; h < H; ++h) EXPECT_EQ(want_lse[h], kNegInf);
      }
    }
  }
}

}  // namespace
}  // namespace kestrel::parallel
