#include "kernels/cuda/gemm_fp8_block.h"

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

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
int64_t blocks_of(int64_t n) { return (n + kFp8BlockGroup - 1) / kFp8BlockGroup; }
size_t align256(size_t n) { return (n + 255) / 256 * 256; }
bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The staged output: padded_rows rows of N rounded up to 4 fp32 values (16-byte columns for cuBLASLt).
int64_t staged_ld(int64_t N) { return round_up(N, 4); }
size_t staged_bytes(int64_t M, int64_t N) {
  if (M % 4 == 0) return 0;
  return static_cast<size_t>(round_up(M, 4) * staged_ld(N)) * sizeof(float);
}

// The largest power of two up to 256 dividing the address and the row pitch: what cuBLASLt may assume of an operand.
uint32_t operand_alignment(const void* ptr, int64_t row_bytes) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(ptr) | static_cast<uint64_t>(row_bytes) | 256u;
  return static_cast<uint32_t>(uint64_t{1} << std::countr_zero(bits));
}

void check_problem(const Fp8BlockProblem& p, const char* fn) {
  KESTREL_CHECK(p.a.M >= 0, "{}: M = {} must be non-negative", fn, p.a.M);
  KESTREL_CHECK(p.a.K >= 1 && p.w.N >= 1, "{}: K = {} and N = {} must be at least 1", fn, p.a.K, p.w.N);
  KESTREL_CHECK(p.w.K == p.a.K, "{}: the weight has K = {} columns, the activations {}", fn, p.w.K, p.a.K);
  KESTREL_CHECK(p.ldy >= p.w.N, "{}: ldy = {} must be >= N = {}", fn, p.ldy, p.w.N);
  KESTREL_CHECK(!(p.accumulate && p.y_bf16), "{}: accumulate needs an fp32 output", fn);
  KESTREL_CHECK((p.w.N + 63) / 64 <= 65535, "{}: N = {} exceeds the fallback kernel's grid", fn, p.w.N);
  if (p.a.M == 0) return;
  KESTREL_CHECK(p.a.codes && p.a.scales && p.w.codes && p.w.scales && p.y,
                "{}: the activation codes and scales, the weight codes and scales and y must be set", fn);
  KESTREL_CHECK(aligned(p.a.codes, 16) && aligned(p.a.scales, 16) && aligned(p.w.codes, 16) && aligned(p.w.scales, 16),
                "{}: the activation and weight codes and scales must be 16-byte aligned", fn);
  KESTREL_CHECK(aligned(p.y, p.y_bf16 ? 2 : 4), "{}: y must be aligned to its element size", fn);
}

// Everything the choice of a path and a cuBLASLt algorithm depends on.
using PlanKey = std::array<int64_t, 7>;

PlanKey plan_key(const Fp8BlockProblem& p) {
  return PlanKey{p.a.M, p.w.N, p.a.K, p.ldy, p.y_bf16, p.accumulate,
                 operand_alignment(p.y, p.ldy * (p.y_bf16 ? 2 : 4))};
}

struct Plan {
  Fp8BlockPath path = Fp8BlockPath::mma_fallback;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t w_layout = nullptr;  // cuBLASLt's A
  cublasLtMatrixLayout_t a_layout = nullptr;  // cuBLASLt's B
  cublasLtMatrixLayout_t y_layout = nullptr;  // C and D
  cublasLtMatmulAlgo_t algo{};

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() { release(); }
  void release() {
    // Destroying descriptors only fails on invalid handles, which these are not.
    if (y_layout) cublasLtMatrixLayoutDestroy(y_layout);
    if (a_layout) cublasLtMatrixLayoutDestroy(a_layout);
    if (w_layout) cublasLtMatrixLayoutDestroy(w_layout);
    if (desc) cublasLtMatmulDescDestroy(desc);
    y_layout = a_layout = w_layout = nullptr;
    desc = nullptr;
  }
};

template <typename T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  KESTREL_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
}

}  // namespace

bool Fp8BlockWeightLayout::same_as_checkpoint() const { return row_bytes == K && scale_row_floats == blocks_of(K); }

Fp8BlockWeightLayout fp8_block_weight_layout(int64_t N, int64_t K) {
  KESTREL_CHECK(N >= 1 && K >= 1, "fp8_block_weight_layout: N = {} and K = {} must be at least 1", N, K);
  Fp8BlockWeightLayout l;
  l.N = N;
  l.K = K;
  l.row_bytes = round_up(K, 16);
  l.block_rows = blocks_of(N);
  l.scale_row_floats = round_up(blocks_of(K), 4);
  return l;
}

Fp8ActivationLayout fp8_activation_layout(int64_t M, int64_t K) {
  KESTREL_CHECK(M >= 0 && K >= 1, "fp8_activation_layout: M = {} must be non-negative and K = {} at least 1", M, K);
  Fp8ActivationLayout l;
  l.M = M;
  l.K = K;
  l.padded_rows = round_up(M, 4);
  l.row_bytes = round_up(K, 16);
  l.groups = blocks_of(K);
  return l;
}

