// One dense MLA decode layer step on the GPU (mla_decode over the FP8 and the bf16 latent) at long context, against
// the roofline of shared/bench/BENCHMARKING.md, and in the same run one DSA decode layer step at the same shapes
// (index scores, exact and FP8 mode, + top-2048 + sparse MLA: the kernels of dsa.h, called as
// bench/gpu/dsa_decode_bench.cpp calls them), for issue 7's ratio of a DSA step to a dense step. Writes markdown
// tables.
//
// Usage: mla_decode_bench             the tables
//        mla_decode_bench --latents   the dense decode over the FP8 and the bf16 latent side by side at L = 8K, 32K,
//                                     128K, B = 1, 32, 64, H = 128 and 32
//        mla_decode_bench --profile   one dense launch per latent format at B = 32, L = 128K, H = 128, then one at
//                                     B = 1 (FP8), for ncu
// Inputs are random (quantised Gaussian latents, index keys and queries; never zeros); each request's pages are
// scattered over one pool, and every timed iteration uses another set of requests' pages (sets until they are
// several times the 60 MB L2), so the timings read the cache from memory.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/formats.h"
#include "kernels/cuda/dsa.h"
#include "kernels/cuda/mla_decode.h"
#include "kernels/cuda/runtime.h"
#include "event_timing.h"

namespace {

using kestrel::bench::median_us;

using kestrel::cuda::BlockTable;
using kestrel::cuda::DeviceBuffer;
using kestrel::cuda::LatentDtype;
using kestrel::cuda::Pages;
using kestrel::cuda::kIndexKeyBytes;
using kestrel::cuda::kLatentDim;
using kestrel::cuda::kLatentValueDim;

constexpr int kPage = 64;
constexpr int kTopk = 2048;
constexpr int kMaxBatch = 64;
constexpr int kMaxCtx = 131072;
constexpr double kBw = 4.27e12;        // device-to-device copy, bytes read + written (BENCHMARKING.md)
constexpr double kBf16Flops = 790e12;  // bf16 GEMM 8192^3 through cuBLAS (BENCHMARKING.md); f16 runs at the same rate
constexpr float kKvScale = 4.0f / 448.0f;
constexpr float kSoftmaxScale = 0.1352338f;
constexpr int kIters = 20, kWarm = 3;


// Fills `bytes` of dst with copies of a random host block.
void fill(uint8_t* dst, int64_t bytes, const std::vector<uint8_t>& block) {
  DeviceBuffer<uint8_t> src(block.size());
  src.upload(block.data());
  const int64_t n = static_cast<int64_t>(block.size());
  for (int64_t p = 0; p < bytes; p += n)
    KESTREL_CUDA_CHECK(cudaMemcpy(dst + p, src.get(), std::min(n, bytes - p), cudaMemcpyDeviceToDevice));
}

std::vector<uint8_t> latent_block(std::mt19937& rng, LatentDtype dtype) {
  const int rows = 256 * kPage;
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<uint8_t> b(static_cast<size_t>(rows) * kestrel::cuda::latent_row_bytes(dtype));
  if (dtype == LatentDtype::fp8_e4m3) {
    for (uint8_t& c : b) c = kestrel::f32_to_e4m3(n(rng) / kKvScale);
  } else {
    for (size_t i = 0; i < b.size(); i += 2) {
      const uint16_t v = kestrel::f32_to_bf16(n(rng));
      std::memcpy(&b[i], &v, 2);
    }
  }
  return b;
}

std::vector<uint8_t> index_key_block(std::mt19937& rng) {
  const int pages = 512;
  std::vector<uint8_t> b(static_cast<size_t>(pages) * kPage * kIndexKeyBytes);
  std::normal_distribution<float> n(0.0f, 1.0f);
  float x[kestrel::cuda::kIndexHeadDim];
  for (int p = 0; p < pages; ++p) {
    uint8_t* page = b.data() + static_cast<size_t>(p) * kPage * kIndexKeyBytes;
    for (int r = 0; r < kPage; ++r) {
      for (float& v : x) v = n(rng);
      const float s = kestrel::quantize_fp8_ue8m0(x, kestrel::cuda::kIndexHeadDim, page + r * 128);
      std::memcpy(page + kPage * 128 + 4 * r, &s, 4);
    }
  }
  return b;
}

// The page pools: one latent pool (sized for B = 64 at 128K in bf16; in FP8 its first half holds as many pages) and
// one index-key pool with the same page numbers, and a shuffled order of all pages from which each shape takes its
// sets.
struct Pools {
  int64_t pages = int64_t{kMaxBatch} * kMaxCtx / kPage;
  int64_t latent_page_bytes = int64_t{kPage} * 2 * kLatentDim;  // bf16; an FP8 page is half that
  DeviceBuffer<uint8_t> latent{static_cast<size_t>(pages * latent_page_bytes)};
  DeviceBuffer<uint8_t> index_keys{static_cast<size_t>(pages * kPage * kIndexKeyBytes)};
  std::vector<int32_t> order;
  LatentDtype filled = LatentDtype::fp8_e4m3;
  std::mt19937 rng{12345};

