// Times the FP8 block-scaled linear (gemm_fp8.h) against cuBLASLt on the bf16 copy of the same weight (gemm.h) at
// decode shapes: M = 1, 2, 4, 8, 16, 64 rows of x; N x K = 7168 x 2048, 2048 x 7168 (DeepSeek-V3.2's 2048-wide
// expert down and up/gate), 24576 x 1536 (q_b), 7168 x 16384 (the attention output projection, 128 heads of 128),
// 7168 x 18432 (the dense FFN down projection) and 576 x 7168 (kv_a: 512 + 64). Each launch reads one of several
// copies of the weight, together well over the L2 cache, so that the weight comes from memory as in a model step.
// Two times per form, medians of CUDA-event-timed runs: a launch among the launches of a captured CUDA graph (one
// pass over the copies, at least kBatch launches; as in a captured model step, with no host launch cost between
// them; the GB/s, weight bytes streamed per second, FP8: codes + scales, bf16: 2 bytes a weight, and the ratio are
// from this one), and a launch alone (which adds the launch latency: ~15 MB of FP8 weight at 4 TB/s take under
// 4 us). cuBLASLt is capturable here because Gemm preallocates its workspace and the uncaptured warm-up pass makes
// the first call of each shape (its host-side heuristic query); should its capture fail anyway, its time is taken
// from the same launches back to back, and the line says so. Before timing, one launch of each form is checked
// against the other (a FAIL line, and exit status 1, when they disagree). GpuModel's kFp8MaxRows
// (src/gpu/gpu_model.cpp) is the largest M whose ratio is above 1.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <optional>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "event_timing.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_fp8.h"
#include "kernels/cuda/runtime.h"

