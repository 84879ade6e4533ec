#include "parallel/lse_combine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace kestrel::parallel {

void lse_combine(int n_parts, const float* const* out_parts, const float* const* lse_parts, int H, int C,
                 float* out, float* lse) {
  KESTREL_CHECK(n_parts >= 1 && H >= 1 && C >= 1, "lse_combine: bad shape parts={} H={} C={}", n_parts, H, C);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int h = 0; h < H; ++h) {
    float* o = out + static_cast<int64_t>(h) * C;
    std::fill(o, o + C, 0.0f);
    float top = kNegInf;
    for (int r = 0; r < n_parts; ++r) {
      const float l = lse_parts[r][h];
      KESTREL_CHECK(!std::isnan(l) && l != std::numeric_limits<float>::infinity(),
                    "lse_combine: part {} head {} has lse {}", r, h, l);
      top = std::max(top, l);
    }
    if (top == kNegInf) {  // no part attended any key; exp(-inf - -inf) would be NaN
      lse[h] = kNegInf;
      continue;
    }
    float sum = 0.0f;
    for (int r = 0; r < n_parts; ++r) sum += std::exp(lse_parts[r][h] - top);
    lse[h] = top + std::log(sum);
    for (int r = 0; r < n_parts; ++r) {
      if (lse_parts[r][h] == kNegInf) continue;
      const float weight = std::exp(lse_parts[r][h] - lse[h]);
      const float* part = out_parts[r] + static_cast<int64_t>(h) * C;
      for (int c = 0; c < C; ++c) o[c] += weight * part[c];
    }
  }
}

void all_gather_lse_combine(Communicator& comm, const float* out_part, const float* lse_part, int64_t rows, int H,
                            int C, float* out, float* lse) {
  KESTREL_CHECK(rows >= 0 && H >= 1 && C >= 1, "all_gather_lse_combine: bad shape rows={} H={} C={}", rows, H, C);
  const int W = comm.size();
  const int64_t out_floats = rows * H * C, row_floats = static_cast<int64_t>(H) * (C + 1);
  // Each rank's block: its outputs, then its lse values.
  std::vector<float> mine(rows * row_floats);
  std::copy(out_part, out_part + out_floats, mine.begin());
  std::copy(lse_part, lse_part + rows * H, mine.begin() + out_floats);
  std::vector<float> all(mine.size() * W);
  comm.all_gather(mine.data(), mine.size() * sizeof(float), all.data());
  std::vector<const float*> outs(W), lses(W);
  for (int64_t i = 0; i < rows; ++i) {
    for (int r = 0; r < W; ++r) {
      const float* block = all.data() + r * mine.size();
      outs[r] = block + i * H * C;
      lses[r] = block + out_floats + i * H;
    }
    lse_combine(W, outs.data(), lses.data(), H, C, out + i * H * C, lse + i * H);
  }
}

}  // namespace kestrel::parallel