void quantize_fp8_activations(const float* x, int64_t M, int64_t K, int64_t ldx, uint8_t* codes, float* scales,
                              cudaStream_t stream) {
  const Fp8ActivationLayout l = fp8_activation_layout(M, K);
  KESTREL_CHECK(ldx >= K, "quantize_fp8_activations: ldx = {} must be >= K = {}", ldx, K);
  KESTREL_CHECK(l.padded_rows * l.groups <= std::numeric_limits<int32_t>::max() / 32,
                "quantize_fp8_activations: M = {} and K = {} exceed the kernel's grid", M, K);
  if (M == 0) return;
  KESTREL_CHECK(x && codes && scales, "quantize_fp8_activations: x, codes and scales must be set");
  KESTREL_CHECK(aligned(codes, 16) && aligned(scales, 16), "quantize_fp8_activations: codes and scales must be 16-byte "
                                                           "aligned");
  const detail::QuantizeArgs a{x, M, l.padded_rows, K, ldx, codes, l.row_bytes, scales, 1, l.padded_rows};
  KESTREL_CUDA_CHECK(detail::launch_quantize_fp8(a, stream));
}

void fp8_block_gemm_mma(const Fp8BlockProblem& p, cudaStream_t stream) {
  check_problem(p, "fp8_block_gemm_mma");
  if (p.a.M == 0) return;
  KESTREL_CUDA_CHECK(detail::launch_fp8_block_gemm_mma(p, stream));
}

struct Fp8BlockGemm::Impl {
  cublasLtHandle_t handle = nullptr;
  DeviceBuffer<uint8_t> workspace;
  std::map<PlanKey, Plan> plans;

  ~Impl() {
    plans.clear();  // the descriptors before the handle
    if (handle) cublasLtDestroy(handle);
  }

  const Plan& plan(const Fp8BlockProblem& p) {
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

  // D[N, cols] = op(W) X in cuBLASLt's column-major terms (see the header). Returns whether the heuristic found an
  // algorithm; plan holds the descriptors either way (released by the caller when not).
  bool try_configure(const Fp8BlockProblem& p, bool staged, Plan& plan) {
    const int64_t N = p.w.N, K = fp8_block_weight_layout(N, p.a.K).row_bytes;
    const int64_t cols = staged ? round_up(p.a.M, 4) : p.a.M;
    const cudaDataType_t y_type = !staged && p.y_bf16 ? CUDA_R_16BF : CUDA_R_32F;
    const int64_t ld = staged ? staged_ld(N) : p.ldy;
    KESTREL_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
    const int32_t w_scales = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const int32_t a_scales = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, w_scales);
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, a_scales);
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(p.w.scales));
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(p.a.scales));
    KESTREL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.w_layout, CUDA_R_8F_E4M3, K, N, K));
    KESTREL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a_layout, CUDA_R_8F_E4M3, K, cols, K));
    KESTREL_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.y_layout, y_type, N, cols, ld));

    cublasLtMatmulPreference_t preference = nullptr;
    KESTREL_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
    const uint64_t max_workspace = workspace.bytes();
    // Codes are only promised 16-byte aligned (rows of a multiple of 16 bytes), so a plan holds for any weight and
    // workspace. Staged outputs sit at 256-byte offsets of the caller's workspace with 16-byte columns.
    const uint32_t align_y = staged ? 16u : operand_alignment(p.y, p.ldy * (p.y_bf16 ? 2 : 4));
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, 16u},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, 16u},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_y},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_y}};
    cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
        preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace, sizeof(max_workspace));
    for (const auto& [attribute, value] : alignments)
      if (status == CUBLAS_STATUS_SUCCESS)
        status = cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.w_layout, plan.a_layout, plan.y_layout,
                                              plan.y_layout, preference, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(preference);
    // NOT_SUPPORTED (or no result): cuBLASLt has no kernel for this shape, layout, scale mode or GPU.
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_ARCH_MISMATCH ||
        (status == CUBLAS_STATUS_SUCCESS && found == 0))
      return false;
    check_cublas(status, "cublasLtMatmulAlgoGetHeuristic");
    check_cublas(result.state, "cublasLtMatmulAlgoGetHeuristic (result)");
    plan.algo = result.algo;
    return true;
  }

  void configure(const Fp8BlockProblem& p, Plan& plan) {
    const bool staged = p.a.M % 4 != 0;
    if (try_configure(p, staged, plan)) {
      plan.path = staged ? Fp8BlockPath::cublaslt_staged : Fp8BlockPath::cublaslt;
      return;
    }
    plan.release();
    plan.path = Fp8BlockPath::mma_fallback;
  }

  void run(const Fp8BlockProblem& p, void* ws, size_t ws_bytes, cudaStream_t stream, const char* fn) {
    check_problem(p, fn);
    if (p.a.M == 0) return;
    const Plan& chosen = plan(p);
    if (chosen.path == Fp8BlockPath::mma_fallback) {
      KESTREL_CUDA_CHECK(detail::launch_fp8_block_gemm_mma(p, stream));
      return;
    }
    const bool staged = chosen.path == Fp8BlockPath::cublaslt_staged;
    const size_t need = staged_bytes(p.a.M, p.w.N);
    KESTREL_CHECK(!staged || (ws && ws_bytes >= need && aligned(ws, 256)),
                  "{}: M = {} stages its output in the workspace: {} bytes, 256-byte aligned, needed; got {}", fn,
                  p.a.M, need, ws_bytes);
    set_desc(chosen.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(p.w.scales));
    set_desc(chosen.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(p.a.scales));
    const float alpha = 1.0f, beta = !staged && p.accumulate ? 1.0f : 0.0f;
    void* d = staged ? ws : p.y;
    KESTREL_CUBLAS_CHECK(cublasLtMatmul(handle, chosen.desc, &alpha, p.w.codes, chosen.w_layout, p.a.codes,
                                       chosen.a_layout, &beta, d, chosen.y_layout, d, chosen.y_layout, &chosen.algo,
                                       workspace.get(), workspace.bytes(), stream));
    if (staged)
      KESTREL_CUDA_CHECK(detail::launch_fp8_stage_copy(static_cast<const float*>(ws), staged_ld(p.w.N), p.a.M, p.w.N,
                                                       p.y, p.y_bf16, p.ldy, p.accumulate, stream));
  }

  void linear(const float* x, int64_t M, int64_t ldx, const Fp8BlockWeight& w, void* y, bool y_bf16, int64_t ldy,
              bool accumulate, void* ws, size_t ws_bytes, cudaStream_t stream, const char* fn) {
    const Fp8ActivationLayout l = fp8_activation_layout(M, w.K);
    if (M > 0) {
      const size_t need = Fp8BlockGemm::workspace_bytes(M, w.N, w.K);
      KESTREL_CHECK(ws && ws_bytes >= need && aligned(ws, 256),
                    "{}: the workspace must hold {} bytes (Fp8BlockGemm::workspace_bytes), 256-byte aligned; got {}",
                    fn, need, ws_bytes);
      KESTREL_CHECK(x && ldx >= w.K, "{}: x must be set and ldx = {} >= K = {}", fn, ldx, w.K);
    }
    // The workspace: the activation codes, their scales, then the staged output (256-byte aligned regions).
    const size_t scales_at = align256(l.code_bytes()), staged_at = scales_at + align256(l.scale_bytes());
    auto* codes = static_cast<uint8_t*>(ws);
    auto* scales = M > 0 ? reinterpret_cast<float*>(codes + scales_at) : nullptr;
    Fp8BlockProblem p;
    p.a = Fp8Activations{codes, scales, M, w.K};
    p.w = w;
    p.y = y;
    p.y_bf16 = y_bf16;
    p.ldy = ldy;
    p.accumulate = accumulate;
    check_problem(p, fn);
    if (M == 0) return;
    quantize_fp8_activations(x, M, w.K, ldx, codes, scales, stream);
    run(p, codes + staged_at, ws_bytes - staged_at, stream, fn);
  }
};

