#include "kernels/cpu/moe.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/cpu/basic.h"

namespace kestrel::cpu {

namespace {

// The scores (s: sigmoid, b: biased), the candidates in rank order and, for grouped routing, the groups in rank
// order with their scores: what moe_route and moe_route_margin both decide from.
struct Ranked {
  std::vector<float> s, b, gscore;
  std::vector<int> cand, groups;
};

Ranked rank(const float* logits, const float* bias, const MoeRouting& r) {
  const int E = r.n_experts;
  Ranked k;
  k.s.resize(E);
  k.b.resize(E);
  for (int e = 0; e < E; ++e) {
    k.s[e] = sigmoid(logits[e]);
    k.b[e] = bias ? k.s[e] + bias[e] : k.s[e];
  }
  const std::vector<float>& b = k.b;
  std::vector<char> allowed(E, 1);
  if (r.n_group > 1) {
    const int per = E / r.n_group;
    k.gscore.resize(r.n_group);
    for (int g = 0; g < r.n_group; ++g) {
      float best = b[g * per], second = -std::numeric_limits<float>::infinity();
      for (int i = 1; i < per; ++i) {
        const float v = b[g * per + i];
        if (v > best) {
          second = best;
          best = v;
        } else if (v > second) {
          second = v;
        }
      }
      k.gscore[g] = per >= 2 ? best + second : best;
    }
    k.groups.resize(r.n_group);
    std::iota(k.groups.begin(), k.groups.end(), 0);
    std::stable_sort(k.groups.begin(), k.groups.end(), [&](int x, int y) { return k.gscore[x] > k.gscore[y]; });
    std::fill(allowed.begin(), allowed.end(), 0);
    for (int i = 0; i < r.topk_group; ++i) std::fill_n(allowed.begin() + k.groups[i] * per, per, 1);
  }
  for (int e = 0; e < E; ++e)
    if (allowed[e]) k.cand.push_back(e);
  std::stable_sort(k.cand.begin(), k.cand.end(), [&](int x, int y) { return b[x] > b[y]; });
  return k;
}

}  // namespace

float moe_route_margin(const float* logits, const float* bias, const MoeRouting& r) {
  const Ranked k = rank(logits, bias, r);
  float m = std::numeric_limits<float>::infinity();
  if (static_cast<int>(k.cand.size()) > r.top_k) m = k.b[k.cand[r.top_k - 1]] - k.b[k.cand[r.top_k]];
  if (r.n_group > 1 && r.topk_group < r.n_group)
    m = std::min(m, k.gscore[k.groups[r.topk_group - 1]] - k.gscore[k.groups[r.topk_group]]);
  return m;
}

void moe_route(const float* logits, const float* bias, const MoeRouting& r, int32_t* ids, float* weights) {
  const Ranked k = rank(logits, bias, r);
  const std::vector<float>& s = k.s;
  const std::vector<int>& cand = k.cand;
  float total = 0.0f;
  for (int i = 0; i < r.top_k; ++i) {
    ids[i] = cand[i];
    weights[i] = s[cand[i]];
    total += weights[i];
  }
  for (int i = 0; i < r.top_k; ++i) {
    if (r.renormalize) weights[i] /= total;
    weights[i] *= r.scaling;
  }
}

}  // namespace kestrel::cpu
