// The CUDA backend's MLA attention op: the new tokens' latent entries (and, with DSA, index keys) into their cache
// slots, the absorbed queries, the DSA selection, attention over the paged latent (the tensor-core kernels where they
// take the entry and shape, the generic fp32 kernel otherwise) and the un-absorption. The CPU's MlaCore computes the
// same function.
#include "core/error.h"
#include "gpu/cuda_state.h"
#include "kernels/cuda/dsa.h"
#include "kernels/cuda/fp4_cache.h"
#include "kernels/cuda/mla_decode.h"
#include "kernels/cuda/mla_glue.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"
#include "kernels/cuda/v32_glue.h"

namespace kestrel::gpu {

namespace {

constexpr int kFastLatentC = 512, kFastLatentR = 64;  // the tensor-core MLA kernels' latent
static_assert(cuda::v32_latent_entry_bytes(kFastLatentC, kFastLatentR) == cuda::kV32LatentEntryBytes,
              "the sparse MLA kernel's deepseek_v32 entry is the cache's");

cuda::LatentEntry latent_entry(const ModelConfig& cfg, LatentCacheDtype d) {
  switch (d) {
    case LatentCacheDtype::bf16: return cuda::LatentEntry::bf16;
    case LatentCacheDtype::nvfp4: return cuda::LatentEntry::nvfp4;
    case LatentCacheDtype::fp8: return cfg.arch == Arch::deepseek_v32 ? cuda::LatentEntry::v32_fp8 : cuda::LatentEntry::kimi_fp8;
    case LatentCacheDtype::auto_fp32: break;
  }
  fail("the GPU keeps the MLA latent in bf16, FP8 or NVFP4 (--kv-cache-dtype auto, bf16, fp8 or nvfp4), not fp32");
}

}  // namespace

Act CudaStep::mla_attention(MlaAttnW wh, int layer, Act x, Act qr, Act q, Act kv) {
  const ModelConfig& cfg = s_.cfg;
  const StepBatch& batch = *batch_;
  const StepTables& t = *t_;
  const Ordered& ord = t.ord;
  const CachePlan& plan = *batch.plan;
  StepScratch& s = s_.s;
  const cudaStream_t st = s_.stream;
  const DMla& m = s_.w.mla.at(wh.id);
  const size_t l = static_cast<size_t>(layer);
  const int64_t N = t.N, bt_stride = t.bt_stride;
  const int S = t.S;
  const int64_t H = cfg.num_attention_heads, C = cfg.kv_lora_rank, R = cfg.qk_rope_head_dim;
  const int64_t dn = cfg.qk_nope_head_dim, dv = cfg.v_head_dim, dq = cfg.qk_head_dim();
  const cuda::Pages pages{batch.pool + plan.page_offset[l], plan.row_bytes, plan.block_size};
  const cuda::BlockTable table{t.bt, static_cast<int>(bt_stride)};
  const cuda::LatentEntry entry = latent_entry(cfg, s_.opts.latent_cache);
  KESTREL_CHECK(q.cols == H * dq && q.cols == ld(q) && kv.cols == C + R,
                "the MLA op takes whole queries of {} columns and a latent of {}", H * dq, C + R);
  // kv_scale multiplies FP8 and NVFP4 codes; bf16 entries hold the values themselves.
  const float kv_scale = entry == cuda::LatentEntry::bf16 ? 1.0f : m.kv_scale;

  // The new tokens' latents first: a token attends to itself.
  const float* kvp = f32(kv);
  const int64_t ldkv = ld(kv);
  switch (entry) {
    case cuda::LatentEntry::v32_fp8:
      cuda::mla_latent_write_v32(kvp, ldkv, N, static_cast<int>(C), static_cast<int>(R), t.slots, pages, st);
      break;
    case cuda::LatentEntry::nvfp4:
      cuda::mla_latent_write_nvfp4(kvp, ldkv, N, static_cast<int>(C), static_cast<int>(R), m.kv_scale, t.slots, pages,
                                   st);
      break;
    case cuda::LatentEntry::bf16:
      cuda::mla_latent_write_bf16(kvp, ldkv, N, static_cast<int>(C), static_cast<int>(R), t.slots, pages, st);
      break;
    case cuda::LatentEntry::kimi_fp8:
      cuda::mla_latent_write_fp8(kvp, ldkv, N, static_cast<int>(C), static_cast<int>(R), m.kv_scale, t.slots, pages,
                                 st);
      break;
  }

  // Queries, absorbed per head: q_abs[t, h] = [W_UK,h^T q_nope ; q_pe] (q_nope in bf16, q_pe fp32).
  s_.gemm.batched(bf16(q), H * dq, dq, m.kv_b, C, (dn + dv) * C, /*transpose_w=*/false, s.q_abs, H * (C + R), C + R, N,
                  C, dn, H, st);
  if (R > 0)
    KESTREL_CUDA_CHECK(cudaMemcpy2DAsync(s.q_abs + C, (C + R) * sizeof(float), f32(q) + dn, dq * sizeof(float),
                                         R * sizeof(float), N * H, cudaMemcpyDeviceToDevice, st));

  const float scale = cfg.softmax_scale();
  DsaIndexerGpu* indexer = m.indexer.get();
  if (indexer) {
    // DSA: the new tokens' index keys, then every token's top-k positions.
    const int64_t latent_bytes = plan.latent_bytes[l];
    const cuda::Pages key_pages{batch.pool + plan.page_offset[l] + plan.block_size * latent_bytes, plan.row_bytes,
                                plan.block_size};
    const float* xp = f32(x);
    KESTREL_CHECK(x.cols == ld(x), "the DSA indexer takes the layer's whole normed input");
    indexer->write_keys(xp, N, t.slots, t.row_pos, key_pages, st);
    std::vector<IndexerRequest> reqs(S);
    for (int j = 0; j < S; ++j) {
      const SequenceStep& sq = batch.seqs[ord.seq[j]];
      reqs[j] = {ord.first[j], ord.first[j + 1] - ord.first[j], sq.start + static_cast<int64_t>(sq.ids.size()), j};
    }
    const float* qrp = qr.valid() ? f32(qr) : xp;
    indexer->select(xp, qrp, N, t.row_pos, reqs, t.ctx, key_pages, table, s.indices, st, t.graph);
  }
  const int k = s.index_topk;
  const bool fast_shape = C == kFastLatentC && R == kFastLatentR;
  // The dense tensor-core kernel reads Kimi's FP8 and the bf16 latent; the sparse one those and deepseek_v32's FP8.
  const bool fast_dense = fast_shape && (entry == cuda::LatentEntry::kimi_fp8 || entry == cuda::LatentEntry::bf16);
  const bool fast_sparse = fast_dense || (fast_shape && entry == cuda::LatentEntry::v32_fp8);
  if (indexer && fast_sparse) {
    // Sparse MLA over the selected positions: one launch for the single generated tokens, one per prompt.
    cuda::to_bf16(s.q_abs, N * H * (C + R), s.q_abs_bf, st);
    auto run = [&](int b0, int batch_n, int n_q) {
      const int64_t t0 = ord.first[b0];
      cuda::SparseMlaDecodeArgs a;
      a.q_abs = s.q_abs_bf + t0 * H * (C + R);
      a.batch = batch_n;
      a.n_q = n_q;
      a.heads = static_cast<int>(H);
      a.indices = s.indices + t0 * k;
      a.k = k;
      a.ctx_lens = t.ctx + b0;
      a.latent_pages = pages;
      a.entry = entry == cuda::LatentEntry::v32_fp8 ? cuda::SparseMlaEntry::v32_fp8
                : entry == cuda::LatentEntry::bf16  ? cuda::SparseMlaEntry::bf16
                                                    : cuda::SparseMlaEntry::kimi_fp8;
      a.block_table = {t.bt + b0 * bt_stride, static_cast<int>(bt_stride)};
      a.kv_scale = kv_scale;
      a.softmax_scale = scale;
      a.out = s.obar + t0 * H * C;
      a.lse = s.lse + t0 * H;
      cuda::sparse_mla_decode(a, s.sparse_ws, s.sparse_ws_bytes, st);
    };
    if (ord.decode > 0) run(0, ord.decode, 1);
    for (int j = ord.decode; j < S; ++j) run(j, 1, static_cast<int>(ord.first[j + 1] - ord.first[j]));
  } else if (indexer) {
    cuda::mla_attend_generic(s.q_abs, N, static_cast<int>(H), static_cast<int>(C), static_cast<int>(R), entry,
                             t.row_req, t.row_pos, pages, table, kv_scale, scale, s.indices, k, s.obar, s.lse, st);
  } else if (fast_dense) {
    // Tensor-core decode kernel: one launch for the single generated tokens, one per prompt (its tokens are the
    // causal queries of one request).
    cuda::to_bf16(s.q_abs, N * H * (C + R), s.q_abs_bf, st);
    const GpuLimits& lim = s_.limits;
    auto run = [&](int b0, int batch_n, int n_q, int max_ctx) {
      // The grid is sized for a power of two (or max_model_len): the shapes the workspace was sized for.
      int sized = 1;
      while (sized < max_ctx) sized *= 2;
      max_ctx = static_cast<int>(std::min<int64_t>(sized, lim.max_model_len));
      const int64_t t0 = ord.first[b0];
      cuda::MlaDecodeArgs a;
      a.q_abs = s.q_abs_bf + t0 * H * (C + R);
      a.batch = batch_n;
      a.n_q = n_q;
      a.heads = static_cast<int>(H);
      a.ctx_lens = t.ctx + b0;
      a.max_ctx_len = max_ctx;
      a.latent_dtype = entry == cuda::LatentEntry::bf16 ? cuda::LatentDtype::bf16 : cuda::LatentDtype::fp8_e4m3;
      a.latent_pages = pages;
      a.block_table = {t.bt + b0 * bt_stride, static_cast<int>(bt_stride)};
      a.kv_scale = kv_scale;
      a.softmax_scale = scale;
      a.out = s.obar + t0 * H * C;
      a.lse = s.lse + t0 * H;
      const size_t need = cuda::mla_decode_workspace_bytes(batch_n, n_q, a.heads, max_ctx);
      KESTREL_CHECK(need <= s.mla_ws_bytes, "the MLA decode of this step needs {} bytes of workspace, {} were set aside",
                    need, s.mla_ws_bytes);
      cuda::mla_decode(a, s.mla_ws, s.mla_ws_bytes, st);
    };
    auto ctx_of = [&](int j) {
      const SequenceStep& sq = batch.seqs[ord.seq[j]];
      return static_cast<int>(sq.start + static_cast<int64_t>(sq.ids.size()));
    };
    if (ord.decode > 0) {
      int max_ctx = 1;
      for (int j = 0; j < ord.decode; ++j) max_ctx = std::max(max_ctx, ctx_of(j));
      // Replayed for any context that fits the block table's width.
      if (t.graph) max_ctx = static_cast<int>(std::min<int64_t>(lim.max_model_len, bt_stride * plan.block_size));
      run(0, ord.decode, 1, max_ctx);
    }
    for (int j = ord.decode; j < S; ++j) run(j, 1, static_cast<int>(ord.first[j + 1] - ord.first[j]), ctx_of(j));
  } else {
    cuda::mla_attend_generic(s.q_abs, N, static_cast<int>(H), static_cast<int>(C), static_cast<int>(R), entry,
                             t.row_req, t.row_pos, pages, table, kv_scale, scale, nullptr, 0, s.obar, s.lse, st);
  }

  // Un-absorb per head: o[t, h] = W_UV,h obar[t, h] (obar in bf16).
  cuda::to_bf16(s.obar, N * H * C, s.obar_bf, st);
  const Act o = alloc(H * dv);
  s_.gemm.batched(s.obar_bf, H * C, C, m.kv_b + dn * C, C, (dn + dv) * C, /*transpose_w=*/true, bufs_.at(o.buf).f32,
                  H * dv, dv, N, dv, C, H, st);
  return o;
}

}  // namespace kestrel::gpu
