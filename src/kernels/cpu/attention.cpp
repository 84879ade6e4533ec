#include "kernels/cpu/attention.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numbers>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/basic.h"

namespace kestrel::cpu {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// YaRN correction dimension: the rotary dimension whose wavelength completes `rotations` turns over the original
// context (standard YaRN formula, in fp64).
double yarn_correction_dim(double rotations, int dim, double theta, double original_max_pos) {
  return dim * std::log(original_max_pos / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(theta));
}

void check_rope_args(int64_t n_vec, int64_t stride, int dim) {
  KESTREL_CHECK(dim > 0 && dim % 2 == 0, "rope: dim must be positive and even, got {}", dim);
  KESTREL_CHECK(n_vec >= 0, "rope: negative vector count {}", n_vec);
  KESTREL_CHECK(n_vec <= 1 || stride >= dim, "rope: stride {} smaller than dim {}", stride, dim);
}

// The rows an attention call visits, in visiting order: idx with invalid entries dropped, or 0..n_kv-1.
std::vector<int64_t> attended_rows(int64_t n_kv, const int32_t* idx, int64_t n_idx) {
  KESTREL_CHECK(n_kv >= 0, "mla: negative row count {}", n_kv);
  std::vector<int64_t> rows;
  if (idx == nullptr) {
    rows.resize(static_cast<size_t>(n_kv));
    for (int64_t t = 0; t < n_kv; ++t) rows[static_cast<size_t>(t)] = t;
    return rows;
  }
  KESTREL_CHECK(n_idx >= 0, "mla: negative index count {}", n_idx);
  rows.reserve(static_cast<size_t>(n_idx));
  for (int64_t i = 0; i < n_idx; ++i)
    if (idx[i] >= 0 && idx[i] < n_kv) rows.push_back(idx[i]);
  return rows;
}

// Softmax over `scores` (n of them) and the weighted sum of values stored transposed, values_t: [d_value, n].
// Two passes in fp32: max, then exp(s - max) summed with the fixed-order cpu::sum, and each output element is
// the fixed-order cpu::dot of the exponentials with one value column, divided by their sum at the end.
// With no finite maximum (no rows, or every score -inf) the output is 0 and lse is -inf, never NaN.
void softmax_weighted_sum(const float* scores, int64_t n, const float* values_t, int d_value, float* out,
                          float* lse) {
  float max = kNegInf;
  for (int64_t t = 0; t < n; ++t)
    if (scores[t] > max) max = scores[t];
  if (max == kNegInf) {
    std::fill(out, out + d_value, 0.0f);
    *lse = kNegInf;
    return;
  }
  std::vector<float> e(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) e[static_cast<size_t>(t)] = std::exp(scores[t] - max);
  const float denom = sum(e.data(), n);
  for (int j = 0; j < d_value; ++j) out[j] = dot(e.data(), values_t + static_cast<int64_t>(j) * n, n) / denom;
  *lse = max + std::log(denom);
}

}  // namespace

std::vector<float> rope_inv_freq(int dim, double theta, const YarnParams* yarn) {
  KESTREL_CHECK(dim > 0 && dim % 2 == 0, "rope_inv_freq: dim must be positive and even, got {}", dim);
  KESTREL_CHECK(theta > 1.0, "rope_inv_freq: theta must be > 1, got {}", theta);
  const int half = dim / 2;
  std::vector<double> f(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) f[static_cast<size_t>(i)] = std::pow(theta, -2.0 * i / dim);
  if (yarn != nullptr) {
    KESTREL_CHECK(yarn->factor > 0.0, "rope_inv_freq: YaRN factor must be positive, got {}", yarn->factor);
    KESTREL_CHECK(yarn->beta_fast > 0.0 && yarn->beta_slow > 0.0 && yarn->original_max_position_embeddings > 0.0,
                  "rope_inv_freq: YaRN beta_fast, beta_slow and original_max_position_embeddings must be positive");
    const double orig = yarn->original_max_position_embeddings;
    double low = std::floor(yarn_correction_dim(yarn->beta_fast, dim, theta, orig));
    double high = std::ceil(yarn_correction_dim(yarn->beta_slow, dim, theta, orig));
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    // Equal bounds would make the ramp 0/0; YaRN's reference nudges the upper bound instead.
    if (low == high) high += 0.001;
    for (int i = 0; i < half; ++i) {
      const double r = std::clamp((i - low) / (high - low), 0.0, 1.0);
      double& fi = f[static_cast<size_t>(i)];
      fi = fi * (1.0 - r) + fi / yarn->factor * r;
    }
  }
  std::vector<float> out(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) out[static_cast<size_t>(i)] = static_cast<float>(f[static_cast<size_t>(i)]);
  return out;
}

