#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace kestrel {

Sampler::Sampler(const SamplingParams& p) : p_(p), state_(p.seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {
  KESTREL_CHECK(p.temperature >= 0.0f && std::isfinite(p.temperature), "temperature must be >= 0, got {}",
                p.temperature);
  KESTREL_CHECK(p.top_p > 0.0f && p.top_p <= 1.0f, "top_p must be in (0, 1], got {}", p.top_p);
}

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  if (p_.temperature == 0.0f) return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  const double mx = logits[order[0]];
  std::vector<double> prob(vocab);
  double total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) total += prob[i] = std::exp((logits[order[i]] - mx) / p_.temperature);
  int64_t keep = vocab;
  if (p_.top_p < 1.0f) {
    double cum = 0.0;
    for (int64_t i = 0; i < vocab; ++i) {
      cum += prob[i] / total;
      if (cum >= p_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0.0;
  for (int64_t i = 0; i < keep; ++i) kept += prob[i];
  // splitmix64 step -> uniform in [0, 1) with 53 bits
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const double u = static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0) * kept;
  double cum = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    cum += prob[i];
    if (u < cum) return order[i];
  }
  return order[keep - 1];
}

}  // namespace kestrel
