#include "kernels/cuda/runtime.h"

#include "core/error.h"

namespace kestrel::cuda {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    fail("CUDA error in {}: {} ({})", what, cudaGetErrorString(status), cudaGetErrorName(status));
}

int device_count() {
  int n = 0;
  const cudaError_t status = cudaGetDeviceCount(&n);
  if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver) {
    cudaGetLastError();  // consume the error so that the next CUDA call does not report it
    return 0;
  }
  check(status, "cudaGetDeviceCount");
  return n;
}

}  // namespace kestrel::cuda
