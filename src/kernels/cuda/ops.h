// Dense elementwise and per-row operations of the GPU forward pass: norms, residual add, bf16 conversion, SwiGLU,
// embedding lookup, row gather and greedy argmax. Same functions as their CPU counterparts (src/kernels/cpu/basic.h,
// src/core/formats.h). All pointers are device pointers; every call is asynchronous on its stream, checks its
// arguments (kestrel::Error) and its launch; any size >= 0 works (0 is a no-op).
// Numerics: fp32 math; a row reduction is one thread block summing fixed strided slices of the row and then a fixed
// tree (no atomics), so results are the same run to run and do not depend on how many rows are processed together.
// bf16 outputs round to nearest even exactly as kestrel::f32_to_bf16 (NaN stays NaN with its sign, inf stays inf).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace kestrel::cuda {

// y = x / sqrt(mean(x^2) + eps) * w per row of D values (cpu::rms_norm). x fp32 rows of leading dimension ldx >= D;
// y rows of leading dimension ldy >= D.
void rms_norm_bf16(const float* x, int64_t ldx, const float* w, int64_t M, int64_t D, float eps, uint16_t* y,
                   int64_t ldy, cudaStream_t s);
// Both: y_f32 and y_bf16 (bf16 of the same fp32 values) with one leading dimension ldy.
void rms_norm_dual(const float* x, int64_t ldx, const float* w, int64_t M, int64_t D, float eps, float* y_f32,
                   uint16_t* y_bf16, int64_t ldy, cudaStream_t s);
// y may equal x (in place; then ldy must equal ldx).
void rms_norm_f32(const float* x, int64_t ldx, const float* w, int64_t M, int64_t D, float eps, float* y, int64_t ldy,
                  cudaStream_t s);
// (x - mean) / sqrt(var + eps) * w + b per row of D contiguous values (cpu::layer_norm, population variance);
// y may equal x.
void layer_norm_f32(const float* x, const float* w, const float* b, int64_t M, int64_t D, float eps, float* y,
                    cudaStream_t s);
// h[i] += y[i] for i < n.
void add_inplace(float* h, const float* y, int64_t n, cudaStream_t s);
// y[i] = bf16(x[i]) for i < n, rounded to nearest even.
void to_bf16(const float* x, int64_t n, uint16_t* y, cudaStream_t s);
// gu: [T, 2F] fp32 with the gate in columns [0, F) and up in [F, 2F); out[t, j] = silu(gate) * up as bf16 [T, F],
// silu(x) = x * (1 / (1 + exp(-x))) as cpu::silu.
void swiglu_bf16(const float* gu, int64_t T, int64_t F, uint16_t* out, cudaStream_t s);
// The same values in fp32 (out_f32) and bf16 (out_bf16), either of them null.
void swiglu(const float* gu, int64_t T, int64_t F, float* out_f32, uint16_t* out_bf16, cudaStream_t s);
// h[t, :] = table[ids[t], :] with table bf16 bits [V, D] -> fp32 [T, D]. ids must be in range (the host checks).
void embed_bf16(const int32_t* ids, int64_t T, const uint16_t* table, int64_t D, float* h, cudaStream_t s);
// y[i, :] = x[rows[i], :] for i < n (rows: device int32 row numbers), fp32 rows of D contiguous values.
void gather_rows(const float* x, int64_t D, const int32_t* rows, int64_t n, float* y, cudaStream_t s);
// out[m] = argmax over v < V of logits[m, v] (rows of V contiguous values, V < 2^31). Ties: the lowest index. NaN
// never wins; a row with no candidate (all NaN, or V = 0) gives 0.
void argmax_rows(const float* logits, int64_t M, int64_t V, int32_t* out, cudaStream_t s);

// The kernels' launchers (ops.cu), called by the checked functions above (ops.cpp) with arguments they accepted.
namespace detail {
// At least one of y_f32 and y_bf16 is set.
cudaError_t launch_rms_norm(const float* x, int64_t ldx, const float* w, int64_t M, int64_t D, float eps,
                            float* y_f32, uint16_t* y_bf16, int64_t ldy, cudaStream_t s);
cudaError_t launch_layer_norm(const float* x, const float* w, const float* b, int64_t M, int64_t D, float eps,
                              float* y, cudaStream_t s);
cudaError_t launch_add_inplace(float* h, const float* y, int64_t n, cudaStream_t s);
cudaError_t launch_to_bf16(const float* x, int64_t n, uint16_t* y, cudaStream_t s);
cudaError_t launch_swiglu(const float* gu, int64_t T, int64_t F, float* out_f32, uint16_t* out_bf16,
                          cudaStream_t s);
cudaError_t launch_embed_bf16(const int32_t* ids, int64_t T, const uint16_t* table, int64_t D, float* h,
                              cudaStream_t s);
cudaError_t launch_gather_rows(const float* x, int64_t D, const int32_t* rows, int64_t n, float* y, cudaStream_t s);
cudaError_t launch_argmax_rows(const float* logits, int64_t M, int64_t V, int32_t* out, cudaStream_t s);
}  // namespace detail

}  // namespace kestrel::cuda
