// The FP8 block-scaled linear (gemm_fp8.h) against the CPU's dequantised weight (kestrel::e4m3_to_f32(code) * scale,
// what WeightLoader::linear computes) times the bf16 activations, summed in double, on fresh random codes, scales
// and activations: odd N and K (not multiples of the 128 block or of the kernel's 4-row and 128-column tiles), K
// with and without the 16-byte alignment of the vectorised path, M from 1 to more than the rows of one pass.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cuda/gemm_fp8.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device"

// Error bound, relative to the row's sum over k of |x[m, k]| |W[n, k]|. Every product x * e4m3 is exact in fp32;
// a term then meets at most 16 fused adds in its lane's 16-column piece, one fused scale * piece + sum per step of
// its warp (K / 1024 of them), 3 adds across the lanes of a row and 7 across the warps, and the reference's weight
// e4m3 * scale is itself rounded once: at most 27 + K / 1024 roundings of 2^-24 relative to that sum (under 2.6e-6
// up to K = 16384).
constexpr double kRelBound = 1e-5;

struct Fp8Weight {
  int64_t N = 0, K = 0;
  int block = 128;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<float> dequant;  // the CPU's fp32 weight: e4m3_to_f32(code) * scale

  Fp8Weight(int64_t n, int64_t k, int b, std::mt19937& rng) : N(n), K(k), block(b) {
    const int64_t rb = (N + block - 1) / block, cb = (K + block - 1) / block;
    std::uniform_int_distribution<int> byte(0, 255);
    codes.resize(static_cast<size_t>(N * K));
    for (uint8_t& c : codes) {
      do c = static_cast<uint8_t>(byte(rng));
      while ((c & 0x7F) == 0x7F);  // not NaN
    }
    // Scales with full fp32 mantissas (not powers of two), so that e4m3 * scale is rounded in fp32.
    std::uniform_real_distribution<float> mant(1.0f, 2.0f);
    std::uniform_int_distribution<int> expo(-14, -6);
    scales.resize(static_cast<size_t>(rb * cb));
    for (float& s : scales) s = std::ldexp(mant(rng), expo(rng));
    dequant.resize(codes.size());
    for (int64_t r = 0; r < N; ++r)
      for (int64_t c = 0; c < K; ++c)
        dequant[r * K + c] = e4m3_to_f32(codes[r * K + c]) * scales[(r / block) * cb + c / block];
  }
};

std::vector<uint16_t> random_x(int64_t M, int64_t ldx, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(M * ldx));
  for (uint16_t& v : x) v = f32_to_bf16(normal(rng));
  return x;
}

struct Device {
  DeviceBuffer<uint8_t> codes;
  DeviceBuffer<float> scales;
  Fp8BlockMatrix view;
  explicit Device(const Fp8Weight& w) : codes(to_device(w.codes)), scales(to_device(w.scales)) {
    view = {codes.get(), scales.get(), w.N, w.K, w.block};
  }
};

std::vector<float> run_fp32(const Device& w, const std::vector<uint16_t>& x, int64_t M, int64_t ldx, int64_t ldy) {
  DeviceBuffer<uint16_t> dx = to_device(x);
  DeviceBuffer<float> dy(static_cast<size_t>(std::max<int64_t>(M * ldy, 1)));
  linear_fp8(dx.get(), M, ldx, w.view, dy.get(), ldy, nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  return to_host(dy);
}

// Checks y (leading dimension ldy) against the double-precision sum over the CPU's weight.
void expect_near_reference(const Fp8Weight& w, const std::vector<uint16_t>& x, int64_t M, int64_t ldx,
                           const std::vector<float>& y, int64_t ldy) {
  int bad = 0;
  double worst = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < w.N; ++n) {
      double ref = 0, mag = 0;
      for (int64_t k = 0; k < w.K; ++k) {
        const double p = static_cast<double>(bf16_to_f32(x[m * ldx + k])) * w.dequant[n * w.K + k];
        ref += p;
        mag += std::fabs(p);
      }
      const double err = std::fabs(y[m * ldy + n] - ref) / std::max(mag, 1e-30);
      worst = std::max(worst, err);
      if (!(err <= kRelBound) && bad++ < 5)
        ADD_FAILURE() << "y[" << m << ", " << n << "] = " << y[m * ldy + n] << ", reference " << ref
                      << " (relative to sum |x||w| " << mag << ": " << err << ")";
    }
  EXPECT_EQ(bad, 0) << "worst relative error " << worst;
}

