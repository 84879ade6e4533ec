#include "kernels/cuda/gemm.h"

#include <cublasLt.h>

#include <array>
#include <bit>
#include <limits>
#include <map>
#include <utility>

#include "core/error.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {

namespace {

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    fail("cuBLASLt error in {}: {} ({})", what, cublasLtGetStatusString(status), cublasLtGetStatusName(status));
}
#define KESTREL_CUBLAS_CHECK(call) check_cublas((call), #call)

// The alignment, in bytes (a power of two up to 256, cuBLASLt's largest requirement), that every matrix of one
// operand has: its first element's address, each row start (ld) and each batch start (stride) are multiples of it.
uint32_t operand_alignment(const void* ptr, int64_t ld, int64_t stride, int64_t batch, size_t element_bytes) {
  uint64_t bits = reinterpret_cast<uintptr_t>(ptr) | 256u;
  bits |= static_cast<uint64_t>(ld) * element_bytes;
  if (batch > 1 && stride != 0) bits |= static_cast<uint64_t>(stride) * element_bytes;
  return static_cast<uint32_t>(uint64_t{1} << std::countr_zero(bits));
}

// Everything the choice of a cuBLASLt algorithm depends on.
using PlanKey = std::array<int64_t, 16>;

PlanKey plan_key(const GemmProblem& p) {
  const size_t y_bytes = p.y_bf16 ? 2 : 4;
  return PlanKey{p.M,
                 p.N,
                 p.K,
                 p.batch,
                 p.ldx,
                 p.ldw,
                 p.ldy,
                 p.batch > 1 ? p.stride_x : 0,
                 p.batch > 1 ? p.stride_w : 0,
                 p.batch > 1 ? p.stride_y : 0,
                 p.transpose_w,
                 p.y_bf16,
                 p.accumulate,
                 operand_alignment(p.x, p.ldx, p.stride_x, p.batch, 2),
                 operand_alignment(p.w, p.ldw, p.stride_w, p.batch, 2),
                 operand_alignment(p.y, p.ldy, p.stride_y, p.batch, y_bytes)};
}

// One cached cuBLASLt configuration, or the decision to run gemm_simple (no algorithm).
struct Plan {
  bool cublaslt = false;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t w_layout = nullptr;  // cuBLASLt's A
  cublasLtMatrixLayout_t x_layout = nullptr;  // cuBLASLt's B
  cublasLtMatrixLayout_t y_layout = nullptr;  // cuBLASLt's C and D
  cublasLtMatmulAlgo_t algo{};

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    // Destroying descriptors only fails on invalid handles, which these are not.
    if (y_layout) cublasLtMatrixLayoutDestroy(y_layout);
    if (x_layout) cublasLtMatrixLayoutDestroy(x_layout);
    if (w_layout) cublasLtMatrixLayoutDestroy(w_layout);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

template <typename T>
void set_layout(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attribute, T value) {
  KESTREL_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, attribute, &value, sizeof(value)));
}

// A column-major rows x cols matrix (cuBLASLt's view of a row-major cols x rows one) with leading dimension ld,
// repeated `batch` times `stride` elements apart.
cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                                   int64_t stride) {
  cublasLtMatrixLayout_t layout = nullptr;
  KESTREL_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&layout, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld));
  if (batch > 1) {
    set_layout(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, static_cast<int32_t>(batch));
    set_layout(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride);
  }
  return layout;
}

}  // namespace

