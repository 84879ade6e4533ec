// FP8 block-scaled linears on the GPU (gemm_fp8_block.h) against the CPU reference (cpu::linear_fp8_block): the
// activation quantizer bit for bit (special values, partial groups, padding rows and columns), then products on fresh
// random codes, scales and activations with the bound of gemm_fp8_block.h asserted on every element, through
// Fp8BlockGemm (cuBLASLt where it has an algorithm) and through the fallback kernel, at random shapes (N and K not
// multiples of 128, K not a multiple of 16, M not a multiple of 4) and at DeepSeek-V3.2's shapes for M = 1, 2, 7, 64,
// 300 and 2048; bf16 output, accumulation, CUDA-graph replay and argument checks.
#include "kernels/cuda/gemm_fp8_block.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "cuda_test_util.h"
#include "fp8_block_check.h"
#include "kernels/cpu/fp8_linear.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {
namespace {

using test_util::kInf;
using test_util::kNaN;
using test_util::same_float;

const char* path_name(Fp8BlockPath p) {
  switch (p) {
    case Fp8BlockPath::cublaslt: return "cublaslt";
    case Fp8BlockPath::cublaslt_staged: return "cublaslt_staged";
    case Fp8BlockPath::mma_fallback: return "mma_fallback";
  }
  return "?";
}

// A weight in the checkpoint's layout on the host and in fp8_block_weight_layout on the device.
struct Weight {
  int64_t N, K;
  std::vector<uint8_t> codes;  // [N, K]
  std::vector<float> scales;   // [ceil(N/128), ceil(K/128)]
  DeviceBuffer<uint8_t> d_codes;
  DeviceBuffer<float> d_scales;

