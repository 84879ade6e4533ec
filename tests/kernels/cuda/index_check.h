// Pieces shared by the tests of the DSA indexer's generic kernels over each key format (dsa_generic_test for FP8
// keys, fp4_cache_test for MXFP4 keys): inputs, the bit-for-bit check of the scores against cpu::indexer_scores and
// of topk_decode's sets against cpu::topk_indices.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/dsa.h"

namespace kestrel::cuda::test_util {

// fp32(n^-1/2) as MlaCore::select computes it.
inline float inv_sqrt(int n) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))); }

// A value z with fl(z * norm) == m, searched within a few ulps of m / norm.
inline std::optional<float> preimage(float m, float norm) {
  const float z0 = static_cast<float>(static_cast<double>(m) / static_cast<double>(norm));
  float up = z0, down = z0;
  for (int step = 0; step < 16; ++step) {
    if (up * norm == m) return up;
    if (down * norm == m) return down;
    up = std::nextafter(up, kInf);
    down = std::nextafter(down, -kInf);
  }
  return std::nullopt;
}

// Codes uniform over every non-NaN e4m3 code (subnormals, zeros and +-448 included).
inline void random_codes(std::mt19937& rng, uint8_t* codes, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint8_t c;
    do c = static_cast<uint8_t>(rng()); while ((c & 0x7F) == 0x7F);
    codes[i] = c;
  }
}

struct ScoreCase {
  int D, H, page_size, n_q;
  std::vector<int> ctx;
  int max_ctx;  // below a context: that request is cut to it
};

// One case's scores: the GPU's and the CPU's, [rows, stride], entries the kernel must not write holding the poison
// in want; the GPU's scores and contexts stay on the device for the top-k check.
struct ScoreRun {
  std::vector<float> got, want;
  int64_t stride = 0;
  int rows = 0;
  DeviceBuffer<float> scores_d;
  DeviceBuffer<int32_t> ctx_d;
};

// What compare_scores found: entries that differ, and how many of the CPU's written scores are NaN and finite.
struct ScoreCounts {
  int64_t mismatches = 0, nan = 0, finite = 0;
};

// run.got against run.want bit for bit (any NaN matching any NaN); an entry the CPU leaves at the poison must keep
// the poison's exact bits, a written one must not have them. The first 5 differences are reported as failures.
inline ScoreCounts compare_scores(const ScoreRun& run) {
  ScoreCounts n;
  for (size_t i = 0; i < run.got.size(); ++i) {
    const bool same = bits(run.want[i]) == kPoisonBits
                          ? bits(run.got[i]) == kPoisonBits
                          : bits(run.got[i]) != kPoisonBits && same_float(run.got[i], run.want[i]);
    if (!same && n.mismatches < 5)
      ADD_FAILURE() << "entry " << i << " (row " << i / run.stride << ", position " << i % run.stride << "): got "
                    << run.got[i] << ", want " << run.want[i];
    n.mismatches += !same;
    n.nan += std::isnan(run.want[i]) && bits(run.want[i]) != kPoisonBits;
    n.finite += std::isfinite(run.want[i]);
  }
  return n;
}

// topk_decode over the GPU's scores of a case (contexts not cut by max_ctx), for k = 16 and 50, against
// MlaCore::select: cpu::topk_indices over the CPU's scores, then ascending; padded with -1 at the end here.
inline void expect_topk_matches_cpu(const ScoreCase& c, const ScoreRun& run) {
  const int batch = static_cast<int>(c.ctx.size());
  for (const int k : {16, 50}) {
    SCOPED_TRACE("D " + std::to_string(c.D) + ", H " + std::to_string(c.H) + ", n_q " + std::to_string(c.n_q) +
                 ", k " + std::to_string(k));
    const size_t ws_bytes = topk_decode_workspace_bytes(batch, c.n_q, c.max_ctx, k);
    DeviceBuffer<uint8_t> ws = to_device(std::vector<uint8_t>(std::max<size_t>(ws_bytes, 1), 0));
    DeviceBuffer<int32_t> out_d = to_device(std::vector<int32_t>(static_cast<size_t>(run.rows) * k, -7));
    topk_decode(run.scores_d.get(), run.stride, batch, c.n_q, run.ctx_d.get(), c.max_ctx, k, out_d.get(), ws.get(),
                ws_bytes, nullptr);
    sync();
    const std::vector<int32_t> got = to_host(out_d);
    for (int r = 0; r < batch; ++r)
      for (int i = 0; i < c.n_q; ++i) {
        const int64_t row = int64_t{r} * c.n_q + i;
        const int n = c.ctx[r] - c.n_q + i + 1;
        std::vector<int32_t> want(static_cast<size_t>(k), -1);
        cpu::topk_indices(run.want.data() + row * run.stride, n, k, want.data());
        const auto valid_end = std::stable_partition(want.begin(), want.end(), [](int32_t p) { return p >= 0; });
        std::sort(want.begin(), valid_end);
        const std::vector<int32_t> row_got(got.begin() + row * k, got.begin() + (row + 1) * k);
        EXPECT_EQ(row_got, want) << "row " << row;
      }
  }
}

}  // namespace kestrel::cuda::test_util
