#include "parallel/dcp_mla.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/cpu/attention.h"
#include "parallel/dcp_layout.h"
#include "parallel/lse_combine.h"

namespace kestrel::parallel {

void dcp_sparse_mla(Communicator& comm, const MlaShape& shape, int topk, std::span<const DcpQuery> queries,
                    float* out, float* lse, MergeStats* stats, LocalSelection* selection) {
  const int W = comm.size(), me = comm.rank();
  const int H = shape.heads, C = shape.latent, R = shape.rope;
  KESTREL_CHECK(H >= 1 && C >= 1 && R >= 0, "dcp_sparse_mla: bad shape H={} C={} R={}", H, C, R);
  const int64_t rows = static_cast<int64_t>(queries.size());

  std::vector<float> scores;
  std::vector<int64_t> offsets{0}, lengths;
  for (int64_t i = 0; i < rows; ++i) {
    const DcpQuery& q = queries[i];
    const int64_t n = dcp_local_count(q.context_len, me, W);
    KESTREL_CHECK(n == 0 || (q.q_abs && q.kv), "dcp_sparse_mla: query {} has no query or cache rows", i);
    const size_t at = scores.size();
    scores.resize(at + n);
    if (q.index_scores) {
      std::copy_n(q.index_scores, n, scores.begin() + at);
    } else if (n > 0) {
      const IndexerQuery& iq = q.indexer;
      KESTREL_CHECK(iq.q_codes && iq.weights && q.k_codes && q.k_scale,
                    "dcp_sparse_mla: query {} has neither index scores nor indexer inputs", i);
      cpu::indexer_scores(iq.q_codes, iq.weights, iq.heads, iq.dim, q.k_codes, q.k_scale, n, scores.data() + at);
    }
    offsets.push_back(static_cast<int64_t>(scores.size()));
    lengths.push_back(q.context_len);
  }
  LocalSelection selected = packed_topk_merge(comm, RaggedScores{scores, offsets, lengths}, topk, stats);

  std::vector<float> part_out(rows * H * C), part_lse(rows * H);
  for (int64_t i = 0; i < rows; ++i) {
    const std::span<const int32_t> idx = selected.row(i);
    float* o = part_out.data() + i * H * C;
    float* l = part_lse.data() + i * H;
    if (idx.empty()) {  // nothing of this rank is selected (a null idx would mean "every row")
      std::fill(o, o + static_cast<int64_t>(H) * C, 0.0f);
      std::fill(l, l + H, -std::numeric_limits<float>::infinity());
      continue;
    }
    cpu::mla_attend_absorbed(queries[i].q_abs, H, C, R, queries[i].kv, dcp_local_count(queries[i].context_len, me, W),
                             idx.data(), static_cast<int64_t>(idx.size()), shape.scale, o, l);
  }
  all_gather_lse_combine(comm, part_out.data(), part_lse.data(), rows, H, C, out, lse);
  if (selection) *selection = std::move(selected);
}

}  // namespace kestrel::parallel
