// bf16 GEMMs on the GPU with fp32 accumulation: cuBLASLt (CUBLAS_COMPUTE_32F) for every shape it has an algorithm
// for, and a plain CUDA kernel (gemm_simple) for the others. Row-major throughout, weights stored [out, in] as in
// the checkpoints: y[M, N] = x[M, K] · w[N, K]^T, the function of kestrel::cpu::linear. bf16 values are uint16_t
// bits; every pointer is a device pointer and every call is asynchronous on its stream.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace kestrel::cuda {

// One strided-batched problem: for b < batch, y_b[M, N] = x_b[M, K] · op(w_b) (+ y_b when accumulate), where
// x_b = x + b * stride_x (row-major, leading dimension ldx >= K), w_b = w + b * stride_w and
//   transpose_w = true:  w_b is [N, K] row-major (ldw >= K) and op(w_b) = w_b^T  (a linear layer),
//   transpose_w = false: w_b is [K, N] row-major (ldw >= N) and op(w_b) = w_b,
// y_b = y + b * stride_y (row-major, ldy >= N), fp32 or, with y_bf16, bf16 bits rounded to nearest even.
// accumulate needs an fp32 output (with a bf16 C, cuBLASLt's results on an H200 were up to 12 times further from
// the fp32 sum rounded once than one rounding allows). Strides are in elements and may index heads inside a row (x = q, ldx = H * dq,
// stride_x = dq); the batches' outputs must not overlap.
struct GemmProblem {
  const uint16_t* x = nullptr;
  int64_t ldx = 0;
  int64_t stride_x = 0;
  const uint16_t* w = nullptr;
  int64_t ldw = 0;
  int64_t stride_w = 0;
  bool transpose_w = true;
  void* y = nullptr;
  bool y_bf16 = false;
  int64_t ldy = 0;
  int64_t stride_y = 0;
  int64_t M = 0;
  int64_t N = 0;
  int64_t K = 0;
  int64_t batch = 1;
  bool accumulate = false;
};

// Throws kestrel::Error unless p is well formed: M, batch >= 0; N, K >= 1; leading dimensions as above; strides
// >= 0; outputs of different batches disjoint; no accumulation into bf16; pointers set when there is work.
void check_gemm_problem(const GemmProblem& p, const char* fn);

// The plain CUDA kernel behind Gemm's fallback: each output is one fp32 sum over k = 0, 1, ..., K-1 in order (no
// tensor cores, no split over K), so any shape and alignment works and results depend on nothing but the inputs.
void gemm_simple(const GemmProblem& p, cudaStream_t stream);

// bf16 GEMMs through cuBLASLt (fp32 accumulation, CUBLAS_COMPUTE_32F). One object per stream owner; holds the
// cuBLASLt handle, a preallocated workspace (so calls are CUDA-graph capturable) and a cache of matmul
// descriptors/heuristic choices keyed by shape (so the same shape always uses the same algorithm: deterministic).
// The key holds the sizes, leading dimensions, strides, options and the alignment of the three pointers (cuBLASLt
// kernels assume an alignment), so one shape called with differently aligned pointers is two cache entries. A
// shape whose first call finds no cuBLASLt algorithm runs gemm_simple from then on. The first call of a shape
// queries cuBLASLt's heuristic on the host; make it before capturing a graph.
// Not thread-safe: one object serves one host thread (calls on the workspace are ordered by the caller's streams;
// use one Gemm per stream that runs concurrently).
// Different shapes may use different algorithms, so a row of y is not bit-identical across different M.
class Gemm {
 public:
  explicit Gemm(size_t workspace_bytes = size_t{32} << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // y[M, N] = x[M, K] · w[N, K]^T (+ y when accumulate). x: bf16 bits, row-major with leading dimension ldx (>= K);
  // w: bf16 bits [N, K] row-major; y fp32 row-major, leading dim ldy (>= N). M may be 0 (no-op).
  void linear(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* w, int64_t N, float* y,
              int64_t ldy, cudaStream_t stream, bool accumulate = false);
  // Same with a bf16 output (rounded to nearest even).
  void linear_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* w, int64_t N, uint16_t* y,
                   int64_t ldy, cudaStream_t stream);
  // Strided-batched, fp32 output: y_b[M, N] = x_b[M, K] · op(w_b), see GemmProblem for the layouts.
  // MLA query absorption (W_UK[h] the [dn, C] block of kv_b at row h*(dn+dv)):
  //   x = q_nope, ldx = H*dq, stride_x = dq; w = kv_b, ldw = C, stride_w = (dn+dv)*C, transpose_w = false;
  //   M = T, K = dn, N = C, batch = H.
  // Output un-absorption (W_UV[h] the [dv, C] block at row h*(dn+dv) + dn):
  //   x = obar, ldx = H*C, stride_x = C; w = kv_b + dn*C, ldw = C, stride_w = (dn+dv)*C, transpose_w = true;
  //   M = T, K = C, N = dv, batch = H.
  void batched(const uint16_t* x, int64_t ldx, int64_t stride_x, const uint16_t* w, int64_t ldw, int64_t stride_w,
               bool transpose_w, float* y, int64_t ldy, int64_t stride_y, int64_t M, int64_t N, int64_t K,
               int64_t batch, cudaStream_t stream);
  // The general form the three calls above use.
  void run(const GemmProblem& p, cudaStream_t stream);

  // Whether problem p (its shape and pointer alignments; M, batch >= 1) runs on cuBLASLt; false: on gemm_simple.
  // Queries and caches the heuristic as a call would.
  bool uses_cublaslt(const GemmProblem& p);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

namespace detail {
// Launches gemm_simple's kernel for a problem check_gemm_problem accepted (batch, M >= 1).
cudaError_t launch_gemm_simple(const GemmProblem& p, cudaStream_t stream);
}  // namespace detail

}  // namespace kestrel::cuda
