// Exact DSA top-k from bounded fast scores, decode (the GPU version of src/kernels/cpu/topk_candidates.h): one
// inexact FP8 pass over every key, a rigorous-by-model error bound per key, then the exact score only for the keys
// that can still be in the top-k. The result is the same as index_scores_decode(IndexScoreMode::exact) followed by
// topk_decode, position for position, while the exact arithmetic runs on a few thousand keys per row instead of all.
// docs/dsa-kernels.md ("Exact top-k from bounded fast scores") has the argument and the bound's model.
//
// Per query row (conventions of dsa.h: Pages, BlockTable, ctx_lens, row q = r * n_q + i, candidates 0 .. n-1 with
// n = ctx_lens[r] - n_q + i + 1, cut to max_ctx_len):
//   1. fast f_i: index_scores_decode's fast_fp8_mma scores (the f16 mma.sync kernel);
//   2. bound e_i = bound_factor * k_scale_i * ||k_i||_2 * W_q + k_scale_i * 2^-120, W_q = sum_j |w_qj| ||q_qj||_2
//      (norms of the e4m3 values, every operation rounded up; +inf when k_scale ||k|| W_q or ||k|| W_q reaches
//      2^100 or is not a number: then nothing is assumed about the key);
//   3. tau = the k-th largest lo_i = f_i - e_i (rounded down; NaN f_i: unselectable, never a candidate), -inf with
//      fewer than k;
//   4. candidates {i : f_i not NaN, hi_i = f_i + e_i (rounded up) >= tau, hi_i > -inf}, ascending;
//   5. exact scores of the candidates (bit for bit cpu::indexer_scores) and topk_decode over them.
// Step 5's set is the exact top-k whenever |f_i - s_i| <= e_i for every key (s_i the exact fp32 score). That
// inequality is an assumption about the fast kernel's arithmetic, not a proof: see kFastScoreBoundFactor. The
// weights must be finite (with an infinite w_j the fast and exact scores may disagree on NaN, which no bound covers);
// NaN codes and the writer's NaN scales are fine: fast and exact scores are then both NaN and the key is never taken.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/dsa.h"

namespace kestrel::cuda {

// The default bound_factor c. Arithmetic model of the fast_fp8_mma kernel (dsa_index.cu), an ASSUMPTION that the H200
// test (dsa_candidates_test, FastScoresWithinModelBound) checks over every key it scores:
//   - the e4m3 codes become f16 exactly and the tensor core forms every f16 x f16 product exactly;
//   - each of the 8 m16n8k16 MMAs of a 128-term dot adds its 16 products to the fp32 accumulator with an error of
//     at most 18 units in the last place of the largest addend, i.e. <= 18 * 2^-23 * (|acc| + sum |products|)
//     (an adder that aligns all addends to the largest exponent and truncates, with no guard bits), so
//     |dot_fast - dot| <= 8 * 18 * 2^-23 * sum_d |q_d k_d| < 2^-15.8 * ||q|| ||k|| (Cauchy-Schwarz);
//   - ReLU is 1-Lipschitz; w_j * relu, the head tree (at most 8 + 3 additions on a path) and * k_scale are fp32
//     operations: at most 16 roundings, <= 2^-20 * k_scale * ||k|| * W;
//   - the exact score itself is rounded: the dot to fp32, w_j * relu, the in-order sum of H_I <= 64 terms and the
//     scale, <= 67 * 2^-24 < 2^-17.9 of k_scale * ||k|| * W.
// Total < 2^-15.4 * k_scale * ||k|| * W. c = 2^-13 leaves a factor of 5 over that pessimistic model. On random
// keys ||q|| ||k|| is about 1.6 * sum_d |q_d k_d|, and the CPU study (docs) rescored about 2250 keys of 131072 for
// k = 2048 at a bound of the same size.
constexpr float kFastScoreBoundFactor = 0x1p-13f;

struct BoundedTopkArgs {
  IndexQueries queries;
  Pages index_pages;
  BlockTable block_table;
  const int32_t* ctx_lens = nullptr;  // [batch]
  int max_ctx_len = 0;                // >= 1; sizes the grids, as in index_scores_decode / topk_decode
  int k = 0;
  // Per-row capacity of the candidate list, >= k. A row with more candidates "overflows": it is rescored over all
  // of its n positions instead (correct, but as slow as the exact path for that row) and raises `overflowed`.
  int max_candidates = 0;
  float bound_factor = kFastScoreBoundFactor;  // c above, >= 0; 0 is only for tests (it breaks the bound)
  int32_t* out = nullptr;  // [batch * n_q, k]: as topk_decode, ascending positions then -1
  // Optional device outputs (nullptr: not written), all written on every call:
  int32_t* candidate_counts = nullptr;  // [batch * n_q]: candidates of the row (before the cap)
  int32_t* overflowed = nullptr;        // [1]: 1 when some row had more than max_candidates, else 0
  // [batch * n_q]: rescored keys whose exact score fell outside [lo, hi]; nonzero means the bound model is
  // broken and the row's set may be wrong (a broken bound on a key that was not rescored cannot be seen here).
  int32_t* bound_violations = nullptr;
  // The two topk_decode calls' scratch (dsa.h): zero-filled once when it is allocated; every call leaves it
  // zero-filled again, so one buffer of topk_decode_bounded_topk_bytes() for the largest shapes serves any number of
  // calls of those or smaller shapes, one at a time (an exact path's topk_decode scratch sized for batch * n_q rows
  // of n_q = 1 and for the calls' batch / n_q serves as well).
  void* topk_workspace = nullptr;
  size_t topk_workspace_bytes = 0;
};

// The topk_workspace a call of these shapes needs.
size_t topk_decode_bounded_topk_bytes(int batch, int n_q, int max_ctx_len, int k);

// The workspace a call of these shapes needs: scores, bounds, candidates and their exact scores. It needs no initial
// contents (every call writes what it reads), so calls of different shapes may share it freely, one at a time. (The
// first version kept the top-k scratch inside it at a shape-dependent offset, so a call of another shape found
// non-zero words there.)
size_t topk_decode_bounded_workspace_bytes(int batch, int n_q, int max_ctx_len, int k, int max_candidates);

// The k best positions per query row by cpu::topk_indices' rule over the exact scores (cpu::indexer_scores), written
// as topk_decode writes them. Asynchronous on `stream`, no host synchronisation or allocation (capturable in a
// CUDA graph). Argument errors throw kestrel::Error.
void topk_decode_bounded(const BoundedTopkArgs& args, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream);

}  // namespace kestrel::cuda
