#include "parallel/topk_merge.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/formats.h"
#include "parallel/dcp_layout.h"

namespace kestrel::parallel {

uint16_t bf16_order_key(uint16_t bits) {
  const bool is_nan = (bits & 0x7FFFu) > 0x7F80u;
  if (is_nan || bits == 0xFF80u) return 0;
  if (bits == 0x8000u) bits = 0;  // -0 ranks as +0
  // Negative scores: larger magnitude is smaller, so invert all bits; non-negative: set the sign bit to sit above.
  return (bits & 0x8000u) ? static_cast<uint16_t>(~bits) : static_cast<uint16_t>(bits | 0x8000u);
}

int packed_candidates_per_rank(int k, int world) {
  KESTREL_CHECK(k >= 1 && world >= 1, "packed merge: bad k {} or world size {}", k, world);
  const int64_t k_prime = (3 * static_cast<int64_t>(k) + 2 * world - 1) / (2 * world);  // ceil(1.5 k / W)
  return static_cast<int>(std::min<int64_t>(k, k_prime));
}

int position_shift(int64_t length, int world) {
  const int64_t most_local = dcp_local_count(length, 0, world);  // rank 0 holds the most positions
  const int bits = static_cast<int>(std::bit_width(static_cast<uint64_t>(std::max<int64_t>(most_local - 1, 0))));
  return std::max(0, bits - 16);
}

MergeStats& MergeStats::operator+=(const MergeStats& o) {
  rows += o.rows;
  collectives += o.collectives;
  tie_rounds += o.tie_rounds;
  tie_rows += o.tie_rows;
  resend_rounds += o.resend_rounds;
  resends += o.resends;
  bytes_sent += o.bytes_sent;
  bytes_received += o.bytes_received;
  return *this;
}

namespace {

void check_scores(const RaggedScores& s, int world, int rank, int k, const char* who) {
  KESTREL_CHECK(k >= 1, "{}: k must be at least 1, got {}", who, k);
  KESTREL_CHECK(static_cast<int64_t>(s.row_offsets.size()) == s.rows() + 1 && s.row_offsets.front() == 0 &&
                    s.row_offsets.back() == static_cast<int64_t>(s.values.size()),
                "{}: {} rows need {} row offsets from 0 to the number of scores ({})", who, s.rows(), s.rows() + 1,
                s.values.size());
  for (int64_t i = 0; i < s.rows(); ++i) {
    KESTREL_CHECK(s.lengths[i] >= 0 && s.lengths[i] <= std::numeric_limits<int32_t>::max(),
                  "{}: row {} has length {}", who, i, s.lengths[i]);
    const int64_t n = s.row_offsets[i + 1] - s.row_offsets[i];
    KESTREL_CHECK(n == dcp_local_count(s.lengths[i], rank, world),
                  "{}: row {} of length {} has {} scores on rank {} of {}, not its DCP share {}", who, i,
                  s.lengths[i], n, rank, world, dcp_local_count(s.lengths[i], rank, world));
  }
}

void count_bytes(MergeStats& stats, size_t sent, size_t received) {
  ++stats.collectives;
  stats.bytes_sent += static_cast<int64_t>(sent);
  stats.bytes_received += static_cast<int64_t>(received);
}

// This rank's candidate list of every row: its best min(k, selectable) tokens, ordered by score key, then local
// index (= position order within the rank), with their packed keys. The slot of a candidate is its index here.
struct CandidateLists {
  std::vector<uint32_t> packed;
  std::vector<int32_t> local;
  std::vector<int64_t> offsets;

