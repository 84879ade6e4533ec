// Linear layers whose weight is stored FP8: e4m3 codes [N, K] with one fp32 scale per 128 x 128 block
// (DeepSeek-V3's `weight_scale_inv`, [ceil(N/128), ceil(K/128)] row-major), times fp32 activations quantized per row in
// groups of 128 columns (per-token-group quantization, as DeepGEMM, vLLM and SGLang run DeepSeek's FP8 checkpoints).
// This is the rule every backend follows; the CUDA kernels (src/kernels/cuda/gemm_fp8_block.h, moe.h) are tested
// against these functions.
//
// Activation quantization, per row m and group g (columns [128 g, min(128 g + 128, K)); the last group of a row is
// partial when K % 128 != 0):
//   amax   = the largest |x| of the group by fmax from 0 (a NaN is passed over; an infinity makes amax infinite),
//   s      = max(amax, 1e-10) / 448, one correctly rounded fp32 division,
//   code_k = e4m3(x_k / s): the fp32 quotient (correctly rounded) to e4m3 round-to-nearest-even, saturating to
//            +-448 (f32_to_e4m3). A NaN x_k, or an infinite one (inf / inf), gives the NaN code 0x7F; with an infinite
//            amax the finite values of the group get code 0 (+-0). So a NaN or infinite activation makes its row's
//            outputs NaN, as it would in fp32.
// The product, per output y[m, n] with the weight block row b = n / 128:
//   partial_g = sum over k in g of e4m3(cx[m, k]) * e4m3(cw[n, k]), computed exactly (every product of two e4m3 values
//               is a multiple of 2^-18 below 2^18, so a group's sum is below 2^25 and is held exactly in double, in any
//               order), then rounded once to fp32;
//   y[m, n]   = fp32 sum over g = 0, 1, ... in order of  (s_x[m, g] * s_w[b, g]) * partial_g,
//               each product and each sum rounded to fp32 (no fused multiply-add).
// Results do not depend on M, on the other rows or on the number of threads: each output is this fixed sequence.
#pragma once
#include <cstdint>

namespace kestrel::cpu {

constexpr int kFp8Group = 128;            // activation group width and weight block edge
constexpr float kFp8ScaleFloor = 1e-10f;  // the smallest amax a scale is made from

// Number of 128-wide groups (or blocks) covering n elements.
constexpr int64_t fp8_groups(int64_t n) { return (n + kFp8Group - 1) / kFp8Group; }

// s = max(amax, 1e-10) / 448 in fp32.
float fp8_group_scale(float amax);

// x: fp32 [M, K] with leading dimension ldx >= K. codes: [M, K] e4m3 (contiguous), scales: [M, fp8_groups(K)]
// row-major. Throws kestrel::Error unless M >= 0, K >= 1 and ldx >= K.
void quantize_fp8_groups(const float* x, int64_t M, int64_t K, int64_t ldx, uint8_t* codes, float* scales);

// y[M, N] (fp32, contiguous, overwritten) from activations already quantized by quantize_fp8_groups (codes [M, K],
// scales [M, fp8_groups(K)]) and the weight (w_codes [N, K], w_scales [fp8_groups(N), fp8_groups(K)] row-major).
void linear_fp8_block_quantized(const uint8_t* x_codes, const float* x_scales, int64_t M, int64_t K,
                                const uint8_t* w_codes, const float* w_scales, int64_t N, float* y);

// y[M, N] = the rule above for fp32 x [M, K] (contiguous): quantize_fp8_groups, then linear_fp8_block_quantized.
void linear_fp8_block(const float* x, int64_t M, int64_t K, const uint8_t* w_codes, const float* w_scales, int64_t N,
                      float* y);

// One routed expert's FFN on T tokens, every product by linear_fp8_block: gate/up = x [T, D] times w13 (codes [2F, D]:
// F gate rows then F up rows; scales [2F/128, D/128]), h = cpu::swiglu(gate, up) in fp32, y [T, D] = h times w2 (codes
// [D, F], scales [D/128, F/128]). D and F must be multiples of 128 (so the gate and up rows never share a scale block).
void expert_ffn_fp8_block(const float* x, int64_t T, int64_t D, int64_t F, const uint8_t* w13_codes,
                          const float* w13_scales, const uint8_t* w2_codes, const float* w2_scales, float* y);

}  // namespace kestrel::cpu