void check_gemm_problem(const GemmProblem& p, const char* fn) {
  KESTREL_CHECK(p.M >= 0 && p.batch >= 0, "{}: M={} and batch={} must be non-negative", fn, p.M, p.batch);
  KESTREL_CHECK(p.N >= 1 && p.K >= 1, "{}: N={} and K={} must be at least 1", fn, p.N, p.K);
  KESTREL_CHECK(p.batch <= std::numeric_limits<int32_t>::max(), "{}: batch={} exceeds 2^31-1", fn, p.batch);
  KESTREL_CHECK(p.ldx >= p.K, "{}: ldx={} must be >= K={}", fn, p.ldx, p.K);
  const int64_t w_cols = p.transpose_w ? p.K : p.N;
  KESTREL_CHECK(p.ldw >= w_cols, "{}: ldw={} must be >= {}={} (transpose_w={})", fn, p.ldw, p.transpose_w ? "K" : "N",
                w_cols, p.transpose_w);
  KESTREL_CHECK(p.ldy >= p.N, "{}: ldy={} must be >= N={}", fn, p.ldy, p.N);
  KESTREL_CHECK(!(p.accumulate && p.y_bf16), "{}: accumulate needs an fp32 output", fn);
  KESTREL_CHECK(p.stride_x >= 0 && p.stride_w >= 0 && p.stride_y >= 0,
                "{}: strides must be non-negative, got {}, {}, {}", fn, p.stride_x, p.stride_w, p.stride_y);
  if (p.M == 0 || p.batch == 0) return;
  KESTREL_CHECK(p.x && p.w && p.y, "{}: x, w and y must be set", fn);
  if (p.batch > 1) {
    // Disjoint outputs: either the batches sit side by side inside each row (heads of a token) or one after
    // another as whole matrices.
    const bool side_by_side = p.stride_y >= p.N && (p.batch - 1) * p.stride_y + p.N <= p.ldy;
    const bool one_after_another = p.stride_y >= (p.M - 1) * p.ldy + p.N;
    KESTREL_CHECK(side_by_side || one_after_another,
                  "{}: the outputs of different batches overlap (stride_y={}, ldy={}, M={}, N={}, batch={})", fn,
                  p.stride_y, p.ldy, p.M, p.N, p.batch);
  }
}

void gemm_simple(const GemmProblem& p, cudaStream_t stream) {
  check_gemm_problem(p, "gemm_simple");
  if (p.M == 0 || p.batch == 0) return;
  KESTREL_CUDA_CHECK(detail::launch_gemm_simple(p, stream));
}

struct Gemm::Impl {
  cublasLtHandle_t handle = nullptr;
  DeviceBuffer<uint8_t> workspace;
  std::map<PlanKey, Plan> plans;

  ~Impl() {
    plans.clear();  // the descriptors before the handle
    if (handle) cublasLtDestroy(handle);
  }

  const Plan& plan(const GemmProblem& p) {
    auto [it, inserted] = plans.try_emplace(plan_key(p));
    if (!inserted) return it->second;
    try {
      configure(p, it->second);
    } catch (...) {
      plans.erase(it);
      throw;
    }
    return it->second;
  }

  // y^T = op(w) · x^T in cuBLASLt's column-major terms: A = w, B = x (K x M), C = D = y^T (N x M).
  void configure(const GemmProblem& p, Plan& plan) {
    const cudaDataType_t y_type = p.y_bf16 ? CUDA_R_16BF : CUDA_R_32F;
    KESTREL_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_w = p.transpose_w ? CUBLAS_OP_T : CUBLAS_OP_N, op_x = CUBLAS_OP_N;
    KESTREL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_w, sizeof(op_w)));
    KESTREL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_x, sizeof(op_x)));
    plan.w_layout = p.transpose_w ? make_layout(CUDA_R_16BF, p.K, p.N, p.ldw, p.batch, p.stride_w)
                                  : make_layout(CUDA_R_16BF, p.N, p.K, p.ldw, p.batch, p.stride_w);
    plan.x_layout = make_layout(CUDA_R_16BF, p.K, p.M, p.ldx, p.batch, p.stride_x);
    plan.y_layout = make_layout(y_type, p.N, p.M, p.ldy, p.batch, p.stride_y);

    cublasLtMatmulPreference_t preference = nullptr;
    KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
    {
      const uint64_t max_workspace = workspace.bytes();
      const uint32_t align_x = operand_alignment(p.x, p.ldx, p.stride_x, p.batch, 2),
                     align_w = operand_alignment(p.w, p.ldw, p.stride_w, p.batch, 2),
                     align_y = operand_alignment(p.y, p.ldy, p.stride_y, p.batch, p.y_bf16 ? 2 : 4);
      const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_w},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_x},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_y},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_y}};
      status = cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &max_workspace, sizeof(max_workspace));
      for (const auto& [attribute, value] : alignments)
        if (status == CUBLAS_STATUS_SUCCESS)
          status = cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value));
      if (status == CUBLAS_STATUS_SUCCESS)
        status = cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.w_layout, plan.x_layout, plan.y_layout,
                                                plan.y_layout, preference, 1, &result, &found);
    }
    cublasLtMatmulPreferenceDestroy(preference);
    // NOT_SUPPORTED (or no result): cuBLASLt has no kernel for this shape, layout or alignment.
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && found == 0)) return;
    check_cublas(status, "cublasLtMatmulAlgoGetHeuristic");
    check_cublas(result.state, "cublasLtMatmulAlgoGetHeuristic (result)");
    plan.algo = result.algo;
    plan.cublaslt = true;
  }

  void run(const GemmProblem& p, cudaStream_t stream, const char* fn) {
    check_gemm_problem(p, fn);
    if (p.M == 0 || p.batch == 0) return;
    const Plan& chosen = plan(p);
    if (!chosen.cublaslt) {
      KESTREL_CUDA_CHECK(detail::launch_gemm_simple(p, stream));
      return;
    }
    const float alpha = 1.0f, beta = p.accumulate ? 1.0f : 0.0f;
    KESTREL_CUBLAS_CHECK(cublasLtMatmul(handle, chosen.desc, &alpha, p.w, chosen.w_layout, p.x, chosen.x_layout,
                                       &beta, p.y, chosen.y_layout, p.y, chosen.y_layout, &chosen.algo,
                                       workspace.get(), workspace.bytes(), stream));
  }
};

