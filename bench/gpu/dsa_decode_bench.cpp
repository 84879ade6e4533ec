// One DSA decode layer step on the GPU (index-key scan + top-k + sparse MLA over the FP8 latent) at long context,
// timed stage by stage and whole, against the roofline of shared/bench/BENCHMARKING.md. Writes a markdown table.
//
// Usage: dsa_decode_bench [--v32] [context=131072]
//        dsa_decode_bench --profile [--batch B] [--v32] [context=131072]: one launch of each stage (B = 32 unless
//        given, H = 128, H_I = 64), for ncu (the sparse MLA on both of its kernels: wgmma, the engine's on an H200,
//        then mma.sync; then topk_decode_bounded's kernels)
//        dsa_decode_bench --latents [context ...]: the sparse MLA alone over each latent entry (Kimi's FP8 576 B,
//        deepseek_v32's FP8 656 B, bf16 1152 B) on both kernels, H = 128, top-2048, B = 1, 32, 64, at each context
//        (default 8K, 32K, 128K): one table to compare the bf16 latent with the FP8 ones
// --v32: the latent in deepseek_v32's 656-byte entry (SparseMlaEntry::v32_fp8: 4 tiles of 128 e4m3 codes with an
// fp32 scale each, 64 bf16 RoPE values) instead of Kimi's 576 bytes, for a like-for-like comparison with FlashMLA's
// sparse decode over the same layout.
// Bounded columns: topk_decode_bounded (dsa_candidates.h), the exact top-k from fast_fp8_mma scores and a per-key
// bound, timed alone (it replaces "scores exact" + "top-k") and as a step with the sparse MLA; on set 0 its output
// is compared position for position with the exact path's, with its mean candidates per row (cap 4 k), whether a
// row overflowed (then rescored over every key) and the rescored keys whose exact score left the bound.
// Inputs are random (quantised Gaussian keys, queries and latents, never zeros), the pages of each request are
// scattered over the pool, and every timed iteration uses another set of requests' caches (sets of caches until
// they are several times the 60 MB L2), so the timings read the caches from memory.
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
#include "kernels/cuda/dsa_candidates.h"
#include "kernels/cuda/runtime.h"
#include "dsa_bench_inputs.h"
#include "event_timing.h"

