// The parts of the KDA mixer around the fast kernels of kda.h: the short convolutions over a packed varlen batch,
// the gated RMSNorm of the output (bf16 out, for the output projection), and a plain token-by-token recurrence for
// the head sizes that kda_decode / kda_prefill do not implement (anything in [1, 256]; the model's small test
// configurations use 32). Same functions as the CPU reference (src/kernels/cpu/kda.h), fp32 math, asynchronous on
// the given stream, no host synchronisation and no allocation (capturable in a CUDA graph).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/kda.h"

namespace kestrel::cuda {

constexpr int kShortConvMaxWidth = 8;     // largest W short_conv_silu_varlen takes (the models use 4)
constexpr int kKdaRecurrentMaxDim = 256;  // largest dk and dv kda_recurrent_varlen takes

// Causal depthwise short convolution + SiLU over a packed varlen batch (cpu::short_conv_silu per sequence).
// x: [T, C] fp32 raw projections, sequences back to back: sequence b owns rows [cu_seqlens[b], cu_seqlens[b+1])
// (cu_seqlens: device int64 [B+1]). w: [C, W] taps (tap W-1 multiplies the current token). hist: device array of B
// pointers; hist[b] points to that sequence's history [W-1, C] (oldest input first), which is read as the inputs
// before the sequence's first token and then overwritten with the last W-1 inputs (including older history when the
// sequence has fewer than W-1 tokens), exactly as the CPU. out: [T, C] = silu(sum_i w[c, i] * window_i).
// W in [1, kShortConvMaxWidth]; when W == 1 there is no history and hist may be null. The histories must not
// overlap each other, and out must not overlap x or a history (the CPU function allows out == x; this one does
// not). Two launches: the convolution, then the history update.
void short_conv_silu_varlen(const float* x, const int64_t* cu_seqlens, int B, int64_t C, const float* w, int W,
                            float* const* hist, float* out, cudaStream_t s);

// cpu::kda_gated_rmsnorm with a bf16 output, for rows = T*H of dv values:
// y[row, j] = o[row, j] / sqrt(mean(o_row^2) + eps) * w[j] * sigmoid(r[row, j]).
// o, r fp32 [T*H, dv]; w [dv]; y bf16 bits [T*H, dv] (round to nearest even).
void kda_gated_rmsnorm_bf16(const float* o, const float* r, const float* w, int64_t T, int H, int dv, float eps,
                            uint16_t* y, cudaStream_t s);
// The same values in fp32 (y_f32) and bf16 (y_bf16), either of them null.
void kda_gated_rmsnorm(const float* o, const float* r, const float* w, int64_t T, int H, int dv, float eps,
                       float* y_f32, uint16_t* y_bf16, cudaStream_t s);

// The token-by-token KDA recurrence (cpu::kda_recurrent with the preprocessing of KdaInputs: l2-normalised q and k
// when normalize_qk, the fused gate from A_log/dt_bias (with or without gate_lower_bound), beta logit), for any dk,
// dv in [1, kKdaRecurrentMaxDim], over a packed varlen batch: sequence b's tokens are [cu_seqlens[b],
// cu_seqlens[b+1]) (device int64), its state [H, dk, dv] fp32 at state_pool + slots[b] * stride (slots: device
// int32, distinct; stride: in.state_stride, or H*dk*dv when that is 0), updated in place. o: [T, H, dv]. Same math
// and state layout as kda_decode. The value columns of a head are independent in the recurrence, so each thread
// block owns one (sequence, head, 32 value columns) and walks its tokens with that state slice in registers.
void kda_recurrent_varlen(const KdaInputs& in, const int64_t* cu_seqlens, int B, int H, int dk, int dv,
                          float* state_pool, const int32_t* slots, float* o, cudaStream_t s);

}  // namespace kestrel::cuda
