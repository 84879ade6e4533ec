#include "kernels/cuda/ops.h"

#include <cmath>
#include <limits>

#include "core/error.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {

namespace {

void check_eps(const char* fn, float eps) {
  KESTREL_CHECK(std::isfinite(eps) && eps >= 0.0f, "{}: eps must be finite and non-negative, got {}", fn, eps);
}

void check_rows(const char* fn, int64_t M, int64_t D, int64_t ldx, int64_t ldy) {
  KESTREL_CHECK(M >= 0 && D >= 0, "{}: sizes must be non-negative, got M={} D={}", fn, M, D);
  KESTREL_CHECK(ldx >= D && ldy >= D, "{}: leading dimensions ldx={} ldy={} must be >= D={}", fn, ldx, ldy, D);
}

}  // namespace

void rms_norm_bf16(const float* x, int64_t ldx, const float* w, int64_t M, int64_t D, float eps, uint16_t* y,
                   int64_t ldy, cudaStream_t s) {
  check_rows("rms_norm_bf16", M, D, ldx, ldy);
  check_eps("rms_norm_bf16", eps);
  if (M == 0 || D == 0) return;
  KESTREL_CHECK(x && w && y, "rms_norm_bf16: x, w and y must be set");
  KESTREL_CUDA_CHECK(detail::launch_rms_norm(x, ldx, w, M, D, eps, nullptr, y, ldy, s));
}

void rms_norm_dual(const float* x, int64_t ldx, const float* w, int64_t M, int64_t D, float eps, float* y_f32,
                   uint16_t* y_bf16, int64_t ldy, cudaStream_t s) {
  check_rows("rms_norm_dual", M, D, ldx, ldy);
  check_eps("rms_norm_dual", eps);
  KESTREL_CHECK(x != y_f32 || ldx == ldy, "rms_norm_dual: in place needs ldy == ldx, got ldx={} ldy={}", ldx, ldy);
  if (M == 0 || D == 0) return;
  KESTREL_CHECK(x && w && y_f32 && y_bf16, "rms_norm_dual: x, w, y_f32 and y_bf16 must be set");
  KESTREL_CUDA_CHECK(detail::launch_rms_norm(x, ldx, w, M, D, eps, y_f32, y_bf16, ldy, s));
}

void rms_norm_f32(const float* x, int64_t ldx, const float* w, int64_t M, int64_t D, float eps, float* y, int64_t ldy,
                  cudaStream_t s) {
  check_rows("rms_norm_f32", M, D, ldx, ldy);
  check_eps("rms_norm_f32", eps);
  // Rows are normalised by different blocks; in place with another row pitch would overwrite rows not yet read.
  KESTREL_CHECK(x != y || ldx == ldy, "rms_norm_f32: in place needs ldy == ldx, got ldx={} ldy={}", ldx, ldy);
  if (M == 0 || D == 0) return;
  KESTREL_CHECK(x && w && y, "rms_norm_f32: x, w and y must be set");
  KESTREL_CUDA_CHECK(detail::launch_rms_norm(x, ldx, w, M, D, eps, y, nullptr, ldy, s));
}

void layer_norm_f32(const float* x, const float* w, const float* b, int64_t M, int64_t D, float eps, float* y,
                    cudaStream_t s) {
  check_rows("layer_norm_f32", M, D, D, D);
  check_eps("layer_norm_f32", eps);
  if (M == 0 || D == 0) return;
  KESTREL_CHECK(x && w && b && y, "layer_norm_f32: x, w, b and y must be set");
  KESTREL_CUDA_CHECK(detail::launch_layer_norm(x, w, b, M, D, eps, y, s));
}

void add_inplace(float* h, const float* y, int64_t n, cudaStream_t s) {
  KESTREL_CHECK(n >= 0, "add_inplace: n must be non-negative, got {}", n);
  if (n == 0) return;
  KESTREL_CHECK(h && y, "add_inplace: h and y must be set");
  KESTREL_CUDA_CHECK(detail::launch_add_inplace(h, y, n, s));
}

void to_bf16(const float* x, int64_t n, uint16_t* y, cudaStream_t s) {
  KESTREL_CHECK(n >= 0, "to_bf16: n must be non-negative, got {}", n);
  if (n == 0) return;
  KESTREL_CHECK(x && y, "to_bf16: x and y must be set");
  KESTREL_CUDA_CHECK(detail::launch_to_bf16(x, n, y, s));
}

void swiglu_bf16(const float* gu, int64_t T, int64_t F, uint16_t* out, cudaStream_t s) {
  KESTREL_CHECK(T >= 0 && F >= 0, "swiglu_bf16: sizes must be non-negative, got T={} F={}", T, F);
  if (T == 0 || F == 0) return;
  KESTREL_CHECK(gu && out, "swiglu_bf16: gu and out must be set");
  KESTREL_CUDA_CHECK(detail::launch_swiglu(gu, T, F, nullptr, out, s));
}

void swiglu(const float* gu, int64_t T, int64_t F, float* out_f32, uint16_t* out_bf16, cudaStream_t s) {
  KESTREL_CHECK(T >= 0 && F >= 0, "swiglu: sizes must be non-negative, got T={} F={}", T, F);
  if (T == 0 || F == 0) return;
  KESTREL_CHECK(gu && (out_f32 || out_bf16), "swiglu: gu and an output must be set");
  KESTREL_CUDA_CHECK(detail::launch_swiglu(gu, T, F, out_f32, out_bf16, s));
}

void embed_bf16(const int32_t* ids, int64_t T, const uint16_t* table, int64_t D, float* h, cudaStream_t s) {
  KESTREL_CHECK(T >= 0 && D >= 0, "embed_bf16: sizes must be non-negative, got T={} D={}", T, D);
  if (T == 0 || D == 0) return;
  KESTREL_CHECK(ids && table && h, "embed_bf16: ids, table and h must be set");
  KESTREL_CUDA_CHECK(detail::launch_embed_bf16(ids, T, table, D, h, s));
}

void gather_rows(const float* x, int64_t D, const int32_t* rows, int64_t n, float* y, cudaStream_t s) {
  KESTREL_CHECK(D >= 0 && n >= 0, "gather_rows: sizes must be non-negative, got D={} n={}", D, n);
  if (D == 0 || n == 0) return;
  KESTREL_CHECK(x && rows && y, "gather_rows: x, rows and y must be set");
  KESTREL_CUDA_CHECK(detail::launch_gather_rows(x, D, rows, n, y, s));
}

void argmax_rows(const float* logits, int64_t M, int64_t V, int32_t* out, cudaStream_t s) {
  KESTREL_CHECK(M >= 0 && V >= 0, "argmax_rows: sizes must be non-negative, got M={} V={}", M, V);
  KESTREL_CHECK(V <= std::numeric_limits<int32_t>::max(), "argmax_rows: V={} does not fit an int32 index", V);
  if (M == 0) return;
  KESTREL_CHECK(out && (logits || V == 0), "argmax_rows: logits and out must be set");
  KESTREL_CUDA_CHECK(detail::launch_argmax_rows(logits, M, V, out, s));
}

}  // namespace kestrel::cuda
