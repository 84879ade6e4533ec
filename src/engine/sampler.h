// Token sampling from one row of logits: greedy at temperature 0, else temperature + top-p with a seeded,
// per-request random stream (the same seed gives the same tokens on every machine).
#pragma once
#include <cstdint>

namespace kestrel {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (ties to the lower id)
  float top_p = 1.0f;
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  int32_t sample(const float* logits, int64_t vocab);

 private:
  SamplingParams p_;
  uint64_t state_;
};

}  // namespace kestrel
