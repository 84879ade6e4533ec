// GPU GEMMs (gemm.h: cuBLASLt and the plain fallback kernel) and dense ops (ops.h) against the CPU reference
// (kestrel::cpu::linear and the functions of src/kernels/cpu/basic.h, kestrel::f32_to_bf16) on fresh random inputs.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/basic.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (device_count() == 0) GTEST_SKIP() << "no CUDA device"

// Half a bf16 ulp relative to the value: the largest relative error of rounding an fp32 value to bf16 (nearest
// even; 8 significant bits, so an ulp is 2^-7 of the power of two below the value).
constexpr double kBf16HalfUlp = 1.0 / 256;

std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng, float std_dev = 1.0f) {
  std::normal_distribution<float> normal(0.0f, std_dev);
  std::vector<uint16_t> v(n);
  for (uint16_t& e : v) e = f32_to_bf16(normal(rng));
  return v;
}

std::vector<float> random_f32(size_t n, std::mt19937& rng, float mean = 0.0f, float std_dev = 1.0f) {
  std::normal_distribution<float> normal(mean, std_dev);
  std::vector<float> v(n);
  for (float& e : v) e = normal(rng);
  return v;
}

uint32_t bits(float x) { return std::bit_cast<uint32_t>(x); }

// Whether nearly all of `total` bf16 results equal the fp32 reference rounded to bf16: results ~1e-7 (relative) away
// from the reference land on another bf16 value only when they straddle a rounding boundary, a chance of about
// 2^8 * 1e-7 each, while a conversion that truncated instead of rounding to nearest would miss about half.
testing::AssertionResult mostly_exact(int64_t exact, int64_t total) {
  if (total - exact <= 1 + total / 50) return testing::AssertionSuccess();
  return testing::AssertionFailure() << "only " << exact << " of " << total
                                     << " bf16 results equal the reference rounded to bf16";
}

// ------------------------------------------------------------------------------------------------------ GEMM

// Which entry point a case goes through.
enum class Api { kLinear, kLinearBf16, kBatched, kRun };

// A GEMM case; zero leading dimensions and strides mean packed (rows of K or N, batches one matrix after another).
struct GemmCase {
  std::string name;
  Api api;
  int64_t M, N, K;
  int64_t batch = 1;
  bool transpose_w = true;
  bool y_bf16 = false;
  bool accumulate = false;
  int64_t ldx = 0, ldw = 0, ldy = 0;
  int64_t stride_x = 0, stride_w = 0, stride_y = 0;
  int64_t x_offset = 0;  // elements: x starts this far into its buffer (2-byte aligned when odd)
};

// Elements spanned by `batch` matrices of `rows` rows of `cols` with leading dimension ld, `stride` apart.
int64_t span(int64_t batch, int64_t stride, int64_t rows, int64_t ld, int64_t cols) {
  return rows == 0 || batch == 0 ? 0 : (batch - 1) * stride + (rows - 1) * ld + cols;
}

// Host data of one case, its device copies, and the CPU reference.
class GemmCheck {
 public:
  GemmCheck(const GemmCase& c, uint32_t seed) : c_(c) {
    if (c.api == Api::kLinearBf16) c_.y_bf16 = true;
    GemmProblem& p = p_;
    p.M = c.M;
    p.N = c.N;
    p.K = c.K;
    p.batch = c.batch;
    p.transpose_w = c.transpose_w;
    p.y_bf16 = c_.y_bf16;
    p.accumulate = c.accumulate;
    p.ldx = c.ldx ? c.ldx : c.K;
    p.ldw = c.ldw ? c.ldw : (c.transpose_w ? c.K : c.N);
    p.ldy = c.ldy ? c.ldy : c.N;
    const int64_t w_rows = c.transpose_w ? c.N : c.K, w_cols = c.transpose_w ? c.K : c.N;
    p.stride_x = c.stride_x ? c.stride_x : c.M * p.ldx;
    p.stride_w = c.stride_w ? c.stride_w : w_rows * p.ldw;
    p.stride_y = c.stride_y ? c.stride_y : c.M * p.ldy;

    // Every element of the buffers is random, the gaps between rows and batches included: a kernel that reads one
    // gets a wrong sum, one that writes one changes a value checked to stay put.
    std::mt19937 rng(seed);
    x_ = random_bf16(static_cast<size_t>(c.x_offset + span(c.batch, p.stride_x, c.M, p.ldx, c.K)), rng);
    w_ = random_bf16(static_cast<size_t>(span(c.batch, p.stride_w, w_rows, p.ldw, w_cols)), rng);
    const size_t y_size = static_cast<size_t>(span(c.batch, p.stride_y, c.M, p.ldy, c.N));
    y0_.resize(y_size);
    for (float& v : y0_) v = round_to_bf16(std::normal_distribution<float>(0.0f, 4.0f)(rng));
    x_dev_ = to_device(x_);
    w_dev_ = to_device(w_);
    if (c_.y_bf16) {
      y_bf16_dev_ = DeviceBuffer<uint16_t>(y_size);
    } else {
      y_f32_dev_ = DeviceBuffer<float>(y_size);
    }
    p.x = x_dev_.get() + c.x_offset;
    p.w = w_dev_.get();
    p.y = c_.y_bf16 ? static_cast<void*>(y_bf16_dev_.get()) : static_cast<void*>(y_f32_dev_.get());
    compute_reference();
  }

