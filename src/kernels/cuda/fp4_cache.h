// The 4-bit cache formats on the GPU: Kimi's NVFP4 MLA latent entry (--kv-cache-dtype nvfp4) and the MXFP4 DSA
// index key (--index-dtype mxfp4). This file has their writers, bit for bit MlaCore::write_latent /
// write_index_key (src/cpu/mla_core.cpp over nvfp4_encode / mxfp4_encode of src/core/formats.h); the readers are the
// generic kernels, which take the format as a parameter: mla_attend_generic (mla_glue.h) decodes an NVFP4 entry as
// MlaCore::read_latent does, and index_scores_generic (dsa_generic.h) turns each MXFP4 key into FP8 codes and
// one power-of-two scale as mxfp4_key_as_fp8 does, then scores them exactly as FP8 keys. The device functions of
// both directions are in fp4_cache.cuh. Layouts: docs/engine.md, shared/spec/CACHE.md.
//
// Non-finite values. The CPU encoders throw on a non-finite value; a kernel cannot, so such a value is stored as the
// formats' NaN, which every reader propagates: an NVFP4 block of 16 latent values holding one gets the e4m3 NaN code
// as its block scale (all 16 decode as NaN); a tail value gets 0x7F as in the FP8 writer; an MXFP4 key holding one
// gets every block exponent 0xFF (the E8M0 NaN), which index_scores_generic reads as NaN codes with a NaN scale, so
// that every score against it is NaN and top-k never selects it.
//
// All pointers are device pointers; every call is asynchronous on its stream, allocates nothing and reads no device
// data on the host (CUDA-graph capturable), and is deterministic. Argument errors throw kestrel::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/dsa.h"  // Pages

namespace kestrel::cuda {

// How an MLA latent entry of C + R values is stored (Kimi's layouts; one per-layer scale kv_scale):
//   fp8:   C + R e4m3 codes, value = code * kv_scale.
//   nvfp4: C / 2 bytes of e2m1 pairs (element 2j in the low nibble of byte j), C / 16 e4m3 block scales, then the R
//          tail values as e4m3 codes; value i < C = e2m1 * fp32(e4m3(scale of block i / 16) * kv_scale), tail value
//          = code * kv_scale. C a multiple of 16.
enum class LatentFormat { fp8, nvfp4 };
// Bytes of one entry: C + R (fp8), C / 2 + C / 16 + R (nvfp4).
int64_t latent_format_bytes(LatentFormat format, int C, int R);

// How the DSA index keys of D values are stored in an index-key page of page_size keys (shared/spec/CACHE.md):
//   fp8:   page_size keys of D e4m3 codes, then page_size fp32 scales.
//   mxfp4: page_size keys of D / 2 bytes of e2m1 pairs (low nibble first), then page_size keys of D / 32 E8M0 block
//          exponents. D a multiple of 32.
enum class IndexKeyFormat { fp8, mxfp4 };

// Writes T new latent rows into their cache slots in the NVFP4 layout, bit for bit as MlaCore::write_latent
// (nvfp4): per block of 16 values, scale code = e4m3(amax / fp32(6 * kv_scale)), block scale = fp32(e4m3 value *
// kv_scale), codes = e2m1(v / block scale) (all 0 when the block scale is 0), e2m1 and e4m3 rounding to nearest
// even with saturation; tail codes = e4m3(clamp(v / kv_scale, -448, 448)). kv: [T, ldkv] fp32 rows whose first C + R
// values are [c (already RMS-normed) ; k_pe]. slots[t] (device int64) = page * page_size + row; the entry goes to
// pages.base + page * pages.page_stride + row * latent_format_bytes(nvfp4, C, R). A negative slot skips token t.
// kv_scale finite, > 0 and 448 * kv_scale finite (as nvfp4_encode asks of its tensor scale).
void mla_latent_write_nvfp4(const float* kv, int64_t ldkv, int64_t T, int C, int R, float kv_scale,
                            const int64_t* slots, const Pages& pages, cudaStream_t s);

// The index keys of T tokens into their page slots in the MXFP4 layout, as MlaCore::write_cache does after the
// LayerNorm (and RoPE): v = hadamard(key) (Sylvester order, butterflies in fp32, then times fp32(D^-1/2), as
// cpu::hadamard_inplace), then mxfp4_encode(v): per block of 32, exponent e = clamp(floor(log2(amax)) - 2, -127,
// 127) (stored as e + 127), codes = e2m1(fp32(v * 2^-e)) rounded to nearest even with saturation. keys: [T,
// head_dim] fp32; slots[t] (int64) = page * page_size + row, negative: token t is skipped; the codes go to
// row * head_dim / 2 of the slot's page, the exponents to page_size * head_dim / 2 + row * head_dim / 32.
// head_dim a power of two in [32, kMaxGenericIndexPrepDim (dsa_generic.h)].
void index_key_write_mxfp4(const float* keys, int64_t T, int head_dim, const int64_t* slots,
                           const Pages& index_pages, cudaStream_t s);

// Kernel launchers behind the functions above (fp4_cache.cu), called once the arguments are checked (fp4_cache.cpp).
namespace detail {
cudaError_t launch_mla_latent_write_nvfp4(const float* kv, int64_t ldkv, int64_t T, int C, int R, float kv_scale,
                                          const int64_t* slots, const Pages& pages, cudaStream_t s);
cudaError_t launch_index_key_write_mxfp4(const float* keys, int64_t T, int head_dim, float dim_norm,
                                         const int64_t* slots, const Pages& index_pages, cudaStream_t s);
}  // namespace detail

}  // namespace kestrel::cuda
