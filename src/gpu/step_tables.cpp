#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "gpu/cuda_state.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::gpu {

namespace {
constexpr int kFastKdaDim = 128;  // the chunked and decode KDA kernels' head size
}  // namespace

Staging::Staging(DeviceArena& arena, size_t capacity) : capacity_(capacity) {
  dev_ = arena.take_n<uint8_t>(capacity, "step tables");
  KESTREL_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_), capacity));
}

Staging::~Staging() {
  if (host_) cudaFreeHost(host_);
}

void* Staging::put_bytes(const void* p, size_t n) {
  const size_t start = (used_ + 15) / 16 * 16;
  KESTREL_CHECK(start + n <= capacity_, "the step's tables need more than the {} bytes set aside", capacity_);
  if (n) std::memcpy(host_ + start, p, n);
  used_ = start + n;
  return dev_ + start;
}

void Staging::flush(cudaStream_t s) {
  if (used_) KESTREL_CUDA_CHECK(cudaMemcpyAsync(dev_, host_, used_, cudaMemcpyHostToDevice, s));
}

float* CudaState::state_at(const StepBatch& batch, int32_t row, size_t layer) const {
  const CachePlan& plan = *batch.plan;
  return reinterpret_cast<float*>(batch.pool + int64_t{row} * plan.row_bytes + plan.state_offset[layer]);
}

