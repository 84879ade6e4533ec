// Reference building blocks of the CPU backend: fixed-order reductions, GEMM, norms, activations.
// Every reduction here sums in one fixed order that does not depend on how many rows are processed
// together, so a token's result is the same alone or in any batch (batch invariance by construction).
#pragma once
#include <cstdint>

namespace kestrel::cpu {

// Sum of a[i]*b[i] in a fixed order: 8 interleaved fp32 partial sums, then a fixed pairwise tree.
float dot(const float* a, const float* b, int64_t n);
// Sum of a[i] (same order as dot).
float sum(const float* a, int64_t n);
// Sum of a[i]^2 (same order as dot).
float sum_sq(const float* a, int64_t n);

// y[M,N] = x[M,K] · w[N,K]^T (weights stored [out, in] as in the checkpoints). Each y[m,n] is dot(x_m, w_n).
void linear(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N);

// y = x / sqrt(mean(x^2) + eps) * w, per row of D values.
void rms_norm(const float* x, const float* w, float* y, int64_t M, int64_t D, float eps);
// y = (x - mean) / sqrt(var + eps) * w + b, per row (population variance).
void layer_norm(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t D, float eps);

float silu(float x);
float sigmoid(float x);
// softplus with beta 1 and threshold 20 (returns x above 20), as torch.nn.functional.softplus.
float softplus(float x);

// out[i] = silu(gate[i]) * up[i]
void swiglu(const float* gate, const float* up, float* out, int64_t n);

// x /= sqrt(sum(x^2) + eps) over each of `rows` vectors of length d (fp32; eps inside the sqrt).
void l2_normalize_rows(float* x, int64_t rows, int64_t d, float eps);

}  // namespace kestrel::cpu
