// The routed-expert part of a MoE layer on the GPU: routing (cpu::moe_route's rule, bit for bit) and the experts
// (a deterministic counting sort of the (token, slot) pairs by expert, grouped tensor-core GEMMs with fp32
// accumulation, swiglu between the two GEMMs, and a combine that sums each token's slots in rank order, as
// MoE::forward in src/cpu/mla_core.cpp). No atomics anywhere: results are identical run to run and do not depend on how
// the pairs fall into tiles. Every call is asynchronous on its stream and capturable in a CUDA graph: grid sizes depend
// only on the sizes the host passes; the per-expert token counts stay on the device.
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

enum class ExpertDtype { bf16, mxfp4, fp8_block };
// Routed expert weights of one layer, all experts in one allocation each:
//  bf16:  w13 [E, 2F, D] bf16 bits (per expert: F gate rows (w1), then F up rows (w3)); w2 [E, D, F] bf16 bits (down).
//  mxfp4: w13_packed [E, 2F, D/2] (two e2m1 codes per byte, element 2i in the LOW nibble, as src/core/formats.h's
//         mxfp4 encode/decode), w13_scales [E, 2F, D/32] E8M0 exponents (value = e2m1 * 2^(e - 127));
//         w2_packed [E, D, F/2], w2_scales [E, D, F/32]. (D and F multiples of 32.)
//  fp8_block: fp8_w13 [E, 2F, D] e4m3 codes (gate rows, then up rows, as bf16) with fp8_w13_scales [E, 2F/128, D/128]
//         fp32 (one per 128 x 128 block, the checkpoints' `weight_scale_inv` of w1 then w3); fp8_w2 [E, D, F] with
//         fp8_w2_scales [E, D/128, F/128]. D and F multiples of 128.
// MXFP4 values are expanded to bf16 in shared memory; e2m1 * 2^(e-127) is exact in bf16 (the same 8-bit exponent
// range as fp32, subnormals included), so both dtypes run the same bf16 GEMM on the same values as the CPU's decode.
// FP8 experts follow cpu::expert_ffn_fp8_block (src/kernels/cpu/fp8_linear.h): the token's fp32 row is quantized per
// 128-column group for gate/up, the fp32 swiglu output likewise for down, and each 128-wide group's product of codes
// (e4m3 widened to f16, exact; f16 tensor-core MMAs, fp32 accumulation) is scaled by its two scales and added in fp32.
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
  const uint8_t* fp8_w13 = nullptr;
  const float* fp8_w13_scales = nullptr;
  const uint8_t* fp8_w2 = nullptr;
  const float* fp8_w2_scales = nullptr;
};

// Device scratch moe_experts needs for these sizes: the sort tables, the swiglu rows [T*top_k, F] (bf16 for bf16 and
// MXFP4 experts; fp32 plus their codes and scales for FP8 experts, with the quantized input rows) and the per-pair
// fp32 expert outputs [T*top_k, D].
size_t moe_workspace_bytes(int64_t T, int top_k, int n_experts, int64_t D, int64_t F,
                           ExpertDtype dtype = ExpertDtype::bf16);

// y[t, :] (fp32 [T, D], overwritten) = sum over s = 0..top_k-1, in that order, of
// weights[t, s] * expert_{ids[t, s]}(x_t), expert(x) = down(silu(gate(x)) * up(x)); x: bf16 bits [T, D].
// Steps: a deterministic counting sort of the T*top_k (token, slot) pairs by expert (stable by pair index), a grouped
// GEMM for gate/up over each expert's rows (fp32 accumulation), swiglu rounded to bf16, a grouped GEMM for down
// writing each pair's output row, and a combine that sums each token's slots in rank order (fp32:
// y = ((0 + w0 o0) + w1 o1) + ..., products and sums rounded apart). A slot whose id lies outside [0, n_experts)
// contributes nothing (so -1 masks a slot). Workspace: device memory of moe_workspace_bytes, 16-byte aligned (no need
// to zero it). x, y and the weight arrays must be 16-byte aligned. bf16 and MXFP4 experts only.
void moe_experts(const uint16_t* x, int64_t T, const int32_t* ids, const float* weights, int top_k,
                 const MoeExpertWeights& w, float* y, void* workspace, size_t workspace_bytes, cudaStream_t s);

// The same for FP8 block-scaled experts (w.dtype == fp8_block), from fp32 x [T, D]: the rows of x are quantized once
// per token (not per slot), the swiglu output stays fp32 until its own quantization, and the rest (sort, tiles,
// combine) is the bf16 path's. Workspace: moe_workspace_bytes(..., ExpertDtype::fp8_block).
void moe_experts(const float* x, int64_t T, const int32_t* ids, const float* weights, int top_k,
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
  const uint16_t* x;  // bf16 and MXFP4 experts
  const float* x_f32;  // FP8 experts
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
  uint16_t* h;             // [T * top_k, F] bf16 swiglu rows, sorted order (bf16 and MXFP4)
  float* pair_out;         // [T * top_k, D] each pair's expert output, pair order
  // FP8 experts only.
  uint8_t* x_codes;        // [T, D] the quantized rows of x
  float* x_scales;         // [T, D/128]
  float* h_f32;            // [T * top_k, F] fp32 swiglu rows, sorted order
  uint8_t* h_codes;        // [T * top_k, F]
  float* h_scales;         // [T * top_k, F/128]
};
cudaError_t launch_moe_experts(const MoeExpertArgs& a, cudaStream_t s);

// Where the FP8 path keeps its intermediate results in a workspace of moe_workspace_bytes(..., fp8_block) (for tests
// that check each stage): the sorted pair list, the per-expert row offsets, and the swiglu rows in sorted order, fp32
// and quantized. Rows from expert_offset[n_experts] on are not written.
struct MoeFp8Intermediates {
  const int32_t* expert_offset;  // [E + 1]
  const int32_t* sorted_pair;    // [T * top_k]
  const float* h_f32;            // [T * top_k, F]
  const uint8_t* h_codes;        // [T * top_k, F]
  const float* h_scales;         // [T * top_k, F / 128]
};
MoeFp8Intermediates moe_fp8_intermediates(const void* workspace, int64_t T, int top_k, int n_experts, int64_t D,
                                          int64_t F);

}  // namespace detail
}  // namespace kestrel::cuda
