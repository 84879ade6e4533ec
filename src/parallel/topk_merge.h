// Global top-k of DSA under decode context parallelism: each rank scores only its own cache shard (position
// t = local_index * W + rank), so every layer merges the per-rank candidates into the global top-k before sparse
// attention. The result equals cpu::topk_indices over the whole row with Kestrel's one tie rule (higher score,
// then lower position; -0 ranks as +0; -inf and NaN are never selected).
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "parallel/communicator.h"

namespace kestrel::parallel {

// ---- 32-bit candidate keys of the packed merge ----
// Order key of a bf16 score: unsigned comparison of keys is comparison of scores; -0 and +0 share one key; +inf
// is the largest. -inf and NaN are never candidates and get key 0, which no selectable score has (the smallest,
// -max finite, has key 0x0080).
uint16_t bf16_order_key(uint16_t bf16_bits);
// Local indices of a row of `length` positions are shifted right by this much to fit 16 bits: 0 whenever every
// rank holds at most 65536 of the row's positions (length <= 65536 * W).
int position_shift(int64_t length, int world);
// The low half of a packed candidate: larger for a lower local index, so that a larger packed key ranks first.
constexpr uint16_t position_field(int64_t local_index, int shift) {
  return static_cast<uint16_t>(0xFFFF - (local_index >> shift));
}
// The score's order key in the high half, the position field in the low half. Equal scores then compare by local
// index, and with shift 0 equal packed keys of two ranks mean the same local index, whose positions
// (local * W + rank) order by rank: (packed key descending, rank ascending) is exactly the tie rule.
constexpr uint32_t pack_candidate(uint16_t order_key, uint16_t field) {
  return (static_cast<uint32_t>(order_key) << 16) | field;
}
constexpr uint16_t candidate_order_key(uint32_t packed) { return static_cast<uint16_t>(packed >> 16); }
// Fills the unused entries of a rank's list.
constexpr uint32_t kNoCandidate = 0;

// Candidates each rank sends in the first round: k' = min(k, ceil(1.5 k / W)).
int packed_candidates_per_rank(int k, int world);

// One rank's index scores for a batch of rows (one row per query token): row i is
// values[row_offsets[i], row_offsets[i+1]), indexed by the rank's DCP local index; the row has lengths[i]
// positions in all (the same on every rank), of which this rank holds dcp_local_count(lengths[i], rank, W).
struct RaggedScores {
  std::span<const float> values;
  std::span<const int64_t> row_offsets;  // rows + 1 entries: 0, non-decreasing, values.size()
  std::span<const int64_t> lengths;      // rows entries
  int64_t rows() const { return static_cast<int64_t>(lengths.size()); }
};

// The rank's share of each row's global top-k: its local indices, in the tie order.
struct LocalSelection {
  std::vector<int32_t> local_index;
  std::vector<int64_t> row_offsets;  // rows + 1
  std::span<const int32_t> row(int64_t i) const {
    return std::span<const int32_t>(local_index).subspan(row_offsets[i], row_offsets[i + 1] - row_offsets[i]);
  }
};

struct MergeStats {
  int64_t rows = 0;
  int64_t collectives = 0;
  int64_t tie_rounds = 0;     // collectives that exchanged local indices of a cut group of equal keys
  int64_t tie_rows = 0;       // rows that needed them (only rows longer than 65536 * W)
  int64_t resend_rounds = 0;  // collectives that resent candidates
  int64_t resends = 0;        // (row, rank) pairs whose last sent candidate was selected
  int64_t bytes_sent = 0;     // bytes this rank contributed
  int64_t bytes_received = 0; // bytes this rank received, its own contribution included
  MergeStats& operator+=(const MergeStats& o);
};

// The exact packed merge (docs/parallel.md). Scores are rounded to bf16 first; the selection equals
// cpu::topk_indices on the bf16-rounded scores of the whole row. Every rank must pass the same rows and the same
// k >= 1.
//  1. Each rank sorts its selectable tokens by (score, then local index) and keeps the best k as its candidate
//     list. It all-gathers the first k' as packed keys, in list order (kNoCandidate-padded), so a candidate's slot
//     in the list is its index in the rank's block of the gathered buffer and need not be sent.
//  2. Every rank runs the same selection over the W*k' keys: a radix select finds the k-th largest packed key P;
//     keys above P are in, and of the keys equal to P the lowest ranks are in. The taken candidates of each rank
//     are a prefix of its list. Only when the row's position shift is nonzero can keys equal to P from different
//     ranks hold different local indices; if such a group is cut, its ranks all-gather the local indices of the
//     group (a tie round) and the lowest positions are taken.
//  3. A rank whose k'-th candidate is taken may hold more of the top-k than it sent; it all-gathers candidates
//     k'..k-1 of that row (a resend round, the part of its local top-k it had not sent), and the row is selected
//     again. A rank whose last sent candidate is not taken cannot hold more: its unsent tokens all rank below that
//     candidate. After one resend a rank has sent k candidates, all it could contribute, so there is no second.
LocalSelection packed_topk_merge(Communicator& comm, const RaggedScores& scores, int k, MergeStats* stats = nullptr);

// The baseline: every rank all-gathers its local top-k as (fp32 score, int32 position) and every rank selects from
// the W*k pairs. Ranks the scores as given (no bf16 rounding). global_topk, if given, receives [rows, k] positions
// as cpu::topk_indices writes them (rank order, -1 padding), the same on every rank.
LocalSelection generic_topk_merge(Communicator& comm, const RaggedScores& scores, int k, MergeStats* stats = nullptr,
                                  std::vector<int32_t>* global_topk = nullptr);

}  // namespace kestrel::parallel