  Pools() {
    fill(latent.get(), static_cast<int64_t>(latent.size()), latent_block(rng, LatentDtype::fp8_e4m3));
    fill(index_keys.get(), static_cast<int64_t>(index_keys.size()), index_key_block(rng));
    order.resize(static_cast<size_t>(pages));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
  }
  void fill_latent(LatentDtype dtype) {
    if (dtype == filled) return;
    fill(latent.get(), static_cast<int64_t>(latent.size()), latent_block(rng, dtype));
    filled = dtype;
  }
};

// One shape's sets of page tables (set s: requests' pages order[(s * B + b) * ppr + j], among the first `usable`
// pool pages) and its context lengths.
struct Shape {
  int B, L, ppr, sets;
  std::vector<DeviceBuffer<int32_t>> tables;
  DeviceBuffer<int32_t> ctx;

  Shape(const Pools& pools, int B_, int L_, int64_t usable_pages, double bytes_per_token)
      : B(B_), L(L_), ppr(L_ / kPage), ctx(static_cast<size_t>(B_)) {
    const int64_t set_pages = int64_t{B} * ppr;
    const int wanted = std::max(2, static_cast<int>(std::ceil(600e6 / (bytes_per_token * B * L))));
    sets = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, usable_pages / set_pages)));
    std::vector<int32_t> usable;
    for (int32_t p : pools.order)
      if (p < usable_pages) usable.push_back(p);
    for (int s = 0; s < sets; ++s) {
      std::vector<int32_t> t(usable.begin() + s * set_pages, usable.begin() + (s + 1) * set_pages);
      tables.emplace_back(t.size());
      tables.back().upload(t.data());
    }
    const std::vector<int32_t> lens(static_cast<size_t>(B), L);
    ctx.upload(lens.data());
  }
  BlockTable table(int i) const { return {tables[static_cast<size_t>(i % sets)].get(), ppr}; }
};

std::vector<uint16_t> random_bf16(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (uint16_t& e : v) e = kestrel::f32_to_bf16(d(rng));
  return v;
}

// The dense step: mla_decode of B requests, H heads, one query token, over the pool's latent in `dtype`.
struct Dense {
  const Pools& pools;
  const Shape& shape;
  LatentDtype dtype;
  int H;
  DeviceBuffer<uint16_t> q;
  DeviceBuffer<float> out, lse;
  size_t ws_bytes;
  DeviceBuffer<uint8_t> ws;

  Dense(Pools& pools_, const Shape& shape_, LatentDtype dtype_, int H_, std::mt19937& rng)
      : pools(pools_), shape(shape_), dtype(dtype_), H(H_),
        q(static_cast<size_t>(shape_.B) * H_ * kLatentDim),
        out(static_cast<size_t>(shape_.B) * H_ * kLatentValueDim), lse(static_cast<size_t>(shape_.B) * H_),
        ws_bytes(kestrel::cuda::mla_decode_workspace_bytes(shape_.B, 1, H_, shape_.L)), ws(ws_bytes) {
    const std::vector<uint16_t> qh = random_bf16(rng, q.size());
    q.upload(qh.data());
  }
  void operator()(int i) const {
    kestrel::cuda::MlaDecodeArgs a;
    a.q_abs = q.get();
    a.batch = shape.B;
    a.heads = H;
    a.ctx_lens = shape.ctx.get();
    a.max_ctx_len = shape.L;
    a.latent_dtype = dtype;
    const int64_t page_bytes = int64_t{kPage} * kestrel::cuda::latent_row_bytes(dtype);
    a.latent_pages = {pools.latent.get(), page_bytes, kPage};
    a.block_table = shape.table(i);
    a.kv_scale = dtype == LatentDtype::fp8_e4m3 ? kKvScale : 1.0f;
    a.softmax_scale = kSoftmaxScale;
    a.out = out.get();
    a.lse = lse.get();
    kestrel::cuda::mla_decode(a, ws.get(), ws_bytes, nullptr);
  }
};

