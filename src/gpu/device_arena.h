// The GPU's memory for one engine: one cudaMalloc, sized at start-up from --gpu-memory-utilization, cut by a bump
// allocator into the weights, the step workspaces and, last, the cache pool (whatever is left). Nothing is freed
// piecemeal: the arena lives as long as the engine.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace kestrel::gpu {

class DeviceArena {
 public:
  // Takes `bytes` of the current device's memory in one allocation (Error naming the size when it fails).
  explicit DeviceArena(size_t bytes);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // `bytes` more, aligned to 256 bytes; Error naming `what`, the size and what is left when it does not fit.
  void* take(size_t bytes, const char* what);
  template <typename T>
  T* take_n(size_t n, const char* what) {
    return static_cast<T*>(take(n * sizeof(T), what));
  }
  size_t capacity() const { return capacity_; }
  size_t used() const { return used_; }
  size_t remaining() const { return capacity_ - used_; }

  // The budget --gpu-memory-utilization allows on the current device: utilization * total memory, less what other
  // processes (and this one) already hold beyond (1 - utilization) * total. Error for a utilization outside (0, 1].
  static size_t budget(double utilization);

 private:
  uint8_t* base_ = nullptr;
  size_t capacity_ = 0, used_ = 0;
};

}  // namespace kestrel::gpu
