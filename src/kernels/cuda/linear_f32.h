// A plain fp32 matrix product for the few products whose inputs must not be rounded to bf16: the MoE router
// (a near-tie between two experts' scores decides which experts run, so its logits follow the CPU reference as
// closely as fp32 allows). Small outputs only (the router's [T, n_experts]); the bulk of the model uses gemm.h.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace kestrel::cuda {

// y[M, N] = x[M, K] · w[N, K]^T, fp32 in and out, row-major. Each output is one warp's sum: lane l adds the terms
// k = l, l + 32, ... in order, then a fixed butterfly tree; the same bits for the same inputs on every call.
void linear_f32(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y, cudaStream_t stream);

}  // namespace kestrel::cuda