namespace {

using kestrel::bench::fill_pages;
using kestrel::bench::index_key_block;
using kestrel::bench::latent_block;
using kestrel::bench::latent_entry_bytes;
using kestrel::bench::median_us;
using kestrel::bench::v32_latent_block;
using kestrel::bench::bf16_latent_block;

using kestrel::cuda::BlockTable;
using kestrel::cuda::DeviceBuffer;
using kestrel::cuda::Pages;

constexpr int kPage = kestrel::bench::kDsaPage;
constexpr int kTopk = 2048;
constexpr double kBw = 4.27e12;       // device-to-device copy, bytes read + written (BENCHMARKING.md)
constexpr double kBf16Flops = 790e12;  // bf16 GEMM 8192^3 through cuBLAS (BENCHMARKING.md)


struct Result {
  double scores_exact, scores_mma, scores_fast, topk, mla, step_exact, step_fast, recall;
  double mla_mma;            // the sparse MLA on its mma.sync kernel (SparseMlaKernel::mma_sync), for comparison
  // topk_decode_bounded (dsa_candidates.h): the exact top-k from fast_fp8_mma scores, timed alone (it replaces
  // scores exact + top-k) and as a step with the sparse MLA; on set 0 its output against the exact path's, its
  // mean candidates per row, whether a row overflowed and its bound violations (rescored keys outside the bound).
  double bounded, step_bounded, bounded_candidates;
  bool bounded_equal, bounded_overflow;
  int64_t bounded_violations;
  double scores_fast_mma;    // IndexScoreMode::fast_fp8_mma: the previous fast kernel, for comparison
  bool exact_kernels_agree;  // exact and exact_mma wrote the same score bits on set 0
};

Result run(int B, int H, int Hi, int L, double* copy_bw, bool profile, bool v32) {
  std::mt19937 rng(12345);
  const int pages_per_req = L / kPage;
  // Sets of request caches rotated between iterations: at least ~600 MB of index keys + latents in all.
  const double set_bytes = static_cast<double>(B) * L * (kestrel::cuda::kIndexKeyBytes + latent_entry_bytes(v32));
  const int sets = std::max(2, static_cast<int>(std::ceil(600e6 / set_bytes)));
  const int64_t total_pages = int64_t{sets} * B * pages_per_req;
  const int64_t ik_page = int64_t{kPage} * kestrel::cuda::kIndexKeyBytes, lat_page = int64_t{kPage} * latent_entry_bytes(v32);
  DeviceBuffer<uint8_t> ik_pool(total_pages * ik_page), lat_pool(total_pages * lat_page);
  const float kv_scale = 4.0f / 448.0f;
  fill_pages(ik_pool.get(), total_pages, ik_page, index_key_block(rng, 512));
  fill_pages(lat_pool.get(), total_pages, lat_page, v32 ? v32_latent_block(rng, 256) : latent_block(rng, 256, kv_scale));

  // Scattered pages: one shuffled permutation of the pool, cut into per-request tables, one table per set.
  std::vector<int32_t> perm(static_cast<size_t>(total_pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<DeviceBuffer<int32_t>> tables;
  for (int s = 0; s < sets; ++s) {
    std::vector<int32_t> t(perm.begin() + int64_t{s} * B * pages_per_req, perm.begin() + int64_t{s + 1} * B * pages_per_req);
    tables.emplace_back(t.size());
    tables.back().upload(t.data());
  }
  std::vector<int32_t> ctx(B, L);
  DeviceBuffer<int32_t> ctx_d(B);
  ctx_d.upload(ctx.data());

  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<uint8_t> qc(static_cast<size_t>(B) * Hi * 128);
  std::vector<float> x(128), w(static_cast<size_t>(B) * Hi);
  for (int64_t v = 0; v < int64_t{B} * Hi; ++v) {
    for (float& e : x) e = n(rng);
    kestrel::quantize_fp8_ue8m0(x.data(), 128, qc.data() + v * 128);
    w[v] = n(rng) * 0.01f;
  }
  DeviceBuffer<uint8_t> qc_d(qc.size());
  qc_d.upload(qc.data());
  DeviceBuffer<float> w_d(w.size());
  w_d.upload(w.data());
  std::vector<uint16_t> q_abs(static_cast<size_t>(B) * H * kestrel::cuda::kLatentDim);
  for (uint16_t& e : q_abs) e = kestrel::f32_to_bf16(n(rng));
  DeviceBuffer<uint16_t> q_abs_d(q_abs.size());
  q_abs_d.upload(q_abs.data());

  DeviceBuffer<float> scores(static_cast<size_t>(B) * L);
  DeviceBuffer<int32_t> idx_exact(static_cast<size_t>(B) * kTopk), idx_fast(static_cast<size_t>(B) * kTopk);
  DeviceBuffer<float> out(static_cast<size_t>(B) * H * kestrel::cuda::kLatentValueDim), lse(static_cast<size_t>(B) * H);
  const size_t ws_bytes = kestrel::cuda::sparse_mla_decode_workspace_bytes(B, 1, H, kTopk);
  DeviceBuffer<uint8_t> ws(ws_bytes);

  const kestrel::cuda::IndexQueries queries{qc_d.get(), w_d.get(), B, 1, Hi};
  auto pages_of = [&](const DeviceBuffer<uint8_t>& pool, int64_t page_bytes) { return Pages{pool.get(), page_bytes, kPage}; };
  auto table = [&](int i) { return BlockTable{tables[static_cast<size_t>(i % sets)].get(), pages_per_req}; };
  auto scores_step = [&](int i, kestrel::cuda::IndexScoreMode mode) {
    kestrel::cuda::index_scores_decode(queries, pages_of(ik_pool, ik_page), table(i), ctx_d.get(), L, mode,
                                       scores.get(), L, nullptr);
  };
  const size_t topk_ws_bytes = kestrel::cuda::topk_decode_workspace_bytes(B, 1, L, kTopk);
  DeviceBuffer<uint8_t> topk_ws(topk_ws_bytes);
  KESTREL_CUDA_CHECK(cudaMemset(topk_ws.get(), 0, topk_ws_bytes));
  auto topk_step = [&](int32_t* idx) {
    kestrel::cuda::topk_decode(scores.get(), L, B, 1, ctx_d.get(), L, kTopk, idx, topk_ws.get(), topk_ws_bytes, nullptr);
  };
  auto mla_step = [&](int i, const int32_t* idx,
                      kestrel::cuda::SparseMlaKernel kernel = kestrel::cuda::SparseMlaKernel::automatic) {
    kestrel::cuda::SparseMlaDecodeArgs a;
    a.q_abs = q_abs_d.get();
    a.batch = B;
    a.heads = H;
    a.indices = idx;
    a.k = kTopk;
    a.ctx_lens = ctx_d.get();
    a.latent_pages = pages_of(lat_pool, lat_page);
    a.entry = v32 ? kestrel::cuda::SparseMlaEntry::v32_fp8 : kestrel::cuda::SparseMlaEntry::kimi_fp8;
    a.block_table = table(i);
    a.kv_scale = kv_scale;
    a.softmax_scale = 0.1352338f;
    a.out = out.get();
    a.lse = lse.get();
    a.kernel = kernel;
    kestrel::cuda::sparse_mla_decode(a, ws.get(), ws_bytes, nullptr);
  };

  // topk_decode_bounded (compared with the exact path on set 0 below).
  const int cap = 4 * kTopk;
  const size_t bws_bytes = kestrel::cuda::topk_decode_bounded_workspace_bytes(B, 1, L, kTopk, cap);
  DeviceBuffer<uint8_t> bws(bws_bytes);
  const size_t btopk_bytes = kestrel::cuda::topk_decode_bounded_topk_bytes(B, 1, L, kTopk);
  DeviceBuffer<uint8_t> btopk(btopk_bytes);
  KESTREL_CUDA_CHECK(cudaMemset(btopk.get(), 0, btopk_bytes));
  DeviceBuffer<int32_t> idx_bounded(static_cast<size_t>(B) * kTopk), cand_counts(B), overflowed(1), violations(B);
  auto bounded_step = [&](int i, bool stats) {
    kestrel::cuda::BoundedTopkArgs a;
    a.queries = queries;
    a.index_pages = pages_of(ik_pool, ik_page);
    a.block_table = table(i);
    a.ctx_lens = ctx_d.get();
    a.max_ctx_len = L;
    a.k = kTopk;
    a.max_candidates = cap;
    a.out = idx_bounded.get();
    if (stats) {
      a.candidate_counts = cand_counts.get();
      a.overflowed = overflowed.get();
      a.bound_violations = violations.get();
    }
    a.topk_workspace = btopk.get();
    a.topk_workspace_bytes = btopk_bytes;
    kestrel::cuda::topk_decode_bounded(a, bws.get(), bws_bytes, nullptr);
  };
  if (profile) {
    scores_step(0, kestrel::cuda::IndexScoreMode::exact);
    topk_step(idx_exact.get());
    mla_step(0, idx_exact.get());
    mla_step(0, idx_exact.get(), kestrel::cuda::SparseMlaKernel::mma_sync);
    scores_step(0, kestrel::cuda::IndexScoreMode::fast_fp8);
    scores_step(0, kestrel::cuda::IndexScoreMode::exact_mma);
    bounded_step(0, false);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    return {};
  }

  // Recall of the fast mode's top-k against the exact one, on set 0.
  scores_step(0, kestrel::cuda::IndexScoreMode::exact);
  topk_step(idx_exact.get());
  scores_step(0, kestrel::cuda::IndexScoreMode::fast_fp8);
  topk_step(idx_fast.get());
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> ie(idx_exact.size()), ifast(idx_fast.size());
  idx_exact.download(ie.data());
  idx_fast.download(ifast.data());
  int64_t common = 0;
  for (int b = 0; b < B; ++b) {
    std::vector<int32_t> e(ie.begin() + int64_t{b} * kTopk, ie.begin() + int64_t{b + 1} * kTopk);
    std::vector<int32_t> f(ifast.begin() + int64_t{b} * kTopk, ifast.begin() + int64_t{b + 1} * kTopk), both;
    std::set_intersection(e.begin(), e.end(), f.begin(), f.end(), std::back_inserter(both));
    common += static_cast<int64_t>(both.size());
  }

  Result r{};
  r.recall = static_cast<double>(common) / (static_cast<double>(B) * kTopk);
  // The two exact kernels on the full-size set 0 (the tests compare each with the CPU on smaller shapes).
  std::vector<float> by_wgmma(static_cast<size_t>(B) * L), by_mma(by_wgmma.size());
  scores_step(0, kestrel::cuda::IndexScoreMode::exact);
  scores.download(by_wgmma.data());
  scores_step(0, kestrel::cuda::IndexScoreMode::exact_mma);
  scores.download(by_mma.data());
  r.exact_kernels_agree = std::memcmp(by_wgmma.data(), by_mma.data(), by_wgmma.size() * sizeof(float)) == 0;

  // The bounded exact top-k on set 0 against the exact path (idx_exact holds set 0's exact selection).
  scores_step(0, kestrel::cuda::IndexScoreMode::exact);
  topk_step(idx_exact.get());
  bounded_step(0, true);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  {
    std::vector<int32_t> exact_sel(idx_exact.size()), bounded_sel(idx_bounded.size()), counts(B), viol(B);
    int32_t over = 0;
    idx_exact.download(exact_sel.data());
    idx_bounded.download(bounded_sel.data());
    cand_counts.download(counts.data());
    violations.download(viol.data());
    overflowed.download(&over);
    r.bounded_equal = exact_sel == bounded_sel;
    r.bounded_overflow = over != 0;
    r.bounded_candidates = std::accumulate(counts.begin(), counts.end(), 0.0) / B;
    r.bounded_violations = std::accumulate(viol.begin(), viol.end(), int64_t{0});
  }
  const int iters = 20, warm = 3;
  // The sparse MLA alone reads only B * 2048 rows per launch (1.2 MB at B = 1): rotating the cache sets would leave
  // them in L2. Each of its timed launches reads a fresh random selection instead (sorted, distinct positions); the
  // mma.sync kernel's launches get selections of their own.
  std::vector<DeviceBuffer<int32_t>> fresh_idx;
  for (int it = 0; it < 2 * (iters + warm); ++it) {
    std::vector<int32_t> sel(static_cast<size_t>(B) * kTopk);
    std::vector<int32_t> all(static_cast<size_t>(L));
    std::iota(all.begin(), all.end(), 0);
    for (int b = 0; b < B; ++b) {
      for (int k = 0; k < kTopk; ++k) std::swap(all[k], all[k + rng() % (L - k)]);
      std::sort(all.begin(), all.begin() + kTopk);
      std::copy_n(all.begin(), kTopk, sel.begin() + int64_t{b} * kTopk);
    }
    fresh_idx.emplace_back(sel.size());
    fresh_idx.back().upload(sel.data());
  }
  r.scores_exact = median_us(iters, warm, [&](int i) { scores_step(i, kestrel::cuda::IndexScoreMode::exact); });
  r.scores_mma = median_us(iters, warm, [&](int i) { scores_step(i, kestrel::cuda::IndexScoreMode::exact_mma); });
  r.scores_fast = median_us(iters, warm, [&](int i) { scores_step(i, kestrel::cuda::IndexScoreMode::fast_fp8); });
  r.scores_fast_mma =
      median_us(iters, warm, [&](int i) { scores_step(i, kestrel::cuda::IndexScoreMode::fast_fp8_mma); });
  r.topk = median_us(iters, warm, [&](int) { topk_step(idx_exact.get()); });
  r.mla = median_us(iters, warm, [&](int i) { mla_step(i, fresh_idx[static_cast<size_t>(i % (iters + warm))].get()); });
  r.mla_mma = median_us(iters, warm, [&](int i) {
    mla_step(i, fresh_idx[static_cast<size_t>(iters + warm + i % (iters + warm))].get(),
             kestrel::cuda::SparseMlaKernel::mma_sync);
  });
  r.bounded = median_us(iters, warm, [&](int i) { bounded_step(i, false); });
  r.step_bounded = median_us(iters, warm, [&](int i) {
    bounded_step(i, false);
    mla_step(i, idx_bounded.get());
  });
  r.step_exact = median_us(iters, warm, [&](int i) {
    scores_step(i, kestrel::cuda::IndexScoreMode::exact);
    topk_step(idx_exact.get());
    mla_step(i, idx_exact.get());
  });
  r.step_fast = median_us(iters, warm, [&](int i) {
    scores_step(i, kestrel::cuda::IndexScoreMode::fast_fp8);
    topk_step(idx_fast.get());
    mla_step(i, idx_fast.get());
  });
  if (*copy_bw == 0) {
    // The copy ceiling in this run: bytes read + written over the time of a large device-to-device copy.
    const size_t half = static_cast<size_t>(std::min<int64_t>(total_pages * lat_page / 2, int64_t{1} << 30));
    const double us = median_us(10, 2, [&](int) {
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(lat_pool.get() + half, lat_pool.get(), half, cudaMemcpyDeviceToDevice));
    });
    *copy_bw = 2.0 * half / (us * 1e-6);
  }
  return r;
}

// --latents: the sparse MLA over each latent entry, B = 1, 32, 64, H = 128, at each context in `contexts`. One pool
// per entry, sized for B = 64 at the longest context and filled once; each (context, B) cuts sets of requests'
// pages from a shuffled order of it (sets until they hold 600 MB, or the whole pool), each timed launch takes the next
// set and a fresh random selection (sorted distinct positions), so the rows come from memory, not from L2.
int run_latents(const std::vector<int>& contexts, double copy_bw) {
  using kestrel::cuda::SparseMlaEntry;
  using kestrel::cuda::SparseMlaKernel;
  struct Entry {
    SparseMlaEntry entry;
    const char* name;
    int bytes;
  };
  const Entry entries[] = {{SparseMlaEntry::kimi_fp8, "Kimi FP8", kestrel::cuda::kLatentDim},
                           {SparseMlaEntry::v32_fp8, "deepseek_v32 FP8", kestrel::cuda::kV32LatentEntryBytes},
                           {SparseMlaEntry::bf16, "bf16", kestrel::cuda::kBf16LatentEntryBytes}};
  const int batches[] = {1, 32, 64};
  constexpr int H = 128, kMaxB = 64, iters = 20, warm = 3;
  const float kv_scale = 4.0f / 448.0f;
  const int max_l = *std::max_element(contexts.begin(), contexts.end());
  const int64_t pool_pages = int64_t{kMaxB} * max_l / kPage;
  std::mt19937 rng(4321);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<uint16_t> q(static_cast<size_t>(kMaxB) * H * kestrel::cuda::kLatentDim);
  for (uint16_t& e : q) e = kestrel::f32_to_bf16(n(rng));
  DeviceBuffer<uint16_t> q_d(q.size());
  q_d.upload(q.data());
  DeviceBuffer<float> out(static_cast<size_t>(kMaxB) * H * kestrel::cuda::kLatentValueDim), lse(static_cast<size_t>(kMaxB) * H);
  std::vector<int32_t> order(static_cast<size_t>(pool_pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);

  // us[entry][kernel][context][batch]
  std::vector<double> us(std::size(entries) * 2 * contexts.size() * std::size(batches));
  auto at = [&](size_t e, size_t kern, size_t l, size_t b) -> double& {
    return us[((e * 2 + kern) * contexts.size() + l) * std::size(batches) + b];
  };
  for (size_t e = 0; e < std::size(entries); ++e) {
    const Entry& en = entries[e];
    const int64_t page_bytes = int64_t{kPage} * en.bytes;
    DeviceBuffer<uint8_t> pool(static_cast<size_t>(pool_pages * page_bytes));
    fill_pages(pool.get(), pool_pages, page_bytes,
               en.entry == SparseMlaEntry::v32_fp8 ? v32_latent_block(rng, 256)
               : en.entry == SparseMlaEntry::bf16  ? bf16_latent_block(rng, 256)
                                                   : latent_block(rng, 256, kv_scale));
    for (size_t l = 0; l < contexts.size(); ++l) {
      const int L = contexts[l], ppr = L / kPage;
      for (size_t b = 0; b < std::size(batches); ++b) {
        const int B = batches[b];
        const int64_t set_pages = int64_t{B} * ppr;
        const int sets = static_cast<int>(std::clamp<int64_t>(
            static_cast<int64_t>(std::ceil(600e6 / (static_cast<double>(set_pages) * page_bytes))), 1,
            pool_pages / set_pages));
        std::vector<DeviceBuffer<int32_t>> tables;
        for (int set = 0; set < sets; ++set) {
          const std::vector<int32_t> t(order.begin() + set * set_pages, order.begin() + (set + 1) * set_pages);
          tables.emplace_back(t.size());
          tables.back().upload(t.data());
        }
        const std::vector<int32_t> lens(static_cast<size_t>(B), L);
        DeviceBuffer<int32_t> ctx(lens.size());
        ctx.upload(lens.data());
        std::vector<DeviceBuffer<int32_t>> fresh;
        std::vector<int32_t> all(static_cast<size_t>(L)), sel(static_cast<size_t>(B) * kTopk);
        std::iota(all.begin(), all.end(), 0);
        for (int it = 0; it < 2 * (iters + warm); ++it) {
          for (int r = 0; r < B; ++r) {
            for (int k = 0; k < kTopk; ++k) std::swap(all[k], all[k + rng() % (L - k)]);
            std::sort(all.begin(), all.begin() + kTopk);
            std::copy_n(all.begin(), kTopk, sel.begin() + int64_t{r} * kTopk);
          }
          fresh.emplace_back(sel.size());
          fresh.back().upload(sel.data());
        }
        const size_t ws_bytes = kestrel::cuda::sparse_mla_decode_workspace_bytes(B, 1, H, kTopk);
        DeviceBuffer<uint8_t> ws(ws_bytes);
        for (int kern = 0; kern < 2; ++kern) {
          at(e, kern, l, b) = median_us(iters, warm, [&](int i) {
            kestrel::cuda::SparseMlaDecodeArgs a;
            a.q_abs = q_d.get();
            a.batch = B;
            a.heads = H;
            a.indices = fresh[static_cast<size_t>(kern * (iters + warm) + i)].get();
            a.k = kTopk;
            a.ctx_lens = ctx.get();
            a.latent_pages = {pool.get(), page_bytes, kPage};
            a.entry = en.entry;
            a.block_table = {tables[static_cast<size_t>(i % sets)].get(), ppr};
            a.kv_scale = kv_scale;
            a.softmax_scale = 0.1352338f;
            a.out = out.get();
            a.lse = lse.get();
            a.kernel = kern == 0 ? SparseMlaKernel::automatic : SparseMlaKernel::mma_sync;
            kestrel::cuda::sparse_mla_decode(a, ws.get(), ws_bytes, nullptr);
          });
        }
      }
    }
  }
  std::printf("\n### Sparse MLA decode by latent entry (H = 128, top-%d, n_q 1; automatic = wgmma on an H200)\n\n"
              "| L | B | kernel |", kTopk);
  for (const Entry& en : entries) std::printf(" %s µs | %s TB/s |", en.name, en.name);
  std::printf(" bf16 / Kimi FP8 time | compute floor µs |\n|---|---|---|");
  for (size_t e = 0; e < std::size(entries); ++e) std::printf("---|---|");
  std::printf("---|---|\n");
  for (size_t l = 0; l < contexts.size(); ++l)
    for (size_t b = 0; b < std::size(batches); ++b)
      for (int kern = 0; kern < 2; ++kern) {
        const int B = batches[b];
        std::printf("| %dK | %d | %s |", contexts[l] / 1024, B, kern == 0 ? "automatic" : "mma.sync");
        for (size_t e = 0; e < std::size(entries); ++e) {
          const double t = at(e, kern, l, b);
          std::printf(" %.1f | %.2f |", t, static_cast<double>(B) * kTopk * entries[e].bytes / (t * 1e-6) / 1e12);
        }
        std::printf(" %.2f | %.1f |\n", at(2, kern, l, b) / at(0, kern, l, b),
                    static_cast<double>(B) * 2176.0 * H * kTopk / kBf16Flops * 1e6);
      }
  std::printf("\ntimes in microseconds, medians of %d after %d warm-ups; TB/s = B * %d * entry bytes / time (rows read "
              "once); copy bandwidth in this run %.2f TB/s; compute floor at %.0f TFLOP/s (2176 FLOP per head and "
              "selected row)\n",
              iters, warm, kTopk, copy_bw / 1e12, kBf16Flops / 1e12);
  return 0;
}

// The copy ceiling: bytes read + written over the time of a 1 GiB device-to-device copy.
double measure_copy_bw() {
  const size_t half = size_t{1} << 30;
  DeviceBuffer<uint8_t> buf(2 * half);
  const double us = median_us(10, 2, [&](int) {
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(buf.get() + half, buf.get(), half, cudaMemcpyDeviceToDevice));
  });
  return 2.0 * static_cast<double>(half) / (us * 1e-6);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--latents") == 0) {
    std::vector<int> contexts;
    for (int i = 2; i < argc; ++i) {
      const int L = std::atoi(argv[i]);
      if (L < kTopk || L % kPage != 0) {
        std::fprintf(stderr, "--latents: a context must be a multiple of %d and at least %d, got %s\n", kPage, kTopk,
                     argv[i]);
        return 2;
      }
      contexts.push_back(L);
    }
    if (contexts.empty()) contexts = {8192, 32768, 131072};
    if (kestrel::cuda::device_count() == 0) {
      std::fprintf(stderr, "no CUDA device\n");
      return 1;
    }
    cudaDeviceProp prop{};
    KESTREL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs, page %d\n", prop.name, prop.multiProcessorCount, kPage);
    return run_latents(contexts, measure_copy_bw());
  }
  bool profile = false, v32 = false;
  int L = 131072, profile_batch = 32;
  bool batch_given = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--profile") == 0) {
      profile = true;
    } else if (std::strcmp(argv[i], "--v32") == 0) {
      v32 = true;
    } else if (std::strcmp(argv[i], "--batch") == 0) {
      profile_batch = i + 1 < argc ? std::atoi(argv[++i]) : 0;
      batch_given = true;
      if (profile_batch < 1) {
        std::fprintf(stderr, "--batch needs a positive batch\n");
        return 2;
      }
    } else {
      L = std::atoi(argv[i]);
    }
  }
  if (batch_given && !profile) {
    std::fprintf(stderr, "--batch picks the profiled batch: it needs --profile\n");
    return 2;
  }
  if (kestrel::cuda::device_count() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  KESTREL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, context %d, top-%d, page %d, n_q 1, latent entry %d bytes (%s)\n", prop.name,
              prop.multiProcessorCount, L, kTopk, kPage, latent_entry_bytes(v32), v32 ? "deepseek_v32" : "Kimi");
  double copy_bw = 0;
  if (profile) {
    run(profile_batch, 128, 64, L, &copy_bw, true, v32);
    return 0;
  }
  struct Config {
    int B, H, Hi;
  };
  const Config configs[] = {{1, 128, 64}, {32, 128, 64}, {1, 96, 64}, {32, 96, 64}, {32, 128, 32}, {64, 128, 64}};
  std::printf(
      "\n| B | H | H_I | scores exact | scores exact_mma | exact = exact_mma | scores fp8 | scores fp8_mma | top-k | "
      "sparse MLA | "
      "step exact | step fp8 | roofline | roofline/step exact | roofline/step fp8 | fp8 top-k recall | "
      "fp8 scan TB/s | sparse MLA mma.sync | bounded top-k | step bounded | bounded = exact | candidates/row | "
      "overflow | violations |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Config& c : configs) {
    const Result r = run(c.B, c.H, c.Hi, L, &copy_bw, false, v32);
    // Roofline (BENCHMARKING.md): 132 L / BW + max(E K / BW, 2176 h K / F) per request, at the measured copy BW, with
    // E the latent entry's bytes (576; 656 with --v32).
    const double scan = static_cast<double>(c.B) * 132.0 * L / copy_bw;
    const double attn = std::max(static_cast<double>(c.B) * latent_entry_bytes(v32) * kTopk / copy_bw,
                                 static_cast<double>(c.B) * 2176.0 * c.H * kTopk / kBf16Flops);
    const double roof_us = (scan + attn) * 1e6;
    const double scan_tbs = static_cast<double>(c.B) * L * kestrel::cuda::kIndexKeyBytes / (r.scores_fast * 1e-6) / 1e12;
    std::printf(
        "| %d | %d | %d | %.1f | %.1f | %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f | %.4f | "
        "%.2f | %.1f | %.1f | %.1f | %s | %.0f | %s | %lld |\n",
        c.B, c.H, c.Hi, r.scores_exact, r.scores_mma, r.exact_kernels_agree ? "yes" : "NO", r.scores_fast,
        r.scores_fast_mma, r.topk, r.mla, r.step_exact, r.step_fast, roof_us, roof_us / r.step_exact, roof_us / r.step_fast, r.recall, scan_tbs,
        r.mla_mma, r.bounded, r.step_bounded, r.bounded_equal ? "yes" : "NO", r.bounded_candidates,
        r.bounded_overflow ? "yes" : "no", static_cast<long long>(r.bounded_violations));
    std::fflush(stdout);
  }
  std::printf("\ntimes in microseconds, medians of 20 after 3 warm-ups; copy bandwidth measured in this run: %.2f TB/s "
              "(BENCHMARKING.md: %.2f); bf16 rate for the compute term: %.0f TFLOP/s\n",
              copy_bw / 1e12, kBw / 1e12, kBf16Flops / 1e12);
  return 0;
}
