#include "kernels/cuda/kda_glue.h"

#include <cmath>

#include "core/error.h"
#include "kernels/cuda/kda_launch.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {

namespace detail {
// Defined in kda_glue.cu.
cudaError_t launch_short_conv_silu_varlen(const float* x, const int64_t* cu_seqlens, int B, int64_t C, const float* w,
                                          int W, float* const* hist, float* out, cudaStream_t stream);
cudaError_t launch_kda_gated_rmsnorm(const float* o, const float* r, const float* w, int64_t rows, int dv, float eps,
                                     float* y_f32, uint16_t* y, cudaStream_t stream);
cudaError_t launch_kda_recurrent_varlen(const KdaTokenArgs& in, const int64_t* cu_seqlens, int B, int H, int dk,
                                        int dv, float* state_pool, const int32_t* slots, float* o,
                                        cudaStream_t stream);
}  // namespace detail

void short_conv_silu_varlen(const float* x, const int64_t* cu_seqlens, int B, int64_t C, const float* w, int W,
                            float* const* hist, float* out, cudaStream_t s) {
  KESTREL_CHECK(B >= 0 && C > 0, "short_conv_silu_varlen: invalid sizes B={} C={}", B, C);
  KESTREL_CHECK(W >= 1 && W <= kShortConvMaxWidth, "short_conv_silu_varlen: kernel width W={} is not in [1, {}]", W,
                kShortConvMaxWidth);
  KESTREL_CHECK(x && cu_seqlens && w && out && (hist || W == 1),
                "short_conv_silu_varlen: x, cu_seqlens, w, out and (for W > 1) hist must all be set");
  KESTREL_CHECK(out != x, "short_conv_silu_varlen: out must not be x (the GPU form does not work in place)");
  KESTREL_CUDA_CHECK(detail::launch_short_conv_silu_varlen(x, cu_seqlens, B, C, w, W, hist, out, s));
}

void kda_gated_rmsnorm(const float* o, const float* r, const float* w, int64_t T, int H, int dv, float eps,
                       float* y_f32, uint16_t* y_bf16, cudaStream_t s) {
  KESTREL_CHECK(T >= 0 && H > 0 && dv > 0, "kda_gated_rmsnorm: invalid sizes T={} H={} dv={}", T, H, dv);
  KESTREL_CHECK(o && r && w && (y_f32 || y_bf16), "kda_gated_rmsnorm: o, r, w and an output must be set");
  KESTREL_CHECK(std::isfinite(eps) && eps >= 0.0f, "kda_gated_rmsnorm: eps must be finite and >= 0, got {}", eps);
  KESTREL_CUDA_CHECK(detail::launch_kda_gated_rmsnorm(o, r, w, T * H, dv, eps, y_f32, y_bf16, s));
}

void kda_gated_rmsnorm_bf16(const float* o, const float* r, const float* w, int64_t T, int H, int dv, float eps,
                            uint16_t* y, cudaStream_t s) {
  KESTREL_CHECK(y != nullptr, "kda_gated_rmsnorm_bf16: y must be set");
  kda_gated_rmsnorm(o, r, w, T, H, dv, eps, nullptr, y, s);
}

void kda_recurrent_varlen(const KdaInputs& in, const int64_t* cu_seqlens, int B, int H, int dk, int dv,
                          float* state_pool, const int32_t* slots, float* o, cudaStream_t s) {
  const char* fn = "kda_recurrent_varlen";
  KESTREL_CHECK(B >= 0 && H > 0, "{}: invalid sizes B={} H={}", fn, B, H);
  KESTREL_CHECK(dk >= 1 && dk <= kKdaRecurrentMaxDim && dv >= 1 && dv <= kKdaRecurrentMaxDim,
                "{}: dk={} and dv={} must be in [1, {}]", fn, dk, dv, kKdaRecurrentMaxDim);
  KESTREL_CHECK(in.q && in.k && in.v && in.gate && in.beta && cu_seqlens && state_pool && slots && o,
                "{}: q, k, v, gate, beta, cu_seqlens, state_pool, slots and o must all be set", fn);
  const int64_t state_size = int64_t{H} * dk * dv;
  const detail::KdaTokenArgs args = detail::flatten_inputs(fn, in, state_size);
  KESTREL_CHECK(in.state_stride == 0 || in.state_stride >= state_size,
                "{}: state_stride {} must be 0 or at least H*dk*dv = {}", fn, in.state_stride, state_size);
  KESTREL_CUDA_CHECK(detail::launch_kda_recurrent_varlen(args, cu_seqlens, B, H, dk, dv, state_pool, slots, o, s));
}

}  // namespace kestrel::cuda
