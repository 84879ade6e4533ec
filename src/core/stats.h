// Summary statistics shared by the benchmarks.
#pragma once
#include <cmath>
#include <cstddef>
#include <vector>

namespace kestrel {

// numpy's default percentile (p in [0, 100]) of ascending `sorted` values: linear interpolation between the
// closest ranks. `sorted` must not be empty.
inline double percentile(const std::vector<double>& sorted, double p) {
  const double rank = p / 100.0 * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank)), hi = static_cast<size_t>(std::ceil(rank));
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - static_cast<double>(lo));
}

}  // namespace kestrel
