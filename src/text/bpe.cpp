#include "text/bpe.h"

#include <cstring>
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

namespace {

constexpr uint64_t kEmpty = ~uint64_t{0};

// Fibonacci hashing; the high bits of the product mix both halves of the key.
size_t pair_slot(uint64_t key, size_t mask) {
  const uint64_t h = (key ^ (key >> 29)) * 0x9E3779B97F4A7C15ull;
  return static_cast<size_t>(h >> 32) & mask;
}

}  // namespace

uint64_t bytes_hash(std::string_view s) {
  uint64_t h = 0x243F6A8885A308D3ull ^ s.size();
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
  }
  uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  h = (h ^ w) * 0x9E3779B97F4A7C15ull;
  return h ^ (h >> 32);
}

namespace {

size_t table_size(size_t n) {
  size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  return cap;
}

}  // namespace

PieceCache::PieceCache() : slots_(1024, Slot{0, nullptr, 0, 0, 0}) {}

bool PieceCache::lookup(std::string_view piece, uint64_t hash, std::vector<int32_t>& out) const {
  const size_t mask = slots_.size() - 1;
  for (size_t s = static_cast<size_t>(hash) & mask;; s = (s + 1) & mask) {
    const Slot& e = slots_[s];
    if (!e.ptr) return false;
    if (e.hash == hash && e.len == piece.size() && std::memcmp(e.ptr, piece.data(), piece.size()) == 0) {
      out.insert(out.end(), ids_.begin() + e.offset, ids_.begin() + e.offset + e.count);
      return true;
    }
  }
}

void PieceCache::insert(std::string_view piece, uint64_t hash, const int32_t* ids, size_t n) {
  if ((used_ + 1) * 2 > slots_.size()) grow();
  const size_t mask = slots_.size() - 1;
  size_t s = static_cast<size_t>(hash) & mask;
  while (slots_[s].ptr) s = (s + 1) & mask;
  slots_[s] = Slot{hash, piece.data(), static_cast<uint32_t>(piece.size()), static_cast<uint32_t>(ids_.size()),
                   static_cast<uint32_t>(n)};
  ids_.insert(ids_.end(), ids, ids + n);
  ++used_;
}

void PieceCache::grow() {
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(old.size() * 2, Slot{0, nullptr, 0, 0, 0});
  const size_t mask = slots_.size() - 1;
  for (const Slot& e : old) {
    if (!e.ptr) continue;
    size_t s = static_cast<size_t>(e.hash) & mask;
    while (slots_[s].ptr) s = (s + 1) & mask;
    slots_[s] = e;
  }
}

void BpeModel::add_merge(int32_t left, int32_t right, int32_t rank, int32_t merged) {
  if ((merge_count_ + 1) * 2 > merge_slots_.size()) rebuild_merge_table();
  const uint64_t k = key(left, right);
  const size_t mask = merge_slots_.size() - 1;
  for (size_t s = pair_slot(k, mask);; s = (s + 1) & mask) {
    if (merge_slots_[s].first == k) return;  // first definition wins
    if (merge_slots_[s].first == kEmpty) {
      merge_slots_[s] = {k, Merge{rank, merged}};
      ++merge_count_;
      return;
    }
  }
}

void BpeModel::rebuild_merge_table() {
  std::vector<std::pair<uint64_t, Merge>> old = std::move(merge_slots_);
  merge_slots_.assign(table_size(std::max<size_t>(merge_count_ + 1, 1024)), {kEmpty, Merge{0, 0}});
  const size_t mask = merge_slots_.size() - 1;
  for (const auto& e : old) {
    if (e.first == kEmpty) continue;
    size_t s = pair_slot(e.first, mask);
    while (merge_slots_[s].first != kEmpty) s = (s + 1) & mask;
    merge_slots_[s] = e;
  }
}

const BpeModel::Merge* BpeModel::find_merge(int32_t a, int32_t b) const {
  if (merge_slots_.empty()) return nullptr;
  const uint64_t k = key(a, b);
  const size_t mask = merge_slots_.size() - 1;
  for (size_t s = pair_slot(k, mask);; s = (s + 1) & mask) {
    if (merge_slots_[s].first == k) return &merge_slots_[s].second;
    if (merge_slots_[s].first == kEmpty) return nullptr;
  }
}

void BpeModel::enable_whole_piece_lookup(const std::vector<int32_t>& ids) {
  whole_piece_ = true;
  whole_slots_.assign(table_size(ids.size() + 1), -1);
  const size_t mask = whole_slots_.size() - 1;
  for (int32_t id : ids) {
    const std::string& b = id_bytes_[static_cast<size_t>(id)];
    if (b.empty() || find_whole(b) >= 0) continue;
    size_t s = static_cast<size_t>(bytes_hash(b)) & mask;
    while (whole_slots_[s] >= 0) s = (s + 1) & mask;
    whole_slots_[s] = id;
  }
}

int32_t BpeModel::find_whole(std::string_view piece) const {
  if (whole_slots_.empty()) return -1;
  const size_t mask = whole_slots_.size() - 1;
  for (size_t s = static_cast<size_t>(bytes_hash(piece)) & mask;; s = (s + 1) & mask) {
    const int32_t id = whole_slots_[s];
    if (id < 0) return -1;
    if (id_bytes_[static_cast<size_t>(id)] == piece) return id;
  }
}

std::vector<int32_t> BpeModel::self_reaching(const std::vector<int32_t>& ids) const {
  std::vector<int32_t> out, sym;
  for (int32_t id : ids) {
    const std::string& b = id_bytes_[static_cast<size_t>(id)];
    if (b.size() < 2) continue;
    sym.clear();
    for (char c : b) sym.push_back(byte_id_[static_cast<unsigned char>(c)]);
    if (sym.size() <= 64) merge_small(sym);
    else merge_large(sym);
    if (sym.size() == 1 && sym[0] == id) out.push_back(id);
  }
  return out;
}

void BpeModel::require_all_bytes(std::string_view what) const {
  for (int b = 0; b < 256; ++b)
    if (byte_id_[b] < 0) fail("{}: byte 0x{:02X} has no token, so this is not a byte-level BPE vocabulary", what, b);
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
    const int32_t id = find_whole(piece);
    if (id >= 0) {
      out.push_back(id);
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

void BpeModel::encode_piece(std::string_view piece, std::vector<int32_t>& out, PieceCache& cache) const {
  if (piece.size() == 1) {
    out.push_back(byte_id_[static_cast<unsigned char>(piece[0])]);
    return;
  }
  const uint64_t h = bytes_hash(piece);
  if (cache.lookup(piece, h, out)) return;
  const size_t start = out.size();
  encode_piece(piece, out);
  cache.insert(piece, h, out.data() + start, out.size() - start);
}

}  // namespace kestrel::text