double yarn_mscale(double factor, double m) {
  if (factor <= 1.0) return 1.0;
  return 0.1 * m * std::log(factor) + 1.0;
}

void rope_interleaved(float* x, int64_t n_vec, int64_t stride, int dim, int64_t pos, const float* inv_freq) {
  check_rope_args(n_vec, stride, dim);
  const float p = static_cast<float>(pos);
  for (int i = 0; i < dim / 2; ++i) {
    const float angle = p * inv_freq[i];
    const float c = std::cos(angle), s = std::sin(angle);
    for (int64_t v = 0; v < n_vec; ++v) {
      float* xv = x + v * stride;
      const float a = xv[2 * i], b = xv[2 * i + 1];
      xv[2 * i] = a * c - b * s;
      xv[2 * i + 1] = a * s + b * c;
    }
  }
}

void rope_neox(float* x, int64_t n_vec, int64_t stride, int dim, int64_t pos, const float* inv_freq) {
  check_rope_args(n_vec, stride, dim);
  const int half = dim / 2;
  const float p = static_cast<float>(pos);
  for (int i = 0; i < half; ++i) {
    const float angle = p * inv_freq[i];
    const float c = std::cos(angle), s = std::sin(angle);
    for (int64_t v = 0; v < n_vec; ++v) {
      float* xv = x + v * stride;
      const float a = xv[i], b = xv[i + half];
      xv[i] = a * c - b * s;
      xv[i + half] = a * s + b * c;
    }
  }
}

void mla_attend_absorbed(const float* q_abs, int H, int C, int R, const float* kv, int64_t n_kv,
                         const int32_t* idx, int64_t n_idx, float scale, float* out, float* lse) {
  KESTREL_CHECK(H > 0 && C > 0 && R >= 0, "mla_attend_absorbed: bad shape H={} C={} R={}", H, C, R);
  const std::vector<int64_t> rows = attended_rows(n_kv, idx, n_idx);
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t width = static_cast<int64_t>(C) + R;
  // The latents of the attended rows, transposed so each output element is one contiguous fixed-order dot.
  std::vector<float> c_t(static_cast<size_t>(C * n));
  for (int64_t t = 0; t < n; ++t)
    for (int c = 0; c < C; ++c) c_t[static_cast<size_t>(c * n + t)] = kv[rows[static_cast<size_t>(t)] * width + c];
  std::vector<float> scores(static_cast<size_t>(n));
  for (int h = 0; h < H; ++h) {
    const float* qh = q_abs + h * width;
    for (int64_t t = 0; t < n; ++t)
      scores[static_cast<size_t>(t)] = dot(qh, kv + rows[static_cast<size_t>(t)] * width, width) * scale;
    softmax_weighted_sum(scores.data(), n, c_t.data(), C, out + static_cast<int64_t>(h) * C, lse + h);
  }
}

