#include "parallel/token_sharded_prefill.h"

#include <algorithm>

namespace kestrel::parallel {

TokenShardedMla::TokenShardedMla(Communicator& comm, const TokenShardPlan& plan) : comm_(comm), plan_(plan) {
  KESTREL_CHECK(comm.size() == plan.world(), "token-sharded MLA: plan for {} ranks used by {} ranks", plan.world(),
                comm.size());
}

void TokenShardedMla::run(const MlaCore& layer, const float* x, const float* qr, const float* q, const float* kv,
                          std::span<const MlaStepRequest> requests, float* o) {
  const ModelConfig& cfg = layer.config();
  const int W = comm_.size(), me = comm_.rank();
  const int H = cfg.num_attention_heads, dq = cfg.qk_head_dim(), dv = cfg.v_head_dim;
  const int64_t D = cfg.hidden_size, qlr = cfg.q_lora_rank;
  const int64_t R = static_cast<int64_t>(requests.size());

  std::vector<int64_t> first(R + 1, 0);
  for (int64_t r = 0; r < R; ++r) first[r + 1] = first[r] + requests[r].tokens;
  const int64_t N = first.back();
  KESTREL_CHECK(N == plan_.step_tokens(), "token-sharded MLA: a step of {} tokens under a plan of {}", N,
                plan_.step_tokens());
  const std::span<const TokenPiece> pieces = plan_.pieces_of(me);
  for (const TokenPiece& p : pieces)
    KESTREL_CHECK(p.request < R && p.first_token - first[p.request] ==
                                       p.first_position - requests[p.request].pages.pos0,
                  "token-sharded MLA: the step's requests are not those of the plan");

  // Replicated: every rank writes the step's cache entries into its own copy. The queries of this rank's heads go to
  // the ranks that own their tokens.
  const int64_t C = cfg.kv_lora_rank, Rd = cfg.qk_rope_head_dim;
  for (int64_t r = 0; r < R; ++r)
    layer.write_cache(x + first[r] * D, kv + first[r] * (C + Rd), requests[r].tokens, requests[r].pages);
  const HeadRange heads = head_range(H, W, me);
  const int64_t q_row = int64_t{heads.count()} * dq;
  std::vector<float> q_heads(static_cast<size_t>(N * q_row));
  for (int64_t t = 0; t < N; ++t)
    std::copy_n(q + t * H * dq + int64_t{heads.begin} * dq, q_row, q_heads.data() + t * q_row);

  const std::vector<float> q_own = head_to_token_sharded(comm_, plan_, q_heads, H, dq);

  // Split by token: this rank's queries with every head, request by request against the request's context up to
  // the rank's last position in it.
  struct Query {
    int64_t own;  // index among this rank's tokens
    int64_t step_token;
    int64_t position;
  };
  std::vector<float> o_own(plan_.tokens_of(me).size() * H * dv);
  TokenShardWork work{std::vector<int64_t>(R, 0), std::vector<int64_t>(R, 0)};
  MlaContext ctx;
  std::vector<Query> queries;
  int64_t own = 0;
  for (size_t i = 0; i < pieces.size();) {
    const int64_t req = pieces[i].request;
    queries.clear();
    int64_t end = 0;
    for (; i < pieces.size() && pieces[i].request == req; ++i)
      for (int64_t u = 0; u < pieces[i].count; ++u) {
        queries.push_back({own++, pieces[i].first_token + u, pieces[i].first_position + u});
        end = std::max(end, pieces[i].first_position + u + 1);
      }
    if (queries.empty()) continue;
    layer.read_context(requests[req].pages, end, ctx);
    const int64_t n = static_cast<int64_t>(queries.size());
#pragma omp parallel for schedule(dynamic)
    for (int64_t k = 0; k < n; ++k) {
      const Query& qu = queries[k];
      layer.attend(q_own.data() + qu.own * H * dq, x + qu.step_token * D, qr ? qr + qu.step_token * qlr : nullptr,
                   qu.position, ctx, o_own.data() + qu.own * H * dv);
    }
    work.query_tokens[req] += n;
    for (const Query& qu : queries) work.causal_work[req] += qu.position + 1;
  }
  work_.push_back(std::move(work));

  const std::vector<float> o_heads = token_to_head_sharded(comm_, plan_, o_own, H, dv);

  std::vector<size_t> bytes(W);
  for (int r = 0; r < W; ++r) bytes[r] = static_cast<size_t>(N) * head_range(H, W, r).count() * dv * sizeof(float);
  std::vector<float> gathered(static_cast<size_t>(N) * H * dv);
  comm_.all_gather_v(o_heads.data(), o_heads.size() * sizeof(float), gathered.data(), bytes);
  auto from = gathered.begin();
  for (int r = 0; r < W; ++r) {
    const HeadRange hr = head_range(H, W, r);
    for (int64_t t = 0; t < N; ++t, from += hr.count() * dv) std::copy_n(from, hr.count() * dv, o + (t * H + hr.begin) * dv);
  }
}

TokenShardPlan token_shard_plan(const StepBatch& batch, int world) {
  std::vector<PrefillRequest> requests;
  for (const SequenceStep& s : batch.seqs) requests.push_back({s.start, static_cast<int64_t>(s.ids.size())});
  return TokenShardPlan(requests, world);
}

std::vector<TokenShardWork> token_sharded_forward(Communicator& comm, const Model& model, const StepBatch& batch,
                                                  float* logits) {
  const TokenShardPlan plan = token_shard_plan(batch, comm.size());
  TokenShardedMla runner(comm, plan);
  StepBatch sharded = batch;
  sharded.mla_runner = &runner;
  model.forward(sharded, logits);
  return runner.work();
}

}  // namespace kestrel::parallel
