// --device and --gpu-memory-utilization, shared by serve, generate and the offline benchmarks.
#pragma once
#include <string>

#include "engine/engine.h"

namespace kestrel::cli {

// "cpu" or "cuda" for --device auto | cpu | cuda: auto is cuda when this build has the CUDA backend and a GPU is
// visible. Error for cuda without either, or for another value.
std::string resolve_device(const std::string& device);
// The engine hook for a resolved device: empty for cpu; for cuda, the GPU backend taking `utilization` of the GPU's
// memory (0: the default, 0.9), which prints its budget on stderr.
DeviceAttach device_attach(const std::string& resolved, double utilization);

}  // namespace kestrel::cli