  const GemmProblem& problem() const { return p_; }

  void reset_y() {
    if (c_.y_bf16) {
      std::vector<uint16_t> b(y0_.size());
      for (size_t i = 0; i < b.size(); ++i) b[i] = f32_to_bf16(y0_[i]);
      y_bf16_dev_.upload(b.data());
    } else {
      y_f32_dev_.upload(y0_.data());
    }
  }

  std::vector<float> y() const {
    if (!c_.y_bf16) return to_host(y_f32_dev_);
    const std::vector<uint16_t> b = to_host(y_bf16_dev_);
    std::vector<float> v(b.size());
    for (size_t i = 0; i < b.size(); ++i) v[i] = bf16_to_f32(b[i]);
    return v;
  }

  // Runs the case through its entry point of `gemm`.
  void run(Gemm& gemm) {
    const GemmProblem& p = p_;
    float* y = static_cast<float*>(p.y);
    switch (c_.api) {
      case Api::kLinear:
        ASSERT_TRUE(p.batch == 1 && p.transpose_w && !p.y_bf16);
        gemm.linear(p.x, p.M, p.K, p.ldx, p.w, p.N, y, p.ldy, nullptr, p.accumulate);
        break;
      case Api::kLinearBf16:
        ASSERT_TRUE(p.batch == 1 && p.transpose_w && p.y_bf16 && !p.accumulate);
        gemm.linear_bf16(p.x, p.M, p.K, p.ldx, p.w, p.N, static_cast<uint16_t*>(p.y), p.ldy, nullptr);
        break;
      case Api::kBatched:
        ASSERT_TRUE(!p.y_bf16 && !p.accumulate);
        gemm.batched(p.x, p.ldx, p.stride_x, p.w, p.ldw, p.stride_w, p.transpose_w, y, p.ldy, p.stride_y, p.M, p.N,
                     p.K, p.batch, nullptr);
        break;
      case Api::kRun:
        gemm.run(p, nullptr);
        break;
    }
  }

  // Outputs within the bound of the reference; every other element of y unchanged. With a bf16 output, nearly
  // every element also equals the reference rounded to bf16 (see the bound below).
  void expect_matches(const std::vector<float>& got) const {
    ASSERT_EQ(got.size(), y0_.size());
    int64_t bad = 0, exact_bf16 = 0, outputs = 0;
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (!is_output_[i]) {
        if (bits(got[i]) != bits(y0_[i]) && ++bad <= 5)
          ADD_FAILURE() << c_.name << ": element " << i << " outside the outputs changed: " << y0_[i] << " -> "
                        << got[i];
        continue;
      }
      ++outputs;
      const double expected = expected_[i];
      // Both sides multiply bf16 values exactly in fp32 (8-bit significands: a 16-bit product) and add K products
      // with fp32 roundings, in different orders (the CPU: 8 interleaved partial sums, then a tree; cuBLASLt: its
      // tiles and splits of K). Each addition errs by at most 2^-24 of a partial sum bounded by sum_k |x_k w_k|;
      // with rounding errors that grow like a random walk the difference stays far below 1e-5 * sum |x_k w_k| for
      // K <= 1024 (the worst-case linear bound of the two sides together is about that at K = 1024). The
      // accumulate form adds y once more (one rounding of |y| <= 2^-24 |y|).
      double bound = 1e-5 * scale_[i] + 1e-6 + (c_.accumulate ? 1e-6 * std::fabs(y0_[i]) : 0.0);
      // Rounding the fp32 result to bf16 adds at most half a bf16 ulp of it.
      if (c_.y_bf16) bound += kBf16HalfUlp * (std::fabs(expected) + bound);
      const double err = std::fabs(got[i] - expected);
      worst = std::max(worst, err / bound);
      if (!(err <= bound) && ++bad <= 5)
        ADD_FAILURE() << c_.name << ": y element " << i << " = " << got[i] << ", reference " << expected
                      << ", bound " << bound;
      if (c_.y_bf16 && bits(got[i]) == bits(round_to_bf16(static_cast<float>(expected)))) ++exact_bf16;
    }
    EXPECT_EQ(bad, 0) << c_.name << ": " << bad << " wrong elements";
    if (c_.y_bf16) {
      EXPECT_TRUE(mostly_exact(exact_bf16, outputs)) << c_.name;
    }
    std::printf("%-28s largest error / bound %.3g\n", c_.name.c_str(), worst);
  }

 private:
  // y_b = x_b · op(w_b) by cpu::linear on the gathered bf16 values, and the same on magnitudes for the bound.
  void compute_reference() {
    const GemmProblem& p = p_;
    expected_.assign(y0_.begin(), y0_.end());
    scale_.assign(y0_.size(), 0.0);
    is_output_.assign(y0_.size(), false);
    const size_t MK = static_cast<size_t>(p.M * p.K), NK = static_cast<size_t>(p.N * p.K),
                 MN = static_cast<size_t>(p.M * p.N);
    std::vector<float> xb(MK), wb(NK), xa(MK), wa(NK), yb(MN), ya(MN);
    for (int64_t b = 0; b < p.batch; ++b) {
      for (int64_t m = 0; m < p.M; ++m)
        for (int64_t k = 0; k < p.K; ++k)
          xb[m * p.K + k] = bf16_to_f32(x_[c_.x_offset + b * p.stride_x + m * p.ldx + k]);
      for (int64_t n = 0; n < p.N; ++n)
        for (int64_t k = 0; k < p.K; ++k)
          wb[n * p.K + k] = bf16_to_f32(w_[b * p.stride_w + (p.transpose_w ? n * p.ldw + k : k * p.ldw + n)]);
      for (size_t i = 0; i < MK; ++i) xa[i] = std::fabs(xb[i]);
      for (size_t i = 0; i < NK; ++i) wa[i] = std::fabs(wb[i]);
      cpu::linear(xb.data(), wb.data(), yb.data(), p.M, p.K, p.N);
      cpu::linear(xa.data(), wa.data(), ya.data(), p.M, p.K, p.N);
      for (int64_t m = 0; m < p.M; ++m)
        for (int64_t n = 0; n < p.N; ++n) {
          const size_t at = static_cast<size_t>(b * p.stride_y + m * p.ldy + n);
          ASSERT_FALSE(is_output_[at]) << c_.name << ": the case's outputs overlap";
          is_output_[at] = true;
          expected_[at] = p.accumulate ? y0_[at] + yb[m * p.N + n] : yb[m * p.N + n];
          scale_[at] = ya[m * p.N + n];
        }
    }
  }

  GemmCase c_;
  GemmProblem p_;
  std::vector<uint16_t> x_, w_;
  std::vector<float> y0_;
  std::vector<double> expected_, scale_;
  std::vector<bool> is_output_;
  DeviceBuffer<uint16_t> x_dev_, w_dev_, y_bf16_dev_;
  DeviceBuffer<float> y_f32_dev_;
};

