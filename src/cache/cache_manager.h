// The cache manager: the row pool, the prefix cache and the rows of every sequence (its block table and state
// rows). It provides the mechanisms (admit, grow, release, name blocks, checkpoints, fork); the scheduler decides
// when to use them. Modules own what the bytes of a row mean; this never reads them, it only orders row copies.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "cache/cache_plan.h"
#include "cache/prefix_cache.h"
#include "cache/row_pool.h"

namespace kestrel {

// The rows one sequence holds.
struct SequenceRows {
  std::vector<int32_t> token_rows;  // block j of the sequence lives in token_rows[j] (its block table)
  std::vector<int32_t> state_rows;  // its KDA state rows; empty while it is not admitted
  std::vector<uint64_t> hashes;     // chain hashes of its first full blocks, as far as computed
  int64_t named_blocks = 0;         // blocks [0, named_blocks) are named in the prefix cache or never will be
  // Speculative decoding: per-position KDA state slots, slot j in [j * G, (j + 1) * G) for G state rows per
  // request; a verification step leaves the state after its (j + 1)-th token in slot j (engine/spec_decode.h).
  // Held only during that step.
  std::vector<int32_t> spec_rows;
};

// A row copy for the model runner to do before a step's forward: dst = src, or dst = zeros when src < 0.
struct RowOp {
  int32_t src = -1;
  int32_t dst = -1;
};

class CacheManager {
 public:
  // checkpoint_rows of a checkpoint = the plan's state rows per request.
  // host_rows false: the rows' bytes live on a GPU (RowPool without host storage). prefix_caching is ignored for a
  // plan without token rows.
  CacheManager(const CachePlan& plan, int32_t num_rows, bool prefix_caching, bool host_rows = true);
  CacheManager(const CacheManager&) = delete;
  CacheManager& operator=(const CacheManager&) = delete;

  const CachePlan& plan() const { return plan_; }
  RowPool& pool() { return pool_; }
  const RowPool& pool() const { return pool_; }
  const PrefixCache& prefix_cache() const { return prefix_; }
  bool prefix_caching() const { return prefix_caching_; }

  // Extends rows.hashes to the first n_blocks full blocks of `tokens`.
  void hash_blocks(SequenceRows& rows, std::span<const int32_t> tokens, int64_t n_blocks, uint64_t extra_key) const;
  // The deepest resumable cached prefix of at most max_tokens tokens (nothing when prefix caching is off).
  PrefixHit lookup(SequenceRows& rows, std::span<const int32_t> tokens, int64_t max_tokens, uint64_t extra_key) const;
  // Counts a lookup whose result an admission used.
  void record_lookup(const PrefixHit& hit, int64_t query_tokens) { prefix_.record_use(hit, query_tokens); }
  // Admits a sequence holding nothing: references the hit's token rows, takes state rows and the token rows for
  // positions [hit.tokens, end), and appends the ops that initialise the state rows (a copy of the hit's
  // checkpoint, else zeros). The checkpoint's rows are pinned (appended to `pins`, referenced) until the caller
  // unpins them after the copy. Returns false and takes nothing when the pool cannot supply the rows.
  bool admit(SequenceRows& rows, const PrefixHit& hit, int64_t end, std::vector<RowOp>& ops,
             std::vector<int32_t>& pins);
  // Token rows to cover positions [0, end); false, taking nothing, when the pool is short.
  bool grow(SequenceRows& rows, int64_t end);
  // Gives every row back (a finished, aborted or preempted sequence).
  void release(SequenceRows& rows);
  void unpin(std::span<const int32_t> pins);
  // Speculative decoding: makes the sequence hold (at least) `slots` per-position state slots, taking rows nobody
  // holds (never preempting); returns how many it holds, at most `slots` counted (all of them without KDA state).
  int reserve_spec_slots(SequenceRows& rows, int slots);
  // Gives the slots back (the scheduler does at the commit of the step that used them).
  void release_spec_slots(SequenceRows& rows);

  // Names the sequence's full blocks [named_blocks, upto) in the prefix cache (its tokens must be computed).
  void name_blocks(SequenceRows& rows, std::span<const int32_t> tokens, int64_t upto, uint64_t extra_key);
  // Marks blocks up to `upto` as never to be named (their contents would differ from a from-scratch prefill).
  void skip_blocks(SequenceRows& rows, int64_t upto) const;

  // KDA checkpoints: state rows for one, taken only from rows nobody holds (never by preempting): empty when the
  // pool cannot spare them. Commit names them as the checkpoint ending block `block` of the sequence (or frees
  // them when one exists already) and releases them to the prefix cache.
  std::vector<int32_t> allocate_checkpoint();
  bool has_checkpoint(uint64_t hash) const { return prefix_.has_checkpoint(hash); }
  void commit_checkpoint(const SequenceRows& rows, std::span<const int32_t> tokens, int64_t block,
                         std::span<const int32_t> checkpoint_rows);

  // A child sequence continuing from the parent's first `tokens` tokens: it shares the parent's full blocks and
  // gets copies (appended to ops) of the partial last block and of the state rows. False, taking nothing, when
  // the pool is short.
  bool fork(const SequenceRows& parent, int64_t tokens, SequenceRows& child, std::vector<RowOp>& ops);

  // Rows a sequence of `tokens` tokens holds at most: what a single request must fit into.
  int64_t rows_for(int64_t tokens) const { return plan_.rows_per_request(tokens); }
  // Checks every row's reference count against the sequences that hold it (plus `pins`) and the pool's lists.
  void check_accounting(std::span<const SequenceRows* const> live, std::span<const int32_t> pins = {}) const;

 private:
  bool take(int32_t count, std::vector<int32_t>& out);

  CachePlan plan_;
  bool prefix_caching_;
  RowPool pool_;
  PrefixCache prefix_;
};

}  // namespace kestrel
