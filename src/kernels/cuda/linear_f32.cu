#include "kernels/cuda/linear_f32.h"

#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

__global__ void linear_f32_kernel(const float* __restrict__ x, int64_t M, int64_t K, const float* __restrict__ w,
                                  int64_t N, float* __restrict__ y) {
  const int64_t out = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (out >= M * N) return;
  const int64_t m = out / N, n = out % N;
  const float* xr = x + m * K;
  const float* wr = w + n * K;
  float acc = 0.0f;
  for (int64_t k = lane; k < K; k += 32) acc = __fmaf_rn(xr[k], wr[k], acc);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) y[out] = acc;
}

}  // namespace

void linear_f32(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y, cudaStream_t stream) {
  if (M <= 0 || N <= 0) return;
  const int64_t blocks = (M * N + kWarpsPerBlock - 1) / kWarpsPerBlock;
  linear_f32_kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(x, M, K, w, N, y);
  KESTREL_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kestrel::cuda
