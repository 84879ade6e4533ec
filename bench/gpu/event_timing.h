// Timing for the GPU benchmarks: the median of CUDA-event-timed runs after untimed warm-up runs.
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "kernels/cuda/runtime.h"

namespace kestrel::bench {

// Median time in microseconds of `iters` runs of fn(i) after `warm` untimed ones; i counts every run from 0, so fn
// can rotate its inputs. Events are recorded on the default stream.
template <typename F>
double median_us(int iters, int warm, F&& fn) {
  for (int i = 0; i < warm; ++i) fn(i);
  cudaEvent_t a, b;
  KESTREL_CUDA_CHECK(cudaEventCreate(&a));
  KESTREL_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> us;
  for (int i = 0; i < iters; ++i) {
    KESTREL_CUDA_CHECK(cudaEventRecord(a));
    fn(warm + i);
    KESTREL_CUDA_CHECK(cudaEventRecord(b));
    KESTREL_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    us.push_back(ms * 1e3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace kestrel::bench