  int64_t count(int64_t row) const { return offsets[row + 1] - offsets[row]; }
};

CandidateLists build_candidate_lists(const RaggedScores& scores, int world, int k) {
  struct Candidate {
    uint16_t key;
    int32_t local;
  };
  const auto before = [](const Candidate& a, const Candidate& b) {
    return a.key != b.key ? a.key > b.key : a.local < b.local;
  };
  CandidateLists lists;
  lists.offsets.push_back(0);
  std::vector<Candidate> row;
  for (int64_t i = 0; i < scores.rows(); ++i) {
    row.clear();
    const int64_t begin = scores.row_offsets[i], n = scores.row_offsets[i + 1] - begin;
    for (int64_t l = 0; l < n; ++l) {
      const uint16_t key = bf16_order_key(f32_to_bf16(scores.values[begin + l]));
      if (key != 0) row.push_back({key, static_cast<int32_t>(l)});
    }
    const size_t keep = std::min<size_t>(row.size(), static_cast<size_t>(k));
    if (keep < row.size()) std::nth_element(row.begin(), row.begin() + (keep - 1), row.end(), before);
    std::sort(row.begin(), row.begin() + keep, before);
    const int shift = position_shift(scores.lengths[i], world);
    for (size_t s = 0; s < keep; ++s) {
      lists.packed.push_back(pack_candidate(row[s].key, position_field(row[s].local, shift)));
      lists.local.push_back(row[s].local);
    }
    lists.offsets.push_back(static_cast<int64_t>(lists.packed.size()));
  }
  return lists;
}

// Slots [first, first + n) of a row's candidate list as packed keys, kNoCandidate past the end of the list.
void append_packed(const CandidateLists& mine, int64_t row, int64_t first, int64_t n, std::vector<uint32_t>& out) {
  for (int64_t s = first; s < first + n; ++s)
    out.push_back(s < mine.count(row) ? mine.packed[mine.offsets[row] + s] : kNoCandidate);
}

// How one row's top-k splits over the ranks' lists. Keys never increase along a list, so each rank's keys above
// the cut key P are a prefix of its list and its keys equal to P follow it.
struct RowCut {
  std::vector<int64_t> above;  // per rank: candidates with keys above P
  std::vector<int64_t> equal;  // per rank: candidates with keys equal to P (right after `above`)
  int64_t need = 0;            // how many of the equal ones the top-k takes
  std::vector<int64_t> take;   // per rank: length of the list prefix in the top-k; empty until decided
};

int64_t valid_prefix(std::span<const uint32_t> list) {
  return std::find(list.begin(), list.end(), kNoCandidate) - list.begin();
}

// The k-th largest of the packed keys (k <= their number), one 8-bit digit at a time from the top, as a GPU radix
// select does it.
uint32_t kth_largest_key(std::span<const std::span<const uint32_t>> lists, int64_t k) {
  uint32_t prefix = 0, mask = 0;
  for (int digit = 24; digit >= 0; digit -= 8) {
    std::array<int64_t, 256> hist{};
    for (const auto& list : lists)
      for (uint32_t c : list)
        if (c != kNoCandidate && (c & mask) == prefix) ++hist[(c >> digit) & 0xFF];
    int d = 255;
    for (; k > hist[d]; --d) k -= hist[d];
    prefix |= static_cast<uint32_t>(d) << digit;
    mask |= 0xFFu << digit;
  }
  return prefix;
}

// Decides the row when the keys alone can: everything fits; all keys equal to P fit; they come from one rank
// (slot order is position order); or the shift is 0, so equal keys hold one local index and rank order is
// position order.
RowCut cut_row(std::span<const std::span<const uint32_t>> lists, int k, int shift) {
  const size_t W = lists.size();
  RowCut cut;
  cut.above.assign(W, 0);
  cut.equal.assign(W, 0);
  std::vector<int64_t> valid(W);
  for (size_t r = 0; r < W; ++r) valid[r] = valid_prefix(lists[r]);
  if (std::accumulate(valid.begin(), valid.end(), int64_t{0}) <= k) {
    cut.take = valid;
    return cut;
  }
  const uint32_t p = kth_largest_key(lists, k);
  int equal_ranks = 0;
  for (size_t r = 0; r < W; ++r) {
    for (int64_t s = 0; s < valid[r]; ++s) {
      cut.above[r] += lists[r][s] > p;
      cut.equal[r] += lists[r][s] == p;
    }
    equal_ranks += cut.equal[r] > 0;
  }
  cut.need = k - std::accumulate(cut.above.begin(), cut.above.end(), int64_t{0});
  const int64_t equal_total = std::accumulate(cut.equal.begin(), cut.equal.end(), int64_t{0});
  if (cut.need == equal_total || equal_ranks == 1 || shift == 0) {
    cut.take = cut.above;
    int64_t left = cut.need;
    for (size_t r = 0; r < W; ++r) {
      const int64_t t = std::min(cut.equal[r], left);
      cut.take[r] += t;
      left -= t;
    }
  }
  return cut;
}

// Takes the `need` lowest positions of the candidates equal to P; equal_local[r] are rank r's, in slot order.
void take_lowest_positions(RowCut& cut, std::span<const std::span<const int32_t>> equal_local) {
  const int W = static_cast<int>(equal_local.size());
  std::vector<std::pair<int64_t, int>> equal;  // (position, rank)
  for (int r = 0; r < W; ++r)
    for (int32_t local : equal_local[r]) equal.emplace_back(static_cast<int64_t>(local) * W + r, r);
  std::nth_element(equal.begin(), equal.begin() + (cut.need - 1), equal.end());
  cut.take = cut.above;
  for (int64_t i = 0; i < cut.need; ++i) ++cut.take[equal[i].second];
}

struct MergeState {
  Communicator& comm;
  const CandidateLists& mine;
  const RaggedScores& scores;
  int k;
  MergeStats& stats;
  // Every rank's list of every row as all ranks see it: lists[row * W + rank].
  std::vector<std::span<const uint32_t>> lists;
  std::vector<RowCut> cuts;

