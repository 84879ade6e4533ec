// Internal: the wgmma kernel behind index_scores_decode's IndexScoreMode::fast_fp8 on Hopper
// (dsa_index_fp8_wgmma.cu).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/dsa.h"

namespace kestrel::cuda::dsa {

// IndexScoreMode::fast_fp8 through native e4m3 wgmma (sm_90a machine code: compute capability 9.0 only, see
// exact_wgmma_available), same contract and bound as the mma.sync kernel (dsa.h). The arguments are those
// index_scores_decode has checked (batch >= 1, max_ctx_len >= 1, n_q * heads >= 64 for full MMAs); the caller
// checks the launch.
void launch_index_scores_fp8_wgmma(const IndexQueries& queries, const Pages& pages, const BlockTable& block_table,
                                   const int32_t* ctx_lens, int max_ctx_len, float* scores, int64_t score_stride,
                                   cudaStream_t stream);

}  // namespace kestrel::cuda::dsa