// MLA's per-head products with the heads of a token side by side in a row (dsa_mla.md: kv_b viewed as
// [H, dn + dv, C], W_UK the first dn rows of a head, W_UV the last dv).
constexpr int64_t kHeads = 4, kNope = 32, kRope = 16, kValue = 24, kLatent = 64;

GemmCase absorb_case(int64_t T) {
  GemmCase c{"absorb T=" + std::to_string(T), Api::kBatched, T, kLatent, kNope, kHeads, /*transpose_w=*/false};
  c.ldx = kHeads * (kNope + kRope);      // q [T, H, dn + dr]; q_nope is the first dn of each head
  c.stride_x = kNope + kRope;
  c.ldw = kLatent;                       // kv_b [H * (dn + dv), C]; W_UK[h] = rows h*(dn+dv) .. + dn
  c.stride_w = (kNope + kValue) * kLatent;
  c.ldy = kHeads * (kLatent + kRope);    // q_abs [T, H, C + dr]; the rope slot of each head stays untouched
  c.stride_y = kLatent + kRope;
  return c;
}

GemmCase unabsorb_case(int64_t T) {
  GemmCase c{"unabsorb T=" + std::to_string(T), Api::kBatched, T, kValue, kLatent, kHeads, /*transpose_w=*/true};
  c.ldx = kHeads * kLatent;  // obar [T, H, C]
  c.stride_x = kLatent;
  c.ldw = kLatent;           // W_UV[h] = rows h*(dn+dv) + dn .. + dv of kv_b (the test's w buffer starts at row dn)
  c.stride_w = (kNope + kValue) * kLatent;
  c.ldy = kHeads * kValue;   // o [T, H * dv]
  c.stride_y = kValue;
  return c;
}

std::vector<GemmCase> gemm_cases() {
  std::vector<GemmCase> cases = {
      {"linear M=1", Api::kLinear, 1, 256, 128},
      {"linear M=3", Api::kLinear, 3, 130, 64},
      {"linear M=37 K=200 N=1000", Api::kLinear, 37, 1000, 200},
      {"linear odd K=7", Api::kLinear, 5, 9, 7},
      {"linear odd K=13 N=1", Api::kLinear, 3, 1, 13},
      {"linear M=130 K=1024 N=72", Api::kLinear, 130, 72, 1024},
      {"linear bf16 M=37", Api::kLinearBf16, 37, 1000, 200},
      {"linear bf16 M=1 odd", Api::kLinearBf16, 1, 33, 19},
      {"batched transpose_w", Api::kBatched, 7, 24, 40, 3, true},
      {"batched no transpose_w", Api::kBatched, 7, 24, 40, 3, false},
      {"batched odd no transpose", Api::kBatched, 5, 11, 9, 2, false},
      absorb_case(1),
      absorb_case(7),
      unabsorb_case(1),
      unabsorb_case(7),
  };
  GemmCase padded{"linear padded ld", Api::kLinear, 9, 100, 64};
  padded.ldx = 72;
  padded.ldy = 104;
  cases.push_back(padded);
  GemmCase misaligned{"linear x misaligned", Api::kLinear, 6, 48, 64};
  misaligned.x_offset = 1;
  cases.push_back(misaligned);
  GemmCase odd_ld{"linear odd ldx ldy", Api::kLinear, 4, 40, 32};
  odd_ld.ldx = 35;
  odd_ld.ldy = 41;
  cases.push_back(odd_ld);
  GemmCase acc{"linear accumulate", Api::kLinear, 37, 1000, 200};
  acc.accumulate = true;
  cases.push_back(acc);
  GemmCase acc1{"linear accumulate M=1", Api::kLinear, 1, 77, 24};
  acc1.accumulate = true;
  cases.push_back(acc1);
  cases.push_back({"run bf16 batched no transpose", Api::kRun, 5, 16, 48, 3, false, true});
  GemmCase heads_acc = unabsorb_case(5);
  heads_acc.name = "run unabsorb accumulate";
  heads_acc.api = Api::kRun;
  heads_acc.accumulate = true;
  cases.push_back(heads_acc);
  GemmCase heads_bf16 = unabsorb_case(3);
  heads_bf16.name = "run unabsorb bf16";
  heads_bf16.api = Api::kRun;
  heads_bf16.y_bf16 = true;
  cases.push_back(heads_bf16);
  GemmCase odd_heads{"batched odd head strides", Api::kBatched, 3, 5, 7, 3, false};
  odd_heads.ldx = 3 * 9;  // heads of 9 values, the first 7 used
  odd_heads.stride_x = 9;
  odd_heads.ldy = 3 * 5 + 1;
  odd_heads.stride_y = 5;
  cases.push_back(odd_heads);
  return cases;
}

