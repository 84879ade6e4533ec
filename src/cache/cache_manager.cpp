#include "cache/cache_manager.h"

#include <algorithm>

#include "core/error.h"

namespace kestrel {

CacheManager::CacheManager(const CachePlan& plan, int32_t num_rows, bool prefix_caching, bool host_rows)
    : plan_(plan),
      // Prefix caching reuses token rows; a model without attention layers has none (and its KDA checkpoints would
      // have no blocks to hang on), so it runs without.
      prefix_caching_(prefix_caching && plan.num_token_layers > 0),
      pool_(num_rows, plan.row_bytes, host_rows),
      prefix_(pool_, plan.block_size, plan.state_rows_per_request) {}

void CacheManager::hash_blocks(SequenceRows& rows, std::span<const int32_t> tokens, int64_t n_blocks,
                               uint64_t extra_key) const {
  const int64_t B = plan_.block_size;
  for (int64_t j = static_cast<int64_t>(rows.hashes.size()); j < n_blocks; ++j)
    rows.hashes.push_back(block_hash(j ? rows.hashes[j - 1] : kRootBlockHash, tokens.subspan(j * B, B), extra_key));
}

PrefixHit CacheManager::lookup(SequenceRows& rows, std::span<const int32_t> tokens, int64_t max_tokens,
                               uint64_t extra_key) const {
  if (!prefix_caching_ || max_tokens < plan_.block_size) return {};
  hash_blocks(rows, tokens, max_tokens / plan_.block_size, extra_key);
  return prefix_.lookup(tokens, max_tokens, rows.hashes);
}

bool CacheManager::take(int32_t count, std::vector<int32_t>& out) {
  if (pool_.num_available() < count) return false;
  for (int32_t i = 0; i < count; ++i) out.push_back(pool_.allocate());
  return true;
}

bool CacheManager::admit(SequenceRows& rows, const PrefixHit& hit, int64_t end, std::vector<RowOp>& ops,
                         std::vector<int32_t>& pins) {
  KESTREL_CHECK(rows.token_rows.empty() && rows.state_rows.empty(), "admitting a sequence that holds rows");
  const int64_t hit_rows = static_cast<int64_t>(hit.token_rows.size());
  const int64_t needed = plan_.state_rows_per_request + plan_.token_rows_for(end) - hit_rows;
  // Referencing the hit takes its idle rows out of what the pool can hand out.
  int64_t idle_hit = 0;
  for (int32_t r : hit.token_rows) idle_hit += pool_.ref_count(r) == 0;
  for (int32_t r : hit.checkpoint_rows) idle_hit += pool_.ref_count(r) == 0;
  if (pool_.num_available() - idle_hit < needed) return false;
  for (int32_t r : hit.token_rows) pool_.ref(r);
  for (int32_t r : hit.checkpoint_rows) {
    pool_.ref(r);
    pins.push_back(r);
  }
  rows.token_rows = hit.token_rows;
  take(plan_.state_rows_per_request, rows.state_rows);
  for (int g = 0; g < plan_.state_rows_per_request; ++g)
    ops.push_back({hit.checkpoint_rows.empty() ? -1 : hit.checkpoint_rows[g], rows.state_rows[g]});
  take(static_cast<int32_t>(plan_.token_rows_for(end) - hit_rows), rows.token_rows);
  rows.named_blocks = hit_rows;
  return true;
}

bool CacheManager::grow(SequenceRows& rows, int64_t end) {
  const int64_t needed = plan_.token_rows_for(end) - static_cast<int64_t>(rows.token_rows.size());
  return needed <= 0 || take(static_cast<int32_t>(needed), rows.token_rows);
}

void CacheManager::release(SequenceRows& rows) {
  for (int32_t r : rows.token_rows) pool_.unref(r);
  for (int32_t r : rows.state_rows) pool_.unref(r);
  for (int32_t r : rows.spec_rows) pool_.unref(r);
  rows.token_rows.clear();
  rows.state_rows.clear();
  rows.spec_rows.clear();
  rows.named_blocks = 0;
}

int CacheManager::reserve_spec_slots(SequenceRows& rows, int slots) {
  const int G = plan_.state_rows_per_request;
  if (G == 0) return slots;
  while (static_cast<int>(rows.spec_rows.size()) < slots * G && take(G, rows.spec_rows)) {
  }
  return std::min(slots, static_cast<int>(rows.spec_rows.size()) / G);
}

void CacheManager::release_spec_slots(SequenceRows& rows) {
  for (int32_t r : rows.spec_rows) pool_.unref(r);
  rows.spec_rows.clear();
}

void CacheManager::unpin(std::span<const int32_t> pins) {
  for (int32_t r : pins) pool_.unref(r);
}

void CacheManager::name_blocks(SequenceRows& rows, std::span<const int32_t> tokens, int64_t upto,
                               uint64_t extra_key) {
  // A model without attention layers keeps no token rows: there is nothing to name.
  if (upto <= rows.named_blocks || plan_.num_token_layers == 0) return;
  KESTREL_CHECK(upto <= static_cast<int64_t>(rows.token_rows.size()), "naming block {} of a sequence of {} blocks",
                upto - 1, rows.token_rows.size());
  if (prefix_caching_) {
    hash_blocks(rows, tokens, upto, extra_key);
    const int64_t B = plan_.block_size;
    for (int64_t j = rows.named_blocks; j < upto; ++j)
      prefix_.insert_block(rows.hashes[j], j ? rows.hashes[j - 1] : kRootBlockHash, tokens.subspan(j * B, B),
                           rows.token_rows[j]);
  }
  rows.named_blocks = upto;
}

void CacheManager::skip_blocks(SequenceRows& rows, int64_t upto) const {
  rows.named_blocks = std::max(rows.named_blocks, upto);
}

std::vector<int32_t> CacheManager::allocate_checkpoint() {
  std::vector<int32_t> rows;
  take(plan_.state_rows_per_request, rows);
  return rows;
}

void CacheManager::commit_checkpoint(const SequenceRows& rows, std::span<const int32_t> tokens, int64_t block,
                                     std::span<const int32_t> checkpoint_rows) {
  KESTREL_CHECK(block < static_cast<int64_t>(rows.hashes.size()), "checkpoint of block {} before its hash", block);
  const int64_t B = plan_.block_size;
  prefix_.insert_checkpoint(rows.hashes[block], block ? rows.hashes[block - 1] : kRootBlockHash,
                            tokens.subspan(block * B, B), checkpoint_rows);
  for (int32_t r : checkpoint_rows) pool_.unref(r);
}

bool CacheManager::fork(const SequenceRows& parent, int64_t tokens, SequenceRows& child, std::vector<RowOp>& ops) {
  KESTREL_CHECK(child.token_rows.empty() && child.state_rows.empty(), "forking into a sequence that holds rows");
  const int64_t B = plan_.block_size, full = tokens / B;
  const bool partial = tokens % B != 0;
  if (pool_.num_available() < plan_.state_rows_per_request + (partial ? 1 : 0)) return false;
  child.token_rows.assign(parent.token_rows.begin(), parent.token_rows.begin() + full);
  for (int32_t r : child.token_rows) pool_.ref(r);
  if (partial) {
    take(1, child.token_rows);
    ops.push_back({parent.token_rows[full], child.token_rows.back()});
  }
  take(plan_.state_rows_per_request, child.state_rows);
  for (size_t g = 0; g < child.state_rows.size(); ++g) ops.push_back({parent.state_rows[g], child.state_rows[g]});
  child.hashes.assign(parent.hashes.begin(), parent.hashes.begin() + std::min<int64_t>(full, parent.hashes.size()));
  child.named_blocks = std::min(parent.named_blocks, full);
  return true;
}

void CacheManager::check_accounting(std::span<const SequenceRows* const> live, std::span<const int32_t> pins) const {
  std::vector<int32_t> expected(pool_.num_rows(), 0);
  for (const SequenceRows* s : live) {
    for (int32_t r : s->token_rows) ++expected[r];
    for (int32_t r : s->state_rows) ++expected[r];
    for (int32_t r : s->spec_rows) ++expected[r];
  }
  for (int32_t r : pins) ++expected[r];
  for (int32_t r = 0; r < pool_.num_rows(); ++r)
    KESTREL_CHECK(pool_.ref_count(r) == expected[r], "row {} has {} references, its holders account for {}", r,
                  pool_.ref_count(r), expected[r]);
  pool_.check_consistency();
}

}  // namespace kestrel
