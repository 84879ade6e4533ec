#include "kernels/cuda/gemm_fp8.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {

namespace {

void run_linear_fp8(const char* fn, const uint16_t* x, int64_t M, int64_t ldx, const Fp8BlockMatrix& w, void* y,
                    bool y_bf16, int64_t ldy, cudaStream_t stream) {
  KESTREL_CHECK(w.N >= 1 && w.K >= 1, "{}: N={} and K={} must be at least 1", fn, w.N, w.K);
  KESTREL_CHECK(w.block >= 16 && w.block % 16 == 0, "{}: the scale block {} must be a positive multiple of 16", fn,
                w.block);
  KESTREL_CHECK(M >= 0, "{}: M={} must be non-negative", fn, M);
  KESTREL_CHECK(ldx >= w.K, "{}: ldx={} must be >= K={}", fn, ldx, w.K);
  KESTREL_CHECK(ldy >= w.N, "{}: ldy={} must be >= N={}", fn, ldy, w.N);
  const int64_t passes = (M + kFp8RowsPerPass - 1) / kFp8RowsPerPass, row_groups = (w.N + 3) / 4;
  KESTREL_CHECK(row_groups <= std::numeric_limits<int32_t>::max() / std::max<int64_t>(passes, 1),
                "{}: N={} and M={} exceed the kernel's grid", fn, w.N, M);
  if (M == 0) return;
  KESTREL_CHECK(x && w.codes && w.scales && y, "{}: x, the codes, the scales and y must be set", fn);
  KESTREL_CUDA_CHECK(detail::launch_linear_fp8(x, M, ldx, w, y, y_bf16, ldy, stream));
}

}  // namespace

void linear_fp8(const uint16_t* x, int64_t M, int64_t ldx, const Fp8BlockMatrix& w, float* y, int64_t ldy,
                cudaStream_t stream) {
  run_linear_fp8("linear_fp8", x, M, ldx, w, y, false, ldy, stream);
}

void linear_fp8_bf16(const uint16_t* x, int64_t M, int64_t ldx, const Fp8BlockMatrix& w, uint16_t* y, int64_t ldy,
                     cudaStream_t stream) {
  run_linear_fp8("linear_fp8_bf16", x, M, ldx, w, y, true, ldy, stream);
}

}  // namespace kestrel::cuda