TEST(GemmCuda, EveryCaseMatchesCpuLinear) {
  SKIP_WITHOUT_GPU();
  Gemm gemm;
  uint32_t seed = 1;
  for (const GemmCase& c : gemm_cases()) {
    SCOPED_TRACE(c.name);
    GemmCheck check(c, seed++);
    check.reset_y();
    check.run(gemm);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    check.expect_matches(check.y());
    std::printf("%-28s runs on %s\n", c.name.c_str(), gemm.uses_cublaslt(check.problem()) ? "cuBLASLt" : "gemm_simple");
  }
}

TEST(GemmCuda, SimpleKernelMatchesCpuLinear) {
  SKIP_WITHOUT_GPU();
  uint32_t seed = 100;
  for (const GemmCase& c : gemm_cases()) {
    SCOPED_TRACE(c.name);
    GemmCheck check(c, seed++);
    check.reset_y();
    gemm_simple(check.problem(), nullptr);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    check.expect_matches(check.y());
  }
}

// Larger than one tile in every direction, with more M tiles than fit the grid's first pass would be too slow to
// check on the CPU; this covers several tiles in M, N and K with partial last tiles.
TEST(GemmCuda, SimpleKernelSeveralTiles) {
  SKIP_WITHOUT_GPU();
  GemmCase c{"simple 97x75x70", Api::kRun, 97, 75, 70};
  GemmCheck check(c, 7);
  check.reset_y();
  gemm_simple(check.problem(), nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  check.expect_matches(check.y());
}

TEST(GemmCuda, SameProblemTwiceGivesIdenticalBits) {
  SKIP_WITHOUT_GPU();
  Gemm gemm;
  std::vector<GemmCase> cases = {{"det linear 256x512x1024", Api::kLinear, 256, 512, 1024},
                                 {"det linear M=1", Api::kLinear, 1, 2048, 1024},
                                 {"det bf16", Api::kLinearBf16, 64, 384, 512},
                                 unabsorb_case(33)};
  uint32_t seed = 200;
  for (const GemmCase& c : cases) {
    SCOPED_TRACE(c.name);
    GemmCheck check(c, seed++);
    check.reset_y();
    check.run(gemm);
    const std::vector<float> first = check.y();
    check.reset_y();
    check.run(gemm);
    const std::vector<float> second = check.y();
    ASSERT_EQ(first.size(), second.size());
    EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(float)), 0);
  }
}

