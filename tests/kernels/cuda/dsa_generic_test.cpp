// GPU tests of the generic DSA indexer kernels (src/kernels/cuda/dsa_generic.h) against the CPU reference, all bit
// for bit: the query preparation (hadamard_inplace + quantize_fp8_ue8m0 + MlaCore::select's weight folding),
// the key writer, the exact scores (cpu::indexer_scores), and topk_decode (dsa.h) over those scores against
// cpu::topk_indices sorted ascending. Fresh random inputs with fixed seeds, outputs poisoned before every launch,
// pages scattered in a pool.
#include "kernels/cuda/dsa_generic.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/dsa.h"
#include "kernels/cuda/runtime.h"
#include "cuda_test_util.h"
#include "index_check.h"

namespace kestrel::cuda {
namespace {

using namespace test_util;

constexpr uint32_t kNaNBits = 0x7FC00000u;  // the scale the kernels give a non-finite vector

// Whether x lies exactly halfway between two neighbouring e4m3 values (|x| below 448).
bool e4m3_midpoint(float x) {
  const float a = std::fabs(x);
  if (a == 0.0f || a >= 448.0f) return false;
  int k = 0;
  std::frexp(a, &k);  // a = f * 2^k, f in [0.5, 1)
  const float quantum = std::ldexp(1.0f, std::max(k - 1, -6) - 3);
  return std::fmod(a, quantum) == quantum / 2;
}

// ---------------------------------------------------------------- inputs

// Gaussian values times a magnitude from below the amax floor to large, sometimes with one outlier (so that the
// small values fall into e4m3 subnormals).
std::vector<float> random_vector(std::mt19937& rng, int D) {
  static const float magnitudes[] = {1e-7f, 3e-5f, 1e-2f, 1.0f, 37.0f, 3e4f};
  std::normal_distribution<float> n(0.0f, 1.0f);
  const float mag = magnitudes[rng() % 6];
  std::vector<float> x(static_cast<size_t>(D));
  for (float& v : x) v = n(rng) * mag;
  if (rng() % 3 == 0) x[rng() % D] *= 300.0f;
  return x;
}

// A vector whose Hadamard transform lies on e4m3 rounding midpoints of the scale it gets: z e_0 transforms to
// fl(z * norm) everywhere, and z e_0 + z2 e_{D/2} to fl((z + z2) norm) on the first half and fl((z - z2) norm) on
// the second. The larger value m1 = u1 * s (u1 a midpoint in (224, 448)) sets the scale s; the smaller one, when
// its construction is exact, is a midpoint of a random pair of neighbouring codes below u1 (subnormals included).
std::vector<float> tie_vector(std::mt19937& rng, int D) {
  static const float top_midpoints[] = {232, 248, 272, 304, 336, 368, 400, 432};
  const float norm = inv_sqrt(D);
  std::vector<float> x(static_cast<size_t>(D), 0.0f);
  float s = 0.0f, m1 = 0.0f;
  std::optional<float> a;
  for (int attempt = 0; attempt < 16 && !a; ++attempt) {
    s = std::ldexp(1.0f, static_cast<int>(rng() % 17) - 12);
    m1 = (rng() % 2 ? -1.0f : 1.0f) * top_midpoints[rng() % 8] * s;
    a = preimage(m1, norm);
  }
  if (!a) return x;  // all zeros: still a valid input
  x[0] = *a;
  if (D < 2 || rng() % 3 == 0) return x;
  for (int attempt = 0; attempt < 16; ++attempt) {
    const int code = static_cast<int>(rng() % 0x7D);  // a positive code and its successor, both finite
    const float lo = e4m3_to_f32(static_cast<uint8_t>(code)), hi = e4m3_to_f32(static_cast<uint8_t>(code + 1));
    if (hi >= std::fabs(m1) / s) continue;
    const float m2 = (rng() % 2 ? -1.0f : 1.0f) * (lo + hi) / 2 * s;
    const std::optional<float> b = preimage(m2, norm);
    if (!b) continue;
    const float z = static_cast<float>((static_cast<double>(*a) + *b) / 2);
    const float z2 = static_cast<float>((static_cast<double>(*a) - *b) / 2);
    if (z + z2 != *a || z - z2 != *b) continue;
    x[0] = z;
    x[D / 2] = z2;
    return x;
  }
  return x;
}

// ---------------------------------------------------------------- query preparation

struct Prepared {
  std::vector<uint8_t> codes;
  std::vector<float> weights;
  int64_t ties = 0;  // quantised values that sat exactly on an e4m3 midpoint
};

// MlaCore::select's steps for every head of every token.
Prepared cpu_query_prep(const std::vector<float>& q, const std::vector<float>& raw, int64_t T, int H, int D) {
  Prepared p;
  p.codes.resize(static_cast<size_t>(T * H * D));
  p.weights.resize(static_cast<size_t>(T * H));
  const float c_heads = inv_sqrt(H), c_dim = inv_sqrt(D);
  std::vector<float> v(static_cast<size_t>(D));
  for (int64_t i = 0; i < T * H; ++i) {
    std::copy_n(q.begin() + i * D, D, v.begin());
    cpu::hadamard_inplace(v.data(), D);
    const float q_scale = quantize_fp8_ue8m0(v.data(), D, p.codes.data() + i * D);
    for (float x : v) p.ties += e4m3_midpoint(x / q_scale);
    p.weights[static_cast<size_t>(i)] = raw[static_cast<size_t>(i)] * c_heads * q_scale * c_dim;
  }
  return p;
}

TEST(DsaGenericQueryPrep, MatchesCpuBitForBit) {
  REQUIRE_GPU();
  struct Shape {
    int D, H;
  };
  int64_t ties = 0;
  for (const Shape sh : {Shape{32, 4}, Shape{64, 3}, Shape{128, 32}, Shape{8, 5}, Shape{256, 2}}) {
    SCOPED_TRACE("D " + std::to_string(sh.D) + ", H " + std::to_string(sh.H));
    std::mt19937 rng(100 + sh.D + sh.H);
    const int64_t T = 37, V = T * sh.H;
    std::vector<float> q(static_cast<size_t>(V * sh.D)), raw(static_cast<size_t>(V));
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (int64_t v = 0; v < V; ++v) {
      const std::vector<float> x = rng() % 3 == 0 ? tie_vector(rng, sh.D) : random_vector(rng, sh.D);
      std::copy(x.begin(), x.end(), q.begin() + v * sh.D);
      raw[static_cast<size_t>(v)] = n(rng) * (rng() % 2 ? 1.0f : 1e-3f);
    }
    std::fill_n(q.begin(), sh.D, 0.0f);  // an all-zero head: the amax floor sets its scale
    const Prepared want = cpu_query_prep(q, raw, T, sh.H, sh.D);
    ties += want.ties;

    const DeviceBuffer<float> q_d = to_device(q), raw_d = to_device(raw);
    DeviceBuffer<uint8_t> codes_d = to_device(std::vector<uint8_t>(want.codes.size(), 0xA5));
    DeviceBuffer<float> w_d = to_device(std::vector<float>(want.weights.size(), std::bit_cast<float>(kPoisonBits)));
    index_query_prep(q_d.get(), raw_d.get(), T, sh.H, sh.D, codes_d.get(), w_d.get(), nullptr);
    sync();
    const std::vector<uint8_t> codes = to_host(codes_d);
    const std::vector<float> w = to_host(w_d);
    int64_t code_mismatches = 0, weight_mismatches = 0;
    for (size_t i = 0; i < codes.size(); ++i) code_mismatches += codes[i] != want.codes[i];
    for (size_t i = 0; i < w.size(); ++i) weight_mismatches += bits(w[i]) != bits(want.weights[i]);
    EXPECT_EQ(code_mismatches, 0);
    EXPECT_EQ(weight_mismatches, 0);
  }
  // The inputs must really have put values on rounding midpoints (about a third of the vectors are built for it).
  EXPECT_GT(ties, 1000);
}

TEST(DsaGenericQueryPrep, NonFiniteHeadGivesNaNCodesAndWeight) {
  REQUIRE_GPU();
  const int D = 32, H = 2;
  std::mt19937 rng(7);
  std::vector<float> q;
  for (int j = 0; j < H; ++j) {
    const std::vector<float> x = random_vector(rng, D);
    q.insert(q.end(), x.begin(), x.end());
  }
  q[5] = kInf;  // head 0
  const std::vector<float> raw = {0.5f, -2.0f};
  const DeviceBuffer<float> q_d = to_device(q), raw_d = to_device(raw);
  DeviceBuffer<uint8_t> codes_d(static_cast<size_t>(H * D));
  DeviceBuffer<float> w_d(H);
  index_query_prep(q_d.get(), raw_d.get(), 1, H, D, codes_d.get(), w_d.get(), nullptr);
  sync();
  const std::vector<uint8_t> codes = to_host(codes_d);
  const std::vector<float> w = to_host(w_d);
  for (int d = 0; d < D; ++d) EXPECT_EQ(codes[d], 0x7F) << d;
  EXPECT_TRUE(std::isnan(w[0]));
  // The finite head next to it is prepared as usual.
  std::vector<float> v(q.begin() + D, q.end());
  cpu::hadamard_inplace(v.data(), D);
  std::vector<uint8_t> want(static_cast<size_t>(D));
  const float q_scale = quantize_fp8_ue8m0(v.data(), D, want.data());
  EXPECT_TRUE(std::equal(codes.begin() + D, codes.end(), want.begin()));
  EXPECT_EQ(bits(w[1]), bits(raw[1] * inv_sqrt(H) * q_scale * inv_sqrt(D)));
}

// ---------------------------------------------------------------- pages of D-code keys

// Requests' index-key pages in a pool, handed out in a shuffled order, each page followed by a gap (as pages of one
// layer inside the rows of the packed cache). A page: page_size keys of D codes, then page_size fp32 scales.
struct KeyPool {
  int D = 0, page_size = 0;
  int64_t page_stride = 0;
  int bt_stride = 1;
  std::vector<uint8_t> bytes;
  std::vector<int32_t> block_table;