  Weight(int64_t n, int64_t k, uint64_t seed) : N(n), K(k) {
    codes.resize(static_cast<size_t>(N * K));
    fp8_check::random_codes(codes.data(), N * K, seed);
    scales = fp8_check::random_scales(cpu::fp8_groups(N) * cpu::fp8_groups(K), seed + 1, -12, -8);
    const Fp8BlockWeightLayout l = fp8_block_weight_layout(N, K);
    d_codes = DeviceBuffer<uint8_t>(l.code_bytes());
    d_scales = DeviceBuffer<float>(l.scale_bytes() / sizeof(float));
    if (l.same_as_checkpoint()) {
      d_codes.upload(codes.data());
      d_scales.upload(scales.data());
      return;
    }
    // The loader's copy for a padded layout: zeroed allocations, then the rows at the device pitches.
    const int64_t kb = cpu::fp8_groups(K);
    KESTREL_CUDA_CHECK(cudaMemset(d_codes.get(), 0, d_codes.bytes()));
    KESTREL_CUDA_CHECK(cudaMemset(d_scales.get(), 0, d_scales.bytes()));
    KESTREL_CUDA_CHECK(cudaMemcpy2D(d_codes.get(), l.row_bytes, codes.data(), K, K, N, cudaMemcpyHostToDevice));
    KESTREL_CUDA_CHECK(cudaMemcpy2D(d_scales.get(), l.scale_row_floats * sizeof(float), scales.data(),
                                    kb * sizeof(float), kb * sizeof(float), l.block_rows, cudaMemcpyHostToDevice));
  }
  Fp8BlockWeight view() const { return Fp8BlockWeight{d_codes.get(), d_scales.get(), N, K}; }
};

// The CPU side of one activation matrix: its quantization and the reference product with a weight.
struct Reference {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<float> y;          // [M, N]
  std::vector<double> magnitude;  // an upper bound of A (fp8_block_check.h)
};

Reference reference(const std::vector<float>& x, int64_t M, int64_t ldx, const Weight& w) {
  Reference r;
  const int64_t K = w.K;
  r.codes.resize(static_cast<size_t>(M * K));
  r.scales.resize(static_cast<size_t>(M * cpu::fp8_groups(K)));
  cpu::quantize_fp8_groups(x.data(), M, K, ldx, r.codes.data(), r.scales.data());
  r.y.resize(static_cast<size_t>(M * w.N));
  cpu::linear_fp8_block_quantized(r.codes.data(), r.scales.data(), M, K, w.codes.data(), w.scales.data(), w.N,
                                  r.y.data());
  r.magnitude =
      fp8_check::magnitude_bound(r.codes.data(), r.scales.data(), M, K, w.codes.data(), w.scales.data(), w.N);
  return r;
}

// Device activations quantized by quantize_fp8_activations (checked against the CPU's codes and scales, bit for bit,
// padding included).
struct DeviceActivations {
  Fp8ActivationLayout layout;
  DeviceBuffer<uint8_t> codes;
  DeviceBuffer<float> scales;
  Fp8Activations view() const { return Fp8Activations{codes.get(), scales.get(), layout.M, layout.K}; }
};

DeviceActivations quantize_on_device(const DeviceBuffer<float>& dx, int64_t M, int64_t K, int64_t ldx,
                                     const Reference& ref) {
  DeviceActivations a{fp8_activation_layout(M, K), {}, {}};
  a.codes = DeviceBuffer<uint8_t>(a.layout.code_bytes());
  a.scales = DeviceBuffer<float>(a.layout.scale_bytes() / sizeof(float));
  KESTREL_CUDA_CHECK(cudaMemset(a.codes.get(), 0xAB, a.codes.bytes()));
  test_util::fill_poison(a.scales);
  quantize_fp8_activations(dx.get(), M, K, ldx, a.codes.get(), a.scales.get(), nullptr);
  test_util::sync();
  const std::vector<uint8_t> codes = to_host(a.codes);
  const std::vector<float> scales = to_host(a.scales);
  const int64_t G = a.layout.groups, P = a.layout.padded_rows, R = a.layout.row_bytes;
  int64_t bad = 0;
  for (int64_t m = 0; m < P; ++m) {
    for (int64_t k = 0; k < R; ++k) {
      const uint8_t want = m < M && k < K ? ref.codes[m * K + k] : 0;
      bad += codes[m * R + k] != want;
    }
    for (int64_t g = 0; g < G; ++g) {
      const float want = m < M ? ref.scales[m * G + g] : 0.0f;
      bad += !same_float(scales[g * P + m], want);
    }
  }
  EXPECT_EQ(bad, 0) << "quantized activations differ from the CPU's (M=" << M << " K=" << K << ")";
  return a;
}

// Output rows are N + kPadColumns wide: padding columns the kernels must not write, keeping y's rows 16-byte aligned
// (as cuBLASLt needs) whenever N is a multiple of 4.
constexpr int64_t kPadColumns = 8;

// Runs p through `call` into a poisoned y of M + 1 rows of ldy = N + kPadColumns and checks every element of the M
// rows against the reference within c's bound; the padding columns and the extra row must keep the poison.
template <typename Call>
double check_product(const char* what, int64_t M, const Weight& w, const Reference& ref, double c, bool bf16,
                     Call call) {
  const int64_t N = w.N, ldy = N + kPadColumns;
  std::vector<float> got(static_cast<size_t>(M * ldy));
  int64_t outside = 0;  // elements written past the M rows or in the padding columns
  if (bf16) {
    DeviceBuffer<uint16_t> y(static_cast<size_t>((M + 1) * ldy));
    KESTREL_CUDA_CHECK(cudaMemset(y.get(), 0xFF, y.bytes()));
    call(static_cast<void*>(y.get()), ldy);
    test_util::sync();
    const std::vector<uint16_t> h = to_host(y);
    for (size_t i = 0; i < got.size(); ++i) got[i] = bf16_to_f32(h[i]);
    for (int64_t i = 0; i < (M + 1) * ldy; ++i) outside += (i >= M * ldy || i % ldy >= N) && h[i] != 0xFFFF;
  } else {
    DeviceBuffer<float> y(static_cast<size_t>((M + 1) * ldy));
    test_util::fill_poison(y);
    call(static_cast<void*>(y.get()), ldy);
    test_util::sync();
    const std::vector<float> h = to_host(y);
    std::copy_n(h.begin(), got.size(), got.begin());
    for (int64_t i = 0; i < (M + 1) * ldy; ++i)
      outside += (i >= M * ldy || i % ldy >= N) && test_util::bits(h[i]) != test_util::kPoisonBits;
  }
  EXPECT_EQ(outside, 0) << what << ": wrote outside the M x N output";
  return fp8_check::expect_within(what, got.data(), ldy, ref.y.data(), M, N, [&](int64_t m, int64_t n) {
    const double b = fp8_check::linear_bound(ref.magnitude[m * N + n], w.K, c);
    return bf16 ? 1.01 * b + 0x1p-8 * std::fabs(ref.y[m * N + n]) : b;
  });
}

TEST(Fp8BlockLayout, ShapesAndBytes) {
  for (const auto& [N, K] : {std::pair<int64_t, int64_t>{576, 7168}, {24576, 1536}, {7168, 16384}, {7168, 18432},
                             {128, 7168}, {2048, 7168}, {7168, 2048}, {4096, 512}}) {
    const Fp8BlockWeightLayout l = fp8_block_weight_layout(N, K);
    EXPECT_TRUE(l.same_as_checkpoint()) << N << " x " << K;
    EXPECT_EQ(l.code_bytes(), static_cast<size_t>(N * K));
    EXPECT_EQ(l.scale_bytes(), static_cast<size_t>(cpu::fp8_groups(N) * cpu::fp8_groups(K)) * sizeof(float));
  }
  const Fp8BlockWeightLayout odd = fp8_block_weight_layout(200, 300);  // K: 304 bytes a row; 3 blocks -> 4 floats
  EXPECT_FALSE(odd.same_as_checkpoint());
  EXPECT_EQ(odd.row_bytes, 304);
  EXPECT_EQ(odd.block_rows, 2);
  EXPECT_EQ(odd.scale_row_floats, 4);
  const Fp8ActivationLayout a = fp8_activation_layout(7, 300);
  EXPECT_EQ(a.padded_rows, 8);
  EXPECT_EQ(a.row_bytes, 304);
  EXPECT_EQ(a.groups, 3);
  EXPECT_EQ(a.code_bytes(), 8u * 304u);
  EXPECT_EQ(a.scale_bytes(), 3u * 8u * sizeof(float));
  // M % 4 == 0 needs no staged output; other M add padded_rows x round_up(N, 4) floats.
  EXPECT_EQ(Fp8BlockGemm::workspace_bytes(8, 200, 300), 2560u + 256u);
  EXPECT_EQ(Fp8BlockGemm::workspace_bytes(7, 200, 300), 2560u + 256u + 6400u);
  EXPECT_THROW(fp8_block_weight_layout(0, 128), Error);
  EXPECT_THROW(fp8_activation_layout(-1, 128), Error);
}

TEST(Fp8BlockGemm, QuantizerMatchesCpu) {
  REQUIRE_GPU();
  struct Case {
    int64_t M, K, ldx;
  };
  uint64_t seed = 1;
  for (const Case c : {Case{1, 7168, 7168}, Case{7, 300, 333}, Case{64, 128, 128}, Case{5, 16, 20},
                       Case{300, 1536, 1536}, Case{3, 100, 100}}) {
    SCOPED_TRACE(testing::Message() << "M=" << c.M << " K=" << c.K << " ldx=" << c.ldx);
    std::vector<float> x = fp8_check::random_activations(c.M, c.K, c.ldx, seed++);
    // Special values: NaN, +-inf, fp32 subnormals, a group below the floor, and a group with s = 0.125 exactly whose
    // quotients 16 .. 47 include every tie between neighbouring e4m3 codes there (round to even).
    for (int64_t m = 0; m < c.M; m += 2) {
      const int64_t k = (m * 37) % c.K;
      x[m * c.ldx + k] = m % 6 == 0 ? kNaN : m % 6 == 2 ? kInf : -kInf;
    }
    for (int64_t k = 0; k < std::min<int64_t>(c.K, 128); ++k) {
      if (c.M > 1) x[1 * c.ldx + k] = std::ldexp(static_cast<float>(k % 7) - 3.0f, -140);  // subnormal
      if (c.M > 3) x[3 * c.ldx + k] = 1e-12f * static_cast<float>(k % 5);                   // below the floor
      if (c.M > 4) x[4 * c.ldx + k] = k == 0 ? 56.0f : 0.125f * static_cast<float>(16 + k % 32);
    }
    Reference ref;
    ref.codes.resize(static_cast<size_t>(c.M * c.K));
    ref.scales.resize(static_cast<size_t>(c.M * cpu::fp8_groups(c.K)));
    cpu::quantize_fp8_groups(x.data(), c.M, c.K, c.ldx, ref.codes.data(), ref.scales.data());
    const DeviceBuffer<float> dx = to_device(x);
    quantize_on_device(dx, c.M, c.K, c.ldx, ref);
  }
}

// One problem through Fp8BlockGemm (fp32, bf16, and fp32 accumulating into y) and through the fallback kernel.
void check_shape(Fp8BlockGemm& gemm, int64_t M, int64_t N, int64_t K, uint64_t seed, bool outputs_too) {
  SCOPED_TRACE(testing::Message() << "M=" << M << " N=" << N << " K=" << K);
  const Weight w(N, K, seed);
  const int64_t ldx = K + 5;
  const std::vector<float> x = fp8_check::random_activations(M, K, ldx, seed + 7);
  const Reference ref = reference(x, M, ldx, w);
  const DeviceBuffer<float> dx = to_device(x);
  const DeviceActivations a = quantize_on_device(dx, M, K, ldx, ref);
  Fp8BlockProblem p;
  p.a = a.view();
  p.w = w.view();
  p.y = reinterpret_cast<void*>(256);  // the path depends on y's alignment only; the calls set y
  p.ldy = N + kPadColumns;
  // Each output form is a plan of its own and may take another path.
  auto path_of = [&](bool bf16, bool accumulate) {
    Fp8BlockProblem q = p;
    q.y_bf16 = bf16;
    q.accumulate = accumulate;
    return gemm.path(q);
  };
  auto c_of = [](Fp8BlockPath path) {
    return path == Fp8BlockPath::mma_fallback ? fp8_check::kMmaC : fp8_check::kCublasLtC;
  };
  const Fp8BlockPath path = path_of(false, false);
  const double c = c_of(path);
  DeviceBuffer<uint8_t> ws(Fp8BlockGemm::workspace_bytes(M, N, K));

  const double worst = check_product("Fp8BlockGemm::linear", M, w, ref, c, false, [&](void* y, int64_t ldy) {
    gemm.linear(dx.get(), M, ldx, w.view(), static_cast<float*>(y), ldy, ws.get(), ws.size(), nullptr);
  });
  const double worst_mma = check_product("fp8_block_gemm_mma", M, w, ref, fp8_check::kMmaC, false,
                                         [&](void* y, int64_t ldy) {
                                           Fp8BlockProblem q = p;
                                           q.y = y;
                                           q.ldy = ldy;
                                           fp8_block_gemm_mma(q, nullptr);
                                         });
  std::printf("  M=%-5lld N=%-6lld K=%-6lld %-16s bound used %.3f; fallback kernel %.3f\n",
              static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K), path_name(path), worst,
              worst_mma);
  if (!outputs_too) return;