TEST(GemmCuda, ZeroRowsIsANoOp) {
  SKIP_WITHOUT_GPU();
  Gemm gemm;
  gemm.linear(nullptr, 0, 64, 64, nullptr, 32, nullptr, 32, nullptr);
  gemm.batched(nullptr, 64, 64, nullptr, 64, 64, true, nullptr, 32, 32, 5, 32, 64, 0, nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
}

// A GEMM and the ops captured in a CUDA graph and replayed give the bits of the direct calls.
TEST(GemmCuda, CapturedInAGraph) {
  SKIP_WITHOUT_GPU();
  const int64_t M = 5, K = 256, N = 192, F = N / 2;
  std::mt19937 rng(300);
  const auto x = to_device(random_bf16(M * K, rng));
  const auto w = to_device(random_bf16(N * K, rng));
  const auto norm_w = to_device(random_f32(N, rng, 1.0f, 0.1f));
  DeviceBuffer<float> y(M * N);
  DeviceBuffer<uint16_t> act(M * F);
  cudaStream_t stream;
  KESTREL_CUDA_CHECK(cudaStreamCreate(&stream));
  Gemm gemm;
  auto forward = [&] {
    gemm.linear(x.get(), M, K, K, w.get(), N, y.get(), N, stream);
    rms_norm_f32(y.get(), N, norm_w.get(), M, N, 1e-6f, y.get(), N, stream);
    swiglu_bf16(y.get(), M, F, act.get(), stream);
  };
  forward();  // the first call of a shape picks its algorithm; a graph captures later calls
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<float> direct_y = to_host(y);
  const std::vector<uint16_t> direct_act = to_host(act);
  KESTREL_CUDA_CHECK(cudaMemset(y.get(), 0, y.bytes()));
  KESTREL_CUDA_CHECK(cudaMemset(act.get(), 0, act.bytes()));

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  forward();
  KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(to_host(y), direct_y);
  EXPECT_EQ(to_host(act), direct_act);
  KESTREL_CUDA_CHECK(cudaGraphExecDestroy(exec));
  KESTREL_CUDA_CHECK(cudaGraphDestroy(graph));
  KESTREL_CUDA_CHECK(cudaStreamDestroy(stream));
}

// Argument checks run on the host before any CUDA call, so they need no GPU.
TEST(GemmCuda, RejectsMalformedProblems) {
  GemmProblem p;
  p.M = 4;
  p.N = 8;
  p.K = 16;
  p.ldx = 16;
  p.ldw = 16;
  p.ldy = 8;
  static const uint16_t dummy[1] = {};
  float out[1];
  p.x = dummy;
  p.w = dummy;
  p.y = out;
  EXPECT_NO_THROW(check_gemm_problem(p, "test"));
  GemmProblem q = p;
  q.ldx = 15;
  EXPECT_THROW(check_gemm_problem(q, "test"), Error);
  q = p;
  q.transpose_w = false;  // w is [K, N]: ldw >= N = 8 suffices
  q.ldw = 8;
  EXPECT_NO_THROW(check_gemm_problem(q, "test"));
  q.ldw = 7;
  EXPECT_THROW(check_gemm_problem(q, "test"), Error);
  q = p;
  q.ldy = 7;
  EXPECT_THROW(check_gemm_problem(q, "test"), Error);
  q = p;
  q.y_bf16 = true;
  q.accumulate = true;
  EXPECT_THROW(check_gemm_problem(q, "test"), Error);
  q = p;
  q.K = 0;
  EXPECT_THROW(check_gemm_problem(q, "test"), Error);
  q = p;
  q.x = nullptr;
  EXPECT_THROW(check_gemm_problem(q, "test"), Error);
  q.M = 0;  // nothing to do: no pointer needed
  EXPECT_NO_THROW(check_gemm_problem(q, "test"));
  // Batches side by side in a row: 3 heads of 8 in a row of 24 fit; in a row of 23 the last overlaps the next row.
  q = p;
  q.batch = 3;
  q.stride_y = 8;
  q.ldy = 24;
  EXPECT_NO_THROW(check_gemm_problem(q, "test"));
  q.ldy = 23;
  EXPECT_THROW(check_gemm_problem(q, "test"), Error);
  q.ldy = 8;
  q.stride_y = 4 * 8;  // whole matrices one after another
  EXPECT_NO_THROW(check_gemm_problem(q, "test"));
  q.stride_y = 3 * 8 + 7;
  EXPECT_THROW(check_gemm_problem(q, "test"), Error);
}

// ------------------------------------------------------------------------------------------------------- ops

class OpsCuda : public ::testing::Test {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

TEST_F(OpsCuda, ToBf16MatchesHostBitForBit) {
  std::vector<uint32_t> patterns = {
      0x00000000u, 0x80000000u,                            // +-0
      0x7F800000u, 0xFF800000u,                            // +-inf
      0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u,  // NaNs: quiet, payload only in the dropped half
      0x7FFFFFFFu, 0x7FA00000u, 0x7F80FFFFu, 0xFFFF0000u,
      0x3F808000u, 0x3F818000u, 0xBF808000u, 0xBF818000u,  // ties: even kept bit rounds down, odd rounds up
      0x3F807FFFu, 0x3F808001u,                            // just below / above a tie
      0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F7F8000u, 0x7F7F7FFFu,  // near FLT_MAX: overflow to inf or not
      0x00000001u, 0x00008000u, 0x00018000u, 0x80008000u,  // subnormals, ties among them
      0x007FFFFFu, 0x00800000u, 0x3F800000u, 0xC0490FDBu,
  };
  std::mt19937 rng(400);
  for (int i = 0; i < 200000; ++i) patterns.push_back(static_cast<uint32_t>(rng()));  // every class, NaNs included
  for (int i = 0; i < 100000; ++i) {  // ties and near-ties of every exponent
    const uint32_t high = static_cast<uint32_t>(rng()) & 0xFFFF0000u;
    patterns.push_back(high | 0x8000u);
    patterns.push_back(high | (0x8000u + (static_cast<uint32_t>(rng()) % 3) - 1));
  }
  std::vector<float> x(patterns.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::bit_cast<float>(patterns[i]);
  const auto x_dev = to_device(x);
  DeviceBuffer<uint16_t> y(x.size());
  to_bf16(x_dev.get(), static_cast<int64_t>(x.size()), y.get(), nullptr);
  const std::vector<uint16_t> got = to_host(y);
  int64_t bad = 0;
  for (size_t i = 0; i < x.size(); ++i)
    if (got[i] != f32_to_bf16(x[i]) && ++bad <= 5)
      ADD_FAILURE() << std::hex << "0x" << patterns[i] << " -> 0x" << got[i] << ", host 0x" << f32_to_bf16(x[i]);
  EXPECT_EQ(bad, 0);
}

TEST_F(OpsCuda, AddInplaceIsExact) {
  std::mt19937 rng(401);
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{100003}}) {
    const std::vector<float> h0 = random_f32(n, rng), y = random_f32(n, rng, 0.0f, 10.0f);
    auto h_dev = to_device(h0);
    const auto y_dev = to_device(y);
    add_inplace(h_dev.get(), y_dev.get(), n, nullptr);
    const std::vector<float> got = to_host(h_dev);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bits(got[i]), bits(h0[i] + y[i])) << "n=" << n << " i=" << i;
  }
  add_inplace(nullptr, nullptr, 0, nullptr);
}