void mla_absorb_query(const float* q, const float* wkv_b, int H, int dn, int dv, int C, int R, float* q_abs) {
  KESTREL_CHECK(H > 0 && dn > 0 && dv > 0 && C > 0 && R >= 0, "mla_absorb_query: bad shape H={} dn={} dv={} C={} R={}",
                H, dn, dv, C, R);
  const int64_t q_width = static_cast<int64_t>(dn) + R, abs_width = static_cast<int64_t>(C) + R;
  std::vector<float> w_uk_t(static_cast<size_t>(C) * dn);  // W_UK,h transposed: [C, dn]
  for (int h = 0; h < H; ++h) {
    const float* w_uk = wkv_b + static_cast<int64_t>(h) * (dn + dv) * C;
    for (int i = 0; i < dn; ++i)
      for (int c = 0; c < C; ++c) w_uk_t[static_cast<size_t>(c) * dn + i] = w_uk[static_cast<int64_t>(i) * C + c];
    const float* qh = q + h * q_width;
    float* ah = q_abs + h * abs_width;
    for (int c = 0; c < C; ++c) ah[c] = dot(w_uk_t.data() + static_cast<int64_t>(c) * dn, qh, dn);
    std::copy(qh + dn, qh + dn + R, ah + C);
  }
}

void mla_unabsorb_output(const float* obar, const float* wkv_b, int H, int dn, int dv, int C, float* o) {
  KESTREL_CHECK(H > 0 && dn > 0 && dv > 0 && C > 0, "mla_unabsorb_output: bad shape H={} dn={} dv={} C={}", H, dn,
                dv, C);
  for (int h = 0; h < H; ++h) {
    const float* w_uv = wkv_b + (static_cast<int64_t>(h) * (dn + dv) + dn) * C;
    for (int j = 0; j < dv; ++j)
      o[static_cast<int64_t>(h) * dv + j] = dot(w_uv + static_cast<int64_t>(j) * C, obar + static_cast<int64_t>(h) * C, C);
  }
}

void mla_attend_mha(const float* q, const float* wkv_b, int H, int dn, int dv, int C, int R, const float* kv,
                    int64_t n_kv, const int32_t* idx, int64_t n_idx, float scale, float* out, float* lse) {
  KESTREL_CHECK(H > 0 && dn > 0 && dv > 0 && C > 0 && R >= 0, "mla_attend_mha: bad shape H={} dn={} dv={} C={} R={}",
                H, dn, dv, C, R);
  const std::vector<int64_t> rows = attended_rows(n_kv, idx, n_idx);
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t row_width = static_cast<int64_t>(C) + R, q_width = static_cast<int64_t>(dn) + R;
  std::vector<float> key(static_cast<size_t>(q_width));
  std::vector<float> v_t(static_cast<size_t>(dv * n));  // this head's values, transposed: [dv, n]
  std::vector<float> scores(static_cast<size_t>(n));
  for (int h = 0; h < H; ++h) {
    const float* w_uk = wkv_b + static_cast<int64_t>(h) * (dn + dv) * C;
    const float* w_uv = w_uk + static_cast<int64_t>(dn) * C;
    const float* qh = q + h * q_width;
    for (int64_t t = 0; t < n; ++t) {
      const float* row = kv + rows[static_cast<size_t>(t)] * row_width;
      for (int i = 0; i < dn; ++i) key[static_cast<size_t>(i)] = dot(w_uk + static_cast<int64_t>(i) * C, row, C);
      std::copy(row + C, row + C + R, key.begin() + dn);
      scores[static_cast<size_t>(t)] = dot(qh, key.data(), q_width) * scale;
      for (int j = 0; j < dv; ++j) v_t[static_cast<size_t>(j * n + t)] = dot(w_uv + static_cast<int64_t>(j) * C, row, C);
    }
    softmax_weighted_sum(scores.data(), n, v_t.data(), dv, out + static_cast<int64_t>(h) * dv, lse + h);
  }
}

void hadamard_inplace(float* x, int n) {
  KESTREL_CHECK(n > 0 && (n & (n - 1)) == 0, "hadamard_inplace: n must be a power of two, got {}", n);
  for (int half = 1; half < n; half *= 2)
    for (int base = 0; base < n; base += 2 * half)
      for (int i = base; i < base + half; ++i) {
        const float a = x[i], b = x[i + half];
        x[i] = a + b;
        x[i + half] = a - b;
      }
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int i = 0; i < n; ++i) x[i] *= norm;
}