  const Fp8BlockPath path_bf16 = path_of(true, false), path_accumulate = path_of(false, true);
  std::printf("  %*s bf16 output: %s, accumulate: %s\n", 38, "", path_name(path_bf16), path_name(path_accumulate));
  check_product("Fp8BlockGemm::linear_bf16", M, w, ref, c_of(path_bf16), true, [&](void* y, int64_t ldy) {
    gemm.linear_bf16(dx.get(), M, ldx, w.view(), static_cast<uint16_t*>(y), ldy, ws.get(), ws.size(), nullptr);
  });
  check_product("fp8_block_gemm_mma bf16", M, w, ref, fp8_check::kMmaC, true, [&](void* y, int64_t ldy) {
    Fp8BlockProblem q = p;
    q.y = y;
    q.y_bf16 = true;
    q.ldy = ldy;
    fp8_block_gemm_mma(q, nullptr);
  });

  // Accumulation: y starts at random values y0 and ends at y0 + x W^T (one more fp32 rounding).
  const int64_t ldy = N + kPadColumns;
  std::vector<float> y0(static_cast<size_t>(M * ldy));
  for (int64_t i = 0; i < M * ldy; ++i) y0[i] = static_cast<float>((i * 7919) % 2001 - 1000) * 1e-3f;
  for (int pass = 0; pass < 2; ++pass) {
    DeviceBuffer<float> y = to_device(y0);
    if (pass == 0) {
      gemm.linear(dx.get(), M, ldx, w.view(), y.get(), ldy, ws.get(), ws.size(), nullptr, true);
    } else {
      Fp8BlockProblem q = p;
      q.y = y.get();
      q.ldy = ldy;
      q.accumulate = true;
      fp8_block_gemm_mma(q, nullptr);
    }
    test_util::sync();
    const std::vector<float> got = to_host(y);
    std::vector<float> want(static_cast<size_t>(M * N));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) want[m * N + n] = y0[m * ldy + n] + ref.y[m * N + n];
    const double cc = pass == 0 ? c_of(path_accumulate) : fp8_check::kMmaC;
    fp8_check::expect_within(pass == 0 ? "Fp8BlockGemm::linear accumulate" : "fp8_block_gemm_mma accumulate",
                             got.data(), ldy, want.data(), M, N, [&](int64_t m, int64_t n) {
                               return fp8_check::linear_bound(ref.magnitude[m * N + n], K, cc) +
                                      0x1p-23 * (std::fabs(y0[m * ldy + n]) + std::fabs(ref.y[m * N + n]));
                             });
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = N; n < ldy; ++n) ASSERT_EQ(got[m * ldy + n], y0[m * ldy + n]) << "padding column written";
  }
}