  std::span<const std::span<const uint32_t>> row_lists(int64_t row) const {
    const size_t W = static_cast<size_t>(comm.size());
    return std::span<const std::span<const uint32_t>>(lists).subspan(row * W, W);
  }

  // Cuts the rows and runs one tie round for those whose keys cannot decide.
  void select(std::span<const int64_t> rows) {
    const int W = comm.size(), me = comm.rank();
    std::vector<int64_t> contested;
    for (int64_t row : rows) {
      cuts[row] = cut_row(row_lists(row), k, position_shift(scores.lengths[row], W));
      if (cuts[row].take.empty()) contested.push_back(row);
    }
    if (contested.empty()) return;
    std::vector<int32_t> send;
    std::vector<size_t> counts(W, 0);
    for (int64_t row : contested) {
      const RowCut& cut = cuts[row];
      for (int r = 0; r < W; ++r) counts[r] += cut.equal[r] * sizeof(int32_t);
      const int32_t* local = mine.local.data() + mine.offsets[row];
      send.insert(send.end(), local + cut.above[me], local + cut.above[me] + cut.equal[me]);
    }
    const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
    std::vector<int32_t> gathered(total / sizeof(int32_t));
    comm.all_gather_v(send.data(), send.size() * sizeof(int32_t), gathered.data(), counts);
    count_bytes(stats, send.size() * sizeof(int32_t), total);
    ++stats.tie_rounds;
    stats.tie_rows += static_cast<int64_t>(contested.size());

    std::vector<const int32_t*> cursor(W);
    for (int r = 0, at = 0; r < W; at += static_cast<int>(counts[r] / sizeof(int32_t)), ++r)
      cursor[r] = gathered.data() + at;
    std::vector<std::span<const int32_t>> equal_local(W);
    for (int64_t row : contested) {
      RowCut& cut = cuts[row];
      for (int r = 0; r < W; ++r) {
        equal_local[r] = std::span<const int32_t>(cursor[r], cut.equal[r]);
        cursor[r] += cut.equal[r];
      }
      take_lowest_positions(cut, equal_local);
    }
  }
};

}  // namespace

LocalSelection packed_topk_merge(Communicator& comm, const RaggedScores& scores, int k, MergeStats* stats_out) {
  const int W = comm.size(), me = comm.rank();
  check_scores(scores, W, me, k, "packed_topk_merge");
  const int64_t rows = scores.rows();
  const int k_sent = packed_candidates_per_rank(k, W);
  MergeStats stats;
  stats.rows = rows;
  const CandidateLists mine = build_candidate_lists(scores, W, k);

  std::vector<uint32_t> send;
  send.reserve(rows * k_sent);
  for (int64_t row = 0; row < rows; ++row) append_packed(mine, row, 0, k_sent, send);
  std::vector<uint32_t> gathered(send.size() * W);
  comm.all_gather(send.data(), send.size() * sizeof(uint32_t), gathered.data());
  count_bytes(stats, send.size() * sizeof(uint32_t), gathered.size() * sizeof(uint32_t));

  MergeState state{comm, mine, scores, k, stats, std::vector<std::span<const uint32_t>>(rows * W),
                   std::vector<RowCut>(rows)};
  for (int64_t row = 0; row < rows; ++row)
    for (int r = 0; r < W; ++r)
      state.lists[row * W + r] = std::span<const uint32_t>(gathered).subspan((r * rows + row) * k_sent, k_sent);
  std::vector<int64_t> all_rows(rows);
  std::iota(all_rows.begin(), all_rows.end(), int64_t{0});
  state.select(all_rows);

  // Resend round: ranks whose last sent candidate was taken send candidates k_sent..k-1 of those rows.
  std::vector<std::vector<int64_t>> flagged_rows(W);
  std::vector<int64_t> resend_rows;
  if (k_sent < k) {
    for (int64_t row = 0; row < rows; ++row) {
      bool any = false;
      for (int r = 0; r < W; ++r)
        if (state.cuts[row].take[r] == k_sent) {
          flagged_rows[r].push_back(row);
          any = true;
        }
      if (any) resend_rows.push_back(row);
    }
  }
  std::vector<uint32_t> extended;
  if (!resend_rows.empty()) {
    const int64_t extra = k - k_sent;
    send.clear();
    for (int64_t row : flagged_rows[me]) append_packed(mine, row, k_sent, extra, send);
    std::vector<size_t> counts(W);
    for (int r = 0; r < W; ++r) counts[r] = flagged_rows[r].size() * extra * sizeof(uint32_t);
    const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
    std::vector<uint32_t> resent(total / sizeof(uint32_t));
    comm.all_gather_v(send.data(), send.size() * sizeof(uint32_t), resent.data(), counts);
    count_bytes(stats, send.size() * sizeof(uint32_t), total);
    ++stats.resend_rounds;

    size_t n_flagged = 0;
    for (const auto& f : flagged_rows) n_flagged += f.size();
    stats.resends = static_cast<int64_t>(n_flagged);
    extended.reserve(n_flagged * k);  // the spans below point into it: no reallocation
    const uint32_t* from = resent.data();
    for (int r = 0; r < W; ++r) {
      for (int64_t row : flagged_rows[r]) {
        const size_t at = extended.size();
        const std::span<const uint32_t> first = state.lists[row * W + r];
        extended.insert(extended.end(), first.begin(), first.end());
        extended.insert(extended.end(), from, from + extra);
        from += extra;
        state.lists[row * W + r] = std::span<const uint32_t>(extended).subspan(at, k);
      }
    }
    state.select(resend_rows);
    for (int64_t row : resend_rows)
      for (int r = 0; r < W; ++r)
        KESTREL_CHECK(static_cast<int64_t>(state.lists[row * W + r].size()) == k ||
                          state.cuts[row].take[r] < k_sent,
                      "packed_topk_merge: row {} would need a second resend from rank {}", row, r);
  }

  LocalSelection out;
  out.row_offsets.push_back(0);
  for (int64_t row = 0; row < rows; ++row) {
    const int32_t* local = mine.local.data() + mine.offsets[row];
    out.local_index.insert(out.local_index.end(), local, local + state.cuts[row].take[me]);
    out.row_offsets.push_back(static_cast<int64_t>(out.local_index.size()));
  }
  if (stats_out) *stats_out += stats;
  return out;
}

LocalSelection generic_topk_merge(Communicator& comm, const RaggedScores& scores, int k, MergeStats* stats_out,
                                  std::vector<int32_t>* global_topk) {
  check_scores(scores, comm.size(), comm.rank(), k, "generic_topk_merge");
  struct Entry {
    float score;
    int32_t position;
  };
  static_assert(sizeof(Entry) == 8);
  // Float comparison ranks -0 as +0; NaN and -inf never get here.
  const auto before = [](const Entry& a, const Entry& b) {
    return a.score != b.score ? a.score > b.score : a.position < b.position;
  };
  const int W = comm.size(), me = comm.rank();
  const int64_t rows = scores.rows();
  MergeStats stats;
  stats.rows = rows;

  std::vector<Entry> send(rows * k, Entry{-std::numeric_limits<float>::infinity(), -1});
  std::vector<Entry> row;
  for (int64_t i = 0; i < rows; ++i) {
    row.clear();
    const int64_t begin = scores.row_offsets[i], n = scores.row_offsets[i + 1] - begin;
    for (int64_t l = 0; l < n; ++l) {
      const float s = scores.values[begin + l];
      if (std::isnan(s) || s == -std::numeric_limits<float>::infinity()) continue;
      const int64_t position = l * W + me;
      KESTREL_CHECK(position <= std::numeric_limits<int32_t>::max(), "generic_topk_merge: position {} exceeds int32",
                    position);
      row.push_back({s, static_cast<int32_t>(position)});
    }
    const size_t keep = std::min<size_t>(row.size(), static_cast<size_t>(k));
    std::partial_sort(row.begin(), row.begin() + keep, row.end(), before);
    std::copy(row.begin(), row.begin() + keep, send.begin() + i * k);
  }
  std::vector<Entry> gathered(send.size() * W);
  comm.all_gather(send.data(), send.size() * sizeof(Entry), gathered.data());
  count_bytes(stats, send.size() * sizeof(Entry), gathered.size() * sizeof(Entry));

  LocalSelection out;
  out.row_offsets.push_back(0);
  if (global_topk) global_topk->assign(rows * k, -1);
  for (int64_t i = 0; i < rows; ++i) {
    row.clear();
    for (int r = 0; r < W; ++r)
      for (int j = 0; j < k; ++j) {
        const Entry& e = gathered[(r * rows + i) * k + j];
        if (e.position >= 0) row.push_back(e);
      }
    const size_t keep = std::min<size_t>(row.size(), static_cast<size_t>(k));
    std::partial_sort(row.begin(), row.begin() + keep, row.end(), before);
    for (size_t j = 0; j < keep; ++j) {
      if (global_topk) (*global_topk)[i * k + j] = row[j].position;
      if (row[j].position % W == me) out.local_index.push_back(row[j].position / W);
    }
    out.row_offsets.push_back(static_cast<int64_t>(out.local_index.size()));
  }
  if (stats_out) *stats_out += stats;
  return out;
}

}  // namespace kestrel::parallel
