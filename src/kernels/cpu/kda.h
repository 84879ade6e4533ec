// Kimi Delta Attention (gated delta rule with per-channel decay), CPU reference. See spec kda_kimi_linear.md.
// Shapes: T tokens, H heads, dk = key dim, dv = value dim. The recurrent state of one request is
// S[H][dk][dv] (key index as rows, FLA's default [K,V] layout), fp32.
#pragma once
#include <cstdint>
#include <optional>

namespace kestrel::cpu {

// Causal depthwise short convolution followed by SiLU, for C channels and kernel width W.
// x: [T, C]; w: [C, W] (conv1d weight [C,1,W] flattened; tap W-1 multiplies the current token);
// hist: [W-1, C], the previous W-1 inputs, oldest first (zeros at sequence start); updated in place to the
// last W-1 inputs after this call. out: [T, C].
void short_conv_silu(const float* x, int64_t T, int64_t C, const float* w, int W, float* hist, float* out);

// Log-space forget gate. f: [T, H*dk] (output of f_b_proj); A_log: [H]; dt_bias: [H*dk].
// Without lower bound: g = -exp(A_log[h]) * softplus(f + dt_bias)          (Kimi Linear)
// With lower bound lb:  g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))      (Kimi K3)
void kda_gate(const float* f, int64_t T, int H, int dk, const float* A_log, const float* dt_bias,
              std::optional<float> lower_bound, float* g);

// Token-by-token recurrence. q, k: [T, H, dk] already L2-normalised (q NOT yet scaled; `scale` is applied
// here); v: [T, H, dv]; g: [T, H, dk] log-space gates; beta: [T, H]. state: [H, dk, dv], updated in place.
// Per token and head: S = diag(exp(g)) S; S += beta * k (v - S^T k)^T; o = S^T (scale * q). o: [T, H, dv].
void kda_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                   int H, int dk, int dv, float scale, float* state, float* o);

// The same function computed in the chunked (WY / UT-transform) form, chunk length `chunk` (64), with
// chunk-local log-space cumulative gates (only exp of non-positive numbers is ever evaluated).
// Chunk boundaries sit at absolute positions that are multiples of `chunk`: `start_pos` is the absolute position
// of the first token, so a segment that starts mid-chunk begins with a partial chunk. This makes a prompt cut into
// segments at multiples of `chunk` give bit-identical results to the uncut prompt.
// If `checkpoints` is not null, the state after every token whose absolute position p satisfies
// (p + 1) % checkpoint_every == 0 is copied to checkpoints[j] (j-th such boundary inside this call, each
// H*dk*dv floats); checkpoint_every must be a multiple of `chunk`. Returns the number of checkpoints written.
int kda_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                int H, int dk, int dv, float scale, float* state, float* o, int64_t start_pos = 0, int chunk = 64,
                float* checkpoints = nullptr, int64_t checkpoint_every = 0);

// Gated RMSNorm of the KDA output, per head: y = w * o / sqrt(mean(o^2) + eps) * sigmoid(r).
// o: [T, H, dv]; r: [T, H*dv]; w: [dv] shared by all heads. y: [T, H*dv].
void kda_gated_rmsnorm(const float* o, const float* r, const float* w, int64_t T, int H, int dv, float eps, float* y);

}  // namespace kestrel::cpu
