#include "text/bpe.h"

#include <queue>

#include "core/error.h"

namespace kestrel::text {

BpeModel::BpeModel(std::vector<std::string> id_bytes) : id_bytes_(std::move(id_bytes)) {
  byte_id_.fill(-1);
  for (size_t id = 0; id < id_bytes_.size(); ++id) {
    const std::string& b = id_bytes_[id];
    if (b.size() == 1 && byte_id_[static_cast<unsigned char>(b[0])] < 0)
      byte_id_[static_cast<unsigned char>(b[0])] = static_cast<int32_t>(id);
  }
}

void BpeModel::add_merge(int32_t left, int32_t right, int32_t rank, int32_t merged) {
  merges_.try_emplace(key(left, right), Merge{rank, merged});
}

void BpeModel::enable_whole_piece_lookup(const std::vector<int32_t>& ids) {
  whole_piece_ = true;
  whole_.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string& b = id_bytes_[static_cast<size_t>(id)];
    if (!b.empty()) whole_.try_emplace(std::string_view(b), id);
  }
}

void BpeModel::require_all_bytes(std::string_view what) const {
  for (int b = 0; b < 256; ++b)
    if (byte_id_[b] < 0) fail("{}: byte 0x{:02X} has no token, so this is not a byte-level BPE vocabulary", what, b);
}

const BpeModel::Merge* BpeModel::find_merge(int32_t a, int32_t b) const {
  const auto it = merges_.find(key(a, b));
  return it == merges_.end() ? nullptr : &it->second;
}

// Quadratic in the piece length but with tiny constants: the right choice for the short pieces that regex
// pre-tokenization produces almost always.
void BpeModel::merge_small(std::vector<int32_t>& sym) const {
  constexpr int32_t kNone = INT32_MAX;
  const size_t n = sym.size();
  int32_t rank[64], merged[64];
  auto fill = [&](size_t i) {
    const Merge* m = find_merge(sym[i], sym[i + 1]);
    rank[i] = m ? m->rank : kNone;
    merged[i] = m ? m->merged : -1;
  };
  for (size_t i = 0; i + 1 < n; ++i) fill(i);
  size_t len = n;
  while (len > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < len; ++i)
      if (rank[i] < rank[best]) best = i;
    if (rank[best] == kNone) break;
    sym[best] = merged[best];
    for (size_t i = best + 1; i + 1 < len; ++i) {
      sym[i] = sym[i + 1];
      rank[i] = rank[i + 1];
      merged[i] = merged[i + 1];
    }
    --len;
    if (best + 1 < len) fill(best);
    if (best > 0) fill(best - 1);
  }
  sym.resize(len);
}

// Linked list plus a heap ordered by (rank, position): n log n for long pieces (whitespace runs, long CJK runs).
void BpeModel::merge_large(std::vector<int32_t>& sym) const {
  const int32_t n = static_cast<int32_t>(sym.size());
  std::vector<int32_t> next(n), prev(n);
  for (int32_t i = 0; i < n; ++i) {
    next[i] = i + 1 < n ? i + 1 : -1;
    prev[i] = i - 1;
  }
  struct Cand {
    int32_t rank, pos, left, right, merged;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int32_t i) {
    if (i < 0 || next[i] < 0) return;
    if (const Merge* m = find_merge(sym[i], sym[next[i]])) heap.push({m->rank, i, sym[i], sym[next[i]], m->merged});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    const int32_t j = next[c.pos];
    if (sym[c.pos] != c.left || j < 0 || sym[j] != c.right) continue;  // stale
    sym[c.pos] = c.merged;
    sym[j] = -1;
    next[c.pos] = next[j];
    if (next[j] >= 0) prev[next[j]] = c.pos;
    push(prev[c.pos]);
    push(c.pos);
  }
  size_t k = 0;
  for (int32_t i = 0; i >= 0 && i < n; i = next[i]) sym[k++] = sym[i];
  sym.resize(k);
}

void BpeModel::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  if (piece.size() == 1) {
    out.push_back(byte_id_[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (whole_piece_) {
    const auto it = whole_.find(piece);
    if (it != whole_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  thread_local std::vector<int32_t> sym;
  sym.clear();
  for (char c : piece) sym.push_back(byte_id_[static_cast<unsigned char>(c)]);
  if (sym.size() <= 64) merge_small(sym);
  else merge_large(sym);
  out.insert(out.end(), sym.begin(), sym.end());
}

}  // namespace kestrel::text
