#include "cli/device.h"

#include <cstdio>

#include "core/error.h"
#ifdef KESTREL_HAVE_CUDA
#include "gpu/gpu_runner.h"
#include "kernels/cuda/runtime.h"
#endif

namespace kestrel::cli {

namespace {
bool gpu_available() {
#ifdef KESTREL_HAVE_CUDA
  return cuda::device_count() > 0;
#else
  return false;
#endif
}
}  // namespace

std::string resolve_device(const std::string& device) {
  if (device == "cpu") return device;
  if (device == "auto") return gpu_available() ? "cuda" : "cpu";
  if (device != "cuda") fail("--device '{}' is not one of auto, cuda, cpu", device);
#ifndef KESTREL_HAVE_CUDA
  fail("--device cuda: this kestrel was built without the CUDA backend (no nvcc at build time)");
#else
  KESTREL_CHECK(gpu_available(), "--device cuda: no CUDA device is visible");
  return device;
#endif
}

DeviceAttach device_attach(const std::string& resolved, double utilization) {
  if (resolved != "cuda") return {};
#ifdef KESTREL_HAVE_CUDA
  const double u = utilization > 0 ? utilization : 0.9;
  return [u](const Model& m, EngineConfig& cfg) -> std::shared_ptr<void> {
    return gpu::GpuBackend::attach(m, cfg, u, stderr);
  };
#else
  (void)utilization;
  fail("--device cuda: this kestrel was built without the CUDA backend");
#endif
}

}  // namespace kestrel::cli
