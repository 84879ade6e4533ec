// Times the tensor-core KDA prefill (kda_prefill_tc) against the fp32 one (kda_prefill) in the same run: B = 1,
// H = 32, dk = dv = 128, T = 4096 and 32768 from position 0, raw inputs with the gate, q/k norms and beta fused
// in (as kda_cuda_bench and the fla comparison in bench/results/gpu_engine_h200.md §2). Medians of CUDA-event
// timed calls after warm-up; each call includes the copy of the plan's chunk table, as in the engine. Before the
// timing both kernels run once from the same state and the relative difference of their outputs and final
// states is printed (the tensor-core kernel's stated bound against fp32 is 1e-2).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "event_timing.h"
#include "kda_bench_inputs.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/kda_tc.h"
#include "kernels/cuda/runtime.h"

namespace {

using kestrel::cuda::DeviceBuffer;
using kestrel::cuda::KdaInputs;
using kestrel::cuda::KdaPrefillPlan;

constexpr int kH = kestrel::bench::kKdaHeads, kD = kestrel::bench::kKdaDim;
// fla chunk_kda on one H200 with the gate fused (bench/results/gpu_engine_h200.md §2); NOT re-measured here.
constexpr double kFlaFusedMs[] = {1.014, 4.50};  // T = 4096, 32768
constexpr int64_t kTs[] = {4096, 32768};

using Inputs = kestrel::bench::KdaBenchInputs;
using kestrel::bench::device_random;

double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

struct Prefill {
  int64_t T;
  KdaPrefillPlan plan;
  Inputs in;
  DeviceBuffer<float> state0, state, o_tc, o_fp32;
  DeviceBuffer<int32_t> slot;
  DeviceBuffer<unsigned char> ws;

  Prefill(int64_t T_, std::mt19937& rng)
      : T(T_),
        plan(std::vector<int64_t>{0, T_}, std::vector<int64_t>{0}),
        in(T_, rng),
        state0(device_random(static_cast<size_t>(kH) * kD * kD, 0, 0.5f, rng)),
        state(state0.size()),
        o_tc(static_cast<size_t>(T_) * kH * kD),
        o_fp32(o_tc.size()),
        slot(1),
        ws(std::max(plan.workspace_bytes(kH), kestrel::cuda::kda_prefill_tc_workspace_bytes(plan, kH))) {
    const int32_t zero = 0;
    slot.upload(&zero);
    reset_state();
  }
  void reset_state() {
    KESTREL_CUDA_CHECK(cudaMemcpy(state.get(), state0.get(), state0.bytes(), cudaMemcpyDeviceToDevice));
  }
  void run_tc() {
    kestrel::cuda::kda_prefill_tc(plan, in.view, kH, kD, kD, state.get(), slot.get(), o_tc.get(), nullptr, ws.get(),
                                  ws.bytes(), nullptr);
  }
  void run_fp32() {
    kestrel::cuda::kda_prefill(plan, in.view, kH, kD, kD, state.get(), slot.get(), o_fp32.get(), nullptr, ws.get(),
                               ws.bytes(), nullptr);
  }
};

void bench(int64_t T, double fla_ms, std::mt19937& rng) {
  Prefill p(T, rng);
  p.reset_state();
  p.run_fp32();
  const std::vector<float> state_fp32 = kestrel::cuda::to_host(p.state);
  p.reset_state();
  p.run_tc();
  const std::vector<float> state_tc = kestrel::cuda::to_host(p.state);
  const std::vector<float> o_tc = kestrel::cuda::to_host(p.o_tc), o_fp32 = kestrel::cuda::to_host(p.o_fp32);
  size_t bad = 0;
  for (float x : o_tc) bad += !std::isfinite(x);

  const double fp32_ms = kestrel::bench::median_us(10, 3, [&](int) { p.run_fp32(); }) / 1e3;
  const double tc_ms = kestrel::bench::median_us(10, 3, [&](int) { p.run_tc(); }) / 1e3;
  std::printf(
      "prefill T=%-6lld tensor cores %8.3f ms %6.2f M tokens/s | fp32 %8.3f ms %6.2f M tokens/s | tc x%.2f faster | "
      "fla chunk_kda %.3f ms (not re-measured): tc x%.2f (goal 1.5) | tc vs fp32: o %.2e, state %.2e%s\n",
      static_cast<long long>(T), tc_ms, T / (tc_ms * 1e-3) / 1e6, fp32_ms, T / (fp32_ms * 1e-3) / 1e6,
      fp32_ms / tc_ms, fla_ms, fla_ms / tc_ms, rel_diff(o_tc, o_fp32), rel_diff(state_tc, state_fp32),
      bad ? "  NON-FINITE OUTPUT" : "");
}

int run(bool profile) {
  cudaDeviceProp prop;
  KESTREL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %.0f MB, %.0f GB; B=1 H=%d dk=dv=%d, fused gate/norms/beta\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize / 1e6, prop.totalGlobalMem / 1e9, kH, kD);
  std::mt19937 rng(2027);
  if (profile) {  // one untimed call of each kernel at T = 4096, for a kernel profiler (ncu)
    Prefill p(kTs[0], rng);
    p.run_fp32();
    p.run_tc();
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    return 0;
  }
  for (int i = 0; i < 2; ++i) bench(kTs[i], kFlaFusedMs[i], rng);
  return 0;
}

}  // namespace

// Usage: kda_tc_bench [--profile]   (--profile: each kernel once, untimed, for ncu)
int main(int argc, char** argv) {
  try {
    return run(argc > 1 && std::string(argv[1]) == "--profile");
  } catch (const kestrel::Error& e) {
    std::fprintf(stderr, "kda_tc_bench: %s\n", e.what());
    return 1;
  }
}