// The DSA step over the same FP8 latent: index scores (mode) + top-2048 + sparse MLA.
struct Dsa {
  const Pools& pools;
  const Shape& shape;
  int H, Hi;
  DeviceBuffer<uint8_t> q_codes;
  DeviceBuffer<float> weights, scores;
  DeviceBuffer<uint16_t> q_abs;
  DeviceBuffer<int32_t> idx;
  DeviceBuffer<float> out, lse;
  size_t topk_ws_bytes, mla_ws_bytes;
  DeviceBuffer<uint8_t> topk_ws, mla_ws;

  Dsa(const Pools& pools_, const Shape& shape_, int H_, int Hi_, std::mt19937& rng)
      : pools(pools_), shape(shape_), H(H_), Hi(Hi_), q_codes(static_cast<size_t>(shape_.B) * Hi_ * 128),
        weights(static_cast<size_t>(shape_.B) * Hi_), scores(static_cast<size_t>(shape_.B) * shape_.L),
        q_abs(static_cast<size_t>(shape_.B) * H_ * kLatentDim), idx(static_cast<size_t>(shape_.B) * kTopk),
        out(static_cast<size_t>(shape_.B) * H_ * kLatentValueDim), lse(static_cast<size_t>(shape_.B) * H_),
        topk_ws_bytes(kestrel::cuda::topk_decode_workspace_bytes(shape_.B, 1, shape_.L, kTopk)),
        mla_ws_bytes(kestrel::cuda::sparse_mla_decode_workspace_bytes(shape_.B, 1, H_, kTopk)),
        topk_ws(topk_ws_bytes), mla_ws(mla_ws_bytes) {
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::vector<uint8_t> qc(q_codes.size());
    std::vector<float> x(128), w(weights.size());
    for (int64_t v = 0; v < int64_t{shape.B} * Hi; ++v) {
      for (float& e : x) e = n(rng);
      kestrel::quantize_fp8_ue8m0(x.data(), 128, qc.data() + v * 128);
      w[static_cast<size_t>(v)] = n(rng) * 0.01f;
    }
    q_codes.upload(qc.data());
    weights.upload(w.data());
    const std::vector<uint16_t> qa = random_bf16(rng, q_abs.size());
    q_abs.upload(qa.data());
    KESTREL_CUDA_CHECK(cudaMemset(topk_ws.get(), 0, topk_ws_bytes));
  }
  void operator()(int i, kestrel::cuda::IndexScoreMode mode) const {
    const kestrel::cuda::IndexQueries queries{q_codes.get(), weights.get(), shape.B, 1, Hi};
    kestrel::cuda::index_scores_decode(queries, Pages{pools.index_keys.get(), int64_t{kPage} * kIndexKeyBytes, kPage},
                                       shape.table(i), shape.ctx.get(), shape.L, mode, scores.get(), shape.L, nullptr);
    kestrel::cuda::topk_decode(scores.get(), shape.L, shape.B, 1, shape.ctx.get(), shape.L, kTopk, idx.get(),
                               topk_ws.get(), topk_ws_bytes, nullptr);
    kestrel::cuda::SparseMlaDecodeArgs a;
    a.q_abs = q_abs.get();
    a.batch = shape.B;
    a.heads = H;
    a.indices = idx.get();
    a.k = kTopk;
    a.ctx_lens = shape.ctx.get();
    a.latent_pages = Pages{pools.latent.get(), int64_t{kPage} * kLatentDim, kPage};
    a.block_table = shape.table(i);
    a.kv_scale = kKvScale;
    a.softmax_scale = kSoftmaxScale;
    a.out = out.get();
    a.lse = lse.get();
    kestrel::cuda::sparse_mla_decode(a, mla_ws.get(), mla_ws_bytes, nullptr);
  }
};

double copy_bandwidth(Pools& pools) {
  const size_t half = size_t{1} << 30;
  const double us = median_us(10, 2, [&](int) {
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(pools.latent.get() + half, pools.latent.get(), half, cudaMemcpyDeviceToDevice));
  });
  return 2.0 * static_cast<double>(half) / (us * 1e-6);
}

