#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "core/formats.h"
#include "kernels/cpu/attention.h"
#include "parallel/dcp_mla.h"
#include "parallel/local_world.h"

namespace kestrel::parallel {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kH = 4, kC = 16, kR = 8, kHi = 2, kD = 16;
constexpr float kScale = 0.3f;

// One query token with its whole (unsharded) context.
struct Case {
  int64_t context_len;
  std::vector<float> q_abs, kv, scores;     // scores empty: use the indexer
  std::vector<uint8_t> q_codes, k_codes;
  std::vector<float> weights, k_scale;
};

uint8_t random_e4m3(std::mt19937& rng) {
  uint8_t b;
  do b = static_cast<uint8_t>(rng()); while ((b & 0x7F) == 0x7F);  // no NaN codes
  return b;
}

Case make_case(std::mt19937& rng, int64_t n, bool indexer, bool heavy_ties) {
  Case c;
  c.context_len = n;
  std::normal_distribution<float> normal;
  c.q_abs.resize(kH * (kC + kR));
  c.kv.resize(n * (kC + kR));
  for (float& x : c.q_abs) x = 2.0f * normal(rng);
  for (float& x : c.kv) x = normal(rng);
  if (indexer) {
    c.q_codes.resize(kHi * kD);
    c.k_codes.resize(n * kD);
    for (auto& b : c.q_codes) b = random_e4m3(rng);
    for (auto& b : c.k_codes) b = random_e4m3(rng);
    c.weights = {0.02f * normal(rng), 0.02f * normal(rng)};
    c.k_scale.resize(n);
    for (float& s : c.k_scale) s = std::ldexp(1.0f, -static_cast<int>(rng() % 4));
  } else {
    c.scores.resize(n);
    for (float& s : c.scores) {
      const uint32_t r = rng() % 10;
      s = heavy_ties ? (r < 6 ? 0.0f : (r < 8 ? 1.0f : (r < 9 ? kNegInf : normal(rng)))) : normal(rng);
    }
  }
  return c;
}

std::vector<float> full_scores(const Case& c) {
  if (c.context_len == 0 || !c.scores.empty()) return c.scores;
  std::vector<float> s(c.context_len);
  cpu::indexer_scores(c.q_codes.data(), c.weights.data(), kHi, kD, c.k_codes.data(), c.k_scale.data(),
                      c.context_len, s.data());
  return s;
}

// Single-rank sparse MLA: top-k on the bf16-rounded scores, attention over the selected rows.
void reference(const Case& c, int k, std::vector<int32_t>& topk, float* out, float* lse) {
  std::vector<float> s = full_scores(c);
  for (float& x : s) x = round_to_bf16(x);
  topk.assign(k, -1);
  cpu::topk_indices(s.data(), c.context_len, k, topk.data());
  cpu::mla_attend_absorbed(c.q_abs.data(), kH, kC, kR, c.kv.data(), c.context_len, topk.data(), k, kScale, out, lse);
}

void run_and_compare(const std::vector<Case>& cases, int W, int k, double& worst_rel, MergeStats& stats_out) {
  const int64_t rows = static_cast<int64_t>(cases.size());
  const int width = kC + kR;
  std::vector<std::vector<float>> outs(W), lses(W);
  std::vector<LocalSelection> selections(W);
  std::vector<MergeStats> stats(W);
  LocalWorld(W).run([&](Communicator& comm) {
    const int me = comm.rank();
    // This rank's shards: rows, index keys and scores of positions t with t mod W = me.
    std::vector<std::vector<float>> kv(rows), scores(rows), k_scale(rows);
    std::vector<std::vector<uint8_t>> k_codes(rows);
    std::vector<DcpQuery> queries(rows);
    for (int64_t i = 0; i < rows; ++i) {
      const Case& c = cases[i];
      for (int64_t t = me; t < c.context_len; t += W) {
        kv[i].insert(kv[i].end(), c.kv.begin() + t * width, c.kv.begin() + (t + 1) * width);
        if (!c.scores.empty()) {
          scores[i].push_back(c.scores[t]);
        } else {
          k_codes[i].insert(k_codes[i].end(), c.k_codes.begin() + t * kD, c.k_codes.begin() + (t + 1) * kD);
          k_scale[i].push_back(c.k_scale[t]);
        }
      }
      DcpQuery& q = queries[i];
      q.q_abs = c.q_abs.data();
      q.context_len = c.context_len;
      q.kv = kv[i].data();
      if (!c.scores.empty()) {
        q.index_scores = scores[i].data();
      } else {
        q.indexer = {c.q_codes.data(), c.weights.data(), kHi, kD};
        q.k_codes = k_codes[i].data();
        q.k_scale = k_scale[i].data();
      }
    }
    outs[me].resize(rows * kH * kC);
    lses[me].resize(rows * kH);
    dcp_sparse_mla(comm, MlaShape{kH, kC, kR, kScale}, k, queries, outs[me].data(), lses[me].data(), &stats[me],
                   &selections[me]);
  });
  stats_out += stats[0];
  for (int64_t i = 0; i < rows; ++i) {
    std::vector<int32_t> topk;
    std::vector<float> ref_out(kH * kC), ref_lse(kH);
    reference(cases[i], k, topk, ref_out.data(), ref_lse.data());
    const std::string what = "W=" + std::to_string(W) + " k=" + std::to_string(k) + " query " + std::to_string(i) +
                             " context " + std::to_string(cases[i].context_len);
    // The selected set, exactly.
    std::vector<int64_t> got, want;
    for (int r = 0; r < W; ++r)
      for (int32_t l : selections[r].row(i)) got.push_back(int64_t{l} * W + r);
    for (int32_t p : topk)
      if (p >= 0) want.push_back(p);
    std::sort(got.begin(), got.end());
    std::sort(want.begin(), want.end());
    ASSERT_EQ(got, want) << what;
    // The output, to fp32 rounding, the same bits on every rank, never NaN.
    double max_ref = 0, max_diff = 0;
    for (int j = 0; j < kH * kC; ++j) {
      const float o = outs[0][i * kH * kC + j];
      ASSERT_FALSE(std::isnan(o)) << what;
      for (int r = 1; r < W; ++r) ASSERT_EQ(outs[r][i * kH * kC + j], o) << what;
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref_out[j])));
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(o) - ref_out[j]));
    }
    EXPECT_LE(max_diff, 2e-6 * max_ref) << what;
    if (max_ref > 0) worst_rel = std::max(worst_rel, max_diff / max_ref);
    for (int h = 0; h < kH; ++h) {
      const float l = lses[0][i * kH + h];
      if (ref_lse[h] == kNegInf) {
        EXPECT_EQ(l, kNegInf) << what;
        for (int j = 0; j < kC; ++j) EXPECT_EQ(outs[0][i * kH * kC + h * kC + j], 0.0f) << what;
      } else {
        EXPECT_NEAR(l, ref_lse[h], 2e-6 * std::max(1.0f, std::fabs(ref_lse[h]))) << what;
      }
    }
  }
}

