#include "engine/step_cost.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace kestrel {

int StepCostModel::bucket(int64_t n) {
  const int b = static_cast<int>(std::bit_width(static_cast<uint64_t>(std::max<int64_t>(n, 1) - 1)));
  return std::min(b, 23);  // 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...
}

void StepCostModel::update(Mean& m, double x, bool skip_first) {
  ++m.seen;
  if (skip_first && m.seen == 1) return;  // one-time costs
  m.value = m.seen == (skip_first ? 2 : 1) ? x : m.value + kAlpha * (x - m.value);
}

void StepCostModel::observe(int64_t decode_rows, int64_t prompt_tokens, double seconds) {
  if (!(seconds >= 0) || !std::isfinite(seconds)) return;
  if (prompt_tokens == 0) {
    if (decode_rows > 0) update(decode_[static_cast<size_t>(bucket(decode_rows))], seconds, true);
    return;
  }
  if (prompt_tokens < kMinPromptSample) return;
  if (decode_rows == 0) {
    update(prompt_only_, seconds / static_cast<double>(prompt_tokens), false);
    return;
  }
  const double d = decode_seconds(decode_rows);
  if (d < 0) return;
  update(mixed_, std::max(seconds - d, 0.0) / static_cast<double>(prompt_tokens), false);
}

double StepCostModel::decode_seconds(int64_t n) const {
  const int b = bucket(n);
  // The bucket's own mean, else the nearest measured one (ties: the larger, which is the slower).
  for (int d = 0; d < 24; ++d)
    for (int c : {b + d, b - d})
      if (c >= 0 && c < 24 && decode_[static_cast<size_t>(c)].seen >= 2) return decode_[static_cast<size_t>(c)].value;
  return -1;
}

bool StepCostModel::knows_decode(int64_t n) const { return decode_[static_cast<size_t>(bucket(n))].seen >= 2; }

double StepCostModel::prompt_token_seconds() const {
  if (mixed_.seen >= 1) return mixed_.value;
  if (prompt_only_.seen >= 1) return prompt_only_.value;
  return -1;
}

int64_t StepCostModel::prompt_allowance(int64_t n, double factor) const {
  if (!(factor > 1) || n <= 0) return -1;
  const double d = decode_seconds(n), c = prompt_token_seconds();
  if (d < 0 || c < 0) return -1;
  if (c == 0) return -1;
  const double tokens = (factor - 1) * d / c;
  return tokens >= 1e15 ? -1 : static_cast<int64_t>(tokens);
}

}  // namespace kestrel
