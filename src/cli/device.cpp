#include "cli/device.h"

#include <cstdio>

#include "core/error.h"
#include "cpu/cpu_backend.h"
#ifdef KESTREL_HAVE_CUDA
#include "gpu/cuda_backend.h"
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

std::unique_ptr<Backend> make_backend(const std::string& resolved, double utilization, bool cuda_graphs) {
  if (resolved != "cuda") return std::make_unique<CpuBackend>();
#ifdef KESTREL_HAVE_CUDA
  auto backend = std::make_unique<gpu::CudaBackend>(utilization > 0 ? utilization : 0.9, stderr);
  if (!cuda_graphs) backend->set_cuda_graphs(false);
  return backend;
#else
  (void)utilization;
  (void)cuda_graphs;
  fail("--device cuda: this kestrel was built without the CUDA backend");
#endif
}

DeviceAttach device_attach(const std::string& resolved) {
  if (resolved != "cuda") return {};
#ifdef KESTREL_HAVE_CUDA
  return [](const Model& m, EngineConfig& cfg) -> std::shared_ptr<void> { return gpu::attach_engine(m, cfg, stderr); };
#else
  fail("--device cuda: this kestrel was built without the CUDA backend");
#endif
}

LatentCacheDtype parse_kv_cache_dtype(const std::string& v, const std::string& resolved, const char* flag) {
  if (v == "auto") return resolved == "cuda" ? LatentCacheDtype::bf16 : LatentCacheDtype::auto_fp32;
  if (v == "bf16" || v == "bfloat16") return LatentCacheDtype::bf16;
  if (v == "fp8" || v == "fp8_e4m3") return LatentCacheDtype::fp8;
  if (v == "nvfp4") return LatentCacheDtype::nvfp4;
  fail("{} '{}' is not one of auto, bf16, fp8, nvfp4", flag, v);
}

}  // namespace kestrel::cli