struct Shape {
  int64_t N, K;
  int block;
};

TEST(GemmFp8, MatchesDequantisedWeightForOddShapes) {
  SKIP_WITHOUT_GPU();
  // K = 200: not a multiple of 16 (the byte-wise path); 272 and 400: multiples of 16 with a partial 128-column
  // step and scale block (the vectorised path); block 32: several scale blocks inside one 128-column step. Blocks
  // 48, 80 and 144 are not powers of two: the kernel finds a piece's scale column by a 32-bit division, not a
  // shift.
  const Shape shapes[] = {{300, 200, 128}, {300, 272, 128}, {129, 400, 128}, {77, 400, 32},  {5, 1040, 128},
                          {77, 400, 48},   {50, 1040, 80},  {40, 2064, 144}};
  std::mt19937 rng(41);
  for (const Shape& s : shapes) {
    const Fp8Weight w(s.N, s.K, s.block, rng);
    const Device dw(w);
    for (int64_t M : {1, 3, 17, 64, 130}) {
      SCOPED_TRACE(testing::Message() << "N=" << s.N << " K=" << s.K << " block=" << s.block << " M=" << M);
      const std::vector<uint16_t> x = random_x(M, s.K, rng);
      expect_near_reference(w, x, M, s.K, run_fp32(dw, x, M, s.K, s.N), s.N);
    }
  }
}

TEST(GemmFp8, MatchesDequantisedWeightAtModelSizes) {
  SKIP_WITHOUT_GPU();
  // 2048 x 7168 (the up/gate projection of DeepSeek-V3.2's 2048-wide experts): the vectorised path with 7 steps of
  // codes in flight per lane, M = 16 as two passes of 8 rows. K = 16400: more steps per warp than one batch of loads
  // (8), and a last step that only its first lanes reach. K = 5000 (not a multiple of 16: the byte-wise path, whose batch is 4 steps
  // a warp, 4096 columns): a second batch of loads, with a last 16-column piece that holds only 8 columns.
  const Shape shapes[] = {{2048, 7168, 128}, {40, 16400, 128}, {40, 5000, 128}};
  std::mt19937 rng(45);
  for (const Shape& s : shapes) {
    const Fp8Weight w(s.N, s.K, s.block, rng);
    const Device dw(w);
    for (int64_t M : {1, 4, 16}) {
      SCOPED_TRACE(testing::Message() << "N=" << s.N << " K=" << s.K << " M=" << M);
      const std::vector<uint16_t> x = random_x(M, s.K, rng);
      expect_near_reference(w, x, M, s.K, run_fp32(dw, x, M, s.K, s.N), s.N);
    }
  }
}