TEST(Fp8BlockGemm, RandomShapesMatchCpu) {
  REQUIRE_GPU();
  Fp8BlockGemm gemm;
  struct Shape {
    int64_t M, N, K;
  };
  uint64_t seed = 100;
  for (const Shape s : {Shape{1, 64, 128}, Shape{2, 200, 300}, Shape{3, 129, 256}, Shape{4, 576, 640},
                        Shape{5, 100, 100}, Shape{7, 1, 16}, Shape{8, 8, 1000}, Shape{16, 128, 128},
                        Shape{17, 300, 384}, Shape{33, 256, 200}, Shape{64, 192, 512}, Shape{100, 640, 1152},
                        Shape{300, 200, 256}})
    check_shape(gemm, s.M, s.N, s.K, seed += 10, true);
}

// DeepSeek-V3.2's FP8 linears at M = 1, 2, 7, 64, 300 and 2048. The CPU reference runs once per shape for 2048 rows
// (its rows do not depend on the batch), each M is checked against its first M rows.
TEST(Fp8BlockGemm, DeepSeekShapesMatchCpu) {
  REQUIRE_GPU();
  Fp8BlockGemm gemm;
  struct Shape {
    const char* name;
    int64_t N, K;
  };
  constexpr int64_t kRowsList[] = {1, 2, 7, 64, 300, 2048};
  constexpr int64_t kMaxRows = 2048;
  uint64_t seed = 5000;
  for (const Shape s : {Shape{"kv_a_proj_with_mqa", 576, 7168}, Shape{"q_a_proj", 1536, 7168},
                        Shape{"q_b_proj", 24576, 1536}, Shape{"o_proj", 7168, 16384}, Shape{"mlp.gate_up", 18432, 7168},
                        Shape{"mlp.down", 7168, 18432}, Shape{"shared_expert.gate_up", 2048, 7168},
                        Shape{"shared_expert.down", 7168, 2048}, Shape{"indexer.wq_b", 8192, 1536},
                        Shape{"indexer.wk", 128, 7168}}) {
    SCOPED_TRACE(s.name);
    const auto t0 = std::chrono::steady_clock::now();
    const Weight w(s.N, s.K, seed += 10);
    const std::vector<float> x = fp8_check::random_activations(kMaxRows, s.K, s.K, seed + 3);
    const Reference ref = reference(x, kMaxRows, s.K, w);
    const double cpu_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const DeviceBuffer<float> dx = to_device(x);
    for (const int64_t M : kRowsList) {
      SCOPED_TRACE(testing::Message() << "M=" << M);
      const DeviceActivations a = quantize_on_device(dx, M, s.K, s.K, ref);
      Fp8BlockProblem p;
      p.a = a.view();
      p.w = w.view();
      const int64_t ldy = s.N + kPadColumns;
      DeviceBuffer<float> y(static_cast<size_t>((M + 1) * ldy));
      p.y = y.get();
      p.ldy = ldy;
      const Fp8BlockPath path = gemm.path(p);
      const double c = path == Fp8BlockPath::mma_fallback ? fp8_check::kMmaC : fp8_check::kCublasLtC;
      DeviceBuffer<uint8_t> ws(Fp8BlockGemm::workspace_bytes(M, s.N, s.K));
      double err2 = 0, ref2 = 0;
      const double worst = check_product(s.name, M, w, ref, c, false, [&](void* out, int64_t ld) {
        Fp8BlockProblem q = p;
        q.y = out;
        q.ldy = ld;
        gemm.run(q, ws.get(), ws.size(), nullptr);
      });
      const double worst_mma = check_product(s.name, M, w, ref, fp8_check::kMmaC, false,
                                             [&](void* out, int64_t ld) {
                                               Fp8BlockProblem q = p;
                                               q.y = out;
                                               q.ldy = ld;
                                               fp8_block_gemm_mma(q, nullptr);
                                             });
      // The whole output's relative error as well: a misplaced scale shows up there at ~1e-1.
      gemm.run(p, ws.get(), ws.size(), nullptr);
      test_util::sync();
      const std::vector<float> got = to_host(y);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < s.N; ++n) {
          const double d = static_cast<double>(got[m * ldy + n]) - ref.y[m * s.N + n];
          err2 += d * d;
          ref2 += static_cast<double>(ref.y[m * s.N + n]) * ref.y[m * s.N + n];
        }
      const double rel = std::sqrt(err2 / ref2);
      EXPECT_LE(rel, path == Fp8BlockPath::mma_fallback ? 1e-4 : 4e-3);
      std::printf("  %-22s N=%-6lld K=%-6lld M=%-5lld %-16s bound used %.3f, rel %.2e; fallback kernel %.3f\n",
                  s.name, static_cast<long long>(s.N), static_cast<long long>(s.K), static_cast<long long>(M),
                  path_name(path), worst, rel, worst_mma);
    }
    std::printf("  %-22s CPU reference %.1f s\n", s.name, cpu_s);
  }
}

