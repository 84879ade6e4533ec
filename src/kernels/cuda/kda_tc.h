// Chunked KDA prefill on bf16 tensor cores: the same function, arguments, plan, preprocessing, state layout and
// checkpoints as kda_prefill (kda.h), with the large products of the WY/UT form (Q K^T, W and U, W S, Qg S,
// A_qk V', Kd^T V') on mma.sync with bf16 inputs and fp32 accumulation. The UT transform's triangular inverse,
// the gates and their cumulative sums, the decays and the recurrent state itself stay fp32; the state is rounded
// to bf16 only as an input of the products. Result: within about 1e-2 relative of the fp32 reference
// (kda_prefill_tc_test.cpp states the bound and why). Only dk = dv = 128.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/kda.h"

namespace kestrel::cuda {

// Device scratch that kda_prefill_tc needs for H heads: the plan's chunk tables and, per chunk and head, the
// intra-chunk operands (about 89 KB). Never more than plan.workspace_bytes(H), so a workspace sized for
// kda_prefill serves both.
size_t kda_prefill_tc_workspace_bytes(const KdaPrefillPlan& plan, int H);

// As kda_prefill, with workspace of at least kda_prefill_tc_workspace_bytes(plan, H) bytes. Asynchronous on
// `stream`; no allocation and no host synchronisation; deterministic (no atomics).
void kda_prefill_tc(const KdaPrefillPlan& plan, const KdaInputs& in, int H, int dk, int dv, float* state_pool,
                    const int32_t* slots, float* o, float* checkpoints, void* workspace, size_t workspace_bytes,
                    cudaStream_t stream);

namespace detail {

// Per (chunk, head) workspace of the tensor-core prefill, in bytes from the start of its slot: bf16 rows W, the
// decayed Q and K and A_qk, then fp32 U and the chunk's decay. Rows past the chunk's length are zero.
constexpr size_t kTcW = 0;                            // bf16 [64][128] W = T diag(beta) (exp(G) ⊙ K)
constexpr size_t kTcQg = kTcW + 64 * 128 * 2;         // bf16 [64][128] scale exp(G) ⊙ Q
constexpr size_t kTcKd = kTcQg + 64 * 128 * 2;        // bf16 [64][128] exp(G_end - G) ⊙ K
constexpr size_t kTcA = kTcKd + 64 * 128 * 2;         // bf16 [64][64]  A_qk (scaled), zero above the diagonal
constexpr size_t kTcU = kTcA + 64 * 64 * 2;           // fp32 [64][128] U = T diag(beta) V
constexpr size_t kTcDecay = kTcU + 64 * 128 * 4;      // fp32 [128]     exp(G_end)
constexpr size_t kTcChunkHeadBytes = kTcDecay + 128 * 4;

struct KdaPrefillArgs;  // kda_launch.h; its ws points at the per-chunk slots, kTcChunkHeadBytes apart
cudaError_t launch_kda_prefill_tc(const KdaPrefillArgs& args, cudaStream_t stream);

}  // namespace detail
}  // namespace kestrel::cuda