// x rows with a pitch ldx > D and y rows with ldy > D: the padding must be neither read nor written.
TEST_F(OpsCuda, RmsNormMatchesCpu) {
  std::mt19937 rng(402);
  for (int64_t M : {1, 5, 37})
    for (int64_t D : {1, 3, 256, 1000, 4099}) {
      SCOPED_TRACE(testing::Message() << "M=" << M << " D=" << D);
      const int64_t ldx = D + 3, ldy = D + 5;
      const float eps = 1e-6f;
      const std::vector<float> x = random_f32(M * ldx, rng, 0.5f, 2.0f), w = random_f32(D, rng, 1.0f, 0.3f);
      std::vector<float> packed(M * D), ref(M * D);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t d = 0; d < D; ++d) packed[m * D + d] = x[m * ldx + d];
      cpu::rms_norm(packed.data(), w.data(), ref.data(), M, D, eps);
      const auto x_dev = to_device(x), w_dev = to_device(w);
      const std::vector<float> y0 = random_f32(M * ldy, rng);
      auto y_f32 = to_device(y0);
      rms_norm_f32(x_dev.get(), ldx, w_dev.get(), M, D, eps, y_f32.get(), ldy, nullptr);
      std::vector<uint16_t> y0_bf16(M * ldy, 0x7FC1);
      auto y_bf16 = to_device(y0_bf16);
      rms_norm_bf16(x_dev.get(), ldx, w_dev.get(), M, D, eps, y_bf16.get(), ldy, nullptr);
      // In place, over the padded rows.
      auto x_inplace = to_device(x);
      rms_norm_f32(x_inplace.get(), ldx, w_dev.get(), M, D, eps, x_inplace.get(), ldx, nullptr);
      const std::vector<float> got = to_host(y_f32), got_inplace = to_host(x_inplace);
      const std::vector<uint16_t> got_bf16 = to_host(y_bf16);
      int64_t exact_bf16 = 0;
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t d = 0; d < D; ++d) {
          const float r = ref[m * D + d];
          // The sums of squares differ only in order: positive terms, so the relative difference is below
          // ~D/8 * 2^-24 in the worst case and ~sqrt(D) * 2^-24 in practice; the result inherits half of it plus
          // a few roundings.
          const double bound = 1e-5 * std::fabs(r) + 1e-30;
          ASSERT_LE(std::fabs(got[m * ldy + d] - r), bound) << "m=" << m << " d=" << d;
          ASSERT_LE(std::fabs(got_inplace[m * ldx + d] - r), bound) << "in place m=" << m << " d=" << d;
          const float b = bf16_to_f32(got_bf16[m * ldy + d]);
          ASSERT_LE(std::fabs(b - r), kBf16HalfUlp * (std::fabs(r) + bound) + bound) << "bf16 m=" << m << " d=" << d;
          exact_bf16 += got_bf16[m * ldy + d] == f32_to_bf16(r);
        }
        for (int64_t d = D; d < ldy; ++d) {
          ASSERT_EQ(bits(got[m * ldy + d]), bits(y0[m * ldy + d])) << "padding written";
          ASSERT_EQ(got_bf16[m * ldy + d], 0x7FC1) << "padding written";
        }
        for (int64_t d = D; d < ldx; ++d)
          ASSERT_EQ(bits(got_inplace[m * ldx + d]), bits(x[m * ldx + d])) << "padding written";
      }
      // ~1e-7 relative differences straddle a bf16 rounding boundary rarely (see the GEMM cases).
      EXPECT_TRUE(mostly_exact(exact_bf16, M * D));
    }
}

