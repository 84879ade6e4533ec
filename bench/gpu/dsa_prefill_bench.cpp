// One DSA prompt chunk on the GPU: S query tokens appended to a cached prefix so that the context is L, each stage
// run as the engine runs it (src/gpu/dsa_indexer.cpp, src/gpu/gpu_model.cpp) and timed with CUDA events. Writes
// two markdown tables: the indexer (scores, top-k) and the sparse MLA.
//
// Usage: dsa_prefill_bench [--max-model-len N] [S ...]        (S defaults to 4096 and 1024)
//        dsa_prefill_bench --profile: one launch of each stage (S = 4096, L = 32K, H_I = 64, H = 128), for ncu
//
// The indexer as DsaIndexerGpu::select runs a prompt: the chunk's rows in pieces of score_rows = 256 MiB /
// (4 max_model_len) rows (max_model_len defaults to 131072: 512 rows), each piece scored by index_scores_decode
// (batch 1, n_q = its rows, the context cut to end at its last row) into full-length fp32 score rows of stride
// max_model_len, then topk_decode over those rows. "scores" and "top-k" are the sums of their launches over the
// pieces, timed in the same pass (an event between every launch); "indexer" is the whole pass. The sparse MLA is
// one sparse_mla_decode with batch 1 and n_q = S over the exact indexer's selection, as gpu_model.cpp launches a
// prompt.
//
// Score round trip: the scores are written to memory and read back by top-k, S L 4 bytes each way. "round trip"
// is the time of those bytes at the copy bandwidth measured in this run, and its share of the scores time says
// what fusing top-k into the scoring kernel (never writing the rows) could save at most.
//
// Rates count useful work only: the scores 2 * 128 * H_I per (query, causal candidate) pair (pairs = sum over rows
// of L - S + i + 1, DeepGEMM's fp8_mqa_logits convention in bench/gpu/peers_dsa.py), the sparse MLA 2 * H * (576 +
// 512) per selected row (FlashMLA's convention). The exact mode runs nine int8 tensor-core products per useful one.
// Rooflines (shared/bench/BENCHMARKING.md): the scores at the cuBLAS FP8 GEMM rate (1285 TFLOP/s) or their write at
// copy bandwidth, whichever is longer; the sparse MLA at the bf16 GEMM rate (790 TFLOP/s).
//
// Inputs are random (quantised Gaussian keys, queries and latents, never zeros), the pages are scattered over the
// pool, and timed runs alternate between two copies of the request's caches. A prompt chunk is compute-bound: the
// caches are not rotated past the L2 as in dsa_decode_bench (at L = 8K the keys of one request stay in L2 during
// a real prefill too). Each measurement takes a median of 3 to 20 runs, as many as fit in about half a second.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/formats.h"
#include "kernels/cuda/dsa.h"
#include "kernels/cuda/runtime.h"
#include "dsa_bench_inputs.h"
#include "event_timing.h"