Gemm::Gemm(size_t workspace_bytes) : impl_(std::make_unique<Impl>()) {
  KESTREL_CUBLAS_CHECK(cublasLtCreate(&impl_->handle));
  impl_->workspace = DeviceBuffer<uint8_t>(workspace_bytes);
}

Gemm::~Gemm() = default;

void Gemm::linear(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* w, int64_t N, float* y,
                  int64_t ldy, cudaStream_t stream, bool accumulate) {
  GemmProblem p;
  p.x = x;
  p.ldx = ldx;
  p.w = w;
  p.ldw = K;
  p.transpose_w = true;
  p.y = y;
  p.ldy = ldy;
  p.M = M;
  p.N = N;
  p.K = K;
  p.accumulate = accumulate;
  impl_->run(p, stream, "Gemm::linear");
}

void Gemm::linear_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* w, int64_t N,
                       uint16_t* y, int64_t ldy, cudaStream_t stream) {
  GemmProblem p;
  p.x = x;
  p.ldx = ldx;
  p.w = w;
  p.ldw = K;
  p.transpose_w = true;
  p.y = y;
  p.y_bf16 = true;
  p.ldy = ldy;
  p.M = M;
  p.N = N;
  p.K = K;
  impl_->run(p, stream, "Gemm::linear_bf16");
}

void Gemm::batched(const uint16_t* x, int64_t ldx, int64_t stride_x, const uint16_t* w, int64_t ldw, int64_t stride_w,
                   bool transpose_w, float* y, int64_t ldy, int64_t stride_y, int64_t M, int64_t N, int64_t K,
                   int64_t batch, cudaStream_t stream) {
  GemmProblem p;
  p.x = x;
  p.ldx = ldx;
  p.stride_x = stride_x;
  p.w = w;
  p.ldw = ldw;
  p.stride_w = stride_w;
  p.transpose_w = transpose_w;
  p.y = y;
  p.ldy = ldy;
  p.stride_y = stride_y;
  p.M = M;
  p.N = N;
  p.K = K;
  p.batch = batch;
  impl_->run(p, stream, "Gemm::batched");
}

void Gemm::run(const GemmProblem& p, cudaStream_t stream) { impl_->run(p, stream, "Gemm::run"); }

bool Gemm::uses_cublaslt(const GemmProblem& p) {
  check_gemm_problem(p, "Gemm::uses_cublaslt");
  KESTREL_CHECK(p.M >= 1 && p.batch >= 1, "Gemm::uses_cublaslt: M={} and batch={} must be at least 1", p.M, p.batch);
  return impl_->plan(p).cublaslt;
}

}  // namespace kestrel::cuda