TEST_F(OpsCuda, LayerNormMatchesCpu) {
  std::mt19937 rng(403);
  for (int64_t M : {1, 4, 33})
    for (int64_t D : {1, 5, 768, 3000}) {
      SCOPED_TRACE(testing::Message() << "M=" << M << " D=" << D);
      const float eps = 1e-5f;
      // A mean far from zero makes the centring matter.
      const std::vector<float> x = random_f32(M * D, rng, 3.0f, 1.5f), w = random_f32(D, rng, 1.0f, 0.3f),
                               b = random_f32(D, rng, 0.0f, 0.5f);
      std::vector<float> ref(M * D);
      cpu::layer_norm(x.data(), w.data(), b.data(), ref.data(), M, D, eps);
      const auto x_dev = to_device(x), w_dev = to_device(w), b_dev = to_device(b);
      DeviceBuffer<float> y(M * D);
      layer_norm_f32(x_dev.get(), w_dev.get(), b_dev.get(), M, D, eps, y.get(), nullptr);
      auto x_inplace = to_device(x);
      layer_norm_f32(x_inplace.get(), w_dev.get(), b_dev.get(), M, D, eps, x_inplace.get(), nullptr);
      const std::vector<float> got = to_host(y), got_inplace = to_host(x_inplace);
      for (int64_t m = 0; m < M; ++m) {
        double mean = 0, var = 0;
        for (int64_t d = 0; d < D; ++d) mean += x[m * D + d];
        mean /= static_cast<double>(D);
        for (int64_t d = 0; d < D; ++d) var += (x[m * D + d] - mean) * (x[m * D + d] - mean);
        const double inv = 1.0 / std::sqrt(var / static_cast<double>(D) + eps);
        for (int64_t d = 0; d < D; ++d) {
          const size_t i = static_cast<size_t>(m * D + d);
          // The two sides' fp32 means differ by ~1e-6 of mean |x| (order of a sum of D values), which the output
          // sees scaled by inv * |w|; the centred value, the variance and the affine step add ~1e-6 relative.
          const double bound =
              1e-5 * (std::fabs(mean) * inv * std::fabs(w[d]) + std::fabs(ref[i] - b[d]) + std::fabs(b[d])) + 1e-7;
          ASSERT_LE(std::fabs(got[i] - ref[i]), bound) << "m=" << m << " d=" << d;
          ASSERT_LE(std::fabs(got_inplace[i] - ref[i]), bound) << "in place m=" << m << " d=" << d;
        }
      }
    }
}

TEST_F(OpsCuda, SwigluMatchesCpu) {
  std::mt19937 rng(404);
  for (int64_t T : {1, 3, 17})
    for (int64_t F : {1, 5, 1000}) {
      SCOPED_TRACE(testing::Message() << "T=" << T << " F=" << F);
      std::vector<float> gu = random_f32(T * 2 * F, rng, 0.0f, 3.0f);
      // Gates far out on both sides: exp(-x) overflows to inf (silu -> -0) or vanishes (silu -> x).
      const float extremes[] = {-1e4f, -100.0f, -88.5f, -30.0f, 30.0f, 100.0f, 1e4f, 0.0f, -0.0f};
      for (int64_t i = 0; i < T * F && i < 9; ++i) gu[(i % T) * 2 * F + i / T % F] = extremes[i];
      std::vector<float> ref(T * F);
      for (int64_t t = 0; t < T; ++t)
        cpu::swiglu(gu.data() + t * 2 * F, gu.data() + t * 2 * F + F, ref.data() + t * F, F);
      const auto gu_dev = to_device(gu);
      DeviceBuffer<uint16_t> out(T * F);
      swiglu_bf16(gu_dev.get(), T, F, out.get(), nullptr);
      const std::vector<uint16_t> got = to_host(out);
      int64_t exact = 0;
      for (int64_t i = 0; i < T * F; ++i) {
        // expf on the GPU is within 2 ulp, glibc's within 1: silu * up differs by a few 2^-24 relative before the
        // bf16 rounding, which adds at most half a bf16 ulp.
        const double r = ref[i], bound = (kBf16HalfUlp + 1e-6) * std::fabs(r) + 1e-37;
        ASSERT_LE(std::fabs(bf16_to_f32(got[i]) - r), bound) << "i=" << i << " gate " << gu[i / F * 2 * F + i % F];
        exact += got[i] == f32_to_bf16(ref[i]);
      }
      EXPECT_TRUE(mostly_exact(exact, T * F));
    }
}

TEST_F(OpsCuda, EmbedAndGatherAreExact) {
  std::mt19937 rng(405);
  const int64_t V = 50;
  for (int64_t D : {1, 7, 1000})
    for (int64_t T : {1, 9}) {
      SCOPED_TRACE(testing::Message() << "D=" << D << " T=" << T);
      const std::vector<uint16_t> table = random_bf16(V * D, rng);
      std::vector<int32_t> ids(T);
      for (int32_t& id : ids) id = static_cast<int32_t>(rng() % V);
      ids[0] = static_cast<int32_t>(V - 1);
      const auto table_dev = to_device(table);
      const auto ids_dev = to_device(ids);
      DeviceBuffer<float> h(T * D);
      embed_bf16(ids_dev.get(), T, table_dev.get(), D, h.get(), nullptr);
      const std::vector<float> got = to_host(h);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < D; ++d)
          ASSERT_EQ(bits(got[t * D + d]), bits(bf16_to_f32(table[ids[t] * D + d]))) << "t=" << t << " d=" << d;

      // Gather rows of h, repeats and reversed order included.
      std::vector<int32_t> rows = {static_cast<int32_t>(T - 1), 0, static_cast<int32_t>(T - 1)};
      const auto rows_dev = to_device(rows);
      DeviceBuffer<float> g(rows.size() * D);
      gather_rows(h.get(), D, rows_dev.get(), static_cast<int64_t>(rows.size()), g.get(), nullptr);
      const std::vector<float> gathered = to_host(g);
      for (size_t i = 0; i < rows.size(); ++i)
        for (int64_t d = 0; d < D; ++d)
          ASSERT_EQ(bits(gathered[i * D + d]), bits(got[rows[i] * D + d])) << "i=" << i << " d=" << d;
    }
}

