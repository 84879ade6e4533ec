// Helpers of the FP8 block-scaled GPU tests (gemm_fp8_block_test, moe_cuda_test): fast random codes and scales for
// weights of real size, the error bound of gemm_fp8_block.h and an every-element comparison against it.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "core/formats.h"
#include "kernels/cpu/fp8_linear.h"

namespace kestrel::cuda::fp8_check {

// The bound's tensor-core terms (gemm_fp8_block.h).
constexpr double kMmaC = 0x1p-15;      // this library's kernel: f16 MMAs, fp32 accumulation
constexpr double kCublasLtC = 0x1p-10;  // cuBLASLt's FP8 MMAs

inline uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// n uniformly random e4m3 codes, NaN codes (0x7F, 0xFF) replaced by +-448; in parallel, the same bytes for a seed.
inline void random_codes(uint8_t* codes, int64_t n, uint64_t seed) {
  constexpr int64_t kChunk = int64_t{1} << 20;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < (n + kChunk - 1) / kChunk; ++c) {
    uint64_t s = seed * 0x100000001B3ull + static_cast<uint64_t>(c);
    for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); i += 8) {
      uint64_t r = splitmix64(s);
      for (int64_t j = i; j < std::min(i + 8, n); ++j, r >>= 8) {
        const uint8_t b = static_cast<uint8_t>(r);
        codes[j] = (b & 0x7F) == 0x7F ? static_cast<uint8_t>(b - 1) : b;
      }
    }
  }
}

// Block scales with full fp32 mantissas in [2^lo, 2^(hi+1)).
inline std::vector<float> random_scales(int64_t n, uint64_t seed, int lo, int hi) {
  std::vector<float> s(static_cast<size_t>(n));
  uint64_t st = seed;
  for (float& v : s) {
    const uint64_t r = splitmix64(st);
    const float mantissa = 1.0f + static_cast<float>(r & 0xFFFFFF) / 16777216.0f;
    v = std::ldexp(mantissa, lo + static_cast<int>((r >> 32) % static_cast<uint64_t>(hi - lo + 1)));
  }
  return s;
}

// Activations [M, ld]: uniform in (-1, 1) times a per-group magnitude 2^-6 .. 2^6, one group in 16 all zero.
inline std::vector<float> random_activations(int64_t M, int64_t K, int64_t ld, uint64_t seed) {
  std::vector<float> x(static_cast<size_t>(M * ld), 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(m);
    for (int64_t g = 0; g * 128 < K; ++g) {
      const uint64_t r = splitmix64(s);
      if (r % 16 == 0) continue;
      const float magnitude = std::ldexp(1.0f, static_cast<int>((r >> 8) % 13) - 6);
      for (int64_t k = 128 * g; k < std::min(K, 128 * g + 128); ++k) {
        const uint64_t u = splitmix64(s);
        x[m * ld + k] = magnitude * (static_cast<float>(u >> 40) / 8388608.0f - 1.0f);
      }
    }
  }
  return x;
}

// An upper bound of A[m, n] = sum_g |s_x s_w| sum_{k in g} |e4m3(cx) e4m3(cw)| by Cauchy-Schwarz per group
// (||cx_g|| ||cw_g||): M N G operations instead of M N K. Operands as cpu::linear_fp8_block_quantized's.
inline std::vector<double> magnitude_bound(const uint8_t* xc, const float* xs, int64_t M, int64_t K, const uint8_t* wc,
                                           const float* ws, int64_t N) {
  const int64_t G = cpu::fp8_groups(K);
  auto norms = [&](const uint8_t* c, const float* s, int64_t rows, int64_t scale_rows_per_row) {
    std::vector<double> out(static_cast<size_t>(rows * G));
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < G; ++g) {
        double sq = 0.0;
        for (int64_t k = 128 * g; k < std::min(K, 128 * g + 128); ++k) {
          const double v = e4m3_to_f32(c[r * K + k]);
          sq += v * v;
        }
        out[r * G + g] = std::fabs(static_cast<double>(s[(r / scale_rows_per_row) * G + g])) * std::sqrt(sq);
      }
    return out;
  };
  const std::vector<double> nx = norms(xc, xs, M, 1), nw = norms(wc, ws, N, 128);
  std::vector<double> a(static_cast<size_t>(M * N));
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double sum = 0.0;
      for (int64_t g = 0; g < G; ++g) sum += nx[m * G + g] * nw[n * G + g];
      a[m * N + n] = sum;
    }
  return a;
}

// The bound of gemm_fp8_block.h for one output: c A + (2 G + 4) 2^-24 A.
inline double linear_bound(double a, int64_t K, double c) {
  return (c + static_cast<double>(2 * cpu::fp8_groups(K) + 4) * 0x1p-24) * a;
}

// Compares got[i * ld_got + j] with want[i * cols + j] for i < rows, j < cols against bound(i, j); returns the largest
// |got - want| / scale(i, j) (scale = what the bound multiplies) for the report, and fails the test on the first
// few elements out of bounds (every element is checked).
template <typename Bound>
double expect_within(const char* what, const float* got, int64_t ld_got, const float* want, int64_t rows, int64_t cols,
                     Bound bound) {
  int64_t bad = 0;
  double worst = 0.0;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const double g = got[i * ld_got + j], w = want[i * cols + j], b = bound(i, j);
      const double err = std::fabs(g - w);
      if (!(err <= b)) {
        if (bad < 5)
          ADD_FAILURE() << what << ": element (" << i << ", " << j << ") = " << g << ", reference " << w
                        << ", error " << err << " > bound " << b;
        ++bad;
      } else if (b > 0) {
        worst = std::max(worst, err / b);
      }
    }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << rows * cols << " elements out of bounds";
  return worst;
}

}  // namespace kestrel::cuda::fp8_check
