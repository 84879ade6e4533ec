// The routed-expert part of a MoE layer on the GPU: routing (cpu::moe_route's rule, bit for bit) and the experts
// (a deterministic counting sort of the (token, slot) pairs by expert, grouped bf16 tensor-core GEMMs with fp32
// accumulation, swiglu rounded to bf16 between the two GEMMs, and a combine that sums each token's slots in rank
// order, as MoE::forward in src/model/layers.cpp). No atomics anywhere: results are identical run to run and do not
// depend on how the pairs fall into tiles. Every call is asynchronous on its stream and capturable in a CUDA graph:
// grid sizes depend only on the sizes the host passes; the per-expert token counts stay on the device.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kestrel::cuda {

struct MoeRoutingParams {
  int n_experts = 0, top_k = 0, n_group = 1, topk_group = 1;
  bool renormalize = true;
  float scaling = 1.0f;
};

// The largest expert count moe_route takes (one thread per expert in a token's block).
constexpr int kMoeMaxRoutedExperts = 1024;

// logits: [T, E] fp32 router logits; bias: [E] or nullptr. ids [T, top_k] int32 and weights [T, top_k] fp32, exactly
// cpu::moe_route's rule for the same logits (sigmoid scores; bias only for selection; groups scored by the sum of
// their two highest biased scores, best topk_group groups survive, ties to the lower group; top_k by biased score,
// ties to the lower id, rank order; weights = unbiased scores renormalised (if renormalize) times scaling).
// The sigmoid is evaluated as the CPU does (fp32 1 / (1 + exp(-x)), exp correctly rounded to fp32 through double),
// so ids are bit-identical and weights agree to the last bit except where the host's expf misrounds (< 1 ulp).
// E <= kMoeMaxRoutedExperts; E divisible by n_group; topk_group * E / n_group >= top_k.
void moe_route(const float* logits, const float* bias, int64_t T, const MoeRoutingParams& p, int32_t* ids,
               float* weights, cudaStream_t s);

enum class ExpertDtype { bf16, mxfp4 };
// Routed expert weights of one layer, all experts in one allocation each:
//  bf16:  w13 [E, 2F, D] bf16 bits (per expert: F gate rows (w1), then F up rows (w3)); w2 [E, D, F] bf16 bits (down).
//  mxfp4: w13_packed [E, 2F, D/2] (two e2m1 codes per byte, element 2i in the LOW nibble, as src/core/formats.h's
//         mxfp4 encode/decode), w13_scales [E, 2F, D/32] E8M0 exponents (value = e2m1 * 2^(e - 127));
//         w2_packed [E, D, F/2], w2_scales [E, D, F/32]. (D and F multiples of 32.)
// MXFP4 values are expanded to bf16 in shared memory; e2m1 * 2^(e-127) is exact in bf16 (the same 8-bit exponent
// range as fp32, subnormals included), so both dtypes run the same bf16 GEMM on the same values as the CPU's decode.
struct MoeExpertWeights {
  ExpertDtype dtype = ExpertDtype::bf16;
  int n_experts = 0;
  int64_t D = 0, F = 0;
  const uint16_t* w13 = nullptr;
  const uint16_t* w2 = nullptr;
  const uint8_t* w13_packed = nullptr;
  const uint8_t* w13_scales = nullptr;
  const uint8_t* w2_packed = nullptr;
  const uint8_t* w2_scales = nullptr;
};

// Device scratch moe_experts needs for these sizes (the same for both dtypes): the sort tables, the bf16 swiglu
// rows [T*top_k, F] and the per-pair fp32 expert outputs [T*top_k, D].
size_t moe_workspace_bytes(int64_t T, int top_k, int n_experts, int64_t D, int64_t F);

// y[t, :] (fp32 [T, D], overwritten) = sum over s = 0..top_k-1, in that order, of
// weights[t, s] * expert_{ids[t, s]}(x_t), expert(x) = down(silu(gate(x)) * up(x)); x: bf16 bits [T, D].
// Steps: a deterministic counting sort of the T*top_k (token, slot) pairs by expert (stable by pair index), a grouped
// GEMM for gate/up over each expert's rows (fp32 accumulation), swiglu rounded to bf16, a grouped GEMM for down
// writing each pair's output row, and a combine that sums each token's slots in rank order (fp32:
// y = ((0 + w0 o0) + w1 o1) + ..., products and sums rounded apart). A slot whose id lies outside [0, n_experts)
// contributes nothing (so -1 masks a slot). Workspace: device memory of moe_workspace_bytes, 16-byte aligned (no need
// to zero it). x, y and the weight arrays must be 16-byte aligned.
void moe_experts(const uint16_t* x, int64_t T, const int32_t* ids, const float* weights, int top_k,
                 const MoeExpertWeights& w, float* y, void* workspace, size_t workspace_bytes, cudaStream_t s);

// ---- internal: the interface between the host code (moe.cpp) and the kernels (moe.cu) ----
namespace detail {

// Rows of the sorted pair list one GEMM tile covers, chosen from T so that at T <= 64 (where one expert sees at
// most T rows, ids being distinct per token) every expert's rows fit one tile and each weight tile is read once.
int moe_rows_per_tile(int64_t T);
// Pairs per block of the counting sort.
constexpr int kMoeSortChunk = 256;

struct MoeRouteArgs {
  const float* logits;
  const float* bias;
  int64_t T;
  int n_experts, top_k, n_group, topk_group;
  bool renormalize;
  float scaling;
  int32_t* ids;
  float* weights;
};
cudaError_t launch_moe_route(const MoeRouteArgs& a, cudaStream_t s);

struct MoeExpertArgs {
  const uint16_t* x;
  int64_t T;
  const int32_t* ids;
  const float* weights;
  int top_k;
  MoeExpertWeights w;
  float* y;
  int rows_per_tile;  // moe_rows_per_tile(T)
  int64_t max_tiles;  // bound on the number of row tiles over all experts (the GEMM grids' x size)
  // Workspace regions (see moe.cpp's layout).
  int32_t* chunk_base;     // [n_chunks, E]: per sort chunk, how many pairs of each expert it holds, then their base
  int32_t* expert_offset;  // [E + 1]: start of each expert's rows in the sorted list
  int32_t* tile_start;     // [E + 1]: first tile of each expert
  int32_t* tiles;          // [max_tiles, 2]: (expert or -1, first sorted row)
  int32_t* sorted_pair;    // [T * top_k]: pair index t * top_k + s of each sorted row
  uint16_t* h;             // [T * top_k, F] bf16 swiglu rows, sorted order
  float* pair_out;         // [T * top_k, D] each pair's expert output, pair order
};
cudaError_t launch_moe_experts(const MoeExpertArgs& a, cudaStream_t s);

}  // namespace detail
}  // namespace kestrel::cuda
