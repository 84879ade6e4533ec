#include "kernels/cpu/fp8_linear.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/basic.h"

namespace kestrel::cpu {

namespace {

// Work split of linear_fp8_block_quantized: a task owns kTaskCols weight rows and up to kTaskRows rows of x, and
// walks the groups in order with that weight block (kTaskCols x 128 values, 32 KB) in cache.
constexpr int64_t kTaskCols = 64;
constexpr int64_t kTaskRows = 256;

const std::array<float, 256>& e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = e4m3_to_f32(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

// The exact sums of x[k] * w_r[k] over one group (len <= 128 e4m3 values) for kDotRows rows w_r = w + r * ldw: each
// fp32 product is exact and the double sums hold every partial sum exactly, so the order of the additions (spread
// over vector lanes here) does not matter, and neither does the instruction set: the AVX clones (picked at run time)
// give the same bits as the baseline x86-64 code, as the build's no -march rule asks of the reference.
constexpr int kDotRows = 8;

__attribute__((target_clones("avx512f", "avx2", "default"))) void exact_group_dots(const float* x, const float* w,
                                                                                 int64_t ldw, int64_t len,
                                                                                 double (&out)[kDotRows]) {
  const float *w0 = w, *w1 = w + ldw, *w2 = w + 2 * ldw, *w3 = w + 3 * ldw;
  const float *w4 = w + 4 * ldw, *w5 = w + 5 * ldw, *w6 = w + 6 * ldw, *w7 = w + 7 * ldw;
  double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0, a4 = 0.0, a5 = 0.0, a6 = 0.0, a7 = 0.0;
#pragma omp simd reduction(+ : a0, a1, a2, a3, a4, a5, a6, a7)
  for (int64_t k = 0; k < len; ++k) {
    const float v = x[k];
    a0 += static_cast<double>(v * w0[k]);
    a1 += static_cast<double>(v * w1[k]);
    a2 += static_cast<double>(v * w2[k]);
    a3 += static_cast<double>(v * w3[k]);
    a4 += static_cast<double>(v * w4[k]);
    a5 += static_cast<double>(v * w5[k]);
    a6 += static_cast<double>(v * w6[k]);
    a7 += static_cast<double>(v * w7[k]);
  }
  out[0] = a0;
  out[1] = a1;
  out[2] = a2;
  out[3] = a3;
  out[4] = a4;
  out[5] = a5;
  out[6] = a6;
  out[7] = a7;
}

void check_shape(const char* fn, int64_t M, int64_t K, int64_t N) {
  KESTREL_CHECK(M >= 0, "{}: M = {} must be non-negative", fn, M);
  KESTREL_CHECK(K >= 1 && N >= 1, "{}: K = {} and N = {} must be at least 1", fn, K, N);
}

}  // namespace

float fp8_group_scale(float amax) { return std::fmax(amax, kFp8ScaleFloor) / kE4m3Max; }

void quantize_fp8_groups(const float* x, int64_t M, int64_t K, int64_t ldx, uint8_t* codes, float* scales) {
  KESTREL_CHECK(M >= 0 && K >= 1, "quantize_fp8_groups: M = {} must be non-negative and K = {} at least 1", M, K);
  KESTREL_CHECK(ldx >= K, "quantize_fp8_groups: ldx = {} must be >= K = {}", ldx, K);
  const int64_t G = fp8_groups(K);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * ldx;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t k0 = g * kFp8Group, k1 = std::min(K, k0 + kFp8Group);
      float amax = 0.0f;
      for (int64_t k = k0; k < k1; ++k) amax = std::fmax(amax, std::fabs(row[k]));
      const float s = fp8_group_scale(amax);
      scales[m * G + g] = s;
      for (int64_t k = k0; k < k1; ++k) codes[m * K + k] = f32_to_e4m3(row[k] / s);
    }
  }
}

