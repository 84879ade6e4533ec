#include "kernels/cpu/basic.h"

#include <cmath>

namespace kestrel::cpu {

namespace {
constexpr int kLanes = 8;

inline float reduce_lanes(const float (&acc)[kLanes]) {
  const float a = acc[0] + acc[4], b = acc[1] + acc[5], c = acc[2] + acc[6], d = acc[3] + acc[7];
  return (a + c) + (b + d);
}
}  // namespace

float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  return reduce_lanes(acc);
}

float sum(const float* a, int64_t n) {
  float acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l];
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i];
  return reduce_lanes(acc);
}

float sum_sq(const float* a, int64_t n) { return dot(a, a, n); }

void linear(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N) {
  if (M * N * K < (1 << 16)) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] = dot(x + m * K, w + n * K, K);
    return;
  }
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * N + n] = dot(x + m * K, w + n * K, K);
}

void rms_norm(const float* x, const float* w, float* y, int64_t M, int64_t D, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    const float inv = 1.0f / std::sqrt(sum_sq(xr, D) / static_cast<float>(D) + eps);
    for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * inv * w[i];
  }
}

void layer_norm(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t D, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * D;
    float* yr = y + m * D;
    const float mean = sum(xr, D) / static_cast<float>(D);
    float acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < D; ++i) {
      const float d = xr[i] - mean;
      acc[i % kLanes] += d * d;
    }
    const float var = reduce_lanes(acc) / static_cast<float>(D);
    const float inv = 1.0f / std::sqrt(var + eps);
    for (int64_t i = 0; i < D; ++i) yr[i] = (xr[i] - mean) * inv * w[i] + b[i];
  }
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
float silu(float x) { return x * sigmoid(x); }
float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = silu(gate[i]) * up[i];
}

void l2_normalize_rows(float* x, int64_t rows, int64_t d, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * d;
    const float inv = 1.0f / std::sqrt(sum_sq(xr, d) + eps);
    for (int64_t i = 0; i < d; ++i) xr[i] *= inv;
  }
}

}  // namespace kestrel::cpu
