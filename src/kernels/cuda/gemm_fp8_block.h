// Linear layers with FP8 block-scaled weights on tensor cores at every M, the rule of src/kernels/cpu/fp8_linear.h:
// fp32 activations quantized per row in groups of 128 columns (e4m3 codes, one fp32 scale per group), times e4m3
// weight codes [N, K] with one fp32 scale per 128 x 128 block, y[M, N] = x · W^T in fp32 or bf16. The product runs on
// cuBLASLt's block-scaled FP8 matmul for Hopper (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F for the weight,
// CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F for the activations), or, for a shape cuBLASLt has no algorithm for, on
// this library's own tensor-core kernel (fp8_block_mma.cuh) with the same numerics. Every pointer is a device pointer;
// every call is asynchronous on its stream and capturable in a CUDA graph once its shape has been called outside a
// capture (see Fp8BlockGemm).
//
// cuBLASLt's view (column-major): D[N, Mp] = op(A) B with A = the weight codes (K x N, ld = row bytes, TRANSA = T),
// B = the activation codes (K x Mp, TRANSB = N: the "TN" form FP8 needs on Hopper), D = y^T. Its scale tensors: the
// weight's [ceil(N/128), ceil(K/128)] with the K-block index contiguous and each row padded to a multiple of 4 blocks
// (16 bytes); the activations' [ceil(K/128), Mp] with the row index contiguous. Rows of FP8 codes start on 16 bytes.
//
// Accuracy (asserted on every element by tests/kernels/cuda/gemm_fp8_block_test.cpp). The quantized activations are
// the CPU's bit for bit, so y differs from cpu::linear_fp8_block only in how each group's sum is accumulated and in
// the order of the fp32 steps: with A = sum_g |s_x[m, g] s_w[n / 128, g]| sum_{k in g} |e4m3(cx) e4m3(cw)| and
// G = ceil(K / 128),
//   |y - ref| <= c A + (2 G + 4) 2^-24 A,
//   c = 2^-15 on this library's kernel: f16 MMAs with fp32 accumulation (each m16n8k16 errs by less than 17 addends
//       times 2^-23 of the largest, 8 per group);
//   c = 2^-10 on cuBLASLt: Hopper's FP8 MMA keeps about 13-14 bits below the largest addend of each k32 step (the
//       DeepSeek-V3 technical report), four steps per group before the fp32 promotion. An estimate, not a proven
//       bound: this library's e4m3 wgmma indexer kernel (the same MMAs, four k32 steps per 128-wide dot) erred by up
//       to 2^-12.5 of its dots' sum of |products| on the H200 (bench/results/h200_session5), under a fifth of this c.
// A bf16 output adds its rounding, 2^-9 |y|.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace kestrel::cuda {

inline constexpr int kFp8BlockGroup = 128;

// The device layout of an FP8 block-scaled weight [N, K] that cuBLASLt and the fallback kernel read:
//   codes:  N rows of row_bytes = K rounded up to 16 bytes (the checkpoint's row, then zeros);
//   scales: block_rows = ceil(N / 128) rows of scale_row_floats = ceil(K / 128) rounded up to 4 fp32 values (the
//           checkpoint's `weight_scale_inv` row, then zeros).
// When K % 16 == 0 and ceil(K / 128) % 4 == 0 (every DeepSeek-V3.2 / Kimi shape: K = 512, 1536, 2048, 7168, 16384,
// 18432) both are exactly the checkpoint's bytes: copy the tensors as they are. Otherwise copy row by row into a
// zeroed allocation (cudaMemset, then cudaMemcpy2D with the pitches above). Both arrays must be 16-byte aligned.
struct Fp8BlockWeightLayout {
  int64_t N = 0, K = 0;
  int64_t row_bytes = 0;
  int64_t block_rows = 0, scale_row_floats = 0;
  size_t code_bytes() const { return static_cast<size_t>(N * row_bytes); }
  size_t scale_bytes() const { return static_cast<size_t>(block_rows * scale_row_floats) * sizeof(float); }
  bool same_as_checkpoint() const;  // the checkpoint's tensors are this layout byte for byte
};
// Throws kestrel::Error unless N, K >= 1.
Fp8BlockWeightLayout fp8_block_weight_layout(int64_t N, int64_t K);

// A weight in the layout above.
struct Fp8BlockWeight {
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;
  int64_t N = 0, K = 0;
};

// Quantized activations for M rows of K columns, the layout cuBLASLt reads:
//   codes:  padded_rows = M rounded up to 4 rows of row_bytes (K rounded up to 16) e4m3 codes; rows >= M and
//           columns >= K are 0;
//   scales: groups = ceil(K / 128) rows of padded_rows fp32 scales (scales[g * padded_rows + m]); rows >= M are 0.
struct Fp8ActivationLayout {
  int64_t M = 0, K = 0;
  int64_t padded_rows = 0, row_bytes = 0, groups = 0;
  size_t code_bytes() const { return static_cast<size_t>(padded_rows * row_bytes); }
  size_t scale_bytes() const { return static_cast<size_t>(groups * padded_rows) * sizeof(float); }
};
// Throws kestrel::Error unless M >= 0 and K >= 1.
Fp8ActivationLayout fp8_activation_layout(int64_t M, int64_t K);

