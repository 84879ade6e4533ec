// Times the FP8 block-scaled paths of gemm_fp8_block.h and moe.h against their bf16 counterparts at DeepSeek-V3.2's
// shapes.
//  Dense: the FP8 path (quantize the fp32 activations + cuBLASLt's block-scaled FP8 matmul, or the fallback kernel
//    where cuBLASLt has none; the path is printed), the activation quantization alone, cuBLASLt bf16 on a bf16 copy of
//    the weight (cuda::Gemm, bf16 activations: the conversion is not timed) and the weight-streaming kernel
//    cuda::linear_fp8 (gemm_fp8.h, bf16 activations; M <= 64 only: it makes ceil(M / 8) passes over the weight), at
//    M = 1, 2, 4, 8, 16, 32, 64, 256, 2048 on kv_a, q_a, q_b, o_proj, the dense FFN, the shared expert and the
//    indexer's wq_b and wk.
//  MoE: moe_experts with FP8 block-scaled experts (fp32 activations) against bf16 experts (bf16 activations) at
//    T = 1, 8, 64, 512, 4096 tokens, D = 7168, F = 2048, 256 experts, top-8, random routing.
// Each time is per call among the calls of a captured CUDA graph (median of 10 replays), every call reading another
// copy of the weights (dense: together at least 256 MB per form, five times the L2) or, for the experts, another
// routing (4 sets), so that weights come from memory as in a model step. Weight bytes per second count the FP8 codes
// and scales (dense: the whole weight; MoE: the distinct experts the routing touches) or 2 bytes per bf16 weight;
// TFLOP/s count 2 M N K (MoE: 2 * 3 F D per (token, slot)). The weights are random codes (a 64 MB pattern repeated),
// their values do not matter to the timing. Correctness is the tests' (gemm_fp8_block_test, moe_cuda_test).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_fp8.h"
#include "kernels/cuda/gemm_fp8_block.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/runtime.h"

namespace {

using kestrel::cuda::DeviceBuffer;

constexpr size_t kStreamBytes = size_t{256} << 20;  // per form: the weight copies of one dense shape together
constexpr size_t kPatternBytes = size_t{64} << 20;
constexpr int kMinLaunches = 20;
constexpr int kReplays = 10;

// A host pattern of random bytes (no e4m3 NaN codes), repeated over `bytes` of device memory.
void fill_codes(uint8_t* d, size_t bytes, std::mt19937& rng) {
  std::vector<uint8_t> pattern(std::min(bytes, kPatternBytes));
  std::uniform_int_distribution<int> byte(0, 255);
  for (uint8_t& b : pattern) {
    b = static_cast<uint8_t>(byte(rng));
    if ((b & 0x7F) == 0x7F) --b;
  }
  KESTREL_CUDA_CHECK(cudaMemcpy(d, pattern.data(), pattern.size(), cudaMemcpyHostToDevice));
  for (size_t at = pattern.size(); at < bytes; at += pattern.size())
    KESTREL_CUDA_CHECK(cudaMemcpy(d + at, d, std::min(pattern.size(), bytes - at), cudaMemcpyDeviceToDevice));
}

// bf16 weights: random e4m3 values times 2^-9, as bf16 bits, repeated likewise.
void fill_bf16(uint16_t* d, size_t n, std::mt19937& rng) {
  std::vector<uint16_t> pattern(std::min(n, kPatternBytes / 2));
  std::uniform_int_distribution<int> byte(0, 255);
  for (uint16_t& v : pattern) {
    uint8_t c = static_cast<uint8_t>(byte(rng));
    if ((c & 0x7F) == 0x7F) --c;
    v = kestrel::f32_to_bf16(std::ldexp(kestrel::e4m3_to_f32(c), -9));
  }
  KESTREL_CUDA_CHECK(cudaMemcpy(d, pattern.data(), pattern.size() * 2, cudaMemcpyHostToDevice));
  for (size_t at = pattern.size(); at < n; at += pattern.size())
    KESTREL_CUDA_CHECK(cudaMemcpy(d + at, d, std::min(pattern.size(), n - at) * 2, cudaMemcpyDeviceToDevice));
}

void fill_scales(float* d, size_t n, std::mt19937& rng) {
  std::vector<float> s(n);
  std::uniform_real_distribution<float> u(1.0f, 2.0f);
  for (float& v : s) v = std::ldexp(u(rng), -10);
  KESTREL_CUDA_CHECK(cudaMemcpy(d, s.data(), n * sizeof(float), cudaMemcpyHostToDevice));
}

std::vector<float> random_rows(int64_t rows, int64_t cols, std::mt19937& rng) {
  std::vector<float> x(static_cast<size_t>(rows * cols));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : x) v = normal(rng);
  return x;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = kestrel::f32_to_bf16(x[i]);
  return b;
}

