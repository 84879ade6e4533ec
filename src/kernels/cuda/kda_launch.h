// Internal interface between the KDA host code (kda.cpp, compiled by the C++ compiler) and the kernels (*.cu):
// plain argument structs, the prefill workspace layout, and launchers that return CUDA's status.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/kda.h"

namespace kestrel::cuda::detail {

constexpr int kKdaDim = 128;  // dk = dv: the only head size the kernels implement
constexpr int kKdaChunk = KdaPrefillPlan::kChunk;

// Per (chunk, head) prefill scratch, in floats, written by the intra-chunk kernel and read by the state pass.
// Rows past the chunk's length are zero.
constexpr int64_t kWsW = 0;                                  // [64][128] W = T diag(beta) (exp(G) ⊙ K)
constexpr int64_t kWsU = kWsW + kKdaChunk * kKdaDim;         // [64][128] U = T diag(beta) V
constexpr int64_t kWsQg = kWsU + kKdaChunk * kKdaDim;        // [64][128] scale * exp(G) ⊙ Q
constexpr int64_t kWsKd = kWsQg + kKdaChunk * kKdaDim;       // [64][128] exp(G_end - G) ⊙ K
constexpr int64_t kWsA = kWsKd + kKdaChunk * kKdaDim;        // [64][64]  A_qk, lower with the diagonal, scaled
constexpr int64_t kWsDecay = kWsA + kKdaChunk * kKdaChunk;   // [128]     exp(G_end)
constexpr int64_t kWsChunkHead = kWsDecay + kKdaDim;

// KdaInputs with the optional parts flattened for the kernels.
struct KdaTokenArgs {
  const float* q;
  const float* k;
  const float* v;
  const float* gate;
  const float* beta;
  const float* A_log;    // null: gate holds g
  const float* dt_bias;
  float lower_bound;     // used when has_lower_bound
  bool has_lower_bound;
  bool beta_is_logit;
  bool normalize_qk;
  float scale;
  int64_t state_stride;  // floats between slots' states
};

// Checks what every KDA entry point requires of KdaInputs' gate and scale (Error naming `fn`) and flattens them;
// a state_stride of 0 becomes state_size. Each entry point checks its own sizes, pointers and stride.
KdaTokenArgs flatten_inputs(const char* fn, const KdaInputs& in, int64_t state_size);

cudaError_t launch_kda_decode(const KdaTokenArgs& in, int N, int H, float* state_pool, const int32_t* slots,
                              float* o, cudaStream_t stream);

struct KdaPrefillArgs {
  KdaTokenArgs in;
  int H;
  int num_seqs;
  int64_t num_chunks;
  const KdaPrefillPlan::Chunk* chunks;  // device copies of the plan's tables
  const KdaPrefillPlan::Seq* seqs;
  float* ws;  // num_chunks * H * kWsChunkHead floats
  float* state_pool;
  const int32_t* slots;
  float* o;
  float* checkpoints;
};

cudaError_t launch_kda_prefill(const KdaPrefillArgs& args, cudaStream_t stream);

}  // namespace kestrel::cuda::detail
