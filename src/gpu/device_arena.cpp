#include "gpu/device_arena.h"

#include <cuda_runtime_api.h>

#include "core/error.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::gpu {

namespace {
constexpr size_t kAlign = 256;
double gib(size_t b) { return static_cast<double>(b) / double(1 << 30); }
}  // namespace

DeviceArena::DeviceArena(size_t bytes) : capacity_(bytes) {
  KESTREL_CHECK(bytes > 0, "the GPU memory budget is empty");
  const cudaError_t st = cudaMalloc(reinterpret_cast<void**>(&base_), bytes);
  if (st != cudaSuccess) {
    cudaGetLastError();
    fail("cannot allocate {:.2f} GiB on the GPU ({}); lower --gpu-memory-utilization", gib(bytes),
         cudaGetErrorString(st));
  }
}

DeviceArena::~DeviceArena() {
  if (base_) cudaFree(base_);
}

void* DeviceArena::take(size_t bytes, const char* what) {
  const size_t start = (used_ + kAlign - 1) / kAlign * kAlign;
  KESTREL_CHECK(start <= capacity_ && bytes <= capacity_ - start,
                "GPU memory: {} needs {:.3f} GiB but only {:.3f} GiB of the {:.2f} GiB budget is left; raise "
                "--gpu-memory-utilization or lower --max-num-batched-tokens / --max-num-seqs",
                what, gib(bytes), gib(capacity_ - std::min(start, capacity_)), gib(capacity_));
  used_ = start + bytes;
  return base_ + start;
}

size_t DeviceArena::budget(double utilization) {
  KESTREL_CHECK(utilization > 0.0 && utilization <= 1.0, "--gpu-memory-utilization must be in (0, 1], got {}",
                utilization);
  size_t free_b = 0, total_b = 0;
  KESTREL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const size_t want = static_cast<size_t>(utilization * static_cast<double>(total_b));
  const size_t held = total_b - free_b;  // by other processes and this one's context
  KESTREL_CHECK(held < want, "--gpu-memory-utilization {} allows {:.2f} GiB, but {:.2f} GiB of the GPU are already in use",
                utilization, gib(want), gib(held));
  return want - held;
}

}  // namespace kestrel::gpu
