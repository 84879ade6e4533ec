// Times Kestrel's CUDA KDA kernels on the shapes of bench/results/kda_h200.md: decode (H=32, d=128,
// N = 1 / 64 / 256 sequences) and varlen chunked prefill (B=1, H=32, d=128, T = 4096 / 32768), fp32 state.
// Medians over repeats after warm-up, timed with CUDA events; decode is timed as CUDA-graph replays of many
// launches that walk over different state slots and inputs, so that neither launch gaps nor the L2 cache (60 MB)
// flatter it. Also measures the device-to-device copy bandwidth in the same run, as the memory roofline.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/runtime.h"
#include "kda_bench_inputs.h"

namespace {

using kestrel::cuda::DeviceBuffer;
using kestrel::cuda::KdaInputs;
using kestrel::cuda::KdaPrefillPlan;

constexpr int kH = kestrel::bench::kKdaHeads, kD = kestrel::bench::kKdaDim;
constexpr double kCopyTBs = 4.27;  // BENCHMARKING.md, device-to-device copy on one H200
// Peers from BENCHMARKING.md (fla on one H200, 2026-11-30); NOT re-measured in this run.
constexpr double kFlaRecurrentUs[] = {46, 77, 297};  // fused_recurrent_kda, N = 1 / 64 / 256
constexpr double kFlaChunkMs[] = {0.584, 3.92};      // chunk_kda, T = 4096 / 32768

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

using kestrel::bench::device_random;

struct Timer {
  cudaEvent_t start, stop;
  Timer() {
    KESTREL_CUDA_CHECK(cudaEventCreate(&start));
    KESTREL_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~Timer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  template <typename F>
  double ms(cudaStream_t stream, F&& work) {
    KESTREL_CUDA_CHECK(cudaEventRecord(start, stream));
    work();
    KESTREL_CUDA_CHECK(cudaEventRecord(stop, stream));
    KESTREL_CUDA_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
    return t;
  }
};

using Inputs = kestrel::bench::KdaBenchInputs;

double copy_bandwidth_tbs(cudaStream_t stream) {
  const size_t bytes = size_t{2} << 30;
  DeviceBuffer<unsigned char> a(bytes), b(bytes);
  KESTREL_CUDA_CHECK(cudaMemset(a.get(), 1, bytes));
  Timer timer;
  std::vector<double> t;
  for (int i = 0; i < 12; ++i)
    t.push_back(timer.ms(stream, [&] {
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, stream));
    }));
  t.erase(t.begin(), t.begin() + 2);
  return 2.0 * bytes / (median(t) * 1e-3) / 1e12;
}

void bench_decode(int N, double peer_us, double copy_tbs, cudaStream_t stream, std::mt19937& rng) {
  const int64_t slot_floats = int64_t{kH} * kD * kD;
  // Launch l uses slot set l % sets (N distinct slots of a shuffled pool) and its own inputs; the sets together
  // hold >= 256 MB of state, several times the 60 MB L2, so consecutive launches find their state in HBM.
  const int64_t set_bytes = int64_t{N} * slot_floats * 4;
  const int sets = static_cast<int>(std::clamp<int64_t>(((int64_t{256} << 20) + set_bytes - 1) / set_bytes, 2, 64));
  const int launches = 64;
  const int pool = N * sets;
  DeviceBuffer<float> states = device_random(static_cast<size_t>(pool) * slot_floats, 0, 0.5f, rng);
  std::vector<int32_t> perm(static_cast<size_t>(pool));
  for (int i = 0; i < pool; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  DeviceBuffer<int32_t> slots(perm.size());
  slots.upload(perm.data());
  Inputs in(int64_t{N} * sets, rng);
  DeviceBuffer<float> o(static_cast<size_t>(N) * sets * kH * kD);

  auto launch = [&](int l) {
    const int s = l % sets;  // slots perm[s N .. s N + N), tokens s N .. s N + N - 1
    KdaInputs step = in.view;
    const int64_t off = int64_t{s} * N * kH * kD;
    step.q += off;
    step.k += off;
    step.v += off;
    step.gate += off;
    step.beta += int64_t{s} * N * kH;
    kestrel::cuda::kda_decode(step, N, kH, kD, kD, states.get(), slots.get() + s * N, o.get() + off, stream);
  };

  // Single launches, each timed alone (includes the launch latency the GPU sees).
  Timer timer;
  std::vector<double> single;
  for (int l = 0; l < 200; ++l) single.push_back(timer.ms(stream, [&] { launch(l); }) * 1e3);
  single.erase(single.begin(), single.begin() + 20);

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int l = 0; l < launches; ++l) launch(l);
  KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<double> per_launch;
  for (int r = 0; r < 23; ++r) {
    const double ms = timer.ms(stream, [&] { KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream)); });
    if (r >= 3) per_launch.push_back(ms * 1e3 / launches);
  }
  KESTREL_CUDA_CHECK(cudaGraphExecDestroy(exec));
  KESTREL_CUDA_CHECK(cudaGraphDestroy(graph));

  const double us = median(per_launch), single_us = median(single);
  const double bytes = 2.0 * N * slot_floats * 4;
  const double tbs = bytes / (us * 1e-6) / 1e12;
  std::printf(
      "decode  N=%-4d  %8.2f us/launch (graph)  %8.2f us (single launch)  state %6.3f TB/s = %5.1f%% of %.2f "
      "(measured copy) / %5.1f%% of %.2f  roofline %7.2f us  fla %6.1f us -> x%.2f\n",
      N, us, single_us, tbs, 100 * tbs / copy_tbs, copy_tbs, 100 * tbs / kCopyTBs, kCopyTBs, bytes / (kCopyTBs * 1e6),
      peer_us, peer_us / us);
}

