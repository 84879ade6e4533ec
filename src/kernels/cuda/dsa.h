// DeepSeek Sparse Attention on the GPU, decode: the index-key writer, indexer scoring over paged index keys, the
// exact top-k with the CPU reference's tie rule, and sparse MLA over an FP8 or bf16 latent. Same functions as
// kestrel::cpu::quantize_fp8_ue8m0 / indexer_scores / topk_indices / mla_attend_absorbed (src/core/formats.h,
// src/kernels/cpu/attention.h), over plain pages (shared/spec/CACHE.md). docs/dsa-kernels.md explains the
// numerics and the kernels.
//
// Pages. A kernel sees one layer's pages of one kind: page number p starts at base + p * page_stride bytes
// (page_stride is the packed cache's row size, or the page size itself for a plain per-layer pool) and holds
// page_size consecutive tokens of one request. An index-key page holds page_size * 128 e4m3 codes, then page_size
// fp32 scales. A latent page holds page_size rows of 576 e4m3 codes (Kimi's layout: [c (512) ; k_pe (64)], one fp32
// scale per layer), or, for sparse_mla_decode with SparseMlaEntry::v32_fp8 / bf16, page_size rows of deepseek_v32's
// 656-byte entry / of the 1152-byte bf16 entry. Request r's token at position t lives in page block_table[r * block_table_stride + t / page_size], row
// t % page_size.
//
// Decode rows. A decode step has `batch` requests with n_q query tokens each (n_q > 1: speculative tokens); the
// context length ctx_lens[r] counts request r's tokens including the n_q new ones, whose keys are written first.
// Query token i of request r sits at position ctx_lens[r] - n_q + i and its candidates are the positions <= that
// (the diagonal included). Query row q = r * n_q + i indexes every per-query array.
//
// All pointers are device pointers unless a parameter says otherwise; every call is asynchronous on `stream`.
// The functions check their arguments (kestrel::Error) and the launch (kestrel::Error naming the CUDA error).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kestrel::cuda {

constexpr int kIndexHeadDim = 128;    // indexer head dimension D (DeepSeek-V3.2, Kimi K3)
constexpr int kIndexKeyBytes = 132;   // per token: 128 e4m3 codes + one fp32 scale
constexpr int kLatentDim = 576;       // absorbed query / latent row width: [c (512) ; k_pe (64)]
constexpr int kLatentValueDim = 512;  // value part of a latent row

// One layer's pages of one kind (see the file comment).
struct Pages {
  uint8_t* base = nullptr;
  int64_t page_stride = 0;  // bytes from one page to the next, a multiple of 16
  int page_size = 0;        // tokens per page, a power of two
};

// Per-request page numbers: request r's i-th page is pages[r * stride + i].
struct BlockTable {
  const int32_t* pages = nullptr;
  int stride = 0;
};

// ---------------------------------------------------------------- index-key writer
enum class KeyDtype { f32, bf16 };

// Quantises T index keys (keys: [T, 128] fp32 or bf16 bits, already LayerNorm'd and, for DeepSeek, RoPE'd) into
// their page slots: codes and scale bit for bit as cpu::quantize_fp8_ue8m0 (amax floored at 1e-4, power-of-two
// scale rounded up, e4m3 round-to-nearest-even with saturation). With `hadamard` the key is first rotated exactly
// as cpu::hadamard_inplace (Sylvester order, butterflies in fp32, then times fp32(128^-1/2)), so the writer does
// steps 3-4 of the indexer key in one pass. slots[t] = page * page_size + row (int64); a negative slot skips token
// t. A key with a non-finite value, which the CPU reference rejects, is stored as NaN codes (0x7F) with a NaN
// scale, so that every score against it is NaN and top-k never selects it.
void index_key_write(const void* keys, KeyDtype dtype, int T, bool hadamard, const int64_t* slots,
                     const Pages& index_pages, cudaStream_t stream);