void linear_fp8_block_quantized(const uint8_t* x_codes, const float* x_scales, int64_t M, int64_t K,
                                const uint8_t* w_codes, const float* w_scales, int64_t N, float* y) {
  check_shape("linear_fp8_block_quantized", M, K, N);
  if (M == 0) return;
  const int64_t G = fp8_groups(K);
  const std::array<float, 256>& value = e4m3_values();
  std::vector<float> xv(static_cast<size_t>(M * K));
  for (int64_t i = 0; i < M * K; ++i) xv[i] = value[x_codes[i]];

  const int64_t col_tasks = (N + kTaskCols - 1) / kTaskCols, row_tasks = (M + kTaskRows - 1) / kTaskRows;
  const bool parallel = M * N * K >= (int64_t{1} << 20);
#pragma omp parallel for collapse(2) schedule(dynamic) if (parallel)
  for (int64_t ct = 0; ct < col_tasks; ++ct) {
    for (int64_t rt = 0; rt < row_tasks; ++rt) {
      const int64_t n0 = ct * kTaskCols, cols = std::min(kTaskCols, N - n0);
      const int64_t m0 = rt * kTaskRows, rows = std::min(kTaskRows, M - m0);
      std::vector<float> wv(static_cast<size_t>((cols + kDotRows - 1) / kDotRows * kDotRows * K), 0.0f);
      for (int64_t j = 0; j < cols * K; ++j) wv[j] = value[w_codes[n0 * K + j]];
      std::vector<float> acc(static_cast<size_t>(rows * cols), 0.0f);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t k0 = g * kFp8Group, len = std::min<int64_t>(kFp8Group, K - k0);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t m = m0 + i;
          const float sx = x_scales[m * G + g];
          const float* xr = xv.data() + m * K + k0;
          for (int64_t j0 = 0; j0 < cols; j0 += kDotRows) {
            // Rows past the weight's end (cols % 4 != 0) read the task's zero padding and are not stored.
            double sums[kDotRows];
            exact_group_dots(xr, wv.data() + j0 * K + k0, K, len, sums);
            for (int r = 0; r < kDotRows && j0 + r < cols; ++r) {
              const int64_t n = n0 + j0 + r;
              const float s = sx * w_scales[(n / kFp8Group) * G + g];
              float& a = acc[i * cols + j0 + r];
              a = a + s * static_cast<float>(sums[r]);
            }
          }
        }
      }
      for (int64_t i = 0; i < rows; ++i)
        std::copy_n(acc.data() + i * cols, cols, y + (m0 + i) * N + n0);
    }
  }
}

void linear_fp8_block(const float* x, int64_t M, int64_t K, const uint8_t* w_codes, const float* w_scales, int64_t N,
                      float* y) {
  check_shape("linear_fp8_block", M, K, N);
  std::vector<uint8_t> codes(static_cast<size_t>(M * K));
  std::vector<float> scales(static_cast<size_t>(M * fp8_groups(K)));
  quantize_fp8_groups(x, M, K, K, codes.data(), scales.data());
  linear_fp8_block_quantized(codes.data(), scales.data(), M, K, w_codes, w_scales, N, y);
}

void expert_ffn_fp8_block(const float* x, int64_t T, int64_t D, int64_t F, const uint8_t* w13_codes,
                          const float* w13_scales, const uint8_t* w2_codes, const float* w2_scales, float* y) {
  KESTREL_CHECK(T >= 0, "expert_ffn_fp8_block: T = {} must be non-negative", T);
  KESTREL_CHECK(D > 0 && F > 0 && D % kFp8Group == 0 && F % kFp8Group == 0,
                "expert_ffn_fp8_block: D = {} and F = {} must be positive multiples of {}", D, F, kFp8Group);
  std::vector<float> gate_up(static_cast<size_t>(T * 2 * F)), h(static_cast<size_t>(T * F));
  linear_fp8_block(x, T, D, w13_codes, w13_scales, 2 * F, gate_up.data());
  for (int64_t t = 0; t < T; ++t) {
    const float* row = gate_up.data() + t * 2 * F;
    swiglu(row, row + F, h.data() + t * F, F);
  }
  linear_fp8_block(h.data(), T, F, w2_codes, w2_scales, D, y);
}

}  // namespace kestrel::cpu
