// GPU tests of the dense MLA decode kernel (src/kernels/cuda/mla_decode.h) against cpu::mla_attend_absorbed over
// the dequantised latent rows, within the bound stated in mla_decode.h: fresh random inputs per case, outputs
// poisoned before every launch, pages scattered over a pool with unowned pages and rows past each context holding
// NaN, contexts 1 .. 70000, one or two query tokens, both latent formats; and the shapes the engine launches
// (src/gpu/gpu_model.cpp): prompts as n_q causal queries of one request (a whole first chunk, a chunk after a prefix),
// decode batches of 32 and 64 requests of mixed lengths, max_ctx_len rounded up past every length (a power of two, or
// max_model_len for a replayed graph), over the bf16 entry as the engine caches it (mla_latent_write_bf16, no scale:
// kv_scale 1; its bytes checked against f32_to_bf16 first). Every launch is repeated and must give the same bits.
#include "kernels/cuda/mla_decode.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/mla_glue.h"
#include "kernels/cuda/runtime.h"
#include "cuda_test_util.h"

namespace kestrel::cuda {
namespace {

using namespace test_util;

constexpr int kC = kLatentValueDim;          // 512
constexpr int kR = kLatentDim - kLatentValueDim;  // 64

// Runs fn(0) .. fn(n - 1) on all cores.
template <typename F>
void parallel_for(int n, F&& fn) {
  std::atomic<int> next{0};
  const int workers = std::max(1u, std::min(std::thread::hardware_concurrency(), 32u));
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w)
    pool.emplace_back([&] {
      for (int j = next++; j < n; j = next++) fn(j);
    });
  for (std::thread& t : pool) t.join();
}

struct MlaCase {
  LatentDtype dtype;
  int heads;
  int n_q;
  int page_size;
  std::vector<int> ctx;
  float q_sigma;
  float kv_scale;
  bool wide_rows;   // query rows scaled by 1e-3, 1 or 3e5 (past f16's range: the per-row query scale must act)
  int max_ctx_len;  // 0: the longest context; else larger (the engine rounds it up, or passes max_model_len)
  bool written;     // bf16 only: the pages written on the GPU by mla_latent_write_bf16 (the engine's writer)
};

std::string case_name(const ::testing::TestParamInfo<MlaCase>& info) {
  const MlaCase& c = info.param;
  std::string s = c.dtype == LatentDtype::bf16 ? "bf16" : "fp8";
  s.append("_h").append(std::to_string(c.heads)).append("_nq").append(std::to_string(c.n_q));
  s.append("_page").append(std::to_string(c.page_size));
  if (c.ctx.size() <= 5) {
    s.append("_ctx");
    for (int x : c.ctx) s.append("_").append(std::to_string(x));
  } else {
    s.append("_b").append(std::to_string(c.ctx.size())).append("_ctxmax");
    s.append(std::to_string(*std::max_element(c.ctx.begin(), c.ctx.end())));
  }
  if (c.max_ctx_len > 0) s.append("_max").append(std::to_string(c.max_ctx_len));
  if (c.wide_rows) s.append("_wide");
  if (c.written) s.append("_written");
  return s;
}

// The latent pages of a batch: each request's pages handed out in a shuffled order from a pool with three unowned
// pages, each page followed by a 48-byte gap (as a layer's page inside a packed-cache row). Every byte that is not
// a cached row of a request (unowned pages, gaps, rows past a context) holds a NaN pattern, so that a read of a
// wrong row shows up as NaN.
struct LatentPool {
  int page_size = 0, row_bytes = 0, bt_stride = 1;
  int64_t page_stride = 0;
  std::vector<uint8_t> bytes;
  std::vector<int32_t> block_table;
  std::vector<std::vector<float>> values;  // per request: [ctx, 576] dequantised rows (what the CPU sees)
  // With keep_raw: every request's [ctx, 576] rows before encoding, request after request, and each row's cache slot
  // (page * page_size + row).
  std::vector<float> raw;
  std::vector<int64_t> slots;

