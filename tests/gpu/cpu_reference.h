// What the GPU engine's model tests compare against: one request alone through the CPU model, and the size of a
// row's logit difference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu/cpu_backend.h"
#include "model/model.h"

namespace kestrel::gpu_test {

struct Reference {
  std::vector<int32_t> tokens;
  std::vector<float> logits;  // [prompt + tokens - 1, vocab]
  // Per position, the smallest MoE routing margin over the layers (cpu::moe_route_margin; +infinity without MoE or
  // off the CPU backend): where it is small, another rounding of the router's input may choose other experts.
  std::vector<float> route_margin;
};

// The request alone through the CPU model: the prompt in one call, then one token per call, greedy.
inline Reference cpu_alone(const Model& m, const std::vector<int32_t>& prompt, int max_tokens) {
  const int64_t V = m.config().vocab_size, P = static_cast<int64_t>(prompt.size());
  Reference r;
  SequenceState s = m.new_sequence();
  const auto* cpu = dynamic_cast<const CpuBackend*>(&m.backend());
  if (cpu) cpu->record_route_margins(&r.route_margin);
  r.logits.resize(static_cast<size_t>(P * V));
  m.forward(s, prompt.data(), P, r.logits.data());
  for (int i = 0; i < max_tokens; ++i) {
    const float* last = r.logits.data() + r.logits.size() - V;
    const int32_t tok = static_cast<int32_t>(std::max_element(last, last + V) - last);
    r.tokens.push_back(tok);
    if (i + 1 == max_tokens) break;
    const size_t at = r.logits.size();
    r.logits.resize(at + V);
    m.forward(s, &tok, 1, r.logits.data() + at);
  }
  if (cpu) cpu->record_route_margins(nullptr);
  r.route_margin.resize(static_cast<size_t>(P + max_tokens), std::numeric_limits<float>::infinity());
  return r;
}

// The smallest routing margin at position p and the two before it (a flip at p - 1 or p - 2 reaches p through the
// cache its layers write); positions past the end of `margin` count as +infinity.
inline float routing_margin_near(const std::vector<float>& margin, int64_t p) {
  float m = std::numeric_limits<float>::infinity();
  for (int64_t q = std::max<int64_t>(0, p - 2); q <= p && q < static_cast<int64_t>(margin.size()); ++q)
    m = std::min(m, margin[q]);
  return m;
}

// The largest |a - b| over a row of logits, divided by the reference row's largest |logit|.
inline float row_error(const float* a, const float* ref, int64_t V) {
  float err = 0.0f, scale = 0.0f;
  for (int64_t v = 0; v < V; ++v) {
    err = std::max(err, std::fabs(a[v] - ref[v]));
    scale = std::max(scale, std::fabs(ref[v]));
  }
  return err / scale;
}

}  // namespace kestrel::gpu_test