void indexer_scores(const uint8_t* q_codes, const float* w, int Hi, int D, const uint8_t* k_codes,
                    const float* k_scale, int64_t S, float* scores) {
  KESTREL_CHECK(Hi > 0 && D > 0 && S >= 0, "indexer_scores: bad shape Hi={} D={} S={}", Hi, D, S);
  // Every finite e4m3 value is an integer multiple of 2^-9 (the smallest subnormal), at most 448 * 2^9 of them.
  std::array<int32_t, 256> units{};
  std::array<bool, 256> is_nan{};
  for (int b = 0; b < 256; ++b) {
    const float v = e4m3_to_f32(static_cast<uint8_t>(b));
    is_nan[static_cast<size_t>(b)] = std::isnan(v);
    units[static_cast<size_t>(b)] = is_nan[static_cast<size_t>(b)] ? 0 : static_cast<int32_t>(v * 512.0f);
  }
  constexpr float kUnit2 = 1.0f / (1 << 18);  // 2^-9 * 2^-9, exact
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<int32_t> q_units(static_cast<size_t>(Hi) * D);
  std::vector<bool> q_nan(static_cast<size_t>(Hi), false);
  for (int j = 0; j < Hi; ++j)
    for (int d = 0; d < D; ++d) {
      const uint8_t code = q_codes[static_cast<int64_t>(j) * D + d];
      q_units[static_cast<size_t>(j) * D + d] = units[code];
      if (is_nan[code]) q_nan[static_cast<size_t>(j)] = true;
    }
  for (int64_t s = 0; s < S; ++s) {
    const uint8_t* ks = k_codes + s * D;
    bool k_nan = false;
    for (int d = 0; d < D; ++d) k_nan = k_nan || is_nan[ks[d]];
    float acc = 0.0f;
    for (int j = 0; j < Hi; ++j) {
      const int32_t* qj = q_units.data() + static_cast<int64_t>(j) * D;
      int64_t exact = 0;
      for (int d = 0; d < D; ++d) exact += static_cast<int64_t>(qj[d]) * units[ks[d]];
      // A NaN code poisons the score so that top-k never selects it (it ranks NaN as -inf).
      const float dot_js = (k_nan || q_nan[static_cast<size_t>(j)]) ? nan : static_cast<float>(exact) * kUnit2;
      const float relu = dot_js > 0.0f ? dot_js : (dot_js <= 0.0f ? 0.0f : dot_js);
      acc += w[j] * relu;
    }
    scores[s] = k_scale[s] * acc;
  }
}

void topk_indices(const float* scores, int64_t n, int k, int32_t* out) {
  KESTREL_CHECK(n >= 0 && n <= std::numeric_limits<int32_t>::max(), "topk_indices: bad candidate count {}", n);
  KESTREL_CHECK(k >= 0, "topk_indices: negative k {}", k);
  struct Candidate {
    float score;
    int32_t pos;
  };
  std::vector<Candidate> cand;
  cand.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float s = scores[i];
    if (std::isnan(s) || s == kNegInf) continue;
    // -0 and +0 compare equal below, so ties between them fall to position.
    cand.push_back({s, static_cast<int32_t>(i)});
  }
  // A total order: no two candidates are equivalent because positions are distinct.
  const auto ranks_before = [](const Candidate& a, const Candidate& b) {
    return a.score > b.score || (a.score == b.score && a.pos < b.pos);
  };
  const size_t taken = std::min(cand.size(), static_cast<size_t>(k));
  std::partial_sort(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(taken), cand.end(), ranks_before);
  for (size_t r = 0; r < taken; ++r) out[r] = cand[r].pos;
  std::fill(out + taken, out + k, -1);
}

}  // namespace kestrel::cpu
