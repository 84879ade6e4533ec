// Linear layers whose weight stays in FP8 on the GPU: e4m3 codes with one fp32 scale per block x block tile (the
// checkpoints' WeightQuant::fp8_block, block 128), times bf16 activations, fp32 accumulation. A weight-streaming
// kernel for decode-sized steps (few rows of x): each weight byte is read from memory once per launch (for up to
// kFp8RowsPerPass rows of x), half the bytes of the bf16 copy the cuBLASLt path (gemm.h) streams.
// Row-major, weights [out, in] as in the checkpoints, as gemm.h: y[M, N] = x[M, K] · W[N, K]^T with
// W[n, k] = e4m3(codes[n, k]) * scales[n / block, k / block]. bf16 values are uint16_t bits; every pointer is a
// device pointer and every call is asynchronous on its stream (and capturable in a CUDA graph).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace kestrel::cuda {

struct Fp8BlockMatrix {
  const uint8_t* codes = nullptr;  // e4m3fn [N, K] row-major
  const float* scales = nullptr;   // [ceil(N / block), ceil(K / block)] row-major
  int64_t N = 0, K = 0;
  int block = 128;  // a multiple of 16
};

// Rows of x one pass of the kernel multiplies with the weight values it holds in registers; a step of more rows
// makes ceil(M / kFp8RowsPerPass) passes, which run side by side and read the weight bytes through L2.
inline constexpr int kFp8RowsPerPass = 8;

// y[M, N] = x[M, K] · W^T: x bf16 bits with leading dimension ldx (>= K), y fp32 (or, with the _bf16 form, bf16 bits
// rounded to nearest even) with leading dimension ldy (>= N). M may be 0 (no-op).
// Each output is an fp32 sum in a fixed order of scale * (Σ_k x[m, k] * e4m3(code[n, k])) over 16-column pieces of
// its row of W (each lane adds its pieces in ascending order, then a butterfly over the 8 lanes of a row, then the 8
// warps in order): the value x · W of the CPU reference up to fp32 rounding order (every x · e4m3 product is exact
// in fp32; the CPU's W[n, k] = e4m3 * scale is rounded once). No atomics: the same inputs give the same bits on
// every call, and a row's bits do not depend on M.
// Throws kestrel::Error unless N, K >= 1, block is a positive multiple of 16, the scale grid is as above (implied),
// ldx >= K, ldy >= N, M >= 0 and the pointers are set when M > 0.
void linear_fp8(const uint16_t* x, int64_t M, int64_t ldx, const Fp8BlockMatrix& w, float* y, int64_t ldy,
                cudaStream_t stream);
void linear_fp8_bf16(const uint16_t* x, int64_t M, int64_t ldx, const Fp8BlockMatrix& w, uint16_t* y, int64_t ldy,
                     cudaStream_t stream);

namespace detail {
// Whether a call takes the kernel's vectorised path (16-byte loads of codes and x) rather than the byte-wise one:
// K % 16 == 0, codes and x 16-byte aligned, and ldx % 8 == 0 unless M == 1. Both give the same bits.
bool linear_fp8_vectorised(const uint16_t* x, int64_t M, int64_t ldx, const Fp8BlockMatrix& w);
// Launches the kernel for arguments the host functions checked (M >= 1).
cudaError_t launch_linear_fp8(const uint16_t* x, int64_t M, int64_t ldx, const Fp8BlockMatrix& w, void* y,
                              bool y_bf16, int64_t ldy, cudaStream_t stream);
}  // namespace detail

}  // namespace kestrel::cuda
