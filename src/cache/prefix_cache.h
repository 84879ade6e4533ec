// Prefix caching across the hybrid cache (spec CACHE.md): full blocks of token rows named by a hash chain and
// verified against their token ids, and KDA checkpoints (the state rows of a request at a block boundary) keyed by
// the hash of the block they end. A prefix resumes only where the token rows and a checkpoint both exist.
#pragma once
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "cache/row_pool.h"

namespace kestrel {

// The name of a full block: xxHash (XXH3, 64 bit) of the parent block's hash, the extra key (such as a LoRA id)
// and the block's token ids. The first block's parent is kRootBlockHash.
inline constexpr uint64_t kRootBlockHash = 0x6b657374'72656c00ull;
uint64_t block_hash(uint64_t parent, std::span<const int32_t> tokens, uint64_t extra_key);
// The chain of hashes of the first `n_blocks` full blocks of `tokens`.
std::vector<uint64_t> block_hash_chain(std::span<const int32_t> tokens, int64_t n_blocks, int block_size,
                                       uint64_t extra_key);

struct PrefixHit {
  int64_t tokens = 0;                    // where the request resumes: a block boundary
  std::vector<int32_t> token_rows;       // the rows of blocks [0, tokens / B)
  std::vector<int32_t> checkpoint_rows;  // the KDA checkpoint ending at `tokens` (empty for models without KDA)
  int64_t cached_row_tokens = 0;         // tokens the cached token rows alone would cover (>= tokens)
};

struct PrefixCacheCounters {
  int64_t queries = 0;       // lookups whose result was used
  int64_t query_tokens = 0;  // tokens those lookups asked for
  int64_t hit_tokens = 0;    // tokens they resumed at
  int64_t checkpoints_taken = 0, checkpoints_used = 0, checkpoints_evicted = 0;
  int64_t blocks_registered = 0, blocks_evicted = 0;
};

class PrefixCache {
 public:
  // checkpoint_rows: state rows per checkpoint (a request's state rows); 0 for models without KDA layers, whose
  // prefixes resume wherever token rows are cached.
  PrefixCache(RowPool& pool, int block_size, int checkpoint_rows);
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  int block_size() const { return block_size_; }
  int checkpoint_rows() const { return checkpoint_rows_; }

  // The deepest resumable prefix of at most max_tokens tokens. `hashes` is the chain of tokens' full blocks (at
  // least max_tokens / B of them). Takes no references: the caller refs what it uses.
  PrefixHit lookup(std::span<const int32_t> tokens, int64_t max_tokens, std::span<const uint64_t> hashes) const;
  // Counts a lookup whose result the caller used.
  void record_use(const PrefixHit& hit, int64_t query_tokens);

  // Names a held row that now holds full block `hash` (tokens `block`, parent `parent`). Returns false when that
  // block is already cached in another row (the row then stays unnamed and is freed when released).
  bool insert_block(uint64_t hash, uint64_t parent, std::span<const int32_t> block, int32_t row);
  // Names held state rows that hold a checkpoint at the end of block `hash`; false when one exists already.
  bool insert_checkpoint(uint64_t hash, uint64_t parent, std::span<const int32_t> block, std::span<const int32_t> rows);
  bool has_checkpoint(uint64_t hash) const { return checkpoints_.count(hash) > 0; }

  const PrefixCacheCounters& counters() const { return counters_; }
  int64_t num_cached_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  int64_t num_checkpoints() const { return static_cast<int64_t>(checkpoints_.size()); }

 private:
  struct Checkpoint {
    uint64_t parent;
    std::vector<int32_t> tokens;
    std::vector<int32_t> rows;
  };
  enum class Holds : uint8_t { nothing, block, checkpoint };
  struct RowEntry {
    Holds holds = Holds::nothing;
    uint64_t hash = 0, parent = 0;
  };
  bool block_matches(int32_t row, uint64_t parent, std::span<const int32_t> block) const;
  void evicted(int32_t row);

  RowPool& pool_;
  int block_size_, checkpoint_rows_;
  std::unordered_map<uint64_t, int32_t> blocks_;
  std::unordered_map<uint64_t, Checkpoint> checkpoints_;
  std::vector<RowEntry> rows_;
  std::vector<int32_t> row_tokens_;  // [rows, B]: the token ids of the block a row holds
  PrefixCacheCounters counters_;
};

}  // namespace kestrel