namespace {

using kestrel::bench::fill_pages;
using kestrel::bench::index_key_block;
using kestrel::bench::kDsaPage;
using kestrel::bench::latent_block;
using kestrel::bench::latent_entry_bytes;
using kestrel::bench::median_us;
using kestrel::bench::v32_latent_block;

using kestrel::cuda::BlockTable;
using kestrel::cuda::DeviceBuffer;
using kestrel::cuda::Pages;

constexpr int kTopk = 2048;
constexpr int kMaxIndexHeads = 64, kMaxHeads = 128;
constexpr int kSets = 2;                          // copies of the request's caches, alternated between runs
constexpr size_t kScoreBudgetBytes = size_t{256} << 20;  // src/gpu/dsa_indexer.cpp: the score rows of one launch
constexpr double kBw = 4.27e12;                   // device-to-device copy, bytes read + written (BENCHMARKING.md)
constexpr double kBf16Flops = 790e12;             // bf16 GEMM 8192^3 through cuBLAS (BENCHMARKING.md)
constexpr double kFp8Flops = 1285e12;             // FP8 e4m3 GEMM 8192^3 through cuBLAS (BENCHMARKING.md)
constexpr double kTimedSeconds = 0.5;             // about this long per measurement
constexpr float kKvScale = 4.0f / 448.0f;
constexpr float kSoftmaxScale = 0.1352338f;

// Runs of a measurement: as many as fit in kTimedSeconds at `once_us` each, between 3 and 20.
int runs_for(double once_us) { return std::clamp(static_cast<int>(kTimedSeconds * 1e6 / std::max(once_us, 1.0)), 3, 20); }

// Queries and outputs of the largest chunk, shared by every context.
struct ChunkBuffers {
  DeviceBuffer<uint8_t> q_codes;  // [S, 64, 128] e4m3; H_I = 32 reads the first half of the buffer as [S, 32, 128]
  DeviceBuffer<float> q_weights;  // [S, 64]
  DeviceBuffer<uint16_t> q_abs;   // [S, 128, 576] bf16
  DeviceBuffer<float> out, lse;   // [S, 128, 512], [S, 128]
  DeviceBuffer<int32_t> idx_exact, idx_fast;  // [S, 2048]
};

ChunkBuffers make_chunk_buffers(int S, std::mt19937& rng) {
  ChunkBuffers b;
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<uint8_t> qc(static_cast<size_t>(S) * kMaxIndexHeads * 128);
  std::vector<float> x(128), w(static_cast<size_t>(S) * kMaxIndexHeads);
  for (size_t v = 0; v < w.size(); ++v) {
    for (float& e : x) e = n(rng);
    kestrel::quantize_fp8_ue8m0(x.data(), 128, qc.data() + v * 128);
    w[v] = n(rng) * 0.01f;
  }
  b.q_codes = kestrel::cuda::to_device(qc);
  b.q_weights = kestrel::cuda::to_device(w);
  // The absorbed queries (up to 600 MB): a 1M-value random block repeated.
  const size_t q_abs_n = static_cast<size_t>(S) * kMaxHeads * kestrel::cuda::kLatentDim;
  std::vector<uint16_t> block(std::min<size_t>(q_abs_n, size_t{1} << 20));
  for (uint16_t& e : block) e = kestrel::f32_to_bf16(n(rng));
  b.q_abs = DeviceBuffer<uint16_t>(q_abs_n);
  for (size_t off = 0; off < q_abs_n; off += block.size()) {
    const size_t count = std::min(block.size(), q_abs_n - off);
    KESTREL_CUDA_CHECK(cudaMemcpy(b.q_abs.get() + off, block.data(), count * 2, cudaMemcpyHostToDevice));
  }
  b.out = DeviceBuffer<float>(static_cast<size_t>(S) * kMaxHeads * kestrel::cuda::kLatentValueDim);
  b.lse = DeviceBuffer<float>(static_cast<size_t>(S) * kMaxHeads);
  b.idx_exact = DeviceBuffer<int32_t>(static_cast<size_t>(S) * kTopk);
  b.idx_fast = DeviceBuffer<int32_t>(static_cast<size_t>(S) * kTopk);
  return b;
}

// One request's caches at context L, kSets copies, each with its own scattered page table.
struct Caches {
  int pages_per_req = 0;
  DeviceBuffer<uint8_t> keys, kimi, v32;
  std::vector<DeviceBuffer<int32_t>> tables;
  BlockTable table(int i) const { return {tables[static_cast<size_t>(i % kSets)].get(), pages_per_req}; }
};

Caches make_caches(int L, std::mt19937& rng) {
  Caches c;
  c.pages_per_req = L / kDsaPage;
  const int64_t pages = int64_t{kSets} * c.pages_per_req;
  c.keys = DeviceBuffer<uint8_t>(static_cast<size_t>(pages) * kDsaPage * kestrel::cuda::kIndexKeyBytes);
  c.kimi = DeviceBuffer<uint8_t>(static_cast<size_t>(pages) * kDsaPage * latent_entry_bytes(false));
  c.v32 = DeviceBuffer<uint8_t>(static_cast<size_t>(pages) * kDsaPage * latent_entry_bytes(true));
  fill_pages(c.keys.get(), pages, int64_t{kDsaPage} * kestrel::cuda::kIndexKeyBytes, index_key_block(rng, 512));
  fill_pages(c.kimi.get(), pages, int64_t{kDsaPage} * latent_entry_bytes(false), latent_block(rng, 256, kKvScale));
  fill_pages(c.v32.get(), pages, int64_t{kDsaPage} * latent_entry_bytes(true), v32_latent_block(rng, 256));
  std::vector<int32_t> perm(static_cast<size_t>(pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int s = 0; s < kSets; ++s) {
    std::vector<int32_t> t(perm.begin() + int64_t{s} * c.pages_per_req, perm.begin() + int64_t{s + 1} * c.pages_per_req);
    c.tables.push_back(kestrel::cuda::to_device(t));
  }
  return c;
}

// A prompt chunk's rows in the engine's pieces: rows [r0, r0 + n_q) scored as the last rows of a context of ctx.
struct Piece {
  int r0, n_q, ctx;
};

struct IndexerTimes {
  double scores = 0, topk = 0, whole = 0;  // microseconds, medians
};

struct IndexerRow {
  int S, L, Hi, pieces;
  IndexerTimes exact, fast;
  double recall;
};

struct MlaRow {
  int S, L, H;
  bool v32;
  double us;
};

class Chunk {
 public:
  Chunk(int S, int L, int max_model_len, ChunkBuffers& buf, const Caches& caches)
      : S_(S), stride_(max_model_len), buf_(buf), caches_(caches) {
    const int score_rows = static_cast<int>(std::clamp<int64_t>(
        static_cast<int64_t>(kScoreBudgetBytes / (sizeof(float) * static_cast<size_t>(max_model_len))), 1, S));
    std::vector<int32_t> ctx;
    for (int r0 = 0; r0 < S; r0 += score_rows) {
      const int r1 = std::min(S, r0 + score_rows);
      pieces_.push_back({r0, r1 - r0, L - (S - r1)});
      ctx.push_back(L - (S - r1));
      topk_ws_bytes_ = std::max(topk_ws_bytes_, kestrel::cuda::topk_decode_workspace_bytes(1, r1 - r0, ctx.back(), kTopk));
    }
    ctx_ = kestrel::cuda::to_device(ctx);
    full_ctx_ = kestrel::cuda::to_device(std::vector<int32_t>{L});
    scores_ = DeviceBuffer<float>(static_cast<size_t>(score_rows) * max_model_len);
    topk_ws_ = DeviceBuffer<uint8_t>(topk_ws_bytes_);
    KESTREL_CUDA_CHECK(cudaMemset(topk_ws_.get(), 0, topk_ws_bytes_));  // topk_decode leaves it zero-filled again
    mla_ws_bytes_ = kestrel::cuda::sparse_mla_decode_workspace_bytes(1, S, kMaxHeads, kTopk);
    mla_ws_bytes_ = std::max(mla_ws_bytes_, kestrel::cuda::sparse_mla_decode_workspace_bytes(1, S, 96, kTopk));
    mla_ws_ = DeviceBuffer<uint8_t>(mla_ws_bytes_);
    for (int e = 0; e < 2 * static_cast<int>(pieces_.size()) + 1; ++e) {
      cudaEvent_t ev;
      KESTREL_CUDA_CHECK(cudaEventCreate(&ev));
      events_.push_back(ev);
    }
  }
  ~Chunk() {
    for (cudaEvent_t ev : events_) cudaEventDestroy(ev);
  }
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;

  int pieces() const { return static_cast<int>(pieces_.size()); }

  // One pass of the indexer over the chunk (set i % kSets), events around every launch when `timed`.
  void indexer(int i, int Hi, kestrel::cuda::IndexScoreMode mode, int32_t* idx, bool timed) {
    const Pages keys{caches_.keys.get(), int64_t{kDsaPage} * kestrel::cuda::kIndexKeyBytes, kDsaPage};
    if (timed) KESTREL_CUDA_CHECK(cudaEventRecord(events_[0]));
    for (size_t p = 0; p < pieces_.size(); ++p) {
      const Piece& pc = pieces_[p];
      const kestrel::cuda::IndexQueries q{buf_.q_codes.get() + int64_t{pc.r0} * Hi * 128,
                                          buf_.q_weights.get() + int64_t{pc.r0} * Hi, 1, pc.n_q, Hi};
      kestrel::cuda::index_scores_decode(q, keys, caches_.table(i), ctx_.get() + p, pc.ctx, mode, scores_.get(),
                                         stride_, nullptr);
      if (timed) KESTREL_CUDA_CHECK(cudaEventRecord(events_[2 * p + 1]));
      kestrel::cuda::topk_decode(scores_.get(), stride_, 1, pc.n_q, ctx_.get() + p, pc.ctx, kTopk,
                                 idx + int64_t{pc.r0} * kTopk, topk_ws_.get(), topk_ws_bytes_, nullptr);
      if (timed) KESTREL_CUDA_CHECK(cudaEventRecord(events_[2 * p + 2]));
    }
  }

  IndexerTimes time_indexer(int Hi, kestrel::cuda::IndexScoreMode mode, int32_t* idx) {
    indexer(0, Hi, mode, idx, false);
    const int iters = runs_for(time_once(Hi, mode, idx).whole);
    std::vector<double> scores, topk, whole;
    for (int it = 0; it < iters; ++it) {
      const IndexerTimes t = time_once(Hi, mode, idx, it + 1);
      scores.push_back(t.scores);
      topk.push_back(t.topk);
      whole.push_back(t.whole);
    }
    return {median(scores), median(topk), median(whole)};
  }

  void mla(int i, int H, bool v32) {
    const int E = latent_entry_bytes(v32);
    kestrel::cuda::SparseMlaDecodeArgs a;
    a.q_abs = buf_.q_abs.get();
    a.batch = 1;
    a.n_q = S_;
    a.heads = H;
    a.indices = buf_.idx_exact.get();
    a.k = kTopk;
    a.ctx_lens = full_ctx_.get();
    a.latent_pages = Pages{v32 ? caches_.v32.get() : caches_.kimi.get(), int64_t{kDsaPage} * E, kDsaPage};
    a.entry = v32 ? kestrel::cuda::SparseMlaEntry::v32_fp8 : kestrel::cuda::SparseMlaEntry::kimi_fp8;
    a.block_table = caches_.table(i);
    a.kv_scale = kKvScale;
    a.softmax_scale = kSoftmaxScale;
    a.out = buf_.out.get();
    a.lse = buf_.lse.get();
    kestrel::cuda::sparse_mla_decode(a, mla_ws_.get(), mla_ws_bytes_, nullptr);
  }

  double time_mla(int H, bool v32) {
    const double once = median_us(1, 1, [&](int i) { mla(i, H, v32); });
    return median_us(runs_for(once), 1, [&](int i) { mla(i, H, v32); });
  }

 private:
  IndexerTimes time_once(int Hi, kestrel::cuda::IndexScoreMode mode, int32_t* idx, int i = 0) {
    indexer(i, Hi, mode, idx, true);
    KESTREL_CUDA_CHECK(cudaEventSynchronize(events_.back()));
    IndexerTimes t;
    for (size_t e = 1; e < events_.size(); ++e) {
      float ms = 0;
      KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[e - 1], events_[e]));
      (e % 2 == 1 ? t.scores : t.topk) += ms * 1e3;
    }
    float ms = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, events_.front(), events_.back()));
    t.whole = ms * 1e3;
    return t;
  }

  static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  }

  int S_;
  int64_t stride_;
  ChunkBuffers& buf_;
  const Caches& caches_;
  std::vector<Piece> pieces_;
  DeviceBuffer<int32_t> ctx_, full_ctx_;
  DeviceBuffer<float> scores_;
  size_t topk_ws_bytes_ = 0, mla_ws_bytes_ = 0;
  DeviceBuffer<uint8_t> topk_ws_, mla_ws_;
  std::vector<cudaEvent_t> events_;
};