TEST(GemmFp8, VectorisedAndByteWisePathsGiveTheSameBits) {
  SKIP_WITHOUT_GPU();
  // Both paths add the same products in the same order; only the loads differ. The same x as K-wide rows takes the
  // vectorised path, shifted by 4 elements (8-byte aligned, not 16) the byte-wise path, and as rows of ldx = K + 3
  // the byte-wise path except at M = 1 (one row: ldx is not used, so the vectorised path); each call's path is
  // asserted through the dispatch's own condition.
  std::mt19937 rng(46);
  const Fp8Weight w(37, 1040, 128, rng);
  const Device dw(w);
  for (int64_t M : {1, 2, 3, 5}) {
    SCOPED_TRACE(testing::Message() << "M=" << M);
    const std::vector<uint16_t> x = random_x(M, w.K, rng);
    // y for x laid out as `host` (row r of x at host[offset + r * ldx]), after asserting which path the call takes.
    auto run = [&](const std::vector<uint16_t>& host, int64_t offset, int64_t ldx, bool vectorised) {
      DeviceBuffer<uint16_t> dx = to_device(host);
      EXPECT_EQ(detail::linear_fp8_vectorised(dx.get() + offset, M, ldx, dw.view), vectorised)
          << "offset " << offset << ", ldx " << ldx;
      DeviceBuffer<float> dy(static_cast<size_t>(M * w.N));
      linear_fp8(dx.get() + offset, M, ldx, dw.view, dy.get(), w.N, nullptr);
      return to_host(dy);
    };
    const std::vector<float> vec = run(x, 0, w.K, true);
    expect_near_reference(w, x, M, w.K, vec, w.N);
    std::vector<uint16_t> wide(static_cast<size_t>(M * (w.K + 3)), 0);
    for (int64_t m = 0; m < M; ++m) std::copy_n(x.begin() + m * w.K, w.K, wide.begin() + m * (w.K + 3));
    const std::vector<float> strided = run(wide, 0, w.K + 3, M == 1);
    std::vector<uint16_t> shifted(4 + x.size(), 0);
    std::copy(x.begin(), x.end(), shifted.begin() + 4);
    const std::vector<float> offset = run(shifted, 4, w.K, false);
    for (int64_t i = 0; i < M * w.N; ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(strided[i]), std::bit_cast<uint32_t>(vec[i])) << "ldx = K + 3, at " << i;
      ASSERT_EQ(std::bit_cast<uint32_t>(offset[i]), std::bit_cast<uint32_t>(vec[i])) << "x + 4, at " << i;
    }
  }
}

TEST(GemmFp8, StridedRowsAndUntouchedPadding) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(42);
  const Fp8Weight w(70, 256, 128, rng);
  const Device dw(w);
  // ldx > K (rows of a wider buffer; ldx = 264 keeps the vectorised path, which needs ldx % 8 == 0, 260 and 257 do
  // not) and ldy > N: the columns of y past N keep their bits. The columns of x past K are NaN: a read of any of
  // them would make its row's outputs NaN.
  for (int64_t ldx : {264, 260, 257}) {
    SCOPED_TRACE(testing::Message() << "ldx=" << ldx);
    const int64_t M = 9, ldy = 75;
    std::vector<uint16_t> x = random_x(M, ldx, rng);
    for (int64_t m = 0; m < M; ++m) std::fill(x.begin() + m * ldx + w.K, x.begin() + (m + 1) * ldx, uint16_t{0x7FC0});
    DeviceBuffer<uint16_t> dx = to_device(x);
    EXPECT_EQ(detail::linear_fp8_vectorised(dx.get(), M, ldx, dw.view), ldx % 8 == 0);
    std::vector<float> y0(static_cast<size_t>(M * ldy), -7.5f);
    DeviceBuffer<float> dy = to_device(y0);
    linear_fp8(dx.get(), M, ldx, dw.view, dy.get(), ldy, nullptr);
    const std::vector<float> y = to_host(dy);
    expect_near_reference(w, x, M, ldx, y, ldy);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = w.N; n < ldy; ++n) EXPECT_EQ(y[m * ldy + n], -7.5f);
  }
}

TEST(GemmFp8, SameBitsForEveryRowCount) {
  SKIP_WITHOUT_GPU();
  // A row's sum does not depend on the other rows of the call (the passes of 1, 2, 4 or 8 rows add in the same
  // order), so decode steps of different batch sizes give the same bits.
  std::mt19937 rng(43);
  const Fp8Weight w(131, 528, 128, rng);
  const Device dw(w);
  const int64_t M = 130;
  const std::vector<uint16_t> x = random_x(M, w.K, rng);
  const std::vector<float> all = run_fp32(dw, x, M, w.K, w.N);
  for (int64_t m : {1, 2, 3, 5, 8}) {
    const std::vector<float> part = run_fp32(dw, std::vector<uint16_t>(x.begin(), x.begin() + m * w.K), m, w.K, w.N);
    for (int64_t i = 0; i < m * w.N; ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(part[i]), std::bit_cast<uint32_t>(all[i])) << "M=" << m << " at " << i;
  }
}

