// short_conv_silu_varlen (kda_glue.h) over several projections of one packed input in one pair of launches. The KDA
// mixer's q, k and v come out of one GEMM as rows [q | k | v]; their short convolutions differ only in taps,
// history and output, so one launch (and one history update) serves all three instead of three pairs.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace kestrel::cuda {

// For each part p < parts, exactly short_conv_silu_varlen(x_p, cu_seqlens, B, C, w_p, W, hist_p, out_p) -- the same
// fp32 operations in the same order, so bit for bit the same outputs and histories -- where
//   x_p:    [T, C] with leading dimension ldx: columns [p*C, (p+1)*C) of x ([T, ldx], ldx >= parts*C);
//   w_p:    w + p*C*W, the taps [C, W] (w is the parts' taps stacked, [parts*C, W]);
//   hist_p: per sequence b, hist[b] + p*hist_part_stride, the part's history [W-1, C] (hist: device array of B
//           pointers; hist_part_stride >= (W-1)*C, so the parts' histories do not overlap);
//   out_p:  out + p*out_part_stride, [T, C] contiguous.
// The histories of different sequences must not overlap, nor any output overlap x or a history, nor the parts'
// outputs overlap each other (out_part_stride >= T*C; T lives on the device, so this is the caller's to keep).
// W in [1, kShortConvMaxWidth]; when W == 1 there is no history and hist may be null. Asynchronous on s; no
// allocation, no host synchronisation (capturable in a CUDA graph). Two launches: the convolution, then the history
// update.
void short_conv_silu_varlen_parts(const float* x, int64_t ldx, const int64_t* cu_seqlens, int B, int parts, int64_t C,
                                  const float* w, int W, float* const* hist, int64_t hist_part_stride, float* out,
                                  int64_t out_part_stride, cudaStream_t s);

}  // namespace kestrel::cuda