// Shared selections of the two index modes over the chunk's rows, over k per row.
double recall(const DeviceBuffer<int32_t>& exact, const DeviceBuffer<int32_t>& fast, int S) {
  std::vector<int32_t> ie(exact.size()), ifast(fast.size());
  exact.download(ie.data());
  fast.download(ifast.data());
  int64_t common = 0, selected = 0;
  std::vector<int32_t> both;
  for (int r = 0; r < S; ++r) {
    // Ascending positions, then -1 padding (none here: every row has at least 2048 candidates when L - S >= 2048).
    auto e0 = ie.begin() + int64_t{r} * kTopk, f0 = ifast.begin() + int64_t{r} * kTopk;
    auto e1 = std::find(e0, e0 + kTopk, -1), f1 = std::find(f0, f0 + kTopk, -1);
    both.clear();
    std::set_intersection(e0, e1, f0, f1, std::back_inserter(both));
    common += static_cast<int64_t>(both.size());
    selected += e1 - e0;
  }
  return selected ? static_cast<double>(common) / static_cast<double>(selected) : 1.0;
}

// Query-candidate pairs of the chunk (row i sees L - S + i + 1 positions) and the rows' selected positions.
double causal_pairs(int S, int L) { return static_cast<double>(S) * (L - S) + 0.5 * S * (S + 1.0); }
double selected_rows(int S, int L) {
  double n = 0;
  for (int i = 0; i < S; ++i) n += std::min(kTopk, L - S + i + 1);
  return n;
}

