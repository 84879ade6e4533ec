// Internal to sparse_mla_decode (dsa_mla.cu): the Hopper warpgroup-MMA kernel (dsa_mla_wgmma.cu) for every latent
// entry of SparseMlaEntry. sparse_mla_decode checks the arguments, plans the splits and merges them; this launches the kernel.
#pragma once
#include <cuda_runtime_api.h>

#include "kernels/cuda/dsa.h"

namespace kestrel::cuda::dsa {

// True when the current device runs the kernel: compute capability 9.0 (its code is sm_90a).
bool sparse_mla_wgmma_supported();

// How a launch's index lists are cut: row q's list in `splits` pieces of `tiles_per_split` tiles of 32 indices
// (the mma.sync kernel's split). With splits > 1 each split writes its normalised output and lse to part_o
// [rows * heads, splits, 512] and part_lse [rows * heads, splits] for launch_split_combine; else to args.out/lse.
struct SparseMlaSplit {
  int splits = 1;
  int tiles_per_split = 0;
  float* part_o = nullptr;
  float* part_lse = nullptr;
};

// Launches the wgmma kernel for checked arguments (a.entry kimi_fp8, v32_fp8 or bf16, latent base 16-byte aligned).
// kv_scale is the value multiplier of the stored values (a.kv_scale for kimi_fp8, 1 for v32_fp8 and bf16). Throws kestrel::Error
// when the device is not compute capability 9.0.
void launch_sparse_mla_wgmma(const SparseMlaDecodeArgs& a, float kv_scale, const SparseMlaSplit& split,
                             cudaStream_t stream);

}  // namespace kestrel::cuda::dsa
