// Times the FP8 block-scaled linear (gemm_fp8.h) against cuBLASLt on the bf16 copy of the same weight (gemm.h) at
// decode shapes: M = 1, 2, 4, 8, 16, 64 rows of x; N x K = 7168 x 2048, 2048 x 7168, 24576 x 1536 (DeepSeek-V3.2's
// FFN down/up and q_b widths). Each launch reads one of several copies of the weight, together well over the L2
// cache, so that the weight comes from memory as in a model step. Two times per form, medians of CUDA-event-timed
// runs: a launch among kBatch back-to-back ones (as in a captured model step; the GB/s, weight bytes streamed per
// second, FP8: codes + scales, bf16: 2 bytes a weight, and the ratio are from this one), and a launch alone
// (which adds the launch latency: 15 us of FP8 weight at 4 TB/s take under 4 us). GpuModel's kFp8MaxRows
// (src/gpu/gpu_model.cpp) is the largest M whose ratio is above 1.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <iterator>
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
constexpr Shape kShapes[] = {{7168, 2048}, {2048, 7168}, {24576, 1536}};
constexpr int64_t kRows[] = {1, 2, 4, 8, 16, 64};
constexpr int kBatch = 20;  // launches timed together
constexpr int kBlock = 128;
constexpr size_t kStreamBytes = size_t{512} << 20;  // per form: ten times the H200's 50 MB L2

void bench(const Shape& s, kestrel::cuda::Gemm& gemm, std::mt19937& rng) {
  const int64_t N = s.N, K = s.K, rb = (N + kBlock - 1) / kBlock, cb = (K + kBlock - 1) / kBlock;
  const size_t fp8_bytes = static_cast<size_t>(N * K + rb * cb * 4), bf16_bytes = static_cast<size_t>(2 * N * K);
  const int copies = static_cast<int>(std::max<size_t>(2, kStreamBytes / bf16_bytes));
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
  DeviceBuffer<float> d_y(static_cast<size_t>(M_max * N));

  for (int64_t M : kRows) {
    auto fp8 = [&](int i) {
      const int c = i % copies;
      const kestrel::cuda::Fp8BlockMatrix w{d_codes.get() + c * codes.size(), d_scales.get() + c * scales.size(), N, K,
                                            kBlock};
      kestrel::cuda::linear_fp8(d_x.get(), M, K, w, d_y.get(), N, nullptr);
    };
    auto bf16 = [&](int i) {
      gemm.linear(d_x.get(), M, K, K, d_w.get() + (i % copies) * w_bf16.size(), N, d_y.get(), N, nullptr);
    };
    auto batched_us = [&](auto& one) {
      return kestrel::bench::median_us(20, 2, [&](int i) {
               for (int b = 0; b < kBatch; ++b) one(i * kBatch + b);
             }) /
             kBatch;
    };
    const double fp8_alone = kestrel::bench::median_us(50, 10, fp8);
    const double bf16_alone = kestrel::bench::median_us(50, 10, bf16);
    const double fp8_us = batched_us(fp8), bf16_us = batched_us(bf16);
    std::printf("N=%-6lld K=%-6lld M=%-3lld  fp8 %7.2f us (alone %7.2f) %5.0f GB/s | cuBLASLt bf16 %7.2f us (alone "
                "%7.2f) %5.0f GB/s | fp8 x%.2f\n",
                static_cast<long long>(N), static_cast<long long>(K), static_cast<long long>(M), fp8_us, fp8_alone,
                fp8_bytes / (fp8_us * 1e3), bf16_us, bf16_alone, bf16_bytes / (bf16_us * 1e3), bf16_us / fp8_us);
  }
}

int run() {
  cudaDeviceProp prop;
  KESTREL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %.0f MB; FP8 e4m3 weights with 128x128 fp32 block scales vs bf16 (per launch "
              "among %d back-to-back, and alone; GB/s: weight bytes streamed per second, back-to-back)\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6, kBatch);
  std::mt19937 rng(2028);
  kestrel::cuda::Gemm gemm;
  for (const Shape& s : kShapes) bench(s, gemm, rng);
  return 0;
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