  KeyPool(std::mt19937& rng, const std::vector<int>& ctx, int D_, int page_size_, uint8_t fill)
      : D(D_), page_size(page_size_), page_stride(int64_t{page_size_} * (D_ + 4) + 48) {
    ScatteredPages pages = scatter_pages(rng, ctx, page_size, /*spare_columns=*/0);
    bt_stride = pages.bt_stride;
    block_table = std::move(pages.block_table);
    bytes.assign(static_cast<size_t>(pages.total_pages * page_stride), fill);
  }
  int64_t slot(int r, int pos) const {
    return int64_t{block_table[static_cast<size_t>(r) * bt_stride + pos / page_size]} * page_size + pos % page_size;
  }
  uint8_t* page_of_slot(int64_t slot) { return bytes.data() + slot / page_size * page_stride; }
  void put(int64_t slot, const uint8_t* codes, float scale) {
    uint8_t* page = page_of_slot(slot);
    const int64_t row = slot % page_size;
    std::memcpy(page + row * D, codes, static_cast<size_t>(D));
    std::memcpy(page + int64_t{page_size} * D + 4 * row, &scale, 4);
  }
  const uint8_t* codes_at(int r, int pos) const {
    return bytes.data() + slot(r, pos) / page_size * page_stride + int64_t{pos % page_size} * D;
  }
  float scale_at(int r, int pos) const {
    float s;
    std::memcpy(&s, bytes.data() + slot(r, pos) / page_size * page_stride + int64_t{page_size} * D + 4 * (pos % page_size),
                4);
    return s;
  }
};

TEST(DsaGenericKeyWriter, MatchesCpuQuantisationBitForBit) {
  REQUIRE_GPU();
  for (const int D : {32, 64, 128, 256}) {
    SCOPED_TRACE("D " + std::to_string(D));
    std::mt19937 rng(200 + D);
    const int T = 157;
    std::vector<float> keys(static_cast<size_t>(T) * D);
    for (int t = 0; t < T; ++t) {
      const std::vector<float> x = rng() % 3 == 0 ? tie_vector(rng, D) : random_vector(rng, D);
      std::copy(x.begin(), x.end(), keys.begin() + int64_t{t} * D);
    }
    std::fill_n(keys.begin(), D, 0.0f);  // an all-zero key: amax floor, every code 0
    const int non_finite = 11;
    keys[int64_t{non_finite} * D + 3] = -kInf;

    // Every token of one request at shuffled positions of a 16-token paged pool; token 7 is skipped.
    KeyPool pool(rng, {T + 20}, D, 16, 0xA5);
    std::vector<int> pos_of(T);
    std::iota(pos_of.begin(), pos_of.end(), 0);
    std::shuffle(pos_of.begin(), pos_of.end(), rng);
    std::vector<int64_t> slots(T);
    for (int t = 0; t < T; ++t) slots[t] = pool.slot(0, pos_of[t]);
    slots[7] = -1;

    KeyPool want = pool;
    std::vector<uint8_t> codes(static_cast<size_t>(D));
    for (int t = 0; t < T; ++t) {
      if (slots[t] < 0) continue;
      if (t == non_finite) {  // the CPU throws here; the kernel's documented stand-in
        std::fill(codes.begin(), codes.end(), 0x7F);
        want.put(slots[t], codes.data(), std::bit_cast<float>(kNaNBits));
        continue;
      }
      std::vector<float> v(keys.begin() + int64_t{t} * D, keys.begin() + int64_t{t + 1} * D);
      cpu::hadamard_inplace(v.data(), D);
      const float s = quantize_fp8_ue8m0(v.data(), D, codes.data());
      want.put(slots[t], codes.data(), s);
    }

    const DeviceBuffer<float> keys_d = to_device(keys);
    const DeviceBuffer<int64_t> slots_d = to_device(slots);
    DeviceBuffer<uint8_t> pool_d = to_device(pool.bytes);
    index_key_write_generic(keys_d.get(), T, D, slots_d.get(), Pages{pool_d.get(), pool.page_stride, pool.page_size},
                            nullptr);
    sync();
    const std::vector<uint8_t> got = to_host(pool_d);
    int64_t mismatches = 0;
    for (size_t i = 0; i < got.size(); ++i) mismatches += got[i] != want.bytes[i];
    EXPECT_EQ(mismatches, 0);

    if (D == kIndexHeadDim) {
      // The fast writer (dsa.h) stores the same bytes for every finite key.
      slots[non_finite] = -1;
      const DeviceBuffer<int64_t> finite_slots_d = to_device(slots);
      DeviceBuffer<uint8_t> fast_d = to_device(pool.bytes);
      DeviceBuffer<uint8_t> generic_d = to_device(pool.bytes);
      index_key_write(keys_d.get(), KeyDtype::f32, T, /*hadamard=*/true, finite_slots_d.get(),
                      Pages{fast_d.get(), pool.page_stride, pool.page_size}, nullptr);
      index_key_write_generic(keys_d.get(), T, D, finite_slots_d.get(),
                              Pages{generic_d.get(), pool.page_stride, pool.page_size}, nullptr);
      sync();
      EXPECT_TRUE(to_host(fast_d) == to_host(generic_d));
    }
  }
}

// ---------------------------------------------------------------- scores and top-k

// One case: keys in a pool (some repeated, so that scores tie exactly; one with a NaN code), queries with one NaN
// head, generic scores on the GPU and the CPU's for every row. Returns the GPU scores for the top-k check.
ScoreRun run_scores(const ScoreCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int batch = static_cast<int>(c.ctx.size()), D = c.D, H = c.H;
  KeyPool pool(rng, c.ctx, D, c.page_size, 0x5A);
  std::uniform_real_distribution<float> log_scale(-12.0f, 4.0f);
  std::vector<uint8_t> codes(static_cast<size_t>(D));
  for (int r = 0; r < batch; ++r) {
    for (int p = 0; p < c.ctx[r]; ++p) {
      if (p >= 2 && rng() % 5 == 0) {  // a repeat of an earlier key of the request: an exact score tie
        const int from = static_cast<int>(rng() % p);
        std::memcpy(codes.data(), pool.codes_at(r, from), static_cast<size_t>(D));
        pool.put(pool.slot(r, p), codes.data(), pool.scale_at(r, from));
        continue;
      }
      random_codes(rng, codes.data(), D);
      pool.put(pool.slot(r, p), codes.data(), std::exp2(log_scale(rng)));
    }
  }
  if (c.ctx[0] > 3) {  // a key with a NaN code
    std::memcpy(codes.data(), pool.codes_at(0, 2), static_cast<size_t>(D));
    codes[static_cast<size_t>(D - 1)] = 0xFF;
    pool.put(pool.slot(0, 2), codes.data(), pool.scale_at(0, 2));
  }

  ScoreRun run;
  run.rows = batch * c.n_q;
  run.stride = c.max_ctx + 5;
  std::vector<uint8_t> q(static_cast<size_t>(run.rows) * H * D);
  random_codes(rng, q.data(), q.size());
  q[static_cast<size_t>(H * D + 1)] = 0x7F;  // row 1, head 0: a NaN query code
  std::vector<float> w(static_cast<size_t>(run.rows) * H);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (float& x : w) x = rng() % 10 == 0 ? 0.0f : n(rng);

  // The CPU: each row's keys read back from the pool, scored for positions 0..pos.
  run.want.assign(static_cast<size_t>(run.rows * run.stride), std::bit_cast<float>(kPoisonBits));
  for (int r = 0; r < batch; ++r) {
    const int ctx = std::min(c.ctx[r], c.max_ctx);
    std::vector<uint8_t> k_codes(static_cast<size_t>(ctx) * D);
    std::vector<float> k_scales(static_cast<size_t>(ctx));
    for (int p = 0; p < ctx; ++p) {
      std::memcpy(k_codes.data() + int64_t{p} * D, pool.codes_at(r, p), static_cast<size_t>(D));
      k_scales[static_cast<size_t>(p)] = pool.scale_at(r, p);
    }
    for (int i = 0; i < c.n_q; ++i) {
      const int64_t row = int64_t{r} * c.n_q + i;
      const int pos = ctx - c.n_q + i;
      float* out = run.want.data() + row * run.stride;
      if (pos >= 0)
        cpu::indexer_scores(q.data() + row * H * D, w.data() + row * H, H, D, k_codes.data(), k_scales.data(),
                            pos + 1, out);
      for (int s = std::max(pos + 1, 0); s < ctx; ++s) out[s] = -kInf;
    }
  }

  const DeviceBuffer<uint8_t> pool_d = to_device(pool.bytes), q_d = to_device(q);
  const DeviceBuffer<int32_t> bt_d = to_device(pool.block_table);
  const DeviceBuffer<float> w_d = to_device(w);
  run.ctx_d = to_device(c.ctx);
  run.scores_d = to_device(std::vector<float>(run.want.size(), std::bit_cast<float>(kPoisonBits)));
  IndexQueries queries;
  queries.codes = q_d.get();
  queries.weights = w_d.get();
  queries.batch = batch;
  queries.n_q = c.n_q;
  queries.heads = H;
  index_scores_generic(queries, D, Pages{pool_d.get(), pool.page_stride, pool.page_size},
                       BlockTable{bt_d.get(), pool.bt_stride}, run.ctx_d.get(), c.max_ctx, run.scores_d.get(),
                       run.stride, nullptr);
  sync();
  run.got = to_host(run.scores_d);
  return run;
}

std::vector<ScoreCase> score_cases() {
  return {
      {32, 4, 16, 1, {1, 300, 17, 128, 129, 64}, 300},   // decode rows, the tiny kimi_k3 indexer
      {32, 4, 16, 5, {5, 300, 41, 6}, 300},              // prompt-like rows, a context of exactly n_q
      {128, 32, 64, 1, {1, 300, 200, 33}, 300},          // the small kimi_k3 indexer's shape
      {128, 32, 16, 3, {3, 300, 97}, 320},               // max_ctx above every context (a replayed graph)
      {32, 32, 64, 2, {250, 2}, 256},
      {128, 4, 16, 4, {300, 100}, 256},                  // a context past max_ctx, cut to it
  };
}

TEST(DsaGenericScores, MatchCpuIndexerScoresBitForBit) {
  REQUIRE_GPU();
  uint32_t seed = 300;
  for (const ScoreCase& c : score_cases()) {
    SCOPED_TRACE("D " + std::to_string(c.D) + ", H " + std::to_string(c.H) + ", n_q " + std::to_string(c.n_q) +
                 ", max_ctx " + std::to_string(c.max_ctx));
    const ScoreCounts n = compare_scores(run_scores(c, seed++));
    EXPECT_EQ(n.mismatches, 0);
    EXPECT_GT(n.nan, 0);     // the NaN key and the NaN query head were scored
    EXPECT_GT(n.finite, 0);
  }
}

TEST(DsaGenericScores, TopkOverGenericScoresMatchesCpuTopk) {
  REQUIRE_GPU();
  uint32_t seed = 300;  // the same inputs as the scores test
  for (const ScoreCase& c : score_cases()) {
    const ScoreRun run = run_scores(c, seed++);
    if (*std::max_element(c.ctx.begin(), c.ctx.end()) > c.max_ctx) continue;  // top-k takes uncut contexts
    expect_topk_matches_cpu(c, run);
  }
}

TEST(DsaGenericContexts, ShiftCtxLens) {
  REQUIRE_GPU();
  const std::vector<int32_t> ctx = {5, 300, 77};
  const DeviceBuffer<int32_t> ctx_d = to_device(ctx);
  DeviceBuffer<int32_t> out_d = to_device(std::vector<int32_t>(3, -1));
  shift_ctx_lens(ctx_d.get(), 3, 4, out_d.get(), nullptr);
  sync();
  EXPECT_EQ(to_host(out_d), (std::vector<int32_t>{1, 296, 73}));
}

TEST(DsaGenericArguments, RejectWhatTheKernelsDoNotTake) {
  // Host-side checks: no device is touched before them.
  uint8_t* codes = nullptr;
  float* weights = nullptr;
  EXPECT_THROW(index_query_prep(nullptr, nullptr, 1, 4, 48, codes, weights, nullptr), Error);  // not a power of two
  EXPECT_THROW(index_query_prep(nullptr, nullptr, 1, 0, 32, codes, weights, nullptr), Error);  // no heads
  IndexQueries q;
  q.batch = 1;
  q.heads = 64;
  EXPECT_THROW(index_scores_generic(q, 256, Pages{}, BlockTable{}, nullptr, 10, nullptr, 10, nullptr), Error);
  q.heads = 4;
  EXPECT_THROW(index_scores_generic(q, 2, Pages{}, BlockTable{}, nullptr, 10, nullptr, 10, nullptr), Error);
  EXPECT_THROW(index_scores_generic(q, 32, Pages{}, BlockTable{}, nullptr, 10, nullptr, 9, nullptr), Error);
}

}  // namespace
}  // namespace kestrel::cuda
