#include "kernels/cpu/moe.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/cpu/basic.h"

namespace kestrel::cpu {

void moe_route(const float* logits, const float* bias, const MoeRouting& r, int32_t* ids, float* weights) {
  const int E = r.n_experts;
  std::vector<float> s(E), b(E);
  for (int e = 0; e < E; ++e) {
    s[e] = sigmoid(logits[e]);
    b[e] = bias ? s[e] + bias[e] : s[e];
  }
  std::vector<char> allowed(E, 1);
  if (r.n_group > 1) {
    const int per = E / r.n_group;
    std::vector<float> gscore(r.n_group);
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
      gscore[g] = per >= 2 ? best + second : best;
    }
    std::vector<int> order(r.n_group);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return gscore[x] > gscore[y]; });
    std::fill(allowed.begin(), allowed.end(), 0);
    for (int i = 0; i < r.topk_group; ++i) std::fill_n(allowed.begin() + order[i] * per, per, 1);
  }
  std::vector<int> cand;
  for (int e = 0; e < E; ++e)
    if (allowed[e]) cand.push_back(e);
  std::stable_sort(cand.begin(), cand.end(), [&](int x, int y) { return b[x] > b[y]; });
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