// Quantization and product captured once in a CUDA graph and replayed on new activations give the bits of direct
// calls (the host decided nothing at capture time that depends on the values), for a staged and a direct shape.
TEST(Fp8BlockGemm, GraphReplayEqualsDirectCalls) {
  REQUIRE_GPU();
  Fp8BlockGemm gemm;
  for (const int64_t M : {int64_t{7}, int64_t{64}}) {
    const int64_t N = 576, K = 7168;
    const Weight w(N, K, 77 + M);
    DeviceBuffer<float> x(static_cast<size_t>(M * K)), y(static_cast<size_t>(M * N));
    DeviceBuffer<uint8_t> ws(Fp8BlockGemm::workspace_bytes(M, N, K));
    cudaStream_t stream;
    KESTREL_CUDA_CHECK(cudaStreamCreate(&stream));
    auto step = [&] { gemm.linear(x.get(), M, K, w.view(), y.get(), N, ws.get(), ws.size(), stream); };
    x.upload(fp8_check::random_activations(M, K, K, 1).data());
    step();  // the shape's heuristic query, outside the capture
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    step();
    KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int round = 0; round < 3; ++round) {
      x.upload(fp8_check::random_activations(M, K, K, 10 + round).data());
      test_util::fill_poison(y);
      step();
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::vector<float> direct = to_host(y);
      test_util::fill_poison(y);
      KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::vector<float> replayed = to_host(y);
      EXPECT_TRUE(std::all_of(direct.begin(), direct.end(), [](float v) { return std::isfinite(v); }));
      EXPECT_EQ(std::memcmp(direct.data(), replayed.data(), direct.size() * sizeof(float)), 0)
          << "M=" << M << " round " << round;
    }
    KESTREL_CUDA_CHECK(cudaGraphExecDestroy(exec));
    KESTREL_CUDA_CHECK(cudaGraphDestroy(graph));
    KESTREL_CUDA_CHECK(cudaStreamDestroy(stream));
  }
}

