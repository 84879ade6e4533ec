// Internal: the wgmma kernel behind index_scores_decode's IndexScoreMode::exact on Hopper (dsa_index_wgmma.cu).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/dsa.h"

namespace kestrel::cuda::dsa {

// Whether the current device runs the sm_90a machine code of the wgmma kernel (compute capability 9.0); cached per
// device.
bool exact_wgmma_available();

// IndexScoreMode::exact through wgmma, same contract and bits as the mma.sync kernel (dsa.h). The arguments are
// those index_scores_decode has checked (batch >= 1, max_ctx_len >= 1); the caller checks the launch.
void launch_index_scores_exact_wgmma(const IndexQueries& queries, const Pages& pages, const BlockTable& block_table,
                                     const int32_t* ctx_lens, int max_ctx_len, float* scores, int64_t score_stride,
                                     cudaStream_t stream);

}  // namespace kestrel::cuda::dsa
