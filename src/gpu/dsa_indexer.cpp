#include "gpu/dsa_indexer.h"

#include <algorithm>
#include <climits>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/dsa_generic.h"
#include "kernels/cuda/fp4_cache.h"
#include "kernels/cuda/linear_f32.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"
#include "kernels/cuda/v32_glue.h"

namespace kestrel::gpu {

namespace {

constexpr float kIndexKeyNormEps = 1e-6f;               // as src/cpu/mla_core.cpp
constexpr size_t kScoreBudgetBytes = size_t{256} << 20;  // the score rows of one launch
constexpr int kMaxRequestsPerLaunch = 65535;            // the score kernels put requests on the grid's y dimension
constexpr int kFastDim = cuda::kIndexHeadDim;

bool power_of_two(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

// The tensor-core scores read FP8 keys only; MXFP4 keys go to the generic kernel, which converts them.
bool fast_scores(int heads, int dim, IndexKeyDtype keys) {
  return keys == IndexKeyDtype::fp8 && dim == kFastDim && (heads == 32 || heads == 64);
}

}  // namespace

struct DsaIndexerWorkspace {
  int heads = 0, dim = 0, top_k = 0;
  int64_t max_tokens = 0, max_model_len = 0, score_rows = 0;
  float *keys = nullptr, *q = nullptr, *raw_weights = nullptr, *weights = nullptr;
  uint8_t* codes = nullptr;
  float* scores = nullptr;  // [score_rows, max_model_len]
  void* topk = nullptr;     // topk_decode's scratch, zero-filled
  size_t topk_bytes = 0;
  int32_t* ctx = nullptr;   // the context length of a prompt chunk
  size_t bytes = 0;
};

void DsaIndexerGpu::make_workspace(int64_t max_tokens, int max_seqs, int64_t max_model_len, DeviceArena& arena) {
  KESTREL_CHECK(max_tokens > 0 && max_seqs > 0 && max_model_len > 0,
                "DSA indexer: limits must be positive (tokens {}, sequences {}, model length {})", max_tokens, max_seqs,
                max_model_len);
  KESTREL_CHECK(max_model_len <= INT_MAX, "DSA indexer: max_model_len {} is past the kernels' int32 positions",
                max_model_len);
  auto ws = std::make_shared<DsaIndexerWorkspace>();
  ws->heads = heads_;
  ws->dim = dim_;
  ws->top_k = top_k_;
  ws->max_tokens = max_tokens;
  ws->max_model_len = max_model_len;
  ws->score_rows = std::clamp<int64_t>(
      static_cast<int64_t>(kScoreBudgetBytes / (sizeof(float) * static_cast<size_t>(max_model_len))), 1, max_tokens);
  // topk_decode plans by rows (batch * n_q) and context; a call sized for max_model_len fits this for any rows up
  // to score_rows, and select() falls back to max_model_len when a shorter context's plan would not fit.
  const int L = static_cast<int>(max_model_len);
  for (int64_t rows = 1; rows <= ws->score_rows; ++rows)
    ws->topk_bytes = std::max(ws->topk_bytes, cuda::topk_decode_workspace_bytes(static_cast<int>(rows), 1, L, top_k_));

  const size_t before = arena.used();
  const int64_t N = max_tokens, HD = int64_t{heads_} * dim_;
  ws->keys = arena.take_n<float>(static_cast<size_t>(N * dim_), "DSA indexer keys");
  ws->q = arena.take_n<float>(static_cast<size_t>(N * HD), "DSA indexer queries");
  ws->raw_weights = arena.take_n<float>(static_cast<size_t>(N * heads_), "DSA indexer head weights");
  ws->weights = arena.take_n<float>(static_cast<size_t>(N * heads_), "DSA indexer head weights");
  ws->codes = arena.take_n<uint8_t>(static_cast<size_t>(N * HD), "DSA indexer query codes");
  ws->scores = arena.take_n<float>(static_cast<size_t>(ws->score_rows * max_model_len), "DSA indexer scores");
  if (ws->topk_bytes) {
    ws->topk = arena.take(ws->topk_bytes, "DSA indexer top-k scratch");
    KESTREL_CUDA_CHECK(cudaMemset(ws->topk, 0, ws->topk_bytes));  // topk_decode leaves it zero-filled again
  }
  ws->ctx = arena.take_n<int32_t>(1, "DSA indexer chunk context");
  ws->bytes = arena.used() - before;
  ws_ = std::move(ws);
}

void DsaIndexerGpu::share_workspace(std::shared_ptr<DsaIndexerWorkspace> workspace) {
  KESTREL_CHECK(workspace != nullptr, "DSA indexer: no workspace to share");
  KESTREL_CHECK(workspace->heads == heads_ && workspace->dim == dim_ && workspace->top_k == top_k_,
                "DSA indexer: a workspace for {} heads of {} (top-{}) cannot serve {} heads of {} (top-{})",
                workspace->heads, workspace->dim, workspace->top_k, heads_, dim_, top_k_);
  ws_ = std::move(workspace);
}

DsaIndexerGpu::~DsaIndexerGpu() = default;
DsaIndexerGpu::DsaIndexerGpu(DsaIndexerGpu&&) noexcept = default;
DsaIndexerGpu& DsaIndexerGpu::operator=(DsaIndexerGpu&&) noexcept = default;

int DsaIndexerGpu::top_k() const { return top_k_; }
int64_t DsaIndexerGpu::score_rows() const { return ws_->score_rows; }
size_t DsaIndexerGpu::workspace_bytes() const { return ws_->bytes; }

DsaIndexerGpu::DsaIndexerGpu(const DsaIndexerWeights& w, const ModelConfig& cfg, IndexKeyDtype keys,
                             DeviceArena& arena) {
  keys_ = keys;
  heads_ = cfg.index_n_heads;
  dim_ = cfg.index_head_dim;
  top_k_ = cfg.index_topk;
  hidden_ = cfg.hidden_size;
  q_in_ = cfg.q_lora_rank ? cfg.q_lora_rank : cfg.hidden_size;
  KESTREL_CHECK(top_k_ >= 1, "DSA indexer: index_topk must be positive, got {}", top_k_);
  KESTREL_CHECK(power_of_two(dim_) && dim_ >= cuda::kMinGenericIndexScoreDim &&
                    dim_ <= cuda::kMaxGenericIndexScoreDim,
                "the GPU DSA indexer needs index_head_dim a power of two in [{}, {}], got {}",
                cuda::kMinGenericIndexScoreDim, cuda::kMaxGenericIndexScoreDim, dim_);
  KESTREL_CHECK(keys_ == IndexKeyDtype::fp8 || dim_ >= 32, "MXFP4 index keys need index_head_dim >= 32, got {}",
                dim_);
  KESTREL_CHECK(heads_ > 0 && (fast_scores(heads_, dim_, keys_) ||
                               int64_t{heads_} * dim_ <= cuda::kMaxGenericIndexQueryBytes),
                "the GPU DSA indexer takes at most {} query bytes per token (index_n_heads * index_head_dim) unless "
                "the head dimension is 128 with 32 or 64 heads and FP8 keys; got {} heads of {}",
                cuda::kMaxGenericIndexQueryBytes, heads_, dim_);
  KESTREL_CHECK(w.wq_b && w.wk && w.k_norm_w && w.k_norm_b && w.weights_proj, "DSA indexer: a weight is missing");
  wq_b_ = w.wq_b;
  wk_ = w.wk;
  k_norm_w_ = w.k_norm_w;
  k_norm_b_ = w.k_norm_b;
  w_proj_ = w.weights_proj;
  const size_t before = arena.used();
  if (cfg.use_rope) {
    rope_dim_ = cfg.qk_rope_head_dim;
    KESTREL_CHECK(rope_dim_ > 0 && rope_dim_ % 2 == 0 && rope_dim_ <= dim_ && rope_dim_ <= cuda::kMaxRopeDim,
                  "DSA indexer: RoPE over {} of the head's {} values (it needs an even count up to the head dimension)",
                  rope_dim_, dim_);
    const std::vector<float> inv_freq =
        cpu::rope_inv_freq(rope_dim_, cfg.rope_theta, cfg.yarn ? &*cfg.yarn : nullptr);
    float* d = arena.take_n<float>(inv_freq.size(), "DSA indexer RoPE frequencies");
    KESTREL_CUDA_CHECK(cudaMemcpy(d, inv_freq.data(), inv_freq.size() * sizeof(float), cudaMemcpyHostToDevice));
    inv_freq_ = d;
  }
  weight_bytes_ = arena.used() - before;
}

void DsaIndexerGpu::write_keys(const float* x, int64_t N, const int64_t* slots, const int32_t* positions,
                               const cuda::Pages& key_pages, cudaStream_t s) {
  const DsaIndexerWorkspace& ws = *ws_;
  KESTREL_CHECK(N >= 0 && N <= ws.max_tokens, "DSA indexer: {} tokens, the workspace holds {}", N, ws.max_tokens);
  if (N == 0) return;
  cuda::linear_f32(x, N, hidden_, wk_, dim_, ws.keys, s);
  cuda::layer_norm_f32(ws.keys, k_norm_w_, k_norm_b_, N, dim_, kIndexKeyNormEps, ws.keys, s);
  if (rope_dim_)
    cuda::rope_rows(ws.keys, N, dim_, 1, dim_, rope_dim_, cuda::RopeStyle::neox, positions, inv_freq_, s);
  if (keys_ == IndexKeyDtype::mxfp4)
    cuda::index_key_write_mxfp4(ws.keys, N, dim_, slots, key_pages, s);
  else if (dim_ == kFastDim)
    cuda::index_key_write(ws.keys, cuda::KeyDtype::f32, static_cast<int>(N), /*hadamard=*/true, slots, key_pages, s);
  else
    cuda::index_key_write_generic(ws.keys, N, dim_, slots, key_pages, s);
}

void DsaIndexerGpu::select(const float* x, const float* qr, int64_t N, const int32_t* positions,
                           std::span<const IndexerRequest> requests, const int32_t* ctx_lens, const cuda::Pages& key_pages, const cuda::BlockTable& block_table,
                           int32_t* indices, cudaStream_t s, bool graph_safe) {
  const DsaIndexerWorkspace& ws = *ws_;
  KESTREL_CHECK(N >= 0 && N <= ws.max_tokens, "DSA indexer: {} tokens, the workspace holds {}", N, ws.max_tokens);
  int64_t next = 0;
  for (const IndexerRequest& r : requests) {
    KESTREL_CHECK(r.first_token == next, "DSA indexer: a request starts at token {}, expected {} (back to back)",
                  r.first_token, next);
    KESTREL_CHECK(r.tokens >= 1 && r.tokens <= r.ctx_len && r.ctx_len <= ws.max_model_len && r.req >= 0,
                  "DSA indexer: a request of {} tokens in a context of {} (request index {}, at most {} positions)",
                  r.tokens, r.ctx_len, r.req, ws.max_model_len);
    next += r.tokens;
  }
  KESTREL_CHECK(next == N, "DSA indexer: the requests cover {} tokens of a step of {}", next, N);
  if (N == 0) return;

  cuda::linear_f32(qr, N, q_in_, wq_b_, int64_t{heads_} * dim_, ws.q, s);
  if (rope_dim_)
    cuda::rope_rows(ws.q, N, int64_t{heads_} * dim_, heads_, dim_, rope_dim_, cuda::RopeStyle::neox, positions,
                    inv_freq_, s);
  cuda::linear_f32(x, N, hidden_, w_proj_, heads_, ws.raw_weights, s);
  cuda::index_query_prep(ws.q, ws.raw_weights, N, heads_, dim_, ws.codes, ws.weights, s);

  const int64_t chunk = std::min<int64_t>(ws.score_rows, kMaxRequestsPerLaunch);
  for (size_t a = 0; a < requests.size();) {
    const IndexerRequest& first = requests[a];
    if (first.tokens == 1) {
      // A decode batch: the following single-token requests with consecutive request indices.
      size_t b = a + 1;
      int64_t max_ctx = first.ctx_len;
      while (b < requests.size() && static_cast<int64_t>(b - a) < chunk && requests[b].tokens == 1 &&
             requests[b].req == requests[b - 1].req + 1) {
        max_ctx = std::max(max_ctx, requests[b].ctx_len);
        ++b;
      }
      if (graph_safe) max_ctx = ws.max_model_len;
      score_rows_of(first.first_token, static_cast<int>(b - a), 1, first.req, ctx_lens + first.req,
                    static_cast<int>(max_ctx), key_pages, block_table, indices, s);
      a = b;
      continue;
    }
    // A request of several tokens: its rows in chunks, each run as the last rows of a shorter context.
    for (int64_t r0 = 0; r0 < first.tokens; r0 += chunk) {
      const int64_t r1 = std::min(first.tokens, r0 + chunk), cut = first.tokens - r1;
      const int32_t* ctx = ctx_lens + first.req;
      if (cut > 0) {
        cuda::shift_ctx_lens(ctx, 1, static_cast<int32_t>(cut), ws.ctx, s);
        ctx = ws.ctx;
      }
      score_rows_of(first.first_token + r0, 1, static_cast<int>(r1 - r0), first.req, ctx,
                    static_cast<int>(first.ctx_len - cut), key_pages, block_table, indices, s);
    }
    ++a;
  }
}

void DsaIndexerGpu::score_rows_of(int64_t t0, int batch, int n_q, int32_t req0, const int32_t* ctx_lens, int max_ctx,
                                  const cuda::Pages& key_pages, const cuda::BlockTable& block_table,
                                  int32_t* indices, cudaStream_t s) {
  const DsaIndexerWorkspace& ws = *ws_;
  cuda::IndexQueries q;
  q.codes = ws.codes + t0 * heads_ * dim_;
  q.weights = ws.weights + t0 * heads_;
  q.batch = batch;
  q.n_q = n_q;
  q.heads = heads_;
  const cuda::BlockTable table{block_table.pages + int64_t{req0} * block_table.stride, block_table.stride};
  if (fast_scores(heads_, dim_, keys_))
    cuda::index_scores_decode(q, key_pages, table, ctx_lens, max_ctx, cuda::IndexScoreMode::exact, ws.scores,
                              ws.max_model_len, s);
  else
    cuda::index_scores_generic(q, dim_, key_pages, table, ctx_lens, max_ctx, ws.scores, ws.max_model_len, s,
                               keys_ == IndexKeyDtype::mxfp4 ? cuda::IndexKeyFormat::mxfp4 : cuda::IndexKeyFormat::fp8);
  // Every position below max_ctx that a row can select has been scored; a top-k planned for the longest context
  // reads no more than that (its candidates end at each row's own position).
  int topk_ctx = max_ctx;
  if (cuda::topk_decode_workspace_bytes(batch, n_q, topk_ctx, top_k_) > ws.topk_bytes)
    topk_ctx = static_cast<int>(ws.max_model_len);
  cuda::topk_decode(ws.scores, ws.max_model_len, batch, n_q, ctx_lens, topk_ctx, top_k_, indices + t0 * top_k_, ws.topk,
                    ws.topk_bytes, s);
}

}  // namespace kestrel::gpu
