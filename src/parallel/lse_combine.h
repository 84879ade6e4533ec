// Combining partial attention results computed over disjoint key sets (the DCP shards of a context):
//   lse = logsumexp_r(lse_r),  o = sum_r exp(lse_r - lse) * o_r,
// in rank order. A part with lse_r = -inf (no attended key) contributes nothing; when every part is empty the
// result is o = 0, lse = -inf, never NaN. Part lse values must be finite or -inf.
#pragma once
#include <cstdint>

#include "parallel/communicator.h"

namespace kestrel::parallel {

// One query: out_parts[r] is part r's [H, C] output, lse_parts[r] its [H] log-sum-exp, r = 0..n_parts-1.
void lse_combine(int n_parts, const float* const* out_parts, const float* const* lse_parts, int H, int C,
                 float* out, float* lse);

// Every rank holds its partial results of `rows` queries (out_part [rows, H, C], lse_part [rows, H]); every rank
// receives the combined [rows, H, C] and [rows, H], the same bits on every rank (one all_gather, parts combined
// in rank order).
void all_gather_lse_combine(Communicator& comm, const float* out_part, const float* lse_part, int64_t rows, int H,
                            int C, float* out, float* lse);

}  // namespace kestrel::parallel