TEST(DcpSparseMla, EqualsSingleRankSparseMla) {
  std::mt19937 rng(2024);
  for (int W : {1, 2, 3, 4, 8}) {
    for (int k : {16, 64}) {
      std::vector<Case> cases;
      // Contexts shorter than W (empty shards), shorter than k (dense), and several times k; given scores with
      // heavy ties, plain given scores, and scores from the FP8 indexer.
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{W - 1 > 0 ? W - 1 : 1}, int64_t{k / 2}, int64_t{k + 1},
                        int64_t{3 * k + 5}, int64_t{10 * k}}) {
        cases.push_back(make_case(rng, n, false, true));
        cases.push_back(make_case(rng, n, false, false));
        cases.push_back(make_case(rng, n, true, false));
      }
      double worst = 0;
      MergeStats stats;
      run_and_compare(cases, W, k, worst, stats);
      std::printf("DCP sparse MLA W=%d k=%d: %zu queries, worst relative output error %.3g, %lld resends\n", W, k,
                  cases.size(), worst, static_cast<long long>(stats.resends));
    }
  }
}

TEST(DcpSparseMla, LongContextWithFullTopK) {
  std::mt19937 rng(5);
  const int k = 2048;
  std::vector<Case> cases = {make_case(rng, 3 * k + 17, true, false), make_case(rng, 2 * k, false, true),
                             make_case(rng, k - 3, false, false)};
  for (int W : {2, 8}) {
    double worst = 0;
    MergeStats stats;
    run_and_compare(cases, W, k, worst, stats);
    std::printf("DCP sparse MLA W=%d k=%d: worst relative output error %.3g\n", W, k, worst);
  }
}

TEST(DcpSparseMla, RankWithNothingSelectedContributesNothing) {
  // Every score of rank 1 is -inf: it holds rows but none is selectable; the result must not be NaN.
  const int W = 2, k = 8;
  std::mt19937 rng(9);
  Case c = make_case(rng, 40, false, false);
  for (int64_t t = 1; t < 40; t += 2) c.scores[t] = kNegInf;
  double worst = 0;
  MergeStats stats;
  run_and_compare({c}, W, k, worst, stats);
  // And a context whose every score is -inf: nothing attended anywhere.
  Case none = make_case(rng, 12, false, false);
  std::fill(none.scores.begin(), none.scores.end(), kNegInf);
  run_and_compare({none}, W, k, worst, stats);
}

}  // namespace
}  // namespace kestrel::parallel
