#include "cache/prefix_cache.h"

#include <algorithm>
#include <cstring>

#include <xxhash.h>

#include "core/error.h"

namespace kestrel {

uint64_t block_hash(uint64_t parent, std::span<const int32_t> tokens, uint64_t extra_key) {
  std::vector<uint8_t> bytes(2 * sizeof(uint64_t) + tokens.size_bytes());
  std::memcpy(bytes.data(), &parent, sizeof parent);
  std::memcpy(bytes.data() + sizeof parent, &extra_key, sizeof extra_key);
  if (!tokens.empty()) std::memcpy(bytes.data() + 2 * sizeof(uint64_t), tokens.data(), tokens.size_bytes());
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::vector<uint64_t> block_hash_chain(std::span<const int32_t> tokens, int64_t n_blocks, int block_size,
                                       uint64_t extra_key) {
  KESTREL_CHECK(n_blocks * block_size <= static_cast<int64_t>(tokens.size()),
                "{} blocks of {} tokens need more than the {} tokens given", n_blocks, block_size, tokens.size());
  std::vector<uint64_t> chain(static_cast<size_t>(n_blocks));
  uint64_t parent = kRootBlockHash;
  for (int64_t j = 0; j < n_blocks; ++j)
    parent = chain[j] = block_hash(parent, tokens.subspan(j * block_size, block_size), extra_key);
  return chain;
}

PrefixCache::PrefixCache(RowPool& pool, int block_size, int checkpoint_rows)
    : pool_(pool), block_size_(block_size), checkpoint_rows_(checkpoint_rows) {
  KESTREL_CHECK(block_size > 0 && checkpoint_rows >= 0, "prefix cache: invalid block size {} or checkpoint rows {}",
                block_size, checkpoint_rows);
  rows_.resize(pool.num_rows());
  row_tokens_.resize(static_cast<size_t>(pool.num_rows()) * block_size);
  pool_.set_eviction_handler([this](int32_t r) { evicted(r); });
}

bool PrefixCache::block_matches(int32_t row, uint64_t parent, std::span<const int32_t> block) const {
  return rows_[row].parent == parent &&
         std::equal(block.begin(), block.end(), row_tokens_.begin() + int64_t{row} * block_size_);
}

PrefixHit PrefixCache::lookup(std::span<const int32_t> tokens, int64_t max_tokens,
                              std::span<const uint64_t> hashes) const {
  PrefixHit hit;
  const int64_t max_blocks = std::min<int64_t>(max_tokens, static_cast<int64_t>(tokens.size())) / block_size_;
  KESTREL_CHECK(static_cast<int64_t>(hashes.size()) >= max_blocks, "prefix lookup: {} hashes for {} blocks",
                hashes.size(), max_blocks);
  int64_t resume_blocks = 0;
  const Checkpoint* resume_checkpoint = nullptr;
  for (int64_t j = 0; j < max_blocks; ++j) {
    const uint64_t parent = j ? hashes[j - 1] : kRootBlockHash;
    const std::span<const int32_t> block = tokens.subspan(j * block_size_, block_size_);
    const auto it = blocks_.find(hashes[j]);
    if (it == blocks_.end() || !block_matches(it->second, parent, block)) break;
    hit.token_rows.push_back(it->second);
    if (checkpoint_rows_ == 0) {
      resume_blocks = j + 1;
      continue;
    }
    const auto ck = checkpoints_.find(hashes[j]);
    if (ck != checkpoints_.end() && ck->second.parent == parent &&
        std::equal(block.begin(), block.end(), ck->second.tokens.begin())) {
      resume_blocks = j + 1;
      resume_checkpoint = &ck->second;
    }
  }
  hit.cached_row_tokens = static_cast<int64_t>(hit.token_rows.size()) * block_size_;
  hit.token_rows.resize(resume_blocks);
  hit.tokens = resume_blocks * block_size_;
  if (resume_checkpoint) hit.checkpoint_rows = resume_checkpoint->rows;
  return hit;
}

void PrefixCache::record_use(const PrefixHit& hit, int64_t query_tokens) {
  ++counters_.queries;
  counters_.query_tokens += query_tokens;
  counters_.hit_tokens += hit.tokens;
  if (!hit.checkpoint_rows.empty()) ++counters_.checkpoints_used;
}

bool PrefixCache::insert_block(uint64_t hash, uint64_t parent, std::span<const int32_t> block, int32_t row) {
  KESTREL_CHECK(static_cast<int>(block.size()) == block_size_, "a cached block holds {} tokens, got {}", block_size_,
                block.size());
  if (blocks_.count(hash)) return false;
  KESTREL_CHECK(rows_[row].holds == Holds::nothing, "row {} is already named", row);
  blocks_.emplace(hash, row);
  rows_[row] = RowEntry{Holds::block, hash, parent};
  std::copy(block.begin(), block.end(), row_tokens_.begin() + int64_t{row} * block_size_);
  pool_.mark_cached(row);
  ++counters_.blocks_registered;
  return true;
}

bool PrefixCache::insert_checkpoint(uint64_t hash, uint64_t parent, std::span<const int32_t> block,
                                    std::span<const int32_t> rows) {
  KESTREL_CHECK(static_cast<int>(rows.size()) == checkpoint_rows_, "a checkpoint has {} state rows, got {}",
                checkpoint_rows_, rows.size());
  if (checkpoints_.count(hash)) return false;
  checkpoints_.emplace(hash, Checkpoint{parent, {block.begin(), block.end()}, {rows.begin(), rows.end()}});
  for (int32_t r : rows) {
    KESTREL_CHECK(rows_[r].holds == Holds::nothing, "row {} is already named", r);
    rows_[r] = RowEntry{Holds::checkpoint, hash, parent};
    pool_.mark_cached(r);
  }
  ++counters_.checkpoints_taken;
  return true;
}

void PrefixCache::evicted(int32_t row) {
  const RowEntry e = rows_[row];
  rows_[row] = RowEntry{};
  if (e.holds == Holds::block) {
    blocks_.erase(e.hash);
    ++counters_.blocks_evicted;
  } else if (e.holds == Holds::checkpoint) {
    // A checkpoint is whole or useless: the rest of its rows are released with it.
    const auto it = checkpoints_.find(e.hash);
    for (int32_t r : it->second.rows) {
      if (r == row) continue;
      rows_[r] = RowEntry{};
      pool_.drop_cached(r);
    }
    checkpoints_.erase(it);
    ++counters_.checkpoints_evicted;
  }
}

}  // namespace kestrel
