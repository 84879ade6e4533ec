#include "kernels/cuda/short_conv_parts.h"

#include "core/error.h"
#include "kernels/cuda/kda_glue.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {

namespace detail {
// Defined in short_conv_parts.cu.
cudaError_t launch_short_conv_silu_varlen_parts(const float* x, int64_t ldx, const int64_t* cu_seqlens, int B,
                                                int parts, int64_t C, const float* w, int W, float* const* hist,
                                                int64_t hist_part_stride, float* out, int64_t out_part_stride,
                                                cudaStream_t stream);
}  // namespace detail

void short_conv_silu_varlen_parts(const float* x, int64_t ldx, const int64_t* cu_seqlens, int B, int parts, int64_t C,
                                  const float* w, int W, float* const* hist, int64_t hist_part_stride, float* out,
                                  int64_t out_part_stride, cudaStream_t s) {
  const char* fn = "short_conv_silu_varlen_parts";
  KESTREL_CHECK(B >= 0 && parts >= 1 && C > 0, "{}: invalid sizes B={} parts={} C={}", fn, B, parts, C);
  KESTREL_CHECK(ldx >= parts * C, "{}: ldx {} is less than parts*C = {}", fn, ldx, parts * C);
  KESTREL_CHECK(W >= 1 && W <= kShortConvMaxWidth, "{}: kernel width W={} is not in [1, {}]", fn, W,
                kShortConvMaxWidth);
  KESTREL_CHECK(x && cu_seqlens && w && out && (hist || W == 1),
                "{}: x, cu_seqlens, w, out and (for W > 1) hist must all be set", fn);
  KESTREL_CHECK(W == 1 || parts == 1 || hist_part_stride >= (W - 1) * C,
                "{}: hist_part_stride {} is less than one history, (W-1)*C = {}", fn, hist_part_stride, (W - 1) * C);
  KESTREL_CHECK(parts == 1 || out_part_stride >= C, "{}: out_part_stride {} is less than C = {}", fn,
                out_part_stride, C);
  KESTREL_CHECK(out != x, "{}: out must not be x (the GPU form does not work in place)", fn);
  KESTREL_CUDA_CHECK(detail::launch_short_conv_silu_varlen_parts(x, ldx, cu_seqlens, B, parts, C, w, W, hist,
                                                                 hist_part_stride, out, out_part_stride, s));
}

}  // namespace kestrel::cuda