// ---------------------------------------------------------------- indexer scores (decode)
enum class IndexScoreMode {
  // Bit for bit cpu::indexer_scores: each 128-term dot of e4m3 codes is computed exactly (int8 tensor cores on
  // three 7-bit limbs of the codes' integer values, nine limb products accumulated in int32, combined in int64)
  // and rounded to fp32 once; ReLU, weight, head sum in order j = 0..H_I-1 in fp32, times k_scale. On compute
  // capability 9.0 (Hopper) the products run on warpgroup MMAs (wgmma) when a request has at least 64 (query, head)
  // rows (n_q * heads >= 64), elsewhere as exact_mma.
  exact,
  // The same function and bits as exact, always through the previous kernel (warp-level mma.sync); kept to compare
  // the two kernels in tests and benchmarks.
  exact_mma,
  // One tensor-core pass instead of nine, not exact, and the head sum as a tree. On compute capability 9.0 with
  // n_q * heads >= 64: native e4m3 warpgroup MMAs (wgmma) on the codes as stored (dsa_index_fp8_wgmma.cu); elsewhere
  // as fast_fp8_mma. Bound (docs/dsa-kernels.md, tested): |score - exact| <= 2^-6 * k_scale * sum_j |w_j| *
  // sum_d |q_jd k_d|.
  fast_fp8,
  // The same function and bound as fast_fp8, always through the previous kernel: the codes, converted exactly to
  // f16, on f16 mma.sync with fp32 accumulation (Hopper's mma.sync has no e4m3 form of its own); kept to compare
  // the two kernels in tests and benchmarks.
  fast_fp8_mma,
};

struct IndexQueries {
  const uint8_t* codes = nullptr;  // [batch * n_q, heads, 128] e4m3 (the Hadamard-rotated, quantised queries)
  const float* weights = nullptr;  // [batch * n_q, heads] folded weights w_j (weights_proj * H_I^-1/2 * q_scale * D^-1/2)
  int batch = 0;
  int n_q = 1;
  int heads = 0;  // H_I: 32 or 64
};

// scores: [batch * n_q, score_stride] fp32. Row q = r * n_q + i gets, for every position s < ctx_lens[r]: the
// score when s <= ctx_lens[r] - n_q + i, else -inf; entries from ctx_lens[r] on are not written. Requires
// n_q <= ctx_lens[r] <= max_ctx_len <= score_stride (max_ctx_len sizes the grid; lengths are read on the device,
// where a length past max_ctx_len is cut to it). NaN codes (0x7F/0xFF) give NaN scores, as in the CPU reference.
void index_scores_decode(const IndexQueries& queries, const Pages& index_pages, const BlockTable& block_table,
                         const int32_t* ctx_lens, int max_ctx_len, IndexScoreMode mode, float* scores,
                         int64_t score_stride, cudaStream_t stream);

// ---------------------------------------------------------------- top-k (decode)
// Device scratch that topk_decode needs for these shapes on the current device. It must be zero-filled before
// its first use (cudaMemset once, when it is allocated); every call leaves it zero-filled again, so one workspace
// serves any number of calls of at most these sizes, one call at a time (not on two streams at once).
size_t topk_decode_workspace_bytes(int batch, int n_q, int max_ctx_len, int k);

// For each query row q = r * n_q + i: the k best of candidates 0 .. n-1, n = ctx_lens[r] - n_q + i + 1 (cut to
// max_ctx_len), by cpu::topk_indices' rule (higher score, then lower position; -0 = +0; -inf and NaN never),
// written as request-relative positions in ascending position order (not in rank order), then -1 up to k.
// scores as written by index_scores_decode. out: [batch * n_q, k] int32. A row is split over several CTAs that
// wait for each other (a cooperative launch: the grid is sized to be resident at once); max_ctx_len is limited to
// what the device can hold at once (16384 positions per resident CTA, over 6M on an H200).
void topk_decode(const float* scores, int64_t score_stride, int batch, int n_q, const int32_t* ctx_lens,
                 int max_ctx_len, int k, int32_t* out, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream);

