// --device and --gpu-memory-utilization, shared by serve, generate and the offline benchmarks.
#pragma once
#include <memory>
#include <string>

#include "engine/engine.h"
#include "model/backend.h"
#include "model/cache_formats.h"

namespace kestrel::cli {

// "cpu" or "cuda" for --device auto | cpu | cuda: auto is cuda when this build has the CUDA backend and a GPU is
// visible. Error for cuda without either, or for another value.
std::string resolve_device(const std::string& device);
// The backend a model loads into on a resolved device: the CPU backend, or the CUDA backend taking `utilization` of
// the GPU's memory (0: the default, 0.9) for weights, workspaces and the cache.
// `cuda_graphs` false: the GPU backend runs every step eagerly (--enforce-eager).
std::unique_ptr<Backend> make_backend(const std::string& resolved, double utilization, bool cuda_graphs = true);
// The engine hook for a resolved device: empty for cpu; for cuda, the step workspaces sized for the engine's limits
// and the cache pool in GPU memory (the memory split printed on stderr).
DeviceAttach device_attach(const std::string& resolved);
// --kv-cache-dtype: auto is the model's dtype on the device (fp32 on the CPU, bf16 on the GPU), or bf16, fp8,
// nvfp4. Error naming `flag` for anything else.
LatentCacheDtype parse_kv_cache_dtype(const std::string& v, const std::string& resolved, const char* flag);

}  // namespace kestrel::cli