TEST(Fp8BlockGemm, RejectsBadArguments) {
  auto* p16 = reinterpret_cast<uint8_t*>(256);
  auto* f16 = reinterpret_cast<float*>(256);
  Fp8BlockProblem p;
  p.a = Fp8Activations{p16, f16, 4, 256};
  p.w = Fp8BlockWeight{p16, f16, 64, 256};
  p.y = f16;
  p.ldy = 64;
  EXPECT_NO_THROW(fp8_block_gemm_mma(Fp8BlockProblem{Fp8Activations{p16, f16, 0, 256}, p.w, f16, false, 64, false},
                                     nullptr));  // M = 0: nothing to do
  Fp8BlockProblem bad = p;
  bad.w.K = 128;  // the weight's K differs from the activations'
  EXPECT_THROW(fp8_block_gemm_mma(bad, nullptr), Error);
  bad = p;
  bad.ldy = 63;
  EXPECT_THROW(fp8_block_gemm_mma(bad, nullptr), Error);
  bad = p;
  bad.y_bf16 = true;
  bad.accumulate = true;  // accumulation needs fp32
  EXPECT_THROW(fp8_block_gemm_mma(bad, nullptr), Error);
  bad = p;
  bad.a.codes = p16 + 8;  // misaligned codes
  EXPECT_THROW(fp8_block_gemm_mma(bad, nullptr), Error);
  bad = p;
  bad.w.scales = nullptr;
  EXPECT_THROW(fp8_block_gemm_mma(bad, nullptr), Error);
  EXPECT_THROW(quantize_fp8_activations(f16, 4, 256, 255, p16, f16, nullptr), Error);  // ldx < K
  EXPECT_THROW(quantize_fp8_activations(f16, 4, 256, 256, p16 + 4, f16, nullptr), Error);  // misaligned codes
}

TEST(Fp8BlockGemm, RejectsSmallWorkspace) {
  REQUIRE_GPU();
  Fp8BlockGemm gemm;
  const Weight w(64, 256, 3);
  DeviceBuffer<float> x(7 * 256), y(7 * 64);
  DeviceBuffer<uint8_t> ws(Fp8BlockGemm::workspace_bytes(7, 64, 256));
  EXPECT_THROW(gemm.linear(x.get(), 7, 256, w.view(), y.get(), 64, ws.get(), ws.size() - 1, nullptr), Error);
  EXPECT_NO_THROW(gemm.linear(x.get(), 7, 256, w.view(), y.get(), 64, ws.get(), ws.size(), nullptr));
  test_util::sync();
}

}  // namespace
}  // namespace kestrel::cuda
