// The DSA indexer's GPU pieces for any power-of-two head dimension D and any number of heads H_I, where the fast
// kernels of dsa.h take only D = 128 (and, for the scores, H_I = 32 or 64): query preparation (Hadamard rotation,
// per-head FP8 quantisation and the folded head weights), the index-key writer and the exact scores. Each is bit
// for bit the CPU reference (MlaCore::select / write_cache in src/cpu/mla_core.cpp over hadamard_inplace,
// quantize_fp8_ue8m0 and indexer_scores of src/kernels/cpu/attention.h and src/core/formats.h); their outputs are
// what topk_decode (dsa.h) takes, for any D.
//
// Pages, block tables, decode rows (query row q = r * n_q + i at position ctx_lens[r] - n_q + i) and score rows are
// those of dsa.h, with index-key pages of D-code keys: page p starts at base + p * page_stride and holds page_size
// keys of D e4m3 codes, then page_size fp32 scales.
//
// Non-finite values. The CPU reference throws on a non-finite query or key value; a kernel cannot, so, as
// index_key_write does, such a vector becomes NaN codes (0x7F) with a NaN scale (a query head: a NaN folded
// weight): every score it touches is NaN, and topk_decode never selects a NaN score.
//
// All pointers are device pointers; every call is asynchronous on its stream, allocates nothing and reads no device
// data on the host (CUDA-graph capturable), and is deterministic. Argument errors throw kestrel::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/dsa.h"        // Pages, BlockTable, IndexQueries
#include "kernels/cuda/fp4_cache.h"  // IndexKeyFormat

namespace kestrel::cuda {

// Head dimensions the query preparation and the key writer take: powers of two up to this.
constexpr int kMaxGenericIndexPrepDim = 1024;
// The generic scores: powers of two from 4 (keys are read in 4-byte words) to this, and at most this many query
// bytes per token (H_I * D, held in shared memory).
constexpr int kMinGenericIndexScoreDim = 4;
constexpr int kMaxGenericIndexScoreDim = 256;
constexpr int kMaxGenericIndexQueryBytes = 8192;

// The indexer queries of T tokens, as MlaCore::select prepares them, for every head j of every token t:
// v = hadamard(q[t, j]) (Sylvester order, butterflies in fp32, then times fp32(D^-1/2)); codes[t, j] and q_scale =
// quantize_fp8_ue8m0(v) (amax floored at 1e-4, power-of-two scale rounded up, e4m3 round-to-nearest-even);
// weights[t, j] = ((raw_weights[t, j] * fp32(H_I^-1/2)) * q_scale) * fp32(D^-1/2), fp32 products in that order.
// q: [T, heads, head_dim] fp32 (the indexer's wq_b output, RoPE already applied where the model has it);
// raw_weights: [T, heads] fp32 (weights_proj output); codes: [T, heads, head_dim] e4m3; weights: [T, heads] fp32.
// head_dim a power of two <= kMaxGenericIndexPrepDim.
void index_query_prep(const float* q, const float* raw_weights, int64_t T, int heads, int head_dim, uint8_t* codes,
                      float* weights, cudaStream_t s);

// The index keys of T tokens into their page slots, as MlaCore::write_cache does after the LayerNorm (and
// RoPE): hadamard as above, then codes and scale = quantize_fp8_ue8m0, the codes at row * head_dim of the slot's
// page and the scale at page_size * head_dim + 4 * row. keys: [T, head_dim] fp32; slots[t] (int64) = page *
// page_size + row, negative: token t is skipped. head_dim a power of two <= kMaxGenericIndexPrepDim; page_size a
// power of two with page_size * head_dim a multiple of 4 (aligned scales). For head_dim = 128 this writes what
// index_key_write (dsa.h, f32, hadamard) writes.
void index_key_write_generic(const float* keys, int64_t T, int head_dim, const int64_t* slots,
                             const Pages& index_pages, cudaStream_t s);

// Exact indexer scores for any head dimension and head count, with the contract of index_scores_decode (dsa.h) in
// IndexScoreMode::exact: row q = r * n_q + i of scores [batch * n_q, score_stride] gets, for every position
// s < ctx_lens[r] (a length past max_ctx_len cut to it), the score of cpu::indexer_scores when s <= ctx_lens[r] -
// n_q + i, else -inf; entries from ctx_lens[r] on are not written. Each D-term dot of e4m3 values is computed exactly
// (in double: every product is a multiple of 2^-18 below 2^18 and every partial sum fits 53 bits) and rounded to
// fp32 once; then ReLU, weight, head sum j = 0..H_I-1 and the product with the key's scale in fp32, in the CPU's
// order. queries.heads >= 1 (any count); queries.codes 4-byte aligned; head_dim a power of two in
// [kMinGenericIndexScoreDim, kMaxGenericIndexScoreDim], heads * head_dim <= kMaxGenericIndexQueryBytes;
// batch <= 65535; index pages with page_size * head_dim a multiple of 4.
// keys: the index pages' format (fp4_cache.h). An MXFP4 key (head_dim >= 32) is first turned into D e4m3 codes and
// one scale exactly as mxfp4_key_as_fp8 (src/cpu/mla_core.cpp) does, the form MlaCore scores it in; the scores
// are then those of the FP8 key those codes and that scale make, bit for bit as the CPU's.
void index_scores_generic(const IndexQueries& queries, int head_dim, const Pages& index_pages,
                          const BlockTable& block_table, const int32_t* ctx_lens, int max_ctx_len, float* scores,
                          int64_t score_stride, cudaStream_t s, IndexKeyFormat keys = IndexKeyFormat::fp8);

// out[i] = ctx_lens[i] - shift for i < n: the context lengths of leading parts of requests, so that the decode
// kernels (whose query rows are the last n_q tokens of a context) can take a long prompt's rows in chunks.
void shift_ctx_lens(const int32_t* ctx_lens, int n, int32_t shift, int32_t* out, cudaStream_t s);

// Query tokens per CTA of index_scores_generic (each staged tile of keys serves this many).
constexpr int kGenericScoreTokensPerCta = 8;

// Kernel launchers behind the functions above (dsa_generic.cu), called once the arguments are checked
// (dsa_generic.cpp).
namespace detail {
cudaError_t launch_index_query_prep(const float* q, const float* raw_weights, int64_t T, int heads, int head_dim,
                                    float head_norm, float dim_norm, uint8_t* codes, float* weights, cudaStream_t s);
cudaError_t launch_index_key_write_generic(const float* keys, int64_t T, int head_dim, float dim_norm,
                                           const int64_t* slots, const Pages& index_pages, cudaStream_t s);
cudaError_t launch_index_scores_generic(const IndexQueries& queries, int head_dim, const Pages& index_pages,
                                        const BlockTable& block_table, const int32_t* ctx_lens, int max_ctx_len,
                                        float* scores, int64_t score_stride, cudaStream_t s, IndexKeyFormat keys);
cudaError_t launch_shift_ctx_lens(const int32_t* ctx_lens, int n, int32_t shift, int32_t* out, cudaStream_t s);
}  // namespace detail

}  // namespace kestrel::cuda