  LatentPool(std::mt19937& rng, const std::vector<int>& ctx, int page_size_, LatentDtype dtype, float kv_scale,
             bool keep_raw)
      : page_size(page_size_), row_bytes(latent_row_bytes(dtype)),
        page_stride(int64_t{page_size_} * latent_row_bytes(dtype) + 48) {
    ScatteredPages pages = scatter_pages(rng, ctx, page_size, /*spare_columns=*/0);
    bt_stride = pages.bt_stride;
    block_table = std::move(pages.block_table);
    bytes.assign(static_cast<size_t>(pages.total_pages) * page_stride, 0x7F);  // e4m3 NaN codes; 0x7F7F is a bf16 NaN

    std::normal_distribution<float> n(0.0f, 1.0f);
    values.resize(ctx.size());
    for (size_t r = 0; r < ctx.size(); ++r) {
      values[r].resize(static_cast<size_t>(ctx[r]) * kLatentDim);
      for (int s = 0; s < ctx[r]; ++s) {
        uint8_t* row = bytes.data() + int64_t{block_table[r * bt_stride + s / page_size]} * page_stride +
                       int64_t{s % page_size} * row_bytes;
        float* ref = values[r].data() + static_cast<size_t>(s) * kLatentDim;
        if (keep_raw) slots.push_back(int64_t{block_table[r * bt_stride + s / page_size]} * page_size + s % page_size);
        for (int c = 0; c < kLatentDim; ++c) {
          const float v = n(rng) * (c < kC ? 1.0f : 0.5f);
          if (keep_raw) raw.push_back(v);
          if (dtype == LatentDtype::fp8_e4m3) {
            const uint8_t code = f32_to_e4m3(v / kv_scale);
            row[c] = code;
            ref[c] = e4m3_to_f32(code) * kv_scale;
          } else {
            const uint16_t b = f32_to_bf16(v / kv_scale);
            std::memcpy(row + 2 * c, &b, 2);
            ref[c] = bf16_to_f32(b) * kv_scale;
          }
        }
      }
    }
  }
};

class MlaDecode : public ::testing::TestWithParam<MlaCase> {};

TEST_P(MlaDecode, MatchesCpuWithinBound) {
  REQUIRE_GPU();
  const MlaCase& mc = GetParam();
  const int H = mc.heads, batch = static_cast<int>(mc.ctx.size()), rows = batch * mc.n_q;
  std::mt19937 rng(7001 + H * 31 + mc.n_q * 7 + mc.page_size + static_cast<int>(mc.ctx.back()) +
                   (mc.dtype == LatentDtype::bf16 ? 100 : 0));
  std::normal_distribution<float> n(0.0f, 1.0f);
  const float softmax_scale = 0.1352338f;
  const LatentPool pool(rng, mc.ctx, mc.page_size, mc.dtype, mc.kv_scale, mc.written);

  std::vector<uint16_t> q(static_cast<size_t>(rows) * H * kLatentDim);
  static const float kRowScales[] = {1e-3f, 1.0f, 3e5f};
  for (size_t row = 0; row < q.size() / kLatentDim; ++row) {
    const float s = mc.q_sigma * (mc.wide_rows ? kRowScales[rng() % 3] : 1.0f);
    for (int c = 0; c < kLatentDim; ++c) q[row * kLatentDim + c] = f32_to_bf16(n(rng) * s);
  }

  const int longest = *std::max_element(mc.ctx.begin(), mc.ctx.end());
  const int max_ctx = mc.max_ctx_len > 0 ? mc.max_ctx_len : longest;
  ASSERT_GE(max_ctx, longest);
  DeviceBuffer<uint8_t> pool_d = to_device(pool.bytes);
  if (mc.written) {
    // The engine's bf16 cache: the same rows written on the GPU into a pool of NaN patterns, which must come out as
    // the host's f32_to_bf16 encoding byte for byte (kv_scale 1: bf16 entries have no scale) before it is attended.
    ASSERT_EQ(mc.dtype, LatentDtype::bf16);
    ASSERT_EQ(mc.kv_scale, 1.0f);
    pool_d = to_device(std::vector<uint8_t>(pool.bytes.size(), 0x7F));
    const DeviceBuffer<float> raw_d = to_device(pool.raw);
    const DeviceBuffer<int64_t> slots_d = to_device(pool.slots);
    mla_latent_write_bf16(raw_d.get(), kLatentDim, static_cast<int64_t>(pool.slots.size()), kC, kR, slots_d.get(),
                          Pages{pool_d.get(), pool.page_stride, pool.page_size}, nullptr);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    ASSERT_TRUE(to_host(pool_d) == pool.bytes) << "mla_latent_write_bf16's pages differ from f32_to_bf16's";
  }
  const DeviceBuffer<int32_t> bt_d = to_device(pool.block_table);
  const DeviceBuffer<int32_t> ctx_d = to_device(std::vector<int32_t>(mc.ctx.begin(), mc.ctx.end()));
  const DeviceBuffer<uint16_t> q_d = to_device(q);
  DeviceBuffer<float> out_d(static_cast<size_t>(rows) * H * kC), lse_d(static_cast<size_t>(rows) * H);
  const size_t ws_bytes = mla_decode_workspace_bytes(batch, mc.n_q, H, max_ctx);
  DeviceBuffer<uint8_t> ws(ws_bytes);

  MlaDecodeArgs a;
  a.q_abs = q_d.get();
  a.batch = batch;
  a.n_q = mc.n_q;
  a.heads = H;
  a.ctx_lens = ctx_d.get();
  a.max_ctx_len = max_ctx;
  a.latent_dtype = mc.dtype;
  a.latent_pages = {pool_d.get(), pool.page_stride, pool.page_size};
  a.block_table = {bt_d.get(), pool.bt_stride};
  a.kv_scale = mc.kv_scale;
  a.softmax_scale = softmax_scale;
  a.out = out_d.get();
  a.lse = lse_d.get();
  auto run = [&] {
    fill_poison(out_d);
    fill_poison(lse_d);
    mla_decode(a, ws.get(), ws_bytes, nullptr);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    return std::make_pair(to_host(out_d), to_host(lse_d));
  };
  const auto [out, lse] = run();
  const auto [out2, lse2] = run();
  EXPECT_EQ(std::memcmp(out.data(), out2.data(), out.size() * sizeof(float)), 0) << "second launch differs (out)";
  EXPECT_EQ(std::memcmp(lse.data(), lse2.data(), lse.size() * sizeof(float)), 0) << "second launch differs (lse)";

  // Reference per query row and group of 8 heads, on all cores.
  std::vector<float> ref(out.size()), ref_lse(lse.size()), vmax(static_cast<size_t>(rows));
  const int head_groups = (H + 7) / 8;
  parallel_for(rows * head_groups, [&](int job) {
    const int row = job / head_groups, h0 = 8 * (job % head_groups), nh = std::min(8, H - h0);
    const int r = row / mc.n_q, i = row % mc.n_q;
    const int64_t n_kv = mc.ctx[static_cast<size_t>(r)] - mc.n_q + i + 1;
    std::vector<float> qf(static_cast<size_t>(nh) * kLatentDim);
    for (size_t j = 0; j < qf.size(); ++j)
      qf[j] = bf16_to_f32(q[(static_cast<size_t>(row) * H + h0) * kLatentDim + j]);
    cpu::mla_attend_absorbed(qf.data(), nh, kC, kR, pool.values[static_cast<size_t>(r)].data(), n_kv, nullptr, 0,
                             softmax_scale, ref.data() + (static_cast<size_t>(row) * H + h0) * kC,
                             ref_lse.data() + static_cast<size_t>(row) * H + h0);
    if (h0 == 0) {
      float m = 0.0f;
      for (int64_t s = 0; s < n_kv; ++s)
        for (int c = 0; c < kC; ++c) m = std::max(m, std::fabs(pool.values[static_cast<size_t>(r)][s * kLatentDim + c]));
      vmax[static_cast<size_t>(row)] = m;
    }
  });

  const int bound_exp = mc.dtype == LatentDtype::bf16 ? -8 : -10;
  double worst = 0.0, worst_lse = 0.0;
  int64_t bad = 0, bad_lse = 0, poisoned = 0;
  for (int row = 0; row < rows; ++row) {
    const float tol = std::ldexp(vmax[static_cast<size_t>(row)], bound_exp) + 1e-6f;
    for (int h = 0; h < H; ++h) {
      const size_t hq = static_cast<size_t>(row) * H + h;
      if (bits(lse[hq]) == kPoisonBits) ++poisoned;
      const float lerr = std::fabs(lse[hq] - ref_lse[hq]);
      if (!(lerr <= 1e-4f * (1.0f + std::fabs(ref_lse[hq])))) {
        if (bad_lse++ < 5)
          ADD_FAILURE() << "lse, row " << row << " head " << h << ": " << lse[hq] << " vs " << ref_lse[hq];
      }
      worst_lse = std::max(worst_lse, double{lerr} / (1.0 + std::fabs(ref_lse[hq])));
      for (int c = 0; c < kC; ++c) {
        const float g = out[hq * kC + c], rv = ref[hq * kC + c];
        if (bits(g) == kPoisonBits) ++poisoned;
        const float err = std::fabs(g - rv);
        if (!(err <= tol)) {
          if (bad++ < 5)
            ADD_FAILURE() << "out, row " << row << " head " << h << " col " << c << ": " << g << " vs " << rv
                          << " (tolerance " << tol << ")";
        }
        worst = std::max(worst, double{err} / vmax[static_cast<size_t>(row)]);
      }
    }
  }
  EXPECT_EQ(poisoned, 0) << "outputs never written";
  EXPECT_EQ(bad, 0) << "out elements over the bound";
  EXPECT_EQ(bad_lse, 0) << "lse elements over the bound";
  std::printf("mla_decode %s: largest |out error| / max|v| = %.3g (bound 2^%d = %.3g), largest lse error / (1+|lse|) "
              "= %.3g (bound 1e-4), workspace %zu bytes\n",
              case_name({GetParam(), 0}).c_str(), worst, bound_exp, std::ldexp(1.0, bound_exp), worst_lse, ws_bytes);
}

const LatentDtype kFp8 = LatentDtype::fp8_e4m3;
const LatentDtype kBf16 = LatentDtype::bf16;
const float kKimiScale = 4.0f / 448.0f;

// n context lengths in [lo, hi], drawn from a fixed seed: a decode batch of requests at mixed positions.
std::vector<int> mixed_lengths(int n, int lo, int hi, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> len(lo, hi);
  std::vector<int> v(static_cast<size_t>(n));
  for (int& x : v) x = len(rng);
  return v;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MlaDecode,
    ::testing::Values(MlaCase{kFp8, 128, 1, 64, {1, 63, 64, 1000, 5000}, 1.0f, kKimiScale, false, 0, false},
                      MlaCase{kFp8, 128, 2, 64, {2, 63, 64, 1000, 5000}, 1.0f, kKimiScale, false, 0, false},
                      MlaCase{kFp8, 16, 1, 16, {1, 63, 64, 1000, 5000}, 2.0f, kKimiScale, false, 0, false},
                      MlaCase{kFp8, 96, 2, 128, {63, 1000, 3}, 1.0f, kKimiScale, false, 0, false},
                      MlaCase{kFp8, 64, 1, 64, {70000}, 1.0f, kKimiScale, false, 0, false},
                      MlaCase{kFp8, 128, 2, 64, {20000, 33}, 1.0f, kKimiScale, false, 0, false},
                      MlaCase{kFp8, 32, 1, 32, {64, 1000, 5000}, 1.0f, kKimiScale, true, 0, false},
                      MlaCase{kBf16, 128, 1, 64, {1, 63, 64, 1000, 5000}, 1.0f, 1.0f, false, 0, false},
                      MlaCase{kBf16, 64, 2, 32, {2, 64, 5000}, 1.0f, 0.5f, false, 0, false},
                      MlaCase{kBf16, 32, 1, 64, {50000}, 1.0f, 1.0f, false, 0, false}),
    case_name);

// The engine's launches (gpu_model.cpp): a prompt is one request whose n_q tokens are causal queries, with
// max_ctx_len its length rounded up to a power of two; the generated tokens of a step are one launch of n_q = 1 over
// every decoding request, max_ctx_len the longest rounded up (or max_model_len when the step is a replayed graph).
// The bf16 cases read the entries as the engine caches them: written by mla_latent_write_bf16, kv_scale 1.
INSTANTIATE_TEST_SUITE_P(
    EngineShapes, MlaDecode,
    ::testing::Values(
        // Whole prompts (the first chunk: n_q = ctx) at Kimi Linear's 32 heads and 128 heads.
        MlaCase{kBf16, 32, 300, 64, {300}, 1.0f, 1.0f, false, 512, true},
        MlaCase{kBf16, 128, 64, 64, {64}, 1.0f, 1.0f, false, 64, true},
        // A chunk of 37 tokens after a prefix of 1963, and 100 tokens after 1000 (FP8, for comparison).
        MlaCase{kBf16, 128, 37, 64, {2000}, 1.0f, 1.0f, false, 2048, true},
        MlaCase{kFp8, 64, 100, 64, {1100}, 1.0f, kKimiScale, false, 2048, false},
        // Decode batches of 32 and 64 requests, max_ctx_len rounded up and max_model_len (graph replay).
        MlaCase{kBf16, 128, 1, 64, mixed_lengths(32, 1, 3000, 41), 1.0f, 1.0f, false, 4096, true},
        MlaCase{kBf16, 64, 1, 16, mixed_lengths(64, 1, 700, 42), 1.0f, 1.0f, false, 131072, true},
        MlaCase{kBf16, 32, 1, 64, mixed_lengths(64, 1, 1500, 43), 1.0f, 1.0f, false, 2048, true},
        MlaCase{kFp8, 128, 1, 64, mixed_lengths(32, 1, 3000, 44), 1.0f, kKimiScale, false, 32768, false}),
    case_name);

TEST(MlaDecodeArguments, BadArgumentsThrow) {
  REQUIRE_GPU();
  const DeviceBuffer<uint8_t> pages = to_device(std::vector<uint8_t>(64 * kLatentDim, 0x38));  // e4m3 1.0
  const DeviceBuffer<int32_t> ctx = to_device(std::vector<int32_t>{64});
  const DeviceBuffer<int32_t> table = to_device(std::vector<int32_t>{0});
  const DeviceBuffer<uint16_t> q = to_device(std::vector<uint16_t>(kLatentDim * 16, f32_to_bf16(0.5f)));
  DeviceBuffer<float> out(kC * 16), lse(16);
  MlaDecodeArgs a;
  a.q_abs = q.get();
  a.batch = 1;
  a.heads = 16;
  a.ctx_lens = ctx.get();
  a.max_ctx_len = 64;
  a.latent_pages = {pages.get(), 64 * kLatentDim, 64};
  a.block_table = {table.get(), 1};
  a.kv_scale = 1.0f;
  a.softmax_scale = 0.1f;
  a.out = out.get();
  a.lse = lse.get();
  // The valid call: every row is 1.0, so every output is 1.0 and lse = log(64) + (0.5 * 576) * 0.1. (Even these two
  // tiles may be split over CTAs, so it gets the workspace it asks for.)
  const size_t ws_bytes = mla_decode_workspace_bytes(1, 1, 16, 64);
  DeviceBuffer<uint8_t> ws(ws_bytes);
  EXPECT_NO_THROW(mla_decode(a, ws.get(), ws_bytes, nullptr));
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  for (float v : to_host(out)) EXPECT_EQ(v, 1.0f);
  for (float v : to_host(lse)) EXPECT_NEAR(v, std::log(64.0f) + 28.8f, 1e-4f * 30.0f);
  MlaDecodeArgs b = a;
  b.heads = 0;
  EXPECT_THROW(mla_decode(b, ws.get(), ws_bytes, nullptr), Error);
  b = a;
  b.latent_dtype = LatentDtype::bf16;  // 64 rows of 1152 bytes do not fit a page stride of 64 * 576
  EXPECT_THROW(mla_decode(b, ws.get(), ws_bytes, nullptr), Error);
  b = a;
  b.latent_pages.page_size = 48;
  EXPECT_THROW(mla_decode(b, ws.get(), ws_bytes, nullptr), Error);
  b = a;
  b.out = nullptr;
  EXPECT_THROW(mla_decode(b, ws.get(), ws_bytes, nullptr), Error);
  b = a;
  b.kv_scale = 0.0f;
  EXPECT_THROW(mla_decode(b, ws.get(), ws_bytes, nullptr), Error);
  b = a;
  b.max_ctx_len = 1 << 20;  // split over CTAs: needs a larger workspace
  ASSERT_GT(mla_decode_workspace_bytes(1, 1, 16, b.max_ctx_len), ws_bytes);
  EXPECT_THROW(mla_decode(b, ws.get(), ws_bytes, nullptr), Error);
}

}  // namespace
}  // namespace kestrel::cuda
