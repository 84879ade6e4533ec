// Times one sampling step, cuda::sample_rows (src/kernels/cuda/sampling.h), with the head path (the default) and
// with full_sort (every row sorting its whole vocabulary), at B = 1, 8, 32, 64, 256 rows of vocab 163840 and
// 129280. Rows: normal logits of standard deviation --sd (default 5; LLM-like: at temperature 1 and top-p 0.95
// the head is a few hundred tokens; at sd 4 a few thousand, past the head path's 2048), every row its own.
// Configurations: top-p 0.95 at temperature 1 (the line: <= 30 us at B <= 64), top-k 50 + top-p 0.95 at
// 0.7, and top-p 1 at temperature 1 (no cut: the full sort either way, for its cost).
// Two times per form, medians of CUDA-event-timed runs: the call's launches alone on the default stream, and one
// replay of the call captured in a CUDA graph (as in a captured decode step). The logits are the same buffer
// every run, so at small B they sit in L2 as a freshly written logits row would.
// Before timing, the head path's tokens are checked against the full sort's (a FAIL line and exit status 1 when
// any row differs); the line gives how many rows the head path drew.
// Usage: sampling_bench [--sd S] [--iters N]
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "event_timing.h"
#include "kernels/cuda/runtime.h"
#include "kernels/cuda/sampling.h"

namespace {

using kestrel::cuda::DeviceBuffer;
using kestrel::cuda::SampleRowParams;
using kestrel::cuda::SampleRowsArgs;

struct Config {
  const char* name;
  float temperature, top_p;
  int top_k;
};
constexpr Config kConfigs[] = {{"top-p 0.95, T 1", 1.0f, 0.95f, 0},
                               {"top-k 50 + top-p 0.95, T 0.7", 0.7f, 0.95f, 50},
                               {"top-p 1, T 1", 1.0f, 1.0f, 0}};
constexpr int64_t kVocabs[] = {163840, 129280};
constexpr int64_t kBatches[] = {1, 8, 32, 64, 256};
constexpr int64_t kMaxRows = 256;

// One call's buffers; time() gives the direct and the graph-replay medians.
struct Step {
  SampleRowsArgs args;
  DeviceBuffer<uint8_t> workspace;
  cudaStream_t stream = nullptr;
  cudaGraphExec_t exec = nullptr;

  Step(SampleRowsArgs a, size_t bytes) : args(a), workspace(bytes) {
    KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    launch(stream);  // the first call outside the capture (CUB's one-time queries)
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaGraph_t graph = nullptr;
    KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    launch(stream);
    KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    KESTREL_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  ~Step() {
    cudaGraphExecDestroy(exec);
    cudaStreamDestroy(stream);
  }
  void launch(cudaStream_t s) { kestrel::cuda::sample_rows(args, workspace.get(), workspace.bytes(), s); }
};

int run(float sd, int iters) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, sd);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  int failures = 0;
  std::printf("sampling_bench: logits N(0, %.2f^2), median of %d runs; us per step (direct launches | graph replay)\n",
              sd, iters);
  for (const int64_t V : kVocabs) {
    std::vector<float> logits(static_cast<size_t>(kMaxRows * V));
    for (float& x : logits) x = normal(rng);
    DeviceBuffer<float> d_logits = kestrel::cuda::to_device(logits);
    DeviceBuffer<int32_t> d_tokens(kMaxRows), d_drawn(kMaxRows);
    for (const Config& c : kConfigs) {
      std::vector<SampleRowParams> params(kMaxRows);
      for (SampleRowParams& p : params) {
        p.temperature = c.temperature;
        p.top_p = c.top_p;
        p.top_k = c.top_k;
        p.uniform = uniform(rng);
      }
      DeviceBuffer<SampleRowParams> d_params = kestrel::cuda::to_device(params);
      for (const int64_t B : kBatches) {
        SampleRowsArgs a;
        a.logits = d_logits.get();
        a.logit_rows = B;
        a.vocab = V;
        a.rows = B;
        a.params = d_params.get();
        a.tokens = d_tokens.get();
        a.head_drawn = d_drawn.get();
        const size_t bytes = kestrel::cuda::sample_rows_workspace_bytes(B, V);
        double us[2][2];
        std::vector<int32_t> tokens[2];
        int drawn = 0;
        for (int full = 0; full < 2; ++full) {
          a.full_sort = full == 1;
          Step step(a, bytes);
          step.launch(nullptr);
          KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
          tokens[full] = kestrel::cuda::to_host(d_tokens);
          tokens[full].resize(static_cast<size_t>(B));
          if (full == 0) {
            std::vector<int32_t> d = kestrel::cuda::to_host(d_drawn);
            for (int64_t r = 0; r < B; ++r) drawn += d[r];
          }
          us[full][0] = kestrel::bench::median_us(iters, 3, [&](int) { step.launch(nullptr); });
          us[full][1] = kestrel::bench::median_us(iters, 3, [&](int) {
            KESTREL_CUDA_CHECK(cudaGraphLaunch(step.exec, nullptr));
          });
        }
        int differ = 0;
        for (int64_t r = 0; r < B; ++r) differ += tokens[0][r] != tokens[1][r];
        if (differ > 0) {
          ++failures;
          std::printf("FAIL V=%lld B=%lld %s: %d rows differ from the full sort\n", static_cast<long long>(V),
                      static_cast<long long>(B), c.name, differ);
        }
        std::printf("V=%-6lld B=%-3lld %-30s head %8.1f | %8.1f   full sort %8.1f | %8.1f   x%5.1f | x%5.1f  "
                    "head rows %lld/%lld\n",
                    static_cast<long long>(V), static_cast<long long>(B), c.name, us[0][0], us[0][1], us[1][0],
                    us[1][1], us[1][0] / us[0][0], us[1][1] / us[0][1], static_cast<long long>(drawn),
                    static_cast<long long>(B));
        std::fflush(stdout);
      }
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  float sd = 5.0f;
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--sd" && i + 1 < argc) {
      sd = std::strtof(argv[++i], nullptr);
    } else if (arg == "--iters" && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: sampling_bench [--sd S] [--iters N]\n");
      return 2;
    }
  }
  try {
    return run(sd, iters);
  } catch (const kestrel::Error& e) {
    std::fprintf(stderr, "sampling_bench: %s\n", e.what());
    return 1;
  }
}