// Median time per call of one(i, stream), i = 0 .. launches - 1, captured into a CUDA graph and replayed.
template <typename F>
double graph_us(cudaStream_t stream, int launches, F&& one) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < launches; ++i) one(i, stream);
  KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  KESTREL_CUDA_CHECK(cudaEventCreate(&a));
  KESTREL_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> us;
  for (int it = 0; it < kReplays + 1; ++it) {  // the first replay warms up
    KESTREL_CUDA_CHECK(cudaEventRecord(a, stream));
    KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KESTREL_CUDA_CHECK(cudaEventRecord(b, stream));
    KESTREL_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (it > 0) us.push_back(ms * 1e3 / launches);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

const char* path_name(kestrel::cuda::Fp8BlockPath p) {
  switch (p) {
    case kestrel::cuda::Fp8BlockPath::cublaslt: return "cublaslt";
    case kestrel::cuda::Fp8BlockPath::cublaslt_staged: return "staged";
    case kestrel::cuda::Fp8BlockPath::mma_fallback: return "fallback";
  }
  return "?";
}

struct Shape {
  const char* name;
  int64_t N, K;
};

void bench_dense(const Shape& s, kestrel::cuda::Fp8BlockGemm& gemm8, kestrel::cuda::Gemm& gemm16, cudaStream_t stream,
                 std::mt19937& rng) {
  using namespace kestrel::cuda;
  constexpr int64_t kRows[] = {1, 2, 4, 8, 16, 32, 64, 256, 2048};
  constexpr int64_t kMaxRows = 2048, kStreamingMaxRows = 64;
  const int64_t N = s.N, K = s.K;
  const Fp8BlockWeightLayout l = fp8_block_weight_layout(N, K);
  const size_t fp8_bytes = l.code_bytes() + l.scale_bytes(), bf16_bytes = static_cast<size_t>(2 * N * K);
  const int copies8 = static_cast<int>(std::max<size_t>(2, (kStreamBytes + fp8_bytes - 1) / fp8_bytes));
  const int copies16 = static_cast<int>(std::max<size_t>(2, (kStreamBytes + bf16_bytes - 1) / bf16_bytes));
  DeviceBuffer<uint8_t> codes(l.code_bytes() * copies8);
  DeviceBuffer<float> scales(l.scale_bytes() / sizeof(float) * copies8);
  DeviceBuffer<uint16_t> w16(static_cast<size_t>(N * K) * copies16);
  fill_codes(codes.get(), codes.bytes(), rng);
  fill_scales(scales.get(), scales.size(), rng);
  fill_bf16(w16.get(), w16.size(), rng);
  auto w8 = [&](int i) {
    const int c = i % copies8;
    return Fp8BlockWeight{codes.get() + c * l.code_bytes(), scales.get() + c * (l.scale_bytes() / sizeof(float)), N,
                          K};
  };
  const std::vector<float> x = random_rows(kMaxRows, K, rng);
  const DeviceBuffer<float> dx = to_device(x);
  const DeviceBuffer<uint16_t> dx16 = to_device(to_bf16(x));
  DeviceBuffer<float> y(static_cast<size_t>(kMaxRows * N));
  DeviceBuffer<uint8_t> ws(Fp8BlockGemm::workspace_bytes(kMaxRows - 1, N, K));  // the largest of the M below
  const Fp8ActivationLayout al = fp8_activation_layout(kMaxRows, K);
  DeviceBuffer<uint8_t> act_codes(al.code_bytes());
  DeviceBuffer<float> act_scales(al.scale_bytes() / sizeof(float));

  std::printf("%s: N=%lld K=%lld, FP8 %.1f MB, bf16 %.1f MB\n", s.name, static_cast<long long>(N),
              static_cast<long long>(K), fp8_bytes / 1e6, bf16_bytes / 1e6);
  for (const int64_t M : kRows) {
    const size_t ws_bytes = Fp8BlockGemm::workspace_bytes(M, N, K);
    auto fp8 = [&](int i, cudaStream_t st) { gemm8.linear(dx.get(), M, K, w8(i), y.get(), N, ws.get(), ws_bytes, st); };
    auto quantize = [&](int, cudaStream_t st) {
      quantize_fp8_activations(dx.get(), M, K, K, act_codes.get(), act_scales.get(), st);
    };
    auto bf16 = [&](int i, cudaStream_t st) {
      gemm16.linear(dx16.get(), M, K, K, w16.get() + static_cast<size_t>(i % copies16) * N * K, N, y.get(), N, st);
    };
    auto streaming = [&](int i, cudaStream_t st) {
      const Fp8BlockWeight w = w8(i);
      linear_fp8(dx16.get(), M, K, Fp8BlockMatrix{w.codes, w.scales, N, K, 128}, y.get(), N, st);
    };
    const bool streams = M <= kStreamingMaxRows && l.same_as_checkpoint();
    const int launches = std::max({kMinLaunches, copies8, copies16});
    // Uncaptured first calls: cuBLASLt's heuristic queries (per shape) happen on the host, outside the capture.
    for (int i = 0; i < launches; ++i) {
      fp8(i, stream);
      bf16(i, stream);
    }
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
    Fp8BlockProblem p;
    p.a = Fp8Activations{act_codes.get(), act_scales.get(), M, K};
    p.w = w8(0);
    p.y = y.get();
    p.ldy = N;
    const Fp8BlockPath path = gemm8.path(p);
    const double t8 = graph_us(stream, launches, fp8), tq = graph_us(stream, launches, quantize);
    const double t16 = graph_us(stream, launches, bf16);
    const double ts = streams ? graph_us(stream, launches, streaming) : 0.0;
    const double flop = 2.0 * M * N * K;
    std::printf("  M=%-5lld fp8 %-8s %9.2f us %5.2f TB/s %7.1f TFLOP/s (quantize %6.2f us) | bf16 %9.2f us %5.2f TB/s "
                "%7.1f TFLOP/s | x%.2f",
                static_cast<long long>(M), path_name(path), t8, fp8_bytes / (t8 * 1e6), flop / (t8 * 1e6), tq, t16,
                bf16_bytes / (t16 * 1e6), flop / (t16 * 1e6), t16 / t8);
    if (streams)
      std::printf(" | linear_fp8 %8.2f us %5.2f TB/s x%.2f", ts, fp8_bytes / (ts * 1e6), ts / t8);
    std::printf("\n");
  }
}

void bench_moe(cudaStream_t stream, std::mt19937& rng) {
  using namespace kestrel::cuda;
  constexpr int E = 256, top_k = 8, kRoutings = 4;
  constexpr int64_t D = 7168, F = 2048;
  constexpr int64_t kTokens[] = {1, 8, 64, 512, 4096};
  constexpr int64_t kMaxT = 4096;
  const size_t expert_fp8 = static_cast<size_t>(3 * F * D);
  const size_t w13_scales = static_cast<size_t>(E) * (2 * F / 128) * (D / 128);
  const size_t w2_scales = static_cast<size_t>(E) * (D / 128) * (F / 128);
  const size_t expert_scale_bytes = (w13_scales + w2_scales) / E * sizeof(float);
  DeviceBuffer<uint8_t> w13(static_cast<size_t>(E) * 2 * F * D), w2(static_cast<size_t>(E) * D * F);
  DeviceBuffer<float> s13(w13_scales), s2(w2_scales);
  DeviceBuffer<uint16_t> b13(w13.size()), b2(w2.size());
  fill_codes(w13.get(), w13.bytes(), rng);
  fill_codes(w2.get(), w2.bytes(), rng);
  fill_scales(s13.get(), s13.size(), rng);
  fill_scales(s2.get(), s2.size(), rng);
  fill_bf16(b13.get(), b13.size(), rng);
  fill_bf16(b2.get(), b2.size(), rng);
  MoeExpertWeights w8;
  w8.dtype = ExpertDtype::fp8_block;
  w8.n_experts = E;
  w8.D = D;
  w8.F = F;
  w8.fp8_w13 = w13.get();
  w8.fp8_w13_scales = s13.get();
  w8.fp8_w2 = w2.get();
  w8.fp8_w2_scales = s2.get();
  MoeExpertWeights w16;
  w16.dtype = ExpertDtype::bf16;
  w16.n_experts = E;
  w16.D = D;
  w16.F = F;
  w16.w13 = b13.get();
  w16.w2 = b2.get();

  const std::vector<float> x = random_rows(kMaxT, D, rng);
  const DeviceBuffer<float> dx = to_device(x);
  const DeviceBuffer<uint16_t> dx16 = to_device(to_bf16(x));
  DeviceBuffer<float> y(static_cast<size_t>(kMaxT * D));
  DeviceBuffer<uint8_t> ws8(moe_workspace_bytes(kMaxT, top_k, E, D, F, ExpertDtype::fp8_block));
  DeviceBuffer<uint8_t> ws16(moe_workspace_bytes(kMaxT, top_k, E, D, F, ExpertDtype::bf16));
  std::printf("MoE experts: D=%lld F=%lld E=%d top-%d; FP8 %.1f MB per expert, bf16 %.1f MB\n",
              static_cast<long long>(D), static_cast<long long>(F), E, top_k,
              (expert_fp8 + expert_scale_bytes) / 1e6, 2.0 * 3 * F * D / 1e6);
  for (const int64_t T : kTokens) {
    // kRoutings random routings of T tokens (top_k distinct experts each), and how many distinct experts each touches.
    std::vector<DeviceBuffer<int32_t>> ids;
    std::vector<DeviceBuffer<float>> weights;
    double touched = 0;
    for (int r = 0; r < kRoutings; ++r) {
      std::vector<int32_t> h(static_cast<size_t>(T * top_k));
      std::vector<float> wt(h.size());
      std::vector<int32_t> pool(E);
      std::vector<char> used(E, 0);
      std::uniform_real_distribution<float> u(0.05f, 1.0f);
      for (int64_t t = 0; t < T; ++t) {
        std::iota(pool.begin(), pool.end(), 0);
        for (int s = 0; s < top_k; ++s) {
          std::uniform_int_distribution<int> pick(s, E - 1);
          std::swap(pool[s], pool[pick(rng)]);
          h[t * top_k + s] = pool[s];
          wt[t * top_k + s] = u(rng);
          used[pool[s]] = 1;
        }
      }
      touched += std::count(used.begin(), used.end(), 1);
      ids.push_back(to_device(h));
      weights.push_back(to_device(wt));
    }
    touched /= kRoutings;
    auto fp8 = [&](int i, cudaStream_t st) {
      moe_experts(dx.get(), T, ids[i % kRoutings].get(), weights[i % kRoutings].get(), top_k, w8, y.get(), ws8.get(),
                  ws8.size(), st);
    };
    auto bf16 = [&](int i, cudaStream_t st) {
      moe_experts(dx16.get(), T, ids[i % kRoutings].get(), weights[i % kRoutings].get(), top_k, w16, y.get(),
                  ws16.get(), ws16.size(), st);
    };
    const int launches = T >= 4096 ? 2 : T >= 512 ? 4 : 8;
    const double t8 = graph_us(stream, launches, fp8), t16 = graph_us(stream, launches, bf16);
    const double flop = 2.0 * T * top_k * 3.0 * F * D;
    const double bytes8 = touched * (expert_fp8 + expert_scale_bytes), bytes16 = touched * 2.0 * 3 * F * D;
    std::printf("  T=%-5lld experts touched %5.1f | fp8 %10.2f us %5.2f TB/s %7.1f TFLOP/s | bf16 %10.2f us %5.2f TB/s "
                "%7.1f TFLOP/s | x%.2f\n",
                static_cast<long long>(T), touched, t8, bytes8 / (t8 * 1e6), flop / (t8 * 1e6), t16,
                bytes16 / (t16 * 1e6), flop / (t16 * 1e6), t16 / t8);
  }
}

int run() {
  cudaDeviceProp prop;
  KESTREL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %.0f MB; per call among >= %d calls of a captured CUDA graph, median of %d "
              "replays\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6, kMinLaunches, kReplays);
  std::mt19937 rng(2029);
  kestrel::cuda::Fp8BlockGemm gemm8;
  kestrel::cuda::Gemm gemm16;
  cudaStream_t stream = nullptr;
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const Shape shapes[] = {{"kv_a_proj_with_mqa", 576, 7168}, {"q_a_proj", 1536, 7168},  {"q_b_proj", 24576, 1536},
                          {"o_proj", 7168, 16384},           {"mlp.gate|up", 18432, 7168}, {"mlp.down", 7168, 18432},
                          {"shared_expert.gate|up", 2048, 7168}, {"shared_expert.down", 7168, 2048},
                          {"indexer.wq_b", 8192, 1536},      {"indexer.wk", 128, 7168}};
  for (const Shape& s : shapes) bench_dense(s, gemm8, gemm16, stream, rng);
  bench_moe(stream, rng);
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const kestrel::Error& e) {
    std::fprintf(stderr, "gemm_fp8_block_bench: %s\n", e.what());
    return 1;
  }
}