// ---------------------------------------------------------------- sparse MLA decode
// The latent entry sparse_mla_decode reads (each value as MlaCore::read_latent decodes it).
enum class SparseMlaEntry {
  kimi_fp8,  // 576 e4m3 codes [c ; k_pe]; value = code * kv_scale
  // deepseek_v32 (v32_glue.h, v32_latent_entry_bytes(512, 64)): 512 e4m3 codes in 4 tiles of 128, the 4 tiles'
  // fp32 scales, then k_pe as 64 bf16 values; value = fp32(code * tile scale) for c, the bf16 value for k_pe;
  // kv_scale is not applied.
  v32_fp8,
  // The bf16 entry (mla_glue.h: mla_latent_write_bf16; --kv-cache-dtype auto): 576 bf16 values [c ; k_pe], 1152
  // bytes; value = bf16_to_f32(bits); no scale: kv_scale is not applied.
  bf16,
};
constexpr int kV32LatentEntryBytes = 656;   // 512 codes + 4 * 4 scale bytes + 64 * 2 tail bytes
constexpr int kBf16LatentEntryBytes = 1152;  // 576 bf16 values

// Which kernel sparse_mla_decode runs; both meet the contract below. On an H200 the wgmma kernel is 1.41x the
// mma.sync kernel at B = 32 and 1.56x at B = 64 (H = 128, 128K; bench/results/gpu_h200_session5.md). Session 4
// measured 2-10x larger errors for it where a CTA walks several tiles: the cause was the running maximum's lazy
// slack of 8, which left a split's dominant probability rounded to bf16; without the slack its largest errors in
// dsa_kernels_test equal the mma.sync kernel's to 3 digits (session 5), so automatic takes it where it runs.
enum class SparseMlaKernel {
  automatic,  // wgmma on compute capability 9.0, else mma_sync
  mma_sync,   // warp-level mma.sync tiles, any device
  wgmma,      // Hopper warpgroup MMAs (sm_90a code): compute capability 9.0 only, else kestrel::Error
};

struct SparseMlaDecodeArgs {
  const uint16_t* q_abs = nullptr;  // [batch * n_q, heads, 576] bf16 bits: absorbed queries [W_UK^T q_nope ; q_pe]
  int batch = 0;
  int n_q = 1;
  int heads = 0;
  const int32_t* indices = nullptr;  // [batch * n_q, k] request-relative positions; < 0 or >= ctx_lens[r]: skipped
  int k = 0;
  const int32_t* ctx_lens = nullptr;  // [batch]
  Pages latent_pages;  // one `entry` per token: 576, kV32LatentEntryBytes or kBf16LatentEntryBytes bytes
  SparseMlaEntry entry = SparseMlaEntry::kimi_fp8;
  BlockTable block_table;
  float kv_scale = 1.0f;       // kimi_fp8: the layer's latent scale (value = code * kv_scale); v32_fp8, bf16: not used
  float softmax_scale = 0.0f;  // scores are (q . row) * softmax_scale
  float* out = nullptr;        // [batch * n_q, heads, 512] fp32
  float* lse = nullptr;        // [batch * n_q, heads] fp32, natural log; -inf for a row with no valid index
  SparseMlaKernel kernel = SparseMlaKernel::automatic;
};

// Device scratch that sparse_mla_decode needs for these shapes on the current device (0 when none).
size_t sparse_mla_decode_workspace_bytes(int batch, int n_q, int heads, int k);

// out[q, h] = sum_t p_t c_t over the valid indices t of row q, p = softmax((q_abs[q, h] . row_t) * softmax_scale),
// with row_t the token's latent row as `entry` decodes it; a row with no valid index gives out = 0 and lse = -inf.
// bf16 tensor-core products with fp32 accumulation; the probabilities are rounded to bf16 for the value product.
// Every decoded value enters the products exactly: kimi_fp8 multiplies the codes (bf16-exact) and applies kv_scale
// to the fp32 scores and outputs; v32_fp8 rounds fp32(code * tile scale) to bf16, exact when the scale is a power of
// two (what the writer, quantize_fp8_ue8m0, stores) and the product is a normal fp32 number; bf16 entries are the
// operands as stored. Bound against
// cpu::mla_attend_absorbed on the same bf16 query and the dequantised rows (docs/dsa-kernels.md, tested):
// |out - ref| <= 2^-8 * max |value| over the attended rows (+ fp32 rounding), |lse - ref| <= 1e-4 (1 + |ref|).
// latent_pages.base, q_abs and the workspace must be 16-byte aligned, out 16-byte (8-byte when the index lists are
// not split over several CTAs: workspace_bytes() is 0); kestrel::Error otherwise.
void sparse_mla_decode(const SparseMlaDecodeArgs& args, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream);

}  // namespace kestrel::cuda