// The first index of the largest non-NaN value; 0 when there is none.
int32_t reference_argmax(const float* row, int64_t V) {
  int32_t best = -1;
  for (int64_t i = 0; i < V; ++i)
    if (!std::isnan(row[i]) && (best < 0 || row[i] > row[best])) best = static_cast<int32_t>(i);
  return best < 0 ? 0 : best;
}

TEST_F(OpsCuda, ArgmaxRows) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const int64_t V = 1000;
  std::mt19937 rng(406);
  std::vector<std::vector<float>> rows;
  // Ties between positions that the kernel compares at each level: one thread (1, 257), one warp (2, 3), two
  // warps (5, 40), the last element.
  for (const std::vector<int>& at : std::vector<std::vector<int>>{{257, 1}, {3, 2}, {40, 5}, {999, 600}, {0, 999}}) {
    std::vector<float> r = random_f32(V, rng);
    for (int i : at) r[i] = 7.5f;
    rows.push_back(r);
  }
  rows.push_back(std::vector<float>(V, 1.0f));    // all equal: 0
  rows.push_back(std::vector<float>(V, nan));     // all NaN: 0
  rows.push_back(std::vector<float>(V, -inf));    // all -inf: 0
  {
    std::vector<float> r(V, nan);  // NaN then -inf: the first -inf
    r[700] = -inf;
    r[701] = -inf;
    rows.push_back(r);
  }
  {
    std::vector<float> r = random_f32(V, rng);  // NaN first, +inf later, a larger finite value in between
    r[0] = nan;
    r[10] = 1e30f;
    r[500] = inf;
    r[501] = inf;
    rows.push_back(r);
  }
  {
    std::vector<float> r(V, -1.0f);  // -0 and +0 are equal: the lower index
    r[300] = -0.0f;
    r[100] = 0.0f;
    rows.push_back(r);
  }
  for (int i = 0; i < 6; ++i) rows.push_back(random_f32(V, rng));
  std::vector<float> logits;
  for (const auto& r : rows) logits.insert(logits.end(), r.begin(), r.end());
  const int64_t M = static_cast<int64_t>(rows.size());
  const auto logits_dev = to_device(logits);
  DeviceBuffer<int32_t> out(M);
  argmax_rows(logits_dev.get(), M, V, out.get(), nullptr);
  const std::vector<int32_t> got = to_host(out);
  const int32_t hand[] = {1, 2, 5, 600, 0, 0, 0, 0, 700, 500, 100};
  for (int64_t m = 0; m < M; ++m) {
    EXPECT_EQ(got[m], reference_argmax(logits.data() + m * V, V)) << "row " << m;
    if (m < static_cast<int64_t>(std::size(hand))) {
      EXPECT_EQ(got[m], hand[m]) << "row " << m;
    }
  }

  // Odd and large vocabularies, V = 1, random rows.
  for (int64_t v : {int64_t{1}, int64_t{7}, int64_t{129280}}) {
    const std::vector<float> l = random_f32(3 * v, rng);
    const auto l_dev = to_device(l);
    DeviceBuffer<int32_t> o(3);
    argmax_rows(l_dev.get(), 3, v, o.get(), nullptr);
    const std::vector<int32_t> g = to_host(o);
    for (int64_t m = 0; m < 3; ++m) EXPECT_EQ(g[m], reference_argmax(l.data() + m * v, v)) << "V=" << v;
  }
}

TEST(OpsArguments, RejectedOnTheHost) {
  float f[4] = {};
  uint16_t b[4] = {};
  EXPECT_THROW(rms_norm_f32(f, 4, f, 1, 4, 1e-6f, f, 3, nullptr), Error);    // ldy < D
  EXPECT_THROW(rms_norm_f32(f, 4, f, 1, 2, 1e-6f, f, 2, nullptr), Error);    // in place with another pitch
  EXPECT_THROW(rms_norm_bf16(f, 4, f, 1, 4, -1.0f, b, 4, nullptr), Error);   // negative eps
  EXPECT_THROW(rms_norm_bf16(f, 4, nullptr, 1, 4, 1e-6f, b, 4, nullptr), Error);
  EXPECT_THROW(layer_norm_f32(f, f, f, -1, 4, 1e-5f, f, nullptr), Error);
  EXPECT_THROW(swiglu_bf16(f, 1, -2, b, nullptr), Error);
  EXPECT_THROW(argmax_rows(f, 1, int64_t{1} << 31, nullptr, nullptr), Error);
  // Empty work needs no pointers and launches nothing.
  EXPECT_NO_THROW(rms_norm_f32(nullptr, 4, nullptr, 0, 4, 1e-6f, nullptr, 4, nullptr));
  EXPECT_NO_THROW(embed_bf16(nullptr, 0, nullptr, 16, nullptr, nullptr));
  EXPECT_NO_THROW(gather_rows(nullptr, 16, nullptr, 0, nullptr, nullptr));
}

}  // namespace
}  // namespace kestrel::cuda
