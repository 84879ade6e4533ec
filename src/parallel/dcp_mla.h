// Sparse MLA (DSA) of one layer under decode context parallelism, on the CPU backend: each rank scores its own
// cache shard, the packed top-k merge selects the global top-k, each rank attends over its selected rows, and the
// partial results are LSE-combined. Equals single-rank sparse MLA (cpu::topk_indices on the bf16-rounded index
// scores, then cpu::mla_attend_absorbed over the selected rows): the selected set exactly, the output to fp32
// rounding (the test bounds it by 2e-6 relative).
#pragma once
#include <cstdint>
#include <span>

#include "parallel/communicator.h"
#include "parallel/topk_merge.h"

namespace kestrel::parallel {

struct MlaShape {
  int heads;    // H
  int latent;   // C = kv_lora_rank
  int rope;     // R = qk_rope_head_dim
  float scale;  // softmax scale
};

// The indexer side of one query token (dsa_mla.md §2.4): FP8 query codes [heads, dim] and folded weights [heads].
struct IndexerQuery {
  const uint8_t* q_codes = nullptr;
  const float* weights = nullptr;
  int heads = 0;
  int dim = 0;
};

// One query token as one rank sees it. The query attends positions [0, context_len); the rank holds
// n = dcp_local_count(context_len, rank, W) of them.
struct DcpQuery {
  const float* q_abs = nullptr;  // [H, C+R], every head (the same on every rank)
  int64_t context_len = 0;
  const float* kv = nullptr;     // the rank's cached rows [n, C+R], in local order
  // The rank's index scores [n], or nullptr to compute them with cpu::indexer_scores from `indexer` and the
  // rank's index keys k_codes [n, indexer.dim] and k_scale [n].
  const float* index_scores = nullptr;
  IndexerQuery indexer;
  const uint8_t* k_codes = nullptr;
  const float* k_scale = nullptr;
};

// out [queries, H, C] and lse [queries, H] receive the combined attention (the same bits on every rank); a query
// with nothing to attend gets 0 and -inf. stats accumulates the merge's counters; selection, if given, receives
// the rank's selected local indices.
void dcp_sparse_mla(Communicator& comm, const MlaShape& shape, int topk, std::span<const DcpQuery> queries,
                    float* out, float* lse, MergeStats* stats = nullptr, LocalSelection* selection = nullptr);

}  // namespace kestrel::parallel