double measure_copy_bw() {
  const size_t half = size_t{512} << 20;
  DeviceBuffer<uint8_t> buf(2 * half);
  KESTREL_CUDA_CHECK(cudaMemset(buf.get(), 1, 2 * half));
  const double us = median_us(10, 2, [&](int) {
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(buf.get() + half, buf.get(), half, cudaMemcpyDeviceToDevice));
  });
  return 2.0 * half / (us * 1e-6);
}

}  // namespace

int main(int argc, char** argv) {
  bool profile = false;
  int max_model_len = 131072;
  std::vector<int> chunk_sizes;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--profile") == 0) {
      profile = true;
    } else if (std::strcmp(argv[i], "--max-model-len") == 0 && i + 1 < argc) {
      max_model_len = std::atoi(argv[++i]);
    } else {
      chunk_sizes.push_back(std::atoi(argv[i]));
    }
  }
  if (chunk_sizes.empty()) chunk_sizes = {4096, 1024};
  const int contexts[] = {8192, 32768, 131072};
  for (int S : chunk_sizes) {
    if (S < 1 || S > contexts[0] - kTopk) {
      std::fprintf(stderr, "chunk size %d: must be 1 .. %d\n", S, contexts[0] - kTopk);
      return 2;
    }
  }
  if (max_model_len < contexts[2]) {
    std::fprintf(stderr, "--max-model-len %d: must be at least %d\n", max_model_len, contexts[2]);
    return 2;
  }
  if (kestrel::cuda::device_count() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  KESTREL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::mt19937 rng(12345);

  if (profile) {
    ChunkBuffers buf = make_chunk_buffers(4096, rng);
    const Caches caches = make_caches(32768, rng);
    Chunk chunk(4096, 32768, max_model_len, buf, caches);
    chunk.indexer(0, 64, kestrel::cuda::IndexScoreMode::exact, buf.idx_exact.get(), false);
    chunk.indexer(0, 64, kestrel::cuda::IndexScoreMode::fast_fp8, buf.idx_fast.get(), false);
    chunk.mla(0, 128, false);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    return 0;
  }

  const double copy_bw = measure_copy_bw();
  std::printf("device: %s, %d SMs; one prompt chunk of S tokens at the end of a context of L (batch 1), top-%d, "
              "page %d, max_model_len %d (score pieces of %zu rows)\n",
              prop.name, prop.multiProcessorCount, kTopk, kDsaPage, max_model_len,
              kScoreBudgetBytes / (sizeof(float) * static_cast<size_t>(max_model_len)));
  std::vector<IndexerRow> irows;
  std::vector<MlaRow> mrows;
  const int max_S = *std::max_element(chunk_sizes.begin(), chunk_sizes.end());
  ChunkBuffers buf = make_chunk_buffers(max_S, rng);
  for (int L : contexts) {
    const Caches caches = make_caches(L, rng);
    for (int S : chunk_sizes) {
      Chunk chunk(S, L, max_model_len, buf, caches);
      for (int Hi : {32, 64}) {
        IndexerRow r{S, L, Hi, chunk.pieces(), {}, {}, 0};
        r.exact = chunk.time_indexer(Hi, kestrel::cuda::IndexScoreMode::exact, buf.idx_exact.get());
        r.fast = chunk.time_indexer(Hi, kestrel::cuda::IndexScoreMode::fast_fp8, buf.idx_fast.get());
        // The timed runs alternate between the cache sets and each mode ran its own number of them: select once
        // more on set 0 in both modes, so that the recall compares selections over the same keys.
        chunk.indexer(0, Hi, kestrel::cuda::IndexScoreMode::fast_fp8, buf.idx_fast.get(), false);
        chunk.indexer(0, Hi, kestrel::cuda::IndexScoreMode::exact, buf.idx_exact.get(), false);
        KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
        r.recall = recall(buf.idx_exact, buf.idx_fast, S);
        irows.push_back(r);
        std::fprintf(stderr, "indexer S=%d L=%d H_I=%d done\n", S, L, Hi);
      }
      // The sparse MLA reads the exact selection of H_I = 64, the last one made.
      for (bool v32 : {false, true})
        for (int H : {128, 96}) mrows.push_back({S, L, H, v32, chunk.time_mla(H, v32)});
      std::fprintf(stderr, "sparse MLA S=%d L=%d done\n", S, L);
    }
  }

  std::printf(
      "\n### Indexer (scores by index_scores_decode in the engine's pieces, then topk_decode)\n\n"
      "| S | L | H_I | pieces | scores exact | scores fp8 | top-k | indexer exact | indexer fp8 | exact TOPS | "
      "fp8 TOPS | scores roofline | score bytes w+r (MB) | round trip | round trip / scores exact | "
      "round trip / scores fp8 | fp8 top-k recall |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const IndexerRow& r : irows) {
    const double ops = 2.0 * causal_pairs(r.S, r.L) * r.Hi * kestrel::cuda::kIndexHeadDim;
    const double bytes = 2.0 * r.S * static_cast<double>(r.L) * 4;
    const double trip_us = bytes / copy_bw * 1e6;
    const double roof_us = std::max(ops / kFp8Flops, bytes / 2 / copy_bw) * 1e6;
    std::printf("| %d | %d | %d | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.3f | "
                "%.3f | %.4f |\n",
                r.S, r.L, r.Hi, r.pieces, r.exact.scores, r.fast.scores, r.exact.topk, r.exact.whole, r.fast.whole,
                ops / (r.exact.scores * 1e-6) / 1e12, ops / (r.fast.scores * 1e-6) / 1e12, roof_us, bytes / 1e6,
                trip_us, trip_us / r.exact.scores, trip_us / r.fast.scores, r.recall);
  }
  std::printf(
      "\n### Sparse MLA (sparse_mla_decode, batch 1, n_q = S, over the exact H_I = 64 selection)\n\n"
      "| S | L | H | entry | sparse MLA | TFLOP/s | roofline | roofline / sparse MLA |\n"
      "|---|---|---|---|---|---|---|---|\n");
  for (const MlaRow& r : mrows) {
    const double flops = 2.0 * r.H * selected_rows(r.S, r.L) * (kestrel::cuda::kLatentDim + kestrel::cuda::kLatentValueDim);
    const double roof_us = flops / kBf16Flops * 1e6;
    std::printf("| %d | %d | %d | %s | %.1f | %.1f | %.1f | %.2f |\n", r.S, r.L, r.H,
                r.v32 ? "v32 656 B" : "Kimi 576 B", r.us, flops / (r.us * 1e-6) / 1e12, roof_us, roof_us / r.us);
  }
  std::printf("\ntimes in microseconds, medians of 3-20 runs after a warm-up; copy bandwidth measured in this run: "
              "%.2f TB/s (BENCHMARKING.md: %.2f); TOPS count 2 * 128 * H_I per causal (query, key) pair; rooflines "
              "at %.0f (FP8) and %.0f (bf16) TFLOP/s\n",
              copy_bw / 1e12, kBw / 1e12, kFp8Flops / 1e12, kBf16Flops / 1e12);
  return 0;
}
