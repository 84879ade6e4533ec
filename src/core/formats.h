// Number formats, emulated bit-exactly on the CPU: bf16, FP8 e4m3fn, e2m1 (FP4), E8M0 scales, and the block
// formats built on them (ue8m0-scaled FP8 blocks, MXFP4, NVFP4). Rounding is round-to-nearest-even everywhere.
#pragma once
#include <cstdint>

namespace kestrel {

// ---- bf16 ----
// Round-to-nearest-even; NaN stays NaN (quiet, sign kept); +-inf stay inf; overflow rounds to inf as IEEE does.
uint16_t f32_to_bf16(float x);
float bf16_to_f32(uint16_t b);
inline float round_to_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// ---- FP8 e4m3fn (1-4-3, bias 7, no inf, 0x7F/0xFF = NaN, max finite 448, min subnormal 2^-9) ----
// Saturating conversion (PTX cvt.rn.satfinite): finite values beyond +-448 become +-448; +-inf become +-448;
// NaN becomes 0x7F. Values round to nearest even, including into and within the subnormal range; -0 stays -0.
uint8_t f32_to_e4m3(float x);
float e4m3_to_f32(uint8_t b);
constexpr float kE4m3Max = 448.0f;

// ---- FP4 e2m1 (1-2-1, bias 1, values 0, 0.5, 1, 1.5, 2, 3, 4, 6; no inf/NaN) ----
// Saturating: |x| > 6 gives +-6; NaN gives +6 (0x7) — callers that can see NaN must check before encoding.
uint8_t f32_to_e2m1(float x);  // 4-bit code in the low nibble
float e2m1_to_f32(uint8_t code);
constexpr float kE2m1Max = 6.0f;

// ---- E8M0 (unsigned power-of-two scale, 2^(e-127); 0xFF = NaN) ----
float e8m0_to_f32(uint8_t e);

// Smallest power of two >= s, by exponent arithmetic (exact; no log2). s must be finite and > 0.
// Subnormal and normal inputs both work; the result is a normal fp32 power of two.
float round_up_pow2(float s);

// ---- FP8 block with a ue8m0 scale (DeepSeek indexer q/k and activation quantisation) ----
// amax = max|x| over the n values, floored at 1e-4; s = round_up_pow2(amax * (1/448 as an fp32 constant));
// codes[i] = e4m3(clamp(x[i] / s, -448, 448)). Returns s.
float quantize_fp8_ue8m0(const float* x, int n, uint8_t* codes);
// Dequantised values: e4m3_to_f32(codes[i]) * s.
void dequantize_fp8(const uint8_t* codes, int n, float s, float* out);

// ---- MXFP4: blocks of 32 e2m1 values sharing one E8M0 scale (OCP MX v1.0) ----
// Packing: two codes per byte, the even element in the low nibble. n must be a multiple of 32.
// Encoding (OCP rule): shared exponent = floor(log2(amax)) - 2 (2 = emax of e2m1), clamped to [-127, 127];
// a block of zeros gets exponent -127; values are x / 2^e rounded to e2m1 with saturation to +-6.
void mxfp4_encode(const float* x, int64_t n, uint8_t* packed /* n/2 */, uint8_t* scales /* n/32 */);
void mxfp4_decode(const uint8_t* packed, const uint8_t* scales, int64_t n, float* out);

// An FP8 block-scaled weight [out, in] (DeepSeek's weight_scale_inv: one fp32 scale per block x block tile, row-major
// [ceil(out / block), ceil(in / block)]) decoded: w[r, c] = fp32(e4m3(codes[r, c]) * scales[r / block, c / block]).
void fp8_block_decode(const uint8_t* codes, const float* scales, int64_t out, int64_t in, int64_t block, float* w);

// ---- NVFP4: blocks of 16 e2m1 values, one e4m3 block scale each, and one fp32 tensor scale ----
// Block scale code = e4m3(amax_block / (6 * tensor_scale)); decoded block scale sb = e4m3_to_f32(code) * tensor_scale;
// values = e2m1(x / sb) with saturation (a zero block scale encodes all zeros). n must be a multiple of 16.
void nvfp4_encode(const float* x, int64_t n, float tensor_scale, uint8_t* packed /* n/2 */, uint8_t* scales /* n/16 */);
void nvfp4_decode(const uint8_t* packed, const uint8_t* scales, int64_t n, float tensor_scale, float* out);

}  // namespace kestrel