// One sequence of T tokens from position 0. Its inputs (4 arrays of T x 16 KB: 256 MB at T = 4096) and the
// per-chunk workspace are several times the L2, so repeats do not run from the cache.
void bench_prefill(int64_t T, double peer_ms, cudaStream_t stream, std::mt19937& rng) {
  const std::vector<int64_t> cu = {0, T}, start = {0};
  const KdaPrefillPlan plan(cu, start);
  const Inputs in(T, rng);
  DeviceBuffer<float> state = device_random(static_cast<size_t>(kH) * kD * kD, 0, 0.5f, rng);
  const int32_t slot0 = 0;
  DeviceBuffer<int32_t> slot(1);
  slot.upload(&slot0);
  DeviceBuffer<float> o(static_cast<size_t>(T) * kH * kD);
  DeviceBuffer<unsigned char> ws(plan.workspace_bytes(kH));
  Timer timer;
  std::vector<double> t;
  for (int r = 0; r < 13; ++r) {
    const double ms = timer.ms(stream, [&] {
      kestrel::cuda::kda_prefill(plan, in.view, kH, kD, kD, state.get(), slot.get(), o.get(), nullptr, ws.get(),
                                 ws.bytes(), stream);
    });
    if (r >= 3) t.push_back(ms);
  }
  std::vector<float> host_o(o.size());
  o.download(host_o.data());
  size_t bad = 0;
  for (float x : host_o) bad += !std::isfinite(x);
  const double ms = median(t);
  std::printf("prefill T=%-6lld %8.3f ms  %6.2f M tokens/s  workspace %.2f GB  fla chunk_kda %.3f ms -> x%.2f%s\n",
              static_cast<long long>(T), ms, T / (ms * 1e-3) / 1e6, plan.workspace_bytes(kH) / 1e9, peer_ms,
              peer_ms / ms, bad ? "  NON-FINITE OUTPUT" : "");
}

// For a kernel profiler (ncu): one decode launch at N = 64 and one prefill at T = 4096, untimed.
void profile_once(cudaStream_t stream, std::mt19937& rng) {
  const int N = 64;
  const Inputs dec(N, rng);
  DeviceBuffer<float> states = device_random(static_cast<size_t>(N) * kH * kD * kD, 0, 0.5f, rng);
  std::vector<int32_t> ids(N);
  for (int i = 0; i < N; ++i) ids[i] = i;
  DeviceBuffer<int32_t> slots(ids.size());
  slots.upload(ids.data());
  DeviceBuffer<float> o_dec(static_cast<size_t>(N) * kH * kD);
  kestrel::cuda::kda_decode(dec.view, N, kH, kD, kD, states.get(), slots.get(), o_dec.get(), stream);
  const int64_t T = 4096;
  const std::vector<int64_t> cu = {0, T}, start = {0};
  const KdaPrefillPlan plan(cu, start);
  const Inputs in(T, rng);
  DeviceBuffer<float> o(static_cast<size_t>(T) * kH * kD);
  DeviceBuffer<unsigned char> ws(plan.workspace_bytes(kH));
  kestrel::cuda::kda_prefill(plan, in.view, kH, kD, kD, states.get(), slots.get(), o.get(), nullptr, ws.get(),
                             ws.bytes(), stream);
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
}

int run(bool profile) {
  cudaDeviceProp prop;
  KESTREL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %.0f MB, %.0f GB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6,
              prop.totalGlobalMem / 1e9);
  cudaStream_t stream;
  KESTREL_CUDA_CHECK(cudaStreamCreate(&stream));
  std::mt19937 rng(2026);
  if (profile) {
    profile_once(stream, rng);
    KESTREL_CUDA_CHECK(cudaStreamDestroy(stream));
    return 0;
  }
  const double copy_tbs = copy_bandwidth_tbs(stream);
  std::printf("device-to-device copy (read + write): %.3f TB/s measured now; BENCHMARKING.md: %.2f TB/s\n", copy_tbs,
              kCopyTBs);
  std::printf("peers (fla, BENCHMARKING.md, same GPU model) were NOT re-measured in this run\n");
  const int Ns[] = {1, 64, 256};
  for (int i = 0; i < 3; ++i) bench_decode(Ns[i], kFlaRecurrentUs[i], copy_tbs, stream, rng);
  const int64_t Ts[] = {4096, 32768};
  for (int i = 0; i < 2; ++i) bench_prefill(Ts[i], kFlaChunkMs[i], stream, rng);
  KESTREL_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace

// Usage: kda_cuda_bench [--profile]   (--profile: run each kernel once, untimed, for ncu)
int main(int argc, char** argv) {
  try {
    return run(argc > 1 && std::string(argv[1]) == "--profile");
  } catch (const kestrel::Error& e) {
    std::fprintf(stderr, "kda_cuda_bench: %s\n", e.what());
    return 1;
  }
}