Fp8BlockGemm::Fp8BlockGemm(size_t cublaslt_workspace_bytes) : impl_(std::make_unique<Impl>()) {
  KESTREL_CUBLAS_CHECK(cublasLtCreate(&impl_->handle));
  impl_->workspace = DeviceBuffer<uint8_t>(cublaslt_workspace_bytes);
}

Fp8BlockGemm::~Fp8BlockGemm() = default;

size_t Fp8BlockGemm::workspace_bytes(int64_t M, int64_t N, int64_t K) {
  KESTREL_CHECK(N >= 1, "Fp8BlockGemm::workspace_bytes: N = {} must be at least 1", N);
  const Fp8ActivationLayout l = fp8_activation_layout(M, K);
  return align256(l.code_bytes()) + align256(l.scale_bytes()) + align256(staged_bytes(M, N));
}

void Fp8BlockGemm::linear(const float* x, int64_t M, int64_t ldx, const Fp8BlockWeight& w, float* y, int64_t ldy,
                          void* workspace, size_t workspace_bytes, cudaStream_t stream, bool accumulate) {
  impl_->linear(x, M, ldx, w, y, false, ldy, accumulate, workspace, workspace_bytes, stream, "Fp8BlockGemm::linear");
}

void Fp8BlockGemm::linear_bf16(const float* x, int64_t M, int64_t ldx, const Fp8BlockWeight& w, uint16_t* y,
                               int64_t ldy, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  impl_->linear(x, M, ldx, w, y, true, ldy, false, workspace, workspace_bytes, stream, "Fp8BlockGemm::linear_bf16");
}

void Fp8BlockGemm::run(const Fp8BlockProblem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  impl_->run(p, workspace, workspace_bytes, stream, "Fp8BlockGemm::run");
}

Fp8BlockPath Fp8BlockGemm::path(const Fp8BlockProblem& p) {
  check_problem(p, "Fp8BlockGemm::path");
  KESTREL_CHECK(p.a.M >= 1, "Fp8BlockGemm::path: M = {} must be at least 1", p.a.M);
  return impl_->plan(p).path;
}

}  // namespace kestrel::cuda