// x fp32 [M, K] with leading dimension ldx >= K -> codes and scales in fp8_activation_layout(M, K), bit for bit
// cpu::quantize_fp8_groups (transposed scales; NaN codes are 0x7F as on the CPU). codes and scales 16-byte aligned.
void quantize_fp8_activations(const float* x, int64_t M, int64_t K, int64_t ldx, uint8_t* codes, float* scales,
                              cudaStream_t stream);

struct Fp8Activations {
  const uint8_t* codes = nullptr;  // fp8_activation_layout(M, K)
  const float* scales = nullptr;
  int64_t M = 0, K = 0;
};

// y[M, N] = a · W^T (+ y when accumulate, fp32 output only). y fp32, or bf16 bits rounded to nearest even when y_bf16,
// with leading dimension ldy >= N.
struct Fp8BlockProblem {
  Fp8Activations a;
  Fp8BlockWeight w;
  void* y = nullptr;
  bool y_bf16 = false;
  int64_t ldy = 0;
  bool accumulate = false;
};

// How a problem runs.
enum class Fp8BlockPath {
  cublaslt,         // cuBLASLt writes y
  cublaslt_staged,  // cuBLASLt writes the padded_rows rows into the workspace, a copy kernel writes y's M rows
  mma_fallback,     // no cuBLASLt algorithm: fp8_block_mma.cuh's kernel
};

// FP8 block-scaled GEMMs. One object per stream owner, as cuda::Gemm: the cuBLASLt handle, a preallocated cuBLASLt
// workspace, and a cache of descriptors and heuristic choices per shape (sizes, ldy, output type, accumulate and the
// alignment of y), so a shape always runs the same algorithm (deterministic). The first call of a shape queries
// cuBLASLt's heuristic on the host: make it before capturing a graph. The path (Fp8BlockPath): cuBLASLt writes y
// directly when M is a multiple of 4 (its activation scales are read with the row count as leading dimension, which
// must be 16 bytes); other M run cuBLASLt on padded_rows rows into the caller's workspace and copy the M rows out;
// a shape with no cuBLASLt algorithm (either way) runs the fallback kernel. Not thread-safe.
class Fp8BlockGemm {
 public:
  explicit Fp8BlockGemm(size_t cublaslt_workspace_bytes = size_t{32} << 20);
  ~Fp8BlockGemm();
  Fp8BlockGemm(const Fp8BlockGemm&) = delete;
  Fp8BlockGemm& operator=(const Fp8BlockGemm&) = delete;

  // Device scratch linear()/run() need for M rows of K into N outputs: the quantized activations (linear only) and,
  // when M % 4 != 0, the staged output (padded_rows x N rounded up to 4, fp32). 256-byte aligned regions.
  static size_t workspace_bytes(int64_t M, int64_t N, int64_t K);

  // Quantize x (fp32 [M, K], ldx) into the workspace, then run(). M may be 0 (no-op).
  void linear(const float* x, int64_t M, int64_t ldx, const Fp8BlockWeight& w, float* y, int64_t ldy, void* workspace,
              size_t workspace_bytes, cudaStream_t stream, bool accumulate = false);
  void linear_bf16(const float* x, int64_t M, int64_t ldx, const Fp8BlockWeight& w, uint16_t* y, int64_t ldy,
                   void* workspace, size_t workspace_bytes, cudaStream_t stream);
  // From quantized activations; the workspace holds the staged output (workspace_bytes(M, N, K) suffices).
  void run(const Fp8BlockProblem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

  // The path problem p takes (queries and caches cuBLASLt's heuristic as a call would). M >= 1.
  Fp8BlockPath path(const Fp8BlockProblem& p);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The fallback kernel alone (what Fp8BlockPath::mma_fallback runs), for any problem Fp8BlockGemm accepts. y needs no
// workspace; M may be 0.
void fp8_block_gemm_mma(const Fp8BlockProblem& p, cudaStream_t stream);

namespace detail {

// Quantization of `rows` rows of K fp32 values (leading dimension ldx) into codes (code_ld >= K bytes a row, a multiple
// of 4; columns K .. code_ld - 1 get 0) and scales[r * scale_row_stride + g * scale_group_stride]; rows rows ..
// padded_rows - 1 get codes 0 and scale 0. The rule and bits of cpu::quantize_fp8_groups.
struct QuantizeArgs {
  const float* x;
  int64_t rows, padded_rows, K, ldx;
  uint8_t* codes;
  int64_t code_ld;
  float* scales;
  int64_t scale_row_stride, scale_group_stride;
};
cudaError_t launch_quantize_fp8(const QuantizeArgs& a, cudaStream_t stream);

// The fallback kernel for a checked problem (M >= 1).
cudaError_t launch_fp8_block_gemm_mma(const Fp8BlockProblem& p, cudaStream_t stream);

// y[m, n] (= or +=) staged[m * staged_ld + n] for m < M, n < N; y fp32 or bf16 (rounded to nearest even).
cudaError_t launch_fp8_stage_copy(const float* staged, int64_t staged_ld, int64_t M, int64_t N, void* y, bool y_bf16,
                                  int64_t ldy, bool accumulate, cudaStream_t stream);

}  // namespace detail
}  // namespace kestrel::cuda