TEST(GemmFp8, Bf16OutputIsTheFp32OutputRounded) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(44);
  // K = 200: the byte-wise path; K = 256: the vectorised one.
  for (int64_t K : {200, 256}) {
    const Fp8Weight w(96, K, 128, rng);
    const Device dw(w);
    for (int64_t M : {1, 6, 20}) {
      SCOPED_TRACE(testing::Message() << "K=" << K << " M=" << M);
      const std::vector<uint16_t> x = random_x(M, w.K, rng);
      const std::vector<float> y32 = run_fp32(dw, x, M, w.K, w.N);
      DeviceBuffer<uint16_t> dx = to_device(x), dy(static_cast<size_t>(M * w.N));
      EXPECT_EQ(detail::linear_fp8_vectorised(dx.get(), M, w.K, dw.view), K % 16 == 0);
      linear_fp8_bf16(dx.get(), M, w.K, dw.view, dy.get(), w.N, nullptr);
      const std::vector<uint16_t> y16 = to_host(dy);
      for (size_t i = 0; i < y16.size(); ++i) ASSERT_EQ(y16[i], f32_to_bf16(y32[i])) << "at " << i;
    }
  }
}

TEST(GemmFp8, VectorisedPathCondition) {
  // Host-side only (the pointers are never dereferenced): 16-byte loads need K % 16 == 0, codes and x 16-byte
  // aligned, and rows of x 16-byte apart unless there is one row.
  const auto* x = reinterpret_cast<const uint16_t*>(uintptr_t{4096});
  const Fp8BlockMatrix w{reinterpret_cast<const uint8_t*>(uintptr_t{8192}), nullptr, 8, 1040, 128};
  EXPECT_TRUE(detail::linear_fp8_vectorised(x, 5, 1040, w));
  EXPECT_TRUE(detail::linear_fp8_vectorised(x, 1, 1043, w));
  EXPECT_FALSE(detail::linear_fp8_vectorised(x, 2, 1043, w));
  EXPECT_FALSE(detail::linear_fp8_vectorised(x + 4, 1, 1040, w));
  Fp8BlockMatrix shifted = w;
  shifted.codes += 8;
  EXPECT_FALSE(detail::linear_fp8_vectorised(x, 1, 1040, shifted));
  Fp8BlockMatrix odd_k = w;
  odd_k.K = 1036;
  EXPECT_FALSE(detail::linear_fp8_vectorised(x, 1, 1040, odd_k));
}

TEST(GemmFp8, RejectsBadArguments) {
  // Argument checks run before anything touches the device.
  Fp8BlockMatrix w{nullptr, nullptr, 8, 32, 128};
  float* y = nullptr;
  EXPECT_NO_THROW(linear_fp8(nullptr, 0, 32, w, y, 8, nullptr));  // M = 0: nothing to do
  EXPECT_THROW(linear_fp8(nullptr, 1, 32, w, y, 8, nullptr), Error);  // pointers unset
  EXPECT_THROW(linear_fp8(nullptr, 0, 31, w, y, 8, nullptr), Error);  // ldx < K
  EXPECT_THROW(linear_fp8(nullptr, 0, 32, w, y, 7, nullptr), Error);  // ldy < N
  EXPECT_THROW(linear_fp8(nullptr, -1, 32, w, y, 8, nullptr), Error);
  w.block = 24;
  EXPECT_THROW(linear_fp8(nullptr, 0, 32, w, y, 8, nullptr), Error);  // not a multiple of 16
  w.block = 128;
  w.K = 0;
  EXPECT_THROW(linear_fp8(nullptr, 0, 0, w, y, 8, nullptr), Error);
}

}  // namespace
}  // namespace kestrel::cuda