namespace {

using kestrel::cuda::DeviceBuffer;

struct Shape {
  int64_t N, K;
};
constexpr Shape kShapes[] = {{7168, 2048}, {2048, 7168}, {24576, 1536}, {7168, 16384}, {7168, 18432}, {576, 7168}};
constexpr int64_t kRows[] = {1, 2, 4, 8, 16, 64};
constexpr int kBatch = 20;  // the fewest launches timed together
constexpr int kBlock = 128;
constexpr size_t kStreamBytes = size_t{512} << 20;  // per form: ten times the H200's 50 MB L2
// The bf16 weight is the FP8 weight rounded to bf16 (at most 2^-9 relative per weight), and both forms sum in fp32:
// the two outputs differ by at most about 2^-9 of the row's sum of |x||w|. Five times that is still far below what
// a wrong index or scale gives.
constexpr double kAgreeBound = 1e-2;

bool g_failed = false;

// Median time per launch of one(i, stream), i = 0 .. launches - 1, captured once into a CUDA graph and replayed;
// nullopt (and the stream left usable) when the capture fails.
template <typename F>
std::optional<double> graph_us(cudaStream_t stream, int launches, F&& one) {
  cudaGraph_t graph = nullptr;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  bool captured = true;
  try {
    for (int i = 0; i < launches; ++i) one(i, stream);
  } catch (const kestrel::Error& e) {
    std::printf("  (capture failed: %s)\n", e.what());
    captured = false;
  }
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  if (!captured || ended != cudaSuccess) {
    if (ended != cudaSuccess) std::printf("  (capture failed: %s)\n", cudaGetErrorString(ended));
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    return std::nullopt;
  }
  cudaGraphExec_t exec = nullptr;
  KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  KESTREL_CUDA_CHECK(cudaEventCreate(&a));
  KESTREL_CUDA_CHECK(cudaEventCreate(&b));
  constexpr int kWarm = 2, kIters = 20;
  std::vector<double> us;
  for (int it = 0; it < kWarm + kIters; ++it) {
    KESTREL_CUDA_CHECK(cudaEventRecord(a, stream));
    KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KESTREL_CUDA_CHECK(cudaEventRecord(b, stream));
    KESTREL_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (it >= kWarm) us.push_back(ms * 1e3 / launches);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// y8 (the FP8 form) against y16 (cuBLASLt on the bf16 weight), both [M, N] fp32, on every row of x and about 64
// rows of W spread over N (all of them would take minutes on the host at the largest shapes).
void check_agree(int64_t N, int64_t K, int64_t M, const std::vector<uint16_t>& x, const std::vector<uint16_t>& w_bf16,
                 const std::vector<float>& y8, const std::vector<float>& y16) {
  std::vector<int64_t> rows;
  for (int64_t n = 0; n < N; n += std::max<int64_t>(1, N / 64)) rows.push_back(n);
  if (rows.back() != N - 1) rows.push_back(N - 1);
  int bad = 0;
  for (int64_t n : rows)
    for (int64_t m = 0; m < M; ++m) {
      double mag = 0;
      for (int64_t k = 0; k < K; ++k)
        mag += std::fabs(static_cast<double>(kestrel::bf16_to_f32(x[m * K + k])) * kestrel::bf16_to_f32(w_bf16[n * K + k]));
      const double a = y8[m * N + n], b = y16[m * N + n];
      if (!(std::fabs(a - b) <= kAgreeBound * mag) && bad++ < 3)
        std::printf("FAIL N=%lld K=%lld M=%lld: y[%lld, %lld] fp8 %.6g, bf16 %.6g (bound %.3g of sum |x||w| %.6g)\n",
                    static_cast<long long>(N), static_cast<long long>(K), static_cast<long long>(M),
                    static_cast<long long>(m), static_cast<long long>(n), a, b, kAgreeBound, mag);
    }
  if (bad > 0) g_failed = true;
}

void bench(const Shape& s, kestrel::cuda::Gemm& gemm, cudaStream_t stream, std::mt19937& rng) {
  const int64_t N = s.N, K = s.K, rb = (N + kBlock - 1) / kBlock, cb = (K + kBlock - 1) / kBlock;
  const size_t fp8_bytes = static_cast<size_t>(N * K + rb * cb * 4), bf16_bytes = static_cast<size_t>(2 * N * K);
  const int copies = static_cast<int>(std::max<size_t>(2, kStreamBytes / bf16_bytes));
  const int launches = std::max(kBatch, copies);  // one graph reads every copy
  // One random weight, repeated: every copy has the same values (the timing does not depend on them).
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> codes(static_cast<size_t>(N * K));
  for (uint8_t& c : codes) {
    do c = static_cast<uint8_t>(byte(rng));
    while ((c & 0x7F) == 0x7F);
  }
  std::vector<float> scales(static_cast<size_t>(rb * cb));
  std::uniform_real_distribution<float> scale(1e-4f, 1e-3f);
  for (float& v : scales) v = scale(rng);
  std::vector<uint16_t> w_bf16(codes.size());
  for (int64_t r = 0; r < N; ++r)
    for (int64_t c = 0; c < K; ++c)
      w_bf16[r * K + c] = kestrel::f32_to_bf16(kestrel::e4m3_to_f32(codes[r * K + c]) * scales[(r / kBlock) * cb + c / kBlock]);
  DeviceBuffer<uint8_t> d_codes(codes.size() * copies);
  DeviceBuffer<float> d_scales(scales.size() * copies);
  DeviceBuffer<uint16_t> d_w(w_bf16.size() * copies);
  for (int i = 0; i < copies; ++i) {
    KESTREL_CUDA_CHECK(cudaMemcpy(d_codes.get() + i * codes.size(), codes.data(), codes.size(), cudaMemcpyHostToDevice));
    KESTREL_CUDA_CHECK(cudaMemcpy(d_scales.get() + i * scales.size(), scales.data(), scales.size() * 4,
                                  cudaMemcpyHostToDevice));
    KESTREL_CUDA_CHECK(cudaMemcpy(d_w.get() + i * w_bf16.size(), w_bf16.data(), w_bf16.size() * 2,
                                  cudaMemcpyHostToDevice));
  }
  const int64_t M_max = kRows[std::size(kRows) - 1];
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(M_max * K));
  for (uint16_t& v : x) v = kestrel::f32_to_bf16(normal(rng));
  DeviceBuffer<uint16_t> d_x = kestrel::cuda::to_device(x);
  DeviceBuffer<float> d_y8(static_cast<size_t>(M_max * N)), d_y16(static_cast<size_t>(M_max * N));

  for (int64_t M : kRows) {
    auto fp8 = [&](int i, cudaStream_t st) {
      const int c = i % copies;
      const kestrel::cuda::Fp8BlockMatrix w{d_codes.get() + c * codes.size(), d_scales.get() + c * scales.size(), N, K,
                                            kBlock};
      kestrel::cuda::linear_fp8(d_x.get(), M, K, w, d_y8.get(), N, st);
    };
    auto bf16 = [&](int i, cudaStream_t st) {
      gemm.linear(d_x.get(), M, K, K, d_w.get() + (i % copies) * w_bf16.size(), N, d_y16.get(), N, st);
    };
    // Uncaptured warm-up over every launch of the graph: cuBLASLt's first call of a shape (and pointer alignment)
    // queries its heuristic on the host, which a capture must not do.
    for (int i = 0; i < launches; ++i) {
      fp8(i, stream);
      bf16(i, stream);
    }
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
    check_agree(N, K, M, x, w_bf16, kestrel::cuda::to_host(d_y8), kestrel::cuda::to_host(d_y16));

    auto alone_us = [&](auto& one) { return kestrel::bench::median_us(50, 10, [&](int i) { one(i, nullptr); }); };
    auto batched_us = [&](auto& one, bool& captured) {
      if (const std::optional<double> us = graph_us(stream, launches, one)) return *us;
      captured = false;
      return kestrel::bench::median_us(20, 2, [&](int i) {
               for (int b = 0; b < launches; ++b) one(i * launches + b, nullptr);
             }) /
             launches;
    };
    const double fp8_alone = alone_us(fp8), bf16_alone = alone_us(bf16);
    bool fp8_graph = true, bf16_graph = true;
    const double fp8_us = batched_us(fp8, fp8_graph), bf16_us = batched_us(bf16, bf16_graph);
    std::printf("N=%-6lld K=%-6lld M=%-3lld  fp8 %7.2f us%s (alone %7.2f) %5.0f GB/s | cuBLASLt bf16 %7.2f us%s (alone "
                "%7.2f) %5.0f GB/s | fp8 x%.2f\n",
                static_cast<long long>(N), static_cast<long long>(K), static_cast<long long>(M), fp8_us,
                fp8_graph ? "" : " back-to-back", fp8_alone, fp8_bytes / (fp8_us * 1e3), bf16_us,
                bf16_graph ? "" : " back-to-back", bf16_alone, bf16_bytes / (bf16_us * 1e3), bf16_us / fp8_us);
  }
}

int run() {
  cudaDeviceProp prop;
  KESTREL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %.0f MB; FP8 e4m3 weights with 128x128 fp32 block scales vs bf16 (per launch "
              "among at least %d in a CUDA graph, and alone; GB/s: weight bytes streamed per second, in the graph)\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6, kBatch);
  std::mt19937 rng(2028);
  kestrel::cuda::Gemm gemm;
  cudaStream_t stream = nullptr;
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const Shape& s : kShapes) bench(s, gemm, stream, rng);
  cudaStreamDestroy(stream);
  if (g_failed) std::printf("FAIL: the FP8 and bf16 outputs disagree (lines above)\n");
  return g_failed ? 1 : 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const kestrel::Error& e) {
    std::fprintf(stderr, "gemm_fp8_bench: %s\n", e.what());
    return 1;
  }
}