// FlashMLA's dense bf16 decode on the same H200 (BENCHMARKING.md, quoted, not re-measured), h = 128.
double flashmla_dense_bf16_us(int B, int L, int H) {
  if (H != 128) return 0;
  if (B == 1 && L == 131072) return 83.7;
  if (B == 32 && L == 32768) return 505;
  if (B == 32 && L == 131072) return 1967;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool profile = argc > 1 && std::strcmp(argv[1], "--profile") == 0;
  if (kestrel::cuda::device_count() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  KESTREL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, %.0f MB L2; one query token, 64-token pages, top-%d for DSA\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize / 1e6, kTopk);
  Pools pools;
  std::mt19937 rng(777);
  const int64_t fp8_pages = pools.pages, bf16_pages = pools.pages;

  if (profile) {
    const Shape s32(pools, 32, kMaxCtx, fp8_pages, kLatentDim);
    Dense(pools, s32, LatentDtype::fp8_e4m3, 128, rng)(0);
    const Shape s1(pools, 1, kMaxCtx, fp8_pages, kLatentDim);
    Dense(pools, s1, LatentDtype::fp8_e4m3, 128, rng)(0);
    pools.fill_latent(LatentDtype::bf16);
    const Shape s32b(pools, 32, kMaxCtx, bf16_pages, 2 * kLatentDim);
    Dense(pools, s32b, LatentDtype::bf16, 128, rng)(0);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    return 0;
  }
  const double bw = copy_bandwidth(pools);

  if (argc > 1 && std::strcmp(argv[1], "--latents") == 0) {
    // The same shapes over each latent format, FP8 first (the pool holds one format at a time).
    struct Row {
      int L, B, H;
    };
    std::vector<Row> rows;
    for (int L : {8192, 32768, 131072})
      for (int H : {128, 32})
        for (int B : {1, 32, 64}) rows.push_back({L, B, H});
    std::vector<double> fp8_us, bf16_us;
    for (const LatentDtype dtype : {LatentDtype::fp8_e4m3, LatentDtype::bf16}) {
      pools.fill_latent(dtype);
      const int row_bytes = kestrel::cuda::latent_row_bytes(dtype);
      for (const Row& r : rows) {
        const Shape shape(pools, r.B, r.L, dtype == LatentDtype::bf16 ? bf16_pages : fp8_pages, row_bytes);
        const Dense dense(pools, shape, dtype, r.H, rng);
        (dtype == LatentDtype::bf16 ? bf16_us : fp8_us).push_back(median_us(kIters, kWarm, [&](int i) { dense(i); }));
      }
    }
    std::printf(
        "\n### Dense MLA decode, FP8 (576 B per token) and bf16 (1152 B per token) latent\n\n"
        "| L | B | H | FP8 µs | FP8 TB/s | bf16 µs | bf16 TB/s | bf16 / FP8 time | compute floor µs | bf16 memory "
        "floor µs |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      const double tokens = static_cast<double>(r.B) * r.L;
      const double flops = 2.0 * (kLatentDim + kLatentValueDim) * r.H * tokens;
      std::printf("| %dK | %d | %d | %.1f | %.2f | %.1f | %.2f | %.2f | %.1f | %.1f |\n", r.L / 1024, r.B, r.H,
                  fp8_us[i], tokens * kLatentDim / (fp8_us[i] * 1e-6) / 1e12, bf16_us[i],
                  tokens * 2 * kLatentDim / (bf16_us[i] * 1e-6) / 1e12, bf16_us[i] / fp8_us[i],
                  flops / kBf16Flops * 1e6, tokens * 2 * kLatentDim / bw * 1e6);
    }
    std::printf("\ntimes: medians of %d after %d warm-ups (CUDA events); copy bandwidth measured in this run: %.2f "
                "TB/s; compute floor at %.0f TFLOP/s (2176 FLOP per head and token)\n",
                kIters, kWarm, bw / 1e12, kBf16Flops / 1e12);
    return 0;
  }

  // Dense over the FP8 latent, and the DSA step at the same shapes (H_I = 64 with 128 heads as DeepSeek-V3.2,
  // 32 with 96 heads as Kimi K3.1 Pro).
  struct Row {
    int L, B, H;
  };
  std::vector<Row> rows;
  for (int L : {32768, 131072})
    for (int H : {128, 96, 32})
      for (int B : {1, 32, 64}) rows.push_back({L, B, H});
  std::printf(
      "\n### Dense MLA decode, FP8 latent (576 B per token), and one DSA step at the same shape\n\n"
      "| L | B | H | dense µs | TB/s (576 B/token) | %% of copy BW | compute floor µs | roofline µs | %% of roofline "
      "| DSA step exact µs | DSA step FP8 µs | DSA/dense (exact) | DSA/dense (FP8 scores) | bytes DSA/dense |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    const Shape shape(pools, r.B, r.L, fp8_pages, kLatentDim + kIndexKeyBytes);
    const Dense dense(pools, shape, LatentDtype::fp8_e4m3, r.H, rng);
    const double t = median_us(kIters, kWarm, [&](int i) { dense(i); });
    const double bytes = static_cast<double>(r.B) * r.L * kLatentDim;
    const double flops = 2.0 * (kLatentDim + kLatentValueDim) * r.H * static_cast<double>(r.B) * r.L;
    const double mem_us = bytes / bw * 1e6, cmp_us = flops / kBf16Flops * 1e6, roof = std::max(mem_us, cmp_us);
    std::printf("| %dK | %d | %d | %.1f | %.2f | %.0f%% | %.1f | %.1f | %.0f%% |", r.L / 1024, r.B, r.H, t,
                bytes / (t * 1e-6) / 1e12, 100.0 * mem_us / t, cmp_us, roof, 100.0 * roof / t);
    if (r.H == 32) {
      std::printf(" | | | | |\n");
    } else {
      const Dsa dsa(pools, shape, r.H, r.H == 128 ? 64 : 32, rng);
      const double exact = median_us(kIters, kWarm, [&](int i) { dsa(i, kestrel::cuda::IndexScoreMode::exact); });
      const double fast = median_us(kIters, kWarm, [&](int i) { dsa(i, kestrel::cuda::IndexScoreMode::fast_fp8); });
      const double dsa_bytes = static_cast<double>(r.B) * (static_cast<double>(r.L) * kIndexKeyBytes + 2048.0 * kLatentDim);
      std::printf(" %.1f | %.1f | %.3f | %.3f | %.3f |\n", exact, fast, exact / t, fast / t, dsa_bytes / bytes);
    }
    std::fflush(stdout);
  }

  // Dense over the bf16 latent, with FlashMLA's dense bf16 decode where BENCHMARKING.md has it.
  pools.fill_latent(LatentDtype::bf16);
  std::printf(
      "\n### Dense MLA decode, bf16 latent (1152 B per token)\n\n"
      "| L | B | H | dense µs | TB/s (1152 B/token) | %% of copy BW | compute floor µs | roofline µs | %% of roofline "
      "| FlashMLA dense bf16 µs (quoted) | Kestrel / FlashMLA speed |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n");
  const Row bf16_rows[] = {{32768, 1, 128}, {32768, 32, 128}, {131072, 1, 128}, {131072, 32, 128}, {131072, 32, 32}};
  for (const Row& r : bf16_rows) {
    const Shape shape(pools, r.B, r.L, bf16_pages, 2 * kLatentDim);
    const Dense dense(pools, shape, LatentDtype::bf16, r.H, rng);
    const double t = median_us(kIters, kWarm, [&](int i) { dense(i); });
    const double bytes = static_cast<double>(r.B) * r.L * 2 * kLatentDim;
    const double flops = 2.0 * (kLatentDim + kLatentValueDim) * r.H * static_cast<double>(r.B) * r.L;
    const double mem_us = bytes / bw * 1e6, cmp_us = flops / kBf16Flops * 1e6, roof = std::max(mem_us, cmp_us);
    const double peer = flashmla_dense_bf16_us(r.B, r.L, r.H);
    std::printf("| %dK | %d | %d | %.1f | %.2f | %.0f%% | %.1f | %.1f | %.0f%% |", r.L / 1024, r.B, r.H, t,
                bytes / (t * 1e-6) / 1e12, 100.0 * mem_us / t, cmp_us, roof, 100.0 * roof / t);
    if (peer > 0) {
      std::printf(" %.1f | %.2f× |\n", peer, peer / t);
    } else {
      std::printf(" | |\n");
    }
    std::fflush(stdout);
  }
  std::printf("\ntimes: medians of %d after %d warm-ups (CUDA events); copy bandwidth measured in this run: %.2f TB/s "
              "(BENCHMARKING.md: %.2f); compute floor at %.0f TFLOP/s (2176 FLOP per head and token); roofline = "
              "max(bytes / copy BW, compute floor); bytes DSA/dense = (132 L + 576 * 2048) / (576 L)\n",
              kIters, kWarm, bw / 1e12, kBw / 1e12, kBf16Flops / 1e12);
  return 0;
}