bool CudaState::prepare_tables(const StepBatch& batch) {
  StepTables& t = tables;
  const bool graphs = graphs_on;
  const CachePlan& plan = *batch.plan;
  const auto& seqs = batch.seqs;
  const cudaStream_t st = stream;
  KESTREL_CHECK(plan.row_bytes % 16 == 0, "the GPU needs 16-byte aligned cache rows, the plan has {} bytes",
                plan.row_bytes);
  const bool chunked_kda = opts.kda_chunked_prefill;
  KESTREL_CHECK(prepared, "the CUDA backend runs steps once its workspaces are sized (CudaBackend::prepare)");
  KESTREL_CHECK(batch.mla_runner == nullptr, "the CUDA backend does not take an MLA step runner");

  // The model checked the step (Model::check_step); what follows are the GPU's own limits.
  Ordered& ord = t.ord;
  ord = Ordered{};
  int64_t N = 0, wanted = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SequenceStep& q = seqs[i];
    const int64_t n = static_cast<int64_t>(q.ids.size()), end = q.start + n;
    // The kernels are sized for max_model_len (the MLA split, the indexer's scores): a longer context would be cut.
    KESTREL_CHECK(end <= limits.max_model_len, "a sequence of {} tokens exceeds the GPU's max_model_len {}", end,
                  limits.max_model_len);
    // The chunked kernel takes checkpoints at multiples of the block size.
    for (const CheckpointTarget& c : q.checkpoints)
      KESTREL_CHECK(c.position % plan.block_size == 0, "KDA checkpoint at {} is not a block boundary", c.position);
    N += n;
    wanted += n - q.logits_from;
  }
  KESTREL_CHECK(N <= limits.max_tokens, "a step of {} tokens exceeds the GPU's limit of {}", N, limits.max_tokens);
  KESTREL_CHECK(static_cast<int64_t>(seqs.size()) <= limits.max_seqs, "a step of {} sequences exceeds the limit of {}",
                seqs.size(), limits.max_seqs);
  t.N = N;
  t.wanted = wanted;
  if (seqs.empty()) return false;
  auto group_of = [&](const SequenceStep& q) {
    if (q.ids.size() == 1 && !q.prompt) return 0;
    return q.prompt && chunked_kda ? 1 : 2;
  };
  for (int g = 0; g < 3; ++g)
    for (size_t i = 0; i < seqs.size(); ++i)
      if (group_of(seqs[i]) == g) ord.seq.push_back(static_cast<int>(i));
  const int S = static_cast<int>(ord.seq.size());
  ord.first.assign(S + 1, 0);
  for (int j = 0; j < S; ++j) {
    const SequenceStep& q = seqs[ord.seq[j]];
    ord.first[j + 1] = ord.first[j] + static_cast<int64_t>(q.ids.size());
    const int g = group_of(q);
    ord.decode += g == 0;
    ord.chunked += g == 1;
  }

  // Step tables.
  Staging& tab = *s.staging;
  tab.reset();
  std::vector<int32_t> ids(N), row_req(N), row_pos(N), ctx(S);
  std::vector<int64_t> slots(N), cu(S + 1, 0);
  // A CUDA graph replays fixed shapes: every sequence a single generated token and no checkpoint, block tables of
  // the longest possible width, and the MLA split sized for the longest context.
  bool any_checkpoint = false;
  for (const SequenceStep& q : seqs) any_checkpoint |= !q.checkpoints.empty();
  // Every row's logits wanted: the graph gathers and projects S rows (a recomputed token after a preemption wants
  // none).
  t.graph = graphs && ord.decode == S && !any_checkpoint && wanted == N;
  int64_t bt_stride = 1;
  for (int j = 0; j < S; ++j) bt_stride = std::max<int64_t>(bt_stride, seqs[ord.seq[j]].block_table.size());
  if (t.graph) {
    // Graphs are captured per power-of-two block-table width (so per bucket of context), which also sizes the MLA
    // decode's split: a few graphs per batch size instead of tables and splits sized for max_model_len.
    int64_t width = 1;
    while (width < bt_stride) width *= 2;
    bt_stride = std::min(width, max_blocks);
  }
  std::vector<int32_t> bt(static_cast<size_t>(S * bt_stride), 0);
  for (int j = 0; j < S; ++j) {
    const SequenceStep& q = seqs[ord.seq[j]];
    for (size_t t = 0; t < q.ids.size(); ++t) {
      const int64_t at = ord.first[j] + static_cast<int64_t>(t);
      ids[at] = q.ids[t];
      slots[at] = q.slots[t];
      row_req[at] = j;
      row_pos[at] = static_cast<int32_t>(q.start + static_cast<int64_t>(t));
    }
    ctx[j] = static_cast<int32_t>(q.start + static_cast<int64_t>(q.ids.size()));
    cu[j + 1] = ord.first[j + 1];
    std::copy(q.block_table.begin(), q.block_table.end(), bt.begin() + j * bt_stride);
  }
  t.S = S;
  t.bt_stride = bt_stride;
  t.ids = tab.put(ids);
  t.slots = tab.put(slots);
  t.row_req = tab.put(row_req);
  t.row_pos = tab.put(row_pos);
  t.ctx = tab.put(ctx);
  t.cu = tab.put(cu);
  t.bt = tab.put(bt);
  // KDA: per state group, each sequence's state row; per KDA layer, its conv-history pointers.
  const int groups = plan.state_rows_per_request;
  t.state_rows.assign(groups, nullptr);
  for (int g = 0; g < groups; ++g) {
    std::vector<int32_t> r(S);
    for (int j = 0; j < S; ++j) r[j] = seqs[ord.seq[j]].state_rows[g];
    t.state_rows[g] = tab.put(r);
  }
  const int64_t Hk = cfg.kda_num_heads, dk = cfg.kda_head_dim;
  auto state_base = [&](int32_t row, size_t l) { return state_at(batch, row, l); };
  t.hist.assign(cfg.layer_kinds.size(), {});
  for (size_t l = 0; l < cfg.layer_kinds.size(); ++l) {
    if (cfg.layer_kinds[l] != LayerKind::kda) continue;
    KESTREL_CHECK(plan.state_offset[l] % 16 == 0, "the GPU needs 16-byte aligned KDA states (layer {})", l);
    std::vector<float*> p(S);
    for (int j = 0; j < S; ++j) p[j] = state_base(seqs[ord.seq[j]].state_rows[plan.state_row[l]], l) + Hk * dk * dk;
    t.hist[l] = tab.put(p);
  }
  // Logit rows: each sequence's wanted positions, in the caller's order.
  std::vector<int32_t> out_rows;
  {
    std::vector<int64_t> first_of(seqs.size());
    for (int j = 0; j < S; ++j) first_of[ord.seq[j]] = ord.first[j];
    for (size_t i = 0; i < seqs.size(); ++i)
      for (int64_t t = seqs[i].logits_from; t < static_cast<int64_t>(seqs[i].ids.size()); ++t)
        out_rows.push_back(static_cast<int32_t>(first_of[i] + t));
  }
  t.out_rows = tab.put(out_rows);
  // KDA through the recurrence (every sequence when dk is not the fast kernels' 128, else those the fast kernels do
  // not take): one launch when no such sequence asks for a checkpoint, else each sequence cut at its checkpoints.
  t.fast_kda = dk == kFastKdaDim;
  const int first_recurrent = t.first_recurrent = t.fast_kda ? ord.decode + ord.chunked : 0;
  bool recurrent_checkpoints = false;
  for (int j = first_recurrent; j < S; ++j) recurrent_checkpoints |= !seqs[ord.seq[j]].checkpoints.empty();
  std::vector<StepTables::Segment>& segments = t.segments;
  segments.clear();
  t.recurrent_cu = nullptr;
  if (first_recurrent < S && !recurrent_checkpoints) {
    std::vector<int64_t> rcu;
    for (int j = first_recurrent; j <= S; ++j) rcu.push_back(ord.first[j] - ord.first[first_recurrent]);
    t.recurrent_cu = tab.put(rcu);
  } else if (first_recurrent < S) {
    for (int j = first_recurrent; j < S; ++j) {
      const SequenceStep& q = seqs[ord.seq[j]];
      int64_t done = 0;
      const int64_t n = static_cast<int64_t>(q.ids.size());
      auto add = [&](int64_t len, const CheckpointTarget* ck) {
        if (len > 0 || ck) segments.push_back({j, ord.first[j] + done, len, tab.put(std::vector<int64_t>{0, len}), ck});
        done += len;
      };
      for (const CheckpointTarget& ck : q.checkpoints) add(ck.position - q.start - done, &ck);
      add(n - done, nullptr);
    }
  }
  tab.flush(st);
  return true;
}

}  // namespace kestrel::gpu
