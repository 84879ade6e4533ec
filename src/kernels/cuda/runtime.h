// A small CUDA runtime layer: error checking that throws kestrel::Error, and an owning device buffer.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>
#include <vector>

namespace kestrel::cuda {

// Throws kestrel::Error naming `what` and CUDA's message unless status is cudaSuccess.
void check(cudaError_t status, const char* what);
#define KESTREL_CUDA_CHECK(call) ::kestrel::cuda::check((call), #call)

// Number of usable CUDA devices; 0 (not an error) when there is no GPU or no driver.
int device_count();

// `n` elements of T in device memory (cudaMalloc), freed on destruction. Not initialised.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n > 0) KESTREL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), n * sizeof(T)));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = std::exchange(o.ptr_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  ~DeviceBuffer() { release(); }

  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

  // Synchronous copies of the whole buffer (host arrays of size() elements).
  void upload(const T* host) { KESTREL_CUDA_CHECK(cudaMemcpy(ptr_, host, bytes(), cudaMemcpyHostToDevice)); }
  void download(T* host) const { KESTREL_CUDA_CHECK(cudaMemcpy(host, ptr_, bytes(), cudaMemcpyDeviceToHost)); }

 private:
  void release() noexcept {
    if (ptr_) cudaFree(ptr_);  // cannot throw from a destructor; a failed free is reported by the next call
    ptr_ = nullptr;
  }
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

// Whole-vector copies between host and device (synchronous; tests, benchmarks and set-up code).
template <typename T>
DeviceBuffer<T> to_device(const std::vector<T>& v) {
  DeviceBuffer<T> d(v.size());
  d.upload(v.data());
  return d;
}

template <typename T>
std::vector<T> to_host(const DeviceBuffer<T>& d) {
  std::vector<T> v(d.size());
  d.download(v.data());
  return v;
}

}  // namespace kestrel::cuda
