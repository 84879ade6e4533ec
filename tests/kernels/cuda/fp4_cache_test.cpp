// GPU tests of the 4-bit cache formats (src/kernels/cuda/fp4_cache.h) and of the generic kernels reading them, against
// the CPU reference: the NVFP4 latent writer bit for bit against MlaCore::write_latent's encoding (nvfp4_encode
// and the e4m3 tail), the NVFP4 decode of mla_attend_generic bit for bit against read_latent's (one-position rows),
// its attention against cpu::mla_attend_absorbed over read_latent rows (fp32 bound), the MXFP4 key writer bit for bit
// against hadamard_inplace + mxfp4_encode, and index_scores_generic over MXFP4 keys bit for bit against
// cpu::indexer_scores of mxfp4_key_as_fp8's codes and scales, with topk_decode's sets equal to cpu::topk_indices'.
// Fresh random inputs with fixed seeds, outputs poisoned or sentinel-filled before every launch, pages scattered.
#include "kernels/cuda/fp4_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
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
#include "kernels/cuda/dsa_generic.h"
#include "kernels/cuda/mla_glue.h"
#include "kernels/cuda/runtime.h"
#include "attend_check.h"
#include "cuda_test_util.h"
#include "index_check.h"

namespace kestrel::cuda {
namespace {

using namespace test_util;

// ---------------------------------------------------------------- the CPU side of the formats

// MlaCore::write_latent (nvfp4): nvfp4_encode of c with tensor scale kv_scale (block by block: the encoder
// treats blocks independently), the tail as e4m3(clamp(v / kv_scale)). A block holding a non-finite value, where the
// CPU throws, gets fp4_cache.h's stand-in: the e4m3 NaN scale code and zero codes.
void cpu_write_nvfp4(const float* kv, int C, int R, float kv_scale, uint8_t* e) {
  for (int b = 0; b < C / 16; ++b) {
    const float* block = kv + 16 * b;
    if (!std::all_of(block, block + 16, [](float v) { return std::isfinite(v); })) {
      std::fill_n(e + 8 * b, 8, uint8_t{0});
      e[C / 2 + b] = 0x7F;
      continue;
    }
    nvfp4_encode(block, 16, kv_scale, e + 8 * b, e + C / 2 + b);
  }
  for (int i = 0; i < R; ++i) e[C / 2 + C / 16 + i] = f32_to_e4m3(std::clamp(kv[C + i] / kv_scale, -kE4m3Max, kE4m3Max));
}

// MlaCore::read_latent (nvfp4).
void cpu_read_nvfp4(const uint8_t* e, int C, int R, float kv_scale, float* row) {
  nvfp4_decode(e, e + C / 2, C, kv_scale, row);
  for (int i = 0; i < R; ++i) row[C + i] = e4m3_to_f32(e[C / 2 + C / 16 + i]) * kv_scale;
}

// mxfp4_key_as_fp8 of src/cpu/mla_core.cpp, restated from its contract (the kernel tests link no model code; the
// model test in tests/gpu runs the real one against the GPU): codes e4m3(e2m1 * 2^(e_b - e_max + 6)), scale
// 2^(e_max - 133).
float cpu_mxfp4_key_as_fp8(const uint8_t* packed, const uint8_t* exponents, int D, uint8_t* codes) {
  const int e_max = *std::max_element(exponents, exponents + D / 32);
  for (int i = 0; i < D; ++i) {
    const uint8_t nib = (packed[i / 2] >> (4 * (i % 2))) & 0xF;
    codes[i] = f32_to_e4m3(std::ldexp(e2m1_to_f32(nib), int{exponents[i / 32]} - e_max + 6));
  }
  return std::ldexp(1.0f, e_max - 127 - 6);
}

// Whether |x| lies exactly halfway between two neighbouring e2m1 values.
bool e2m1_midpoint(float x) {
  const float a = std::fabs(x);
  return a == 0.25f || a == 0.75f || a == 1.25f || a == 1.75f || a == 2.5f || a == 3.5f || a == 5.0f;
}

// ---------------------------------------------------------------- latent values

// One block of 16 latent values, relative to kv_scale, of a random kind: Gaussian at a log-uniform magnitude; zeros
// of both signs; e2m1 grid points and midpoints times a random block scale, with the amax at 6 (the range's top end)
// or past it (saturation); so small that the block scale code is 0 (all codes 0); so large that the block scale
// saturates at 448 (values saturate at +-6); one outlier over small values (which go to 0).
void latent_block(std::mt19937& rng, float kv_scale, float* v) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  static const float grid[] = {0.0f, 0.25f, 0.5f, 0.75f, 1.0f, 1.25f, 1.5f, 1.75f,
                               2.0f, 2.5f,  3.0f, 3.5f,  4.0f, 5.0f,  6.0f, 7.0f};
  switch (rng() % 6) {
    case 0:
      for (int i = 0; i < 16; ++i) v[i] = rng() % 2 ? 0.0f : -0.0f;
      return;
    case 1: {
      const float block_scale = e4m3_to_f32(static_cast<uint8_t>(1 + rng() % 0x7D)) * kv_scale;
      for (int i = 0; i < 16; ++i) v[i] = (rng() % 2 ? -1.0f : 1.0f) * grid[rng() % 16] * block_scale;
      v[rng() % 16] = (rng() % 2 ? -6.0f : 6.0f) * block_scale;
      return;
    }
    case 2:
      for (int i = 0; i < 16; ++i) v[i] = n(rng) * 1e-3f * kv_scale;
      return;
    case 3:
      for (int i = 0; i < 16; ++i) v[i] = n(rng) * 3e4f * kv_scale;
      return;
    case 4:
      for (int i = 0; i < 16; ++i) v[i] = n(rng) * 1e-2f * kv_scale;
      v[rng() % 16] = 40.0f * kv_scale;
      return;
    default: {
      const float mag = std::exp2(-20.0f + 40.0f * u(rng)) * kv_scale;
      for (int i = 0; i < 16; ++i) v[i] = n(rng) * mag;
    }
  }
}

// A tail value: Gaussian, zeros, the e4m3 saturation edge and beyond, infinities and NaN (the tail is encoded as the
// FP8 writer does, NaN included).
float tail_value(std::mt19937& rng, float kv_scale) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  static const float special[] = {0.0f, -0.0f, 448.0f, -464.0f, 1e6f, kInf, -kInf, kNaN};
  return rng() % 5 == 0 ? special[rng() % 8] * kv_scale : n(rng) * kv_scale;
}

// A random latent row [c ; tail] of C + R values.
std::vector<float> latent_row(std::mt19937& rng, int C, int R, float kv_scale, bool finite_tail = false) {
  std::vector<float> row(static_cast<size_t>(C + R));
  for (int b = 0; b < C / 16; ++b) latent_block(rng, kv_scale, row.data() + 16 * b);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int i = 0; i < R; ++i) row[static_cast<size_t>(C + i)] = finite_tail ? n(rng) * kv_scale : tail_value(rng, kv_scale);
  return row;
}

// ---------------------------------------------------------------- NVFP4 latent writer

struct WriteCase {
  int C, R;
  float kv_scale;
  int page_size, T;
};

std::string write_case_name(const ::testing::TestParamInfo<WriteCase>& info) {
  const WriteCase& w = info.param;
  return "C" + std::to_string(w.C) + "_R" + std::to_string(w.R) + "_scale" +
         std::to_string(static_cast<int>(w.kv_scale * 1000)) + "m_page" + std::to_string(w.page_size) + "_T" +
         std::to_string(w.T);
}

class Nvfp4LatentWrite : public ::testing::TestWithParam<WriteCase> {};

TEST_P(Nvfp4LatentWrite, MatchesCpuEncodingBitForBit) {
  REQUIRE_GPU();
  const WriteCase& wc = GetParam();
  const int C = wc.C, R = wc.R, T = wc.T;
  const int64_t entry = latent_format_bytes(LatentFormat::nvfp4, C, R), ldkv = C + R + 3;
  ASSERT_EQ(entry, C / 2 + C / 16 + R);
  std::mt19937 rng(7100 + C * 7 + R + T + wc.page_size);

  // A packed-cache-like pool: each page's latent entries followed by an index-key area; every byte a sentinel.
  const int num_pages = (T + wc.page_size - 1) / wc.page_size + 3;
  const int64_t page_stride = wc.page_size * entry + wc.page_size * 68;
  constexpr uint8_t kSentinel = 0xA5;
  std::vector<uint8_t> pool(static_cast<size_t>(num_pages * page_stride), kSentinel);

  std::vector<float> kv(static_cast<size_t>(T * ldkv), kNaN);  // the 3 padding values per row are never read
  for (int t = 0; t < T; ++t) {
    const std::vector<float> row = latent_row(rng, C, R, wc.kv_scale);
    std::copy(row.begin(), row.end(), kv.begin() + t * ldkv);
  }
  if (T > 3) {  // non-finite latent values, which the CPU rejects: the stand-in of fp4_cache.h
    kv[static_cast<size_t>(1 * ldkv + 5)] = kInf;
    kv[static_cast<size_t>(2 * ldkv + C - 1)] = kNaN;
  }
  // Distinct slots scattered over the pool; every fifth token (token 0 included when T > 1) skipped.
  std::vector<int64_t> all_slots(static_cast<size_t>(num_pages) * wc.page_size);
  std::iota(all_slots.begin(), all_slots.end(), 0);
  std::shuffle(all_slots.begin(), all_slots.end(), rng);
  std::vector<int64_t> slots(all_slots.begin(), all_slots.begin() + T);
  for (int t = 0; t < T; ++t)
    if (T > 1 && t % 5 == 0) slots[static_cast<size_t>(t)] = -1 - t;

  std::vector<uint8_t> expected = pool;
  int written = 0;
  for (int t = 0; t < T; ++t) {
    const int64_t slot = slots[static_cast<size_t>(t)];
    if (slot < 0) continue;
    ++written;
    cpu_write_nvfp4(kv.data() + t * ldkv, C, R, wc.kv_scale,
                    expected.data() + slot / wc.page_size * page_stride + slot % wc.page_size * entry);
  }
  ASSERT_GT(written, 0);

  DeviceBuffer<uint8_t> pool_d = to_device(pool);
  const DeviceBuffer<float> kv_d = to_device(kv);
  const DeviceBuffer<int64_t> slots_d = to_device(slots);
  mla_latent_write_nvfp4(kv_d.get(), ldkv, T, C, R, wc.kv_scale, slots_d.get(),
                         Pages{pool_d.get(), page_stride, wc.page_size}, nullptr);
  sync();
  const std::vector<uint8_t> got = to_host(pool_d);
  int64_t bad = 0;
  for (size_t b = 0; b < got.size(); ++b) {
    if (got[b] == expected[b]) continue;
    if (bad++ < 8)
      ADD_FAILURE() << "byte " << b << " (page " << static_cast<int64_t>(b) / page_stride << ", offset "
                    << static_cast<int64_t>(b) % page_stride << "): got 0x" << std::hex << int{got[b]}
                    << ", expected 0x" << int{expected[b]} << std::dec;
  }
  EXPECT_EQ(bad, 0) << "bytes differ from the CPU encoding (or were written outside the slots)";
}

INSTANTIATE_TEST_SUITE_P(Shapes, Nvfp4LatentWrite,
                         ::testing::Values(WriteCase{64, 16, 1.0f, 16, 77}, WriteCase{512, 64, 0.37f, 64, 45},
                                           WriteCase{512, 64, 4.0f / 448.0f, 16, 33}, WriteCase{48, 5, 2.5f, 16, 20},
                                           WriteCase{128, 0, 0.125f, 1, 9}, WriteCase{64, 16, 0.37f, 16, 1}),
                         write_case_name);

// ---------------------------------------------------------------- NVFP4 attention

// Requests' NVFP4 latent pages in a pool, handed out in a shuffled order with three unowned pages; each page is
// page_size entries followed by an index-key area. Bytes outside the requests' entries hold 0x7F, which decodes to
// NaN in a block scale or tail code, so that a read of a wrong row shows up. values: per request [ctx, C + R], the
// rows as read_latent decodes them. The rows are latent_row's varied blocks, or (gaussian) standard normal values as
// the attention test's bound assumes.
struct Nvfp4Pool {
  int page_size = 0, bt_stride = 0;
  int64_t entry = 0, page_stride = 0;
  std::vector<uint8_t> bytes;
  std::vector<int32_t> block_table;
  std::vector<std::vector<float>> values;

  Nvfp4Pool(std::mt19937& rng, const std::vector<int>& ctx, int page_size_, int C, int R, float kv_scale,
            bool gaussian)
      : page_size(page_size_),
        entry(latent_format_bytes(LatentFormat::nvfp4, C, R)),
        page_stride(page_size_ * entry + page_size_ * 68) {
    ScatteredPages pages = scatter_pages(rng, ctx, page_size, /*spare_columns=*/1);
    bt_stride = pages.bt_stride;
    block_table = std::move(pages.block_table);
    bytes.assign(static_cast<size_t>(pages.total_pages * page_stride), 0x7F);
    values.resize(ctx.size());
    for (size_t r = 0; r < ctx.size(); ++r) {
      values[r].resize(static_cast<size_t>(ctx[r]) * (C + R));
      for (int s = 0; s < ctx[r]; ++s) {
        uint8_t* e = bytes.data() + int64_t{block_table[r * bt_stride + s / page_size]} * page_stride +
                     int64_t{s % page_size} * entry;
        std::vector<float> row = latent_row(rng, C, R, kv_scale, /*finite_tail=*/true);
        std::normal_distribution<float> n(0.0f, 1.0f);
        if (gaussian)
          for (int i = 0; i < C + R; ++i) row[static_cast<size_t>(i)] = n(rng) * (i < C ? 1.0f : 0.5f);
        cpu_write_nvfp4(row.data(), C, R, kv_scale, e);
        cpu_read_nvfp4(e, C, R, kv_scale, values[r].data() + static_cast<size_t>(s) * (C + R));
      }
    }
  }
};

// A query row at position 0 of a context of one attends to one entry with probability exactly 1 (exp(0) = 1, a sum
// of 1), so its output is the entry's decoded c part itself: the GPU's NVFP4 decode against read_latent's, exactly
// (as values: the kernel's 1 * v + 0 turns a -0 into +0).
TEST(Nvfp4Attend, DecodeMatchesReadLatentExactly) {
  REQUIRE_GPU();
  for (const auto& [C, R] : {std::pair{64, 16}, std::pair{512, 64}, std::pair{48, 5}}) {
    SCOPED_TRACE("C " + std::to_string(C) + ", R " + std::to_string(R));
    std::mt19937 rng(8200 + C + R);
    const int requests = 150, H = 3;
    const float kv_scale = 0.37f;
    const Nvfp4Pool pool(rng, std::vector<int>(requests, 1), 16, C, R, kv_scale, /*gaussian=*/false);
    std::vector<int32_t> row_req(requests), row_pos(requests, 0);
    std::iota(row_req.begin(), row_req.end(), 0);
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::vector<float> q(static_cast<size_t>(requests) * H * (C + R));
    for (float& v : q) v = n(rng) * 0.01f;
    const DeviceBuffer<uint8_t> pool_d = to_device(pool.bytes);
    const DeviceBuffer<int32_t> bt_d = to_device(pool.block_table), req_d = to_device(row_req),
                                pos_d = to_device(row_pos);
    const DeviceBuffer<float> q_d = to_device(q);
    DeviceBuffer<float> out_d = to_device(std::vector<float>(static_cast<size_t>(requests) * H * C,
                                                             std::bit_cast<float>(kPoisonBits)));
    DeviceBuffer<float> lse_d(static_cast<size_t>(requests) * H);
    mla_attend_generic(q_d.get(), requests, H, C, R, LatentEntry::nvfp4, req_d.get(), pos_d.get(),
                       Pages{pool_d.get(), pool.page_stride, pool.page_size}, BlockTable{bt_d.get(), pool.bt_stride},
                       kv_scale, 0.1f, nullptr, 0, out_d.get(), lse_d.get(), nullptr);
    sync();
    const std::vector<float> out = to_host(out_d);
    int64_t bad = 0, nonzero = 0;
    for (int r = 0; r < requests; ++r)
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < C; ++c) {
          const float g = out[(static_cast<size_t>(r) * H + h) * C + c], want = pool.values[r][static_cast<size_t>(c)];
          nonzero += want != 0.0f;
          if (!(g == want) && bad++ < 8)
            ADD_FAILURE() << "request " << r << " head " << h << " value " << c << ": " << g << " vs " << want;
        }
    EXPECT_EQ(bad, 0);
    EXPECT_GT(nonzero, int64_t{requests} * C / 8);
  }
}

class Nvfp4AttendGeneric : public ::testing::TestWithParam<AttendCase> {};

// mla_attend_generic over an NVFP4 latent against cpu::mla_attend_absorbed over the rows read_latent decodes.
TEST_P(Nvfp4AttendGeneric, MatchesCpuWithinBound) {
  REQUIRE_GPU();
  const AttendCase& ac = GetParam();
  const int C = ac.C, R = ac.R, H = ac.H, width = C + R;
  std::mt19937 rng(9300 + C + R * 3 + H * 17 + ac.page_size * 5 + (ac.sparse ? 1 : 0));
  std::normal_distribution<float> n(0.0f, 1.0f);
  const float kv_scale = 0.37f;
  const float softmax_scale = 1.5f / std::sqrt(static_cast<float>(width));

  // Decode rows of requests with contexts 301, 1 and 70 around a prefill chunk (positions 45..63 of 64) and a first
  // chunk (positions 0..4 of 5).
  const std::vector<int> ctx = {301, 64, 1, 5, 70};
  std::vector<int32_t> row_req, row_pos;
  auto add = [&](int r, int p) {
    row_req.push_back(r);
    row_pos.push_back(p);
  };
  add(0, 300);
  for (int p = 45; p < 64; ++p) add(1, p);
  add(2, 0);
  for (int p = 0; p < 5; ++p) add(3, p);
  add(4, 69);
  const int rows = static_cast<int>(row_req.size());
  const Nvfp4Pool pool(rng, ctx, ac.page_size, C, R, kv_scale, /*gaussian=*/true);
  std::vector<float> q(static_cast<size_t>(rows) * H * width);
  for (float& v : q) v = n(rng);

  // Index lists of k = 40 in random order: mostly causal positions, some -1, some past the row, some repeats.
  constexpr int k = 40;
  const std::vector<int32_t> indices =
      ac.sparse ? random_index_lists(rng, row_req, row_pos, k, /*empty_request=*/-1) : std::vector<int32_t>();

  const DeviceBuffer<uint8_t> pool_d = to_device(pool.bytes);
  const DeviceBuffer<int32_t> bt_d = to_device(pool.block_table), req_d = to_device(row_req),
                              pos_d = to_device(row_pos);
  const DeviceBuffer<float> q_d = to_device(q);
  DeviceBuffer<int32_t> idx_d = ac.sparse ? to_device(indices) : DeviceBuffer<int32_t>();
  DeviceBuffer<float> out_d = to_device(std::vector<float>(static_cast<size_t>(rows) * H * C,
                                                           std::bit_cast<float>(kPoisonBits)));
  DeviceBuffer<float> lse_d = to_device(std::vector<float>(static_cast<size_t>(rows) * H,
                                                           std::bit_cast<float>(kPoisonBits)));
  mla_attend_generic(q_d.get(), rows, H, C, R, LatentEntry::nvfp4, req_d.get(), pos_d.get(),
                     Pages{pool_d.get(), pool.page_stride, pool.page_size}, BlockTable{bt_d.get(), pool.bt_stride},
                     kv_scale, softmax_scale, ac.sparse ? idx_d.get() : nullptr, ac.sparse ? k : 0, out_d.get(),
                     lse_d.get(), nullptr);
  sync();
  const std::vector<float> out = to_host(out_d), lse = to_host(lse_d);

  // Bound, as for the FP8 latent (mla_glue_test): both sides are fp32 over the same decoded values with different
  // summation orders, so the scores differ by a few 1e-7 absolute at these magnitudes, lse by about as much and out
  // by a few 1e-7 * max|value| of the attended rows: 1e-5 relative leaves an order of magnitude.
  const AttendErrors e =
      check_attend_against_cpu(q, H, C, R, row_req, row_pos, pool.values, ac.sparse ? indices.data() : nullptr, k,
                               softmax_scale, out, lse, /*name_request=*/false);
  EXPECT_EQ(e.poisoned, 0) << "outputs never written";
  EXPECT_EQ(e.bad, 0) << "elements over the bound";
  print_attend_errors("mla_attend_generic nvfp4", attend_case_name({GetParam(), 0}), e);
}

std::vector<AttendCase> attend_cases() {
  std::vector<AttendCase> cases;
  for (const auto& [C, R] : {std::pair{64, 16}, std::pair{512, 64}})
    for (int H : {1, 12})
      for (int page_size : {16, 64})
        for (bool sparse : {false, true}) cases.push_back({C, R, H, page_size, sparse});
  cases.push_back({48, 5, 9, 16, true});  // C not a multiple of 32, an odd tail
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, Nvfp4AttendGeneric, ::testing::ValuesIn(attend_cases()), attend_case_name);

// ---------------------------------------------------------------- MXFP4 index keys: pages

// Requests' MXFP4 index-key pages in a pool, handed out in a shuffled order, each followed by a gap: page_size keys
// of D / 2 packed bytes, then page_size keys of D / 32 exponents.
struct Mxfp4KeyPool {
  int D = 0, page_size = 0, bt_stride = 1;
  int64_t page_stride = 0;
  std::vector<uint8_t> bytes;
  std::vector<int32_t> block_table;

  Mxfp4KeyPool(std::mt19937& rng, const std::vector<int>& ctx, int D_, int page_size_, uint8_t fill)
      : D(D_), page_size(page_size_), page_stride(int64_t{page_size_} * (D_ / 2 + D_ / 32) + 48) {
    ScatteredPages pages = scatter_pages(rng, ctx, page_size, /*spare_columns=*/0);
    bt_stride = pages.bt_stride;
    block_table = std::move(pages.block_table);
    bytes.assign(static_cast<size_t>(pages.total_pages * page_stride), fill);
  }
  int64_t slot(int r, int pos) const {
    return int64_t{block_table[static_cast<size_t>(r) * bt_stride + pos / page_size]} * page_size + pos % page_size;
  }
  uint8_t* packed(int64_t slot) { return bytes.data() + slot / page_size * page_stride + slot % page_size * (D / 2); }
  uint8_t* exponents(int64_t slot) {
    return bytes.data() + slot / page_size * page_stride + int64_t{page_size} * (D / 2) + slot % page_size * (D / 32);
  }
};

// ---------------------------------------------------------------- MXFP4 key writer

// Gaussian values times a magnitude from tiny to large, sometimes with one outlier (its block's exponent then
// differs from the others' and the small values of its block go to 0).
std::vector<float> random_key(std::mt19937& rng, int D) {
  static const float magnitudes[] = {1e-30f, 3e-5f, 1e-2f, 1.0f, 37.0f, 3e4f};
  std::normal_distribution<float> n(0.0f, 1.0f);
  const float mag = magnitudes[rng() % 6];
  std::vector<float> x(static_cast<size_t>(D));
  for (float& v : x) v = n(rng) * mag;
  if (rng() % 3 == 0) x[rng() % D] *= 3000.0f;
  return x;
}

// A key whose Hadamard transform lies on e2m1 rounding midpoints of its blocks' scale 2^e: z e_0 + z2 e_{D/2}
// transforms to fl((z + z2) norm) on the first half and fl((z - z2) norm) on the second. The larger value is 5 * 2^e
// (the amax: halfway between 4 and 6), the smaller a lower midpoint (0.25 .. 3.5) times 2^e.
std::vector<float> tie_key(std::mt19937& rng, int D) {
  static const float low_midpoints[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f};
  const float norm = inv_sqrt(D);
  std::vector<float> x(static_cast<size_t>(D), 0.0f);
  for (int attempt = 0; attempt < 16; ++attempt) {
    const float unit = std::ldexp(1.0f, static_cast<int>(rng() % 41) - 20);
    const float m1 = (rng() % 2 ? -5.0f : 5.0f) * unit, m2 = (rng() % 2 ? -1.0f : 1.0f) * low_midpoints[rng() % 6] * unit;
    const std::optional<float> a = preimage(m1, norm), b = preimage(m2, norm);
    if (!a || !b) continue;
    const float z = static_cast<float>((static_cast<double>(*a) + *b) / 2);
    const float z2 = static_cast<float>((static_cast<double>(*a) - *b) / 2);
    if (z + z2 != *a || z - z2 != *b) continue;
    x[0] = z;
    x[static_cast<size_t>(D / 2)] = z2;
    return x;
  }
  return x;  // all zeros: still a valid key
}

TEST(Mxfp4KeyWriter, MatchesCpuEncodingBitForBit) {
  REQUIRE_GPU();
  int64_t ties = 0, saturated = 0;
  for (const int D : {32, 64, 128, 256}) {
    SCOPED_TRACE("D " + std::to_string(D));
    std::mt19937 rng(600 + D);
    const int T = 157;
    std::vector<float> keys(static_cast<size_t>(T) * D);
    for (int t = 0; t < T; ++t) {
      const std::vector<float> x = rng() % 3 == 0 ? tie_key(rng, D) : random_key(rng, D);
      std::copy(x.begin(), x.end(), keys.begin() + int64_t{t} * D);
    }
    std::fill_n(keys.begin(), D, 0.0f);  // an all-zero key: exponent -127 in every block, every code 0
    const int non_finite = 11;
    keys[int64_t{non_finite} * D + 3] = -kInf;

    // Every token of one request at shuffled positions of a 16-token paged pool; token 7 is skipped.
    Mxfp4KeyPool pool(rng, {T + 20}, D, 16, 0xA5);
    std::vector<int> pos_of(T);
    std::iota(pos_of.begin(), pos_of.end(), 0);
    std::shuffle(pos_of.begin(), pos_of.end(), rng);
    std::vector<int64_t> slots(T);
    for (int t = 0; t < T; ++t) slots[t] = pool.slot(0, pos_of[t]);
    slots[7] = -1;

    Mxfp4KeyPool want = pool;
    for (int t = 0; t < T; ++t) {
      if (slots[t] < 0) continue;
      if (t == non_finite) {  // the CPU throws here; the kernel's documented stand-in
        std::fill_n(want.packed(slots[t]), D / 2, uint8_t{0});
        std::fill_n(want.exponents(slots[t]), D / 32, uint8_t{0xFF});
        continue;
      }
      std::vector<float> v(keys.begin() + int64_t{t} * D, keys.begin() + int64_t{t + 1} * D);
      cpu::hadamard_inplace(v.data(), D);
      mxfp4_encode(v.data(), D, want.packed(slots[t]), want.exponents(slots[t]));
      const uint8_t* e = want.exponents(slots[t]);
      for (int i = 0; i < D; ++i) {
        const float scaled = std::ldexp(v[i], 127 - int{e[i / 32]});
        ties += e2m1_midpoint(scaled);
        saturated += std::fabs(scaled) > 6.0f;
      }
    }

    const DeviceBuffer<float> keys_d = to_device(keys);
    const DeviceBuffer<int64_t> slots_d = to_device(slots);
    DeviceBuffer<uint8_t> pool_d = to_device(pool.bytes);
    index_key_write_mxfp4(keys_d.get(), T, D, slots_d.get(), Pages{pool_d.get(), pool.page_stride, pool.page_size},
                          nullptr);
    sync();
    const std::vector<uint8_t> got = to_host(pool_d);
    int64_t mismatches = 0;
    for (size_t i = 0; i < got.size(); ++i) mismatches += got[i] != want.bytes[i];
    EXPECT_EQ(mismatches, 0);
  }
  // The inputs must really have hit e2m1 rounding midpoints and the saturation at 6.
  EXPECT_GT(ties, 200);
  EXPECT_GT(saturated, 200);
}

// ---------------------------------------------------------------- MXFP4 scores and top-k

// An MXFP4 key written directly (not through the writer): random e2m1 codes, and block exponents below a largest
// e_max by 0 to 40, so that blocks more than 14 below it (where mxfp4_key_as_fp8's e4m3 rounds, or flushes to 0) are
// common. e_max mostly mid-range; sometimes at the low end of E8M0 (below 7 the scale is an fp32 subnormal) or high
// (160: scores near 2^50, still finite, so that top-k ranks finite values).
void random_mxfp4_key(std::mt19937& rng, int D, uint8_t* packed, uint8_t* exponents) {
  static const int extremes[] = {0, 1, 6, 7, 160};
  const int e_max = rng() % 5 == 0 ? extremes[rng() % 5] : 110 + static_cast<int>(rng() % 31);
  for (int b = 0; b < D / 32; ++b) {
    const int drop = rng() % 3 == 0 ? 0 : static_cast<int>(rng() % (rng() % 2 ? 15 : 41));
    exponents[b] = static_cast<uint8_t>(std::max(e_max - drop, 0));
  }
  exponents[rng() % (D / 32)] = static_cast<uint8_t>(e_max);
  const bool zeros = rng() % 10 == 0;
  for (int i = 0; i < D / 2; ++i) packed[i] = zeros ? 0 : static_cast<uint8_t>(rng());
}

struct Mxfp4ScoreRun : ScoreRun {
  int64_t rounded_keys = 0;  // keys with a block more than 14 below e_max
};

// One case: MXFP4 keys in a pool (some repeated, so that scores tie exactly; one with the E8M0 NaN), FP8 queries with
// one NaN head, the GPU's scores over the MXFP4 pages and the CPU's over mxfp4_key_as_fp8's codes and scales.
Mxfp4ScoreRun run_scores(const ScoreCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int batch = static_cast<int>(c.ctx.size()), D = c.D, H = c.H;
  Mxfp4KeyPool pool(rng, c.ctx, D, c.page_size, 0x5A);
  Mxfp4ScoreRun run;
  for (int r = 0; r < batch; ++r)
    for (int p = 0; p < c.ctx[r]; ++p) {
      const int64_t slot = pool.slot(r, p);
      if (p >= 2 && rng() % 5 == 0) {  // a repeat of an earlier key of the request: an exact score tie
        const int64_t from = pool.slot(r, static_cast<int>(rng() % p));
        std::memcpy(pool.packed(slot), pool.packed(from), static_cast<size_t>(D / 2));
        std::memcpy(pool.exponents(slot), pool.exponents(from), static_cast<size_t>(D / 32));
        continue;
      }
      random_mxfp4_key(rng, D, pool.packed(slot), pool.exponents(slot));
    }
  const bool nan_key = c.ctx[0] > 3;
  if (nan_key) pool.exponents(pool.slot(0, 2))[0] = 0xFF;

  run.rows = batch * c.n_q;
  run.stride = c.max_ctx + 5;
  std::vector<uint8_t> q(static_cast<size_t>(run.rows) * H * D);
  random_codes(rng, q.data(), q.size());
  q[static_cast<size_t>(H * D + 1)] = 0x7F;  // row 1, head 0: a NaN query code
  std::vector<float> w(static_cast<size_t>(run.rows) * H);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (float& x : w) x = rng() % 10 == 0 ? 0.0f : n(rng);

  run.want.assign(static_cast<size_t>(run.rows * run.stride), std::bit_cast<float>(kPoisonBits));
  for (int r = 0; r < batch; ++r) {
    const int ctx = std::min(c.ctx[r], c.max_ctx);
    std::vector<uint8_t> k_codes(static_cast<size_t>(ctx) * D);
    std::vector<float> k_scales(static_cast<size_t>(ctx));
    for (int p = 0; p < ctx; ++p) {
      const int64_t slot = pool.slot(r, p);
      const uint8_t* e = pool.exponents(slot);
      const int e_max = *std::max_element(e, e + D / 32), e_min = *std::min_element(e, e + D / 32);
      run.rounded_keys += e_max - e_min > 14;
      if (e_max == 0xFF) {  // the E8M0 NaN: NaN codes (every score NaN), as fp4_cache.h documents
        std::fill_n(k_codes.begin() + int64_t{p} * D, D, uint8_t{0x7F});
        k_scales[static_cast<size_t>(p)] = kNaN;
        continue;
      }
      k_scales[static_cast<size_t>(p)] = cpu_mxfp4_key_as_fp8(pool.packed(slot), e, D, k_codes.data() + int64_t{p} * D);
    }
    for (int i = 0; i < c.n_q; ++i) {
      const int64_t row = int64_t{r} * c.n_q + i;
      const int pos = ctx - c.n_q + i;
      float* out = run.want.data() + row * run.stride;
      if (pos >= 0)
        cpu::indexer_scores(q.data() + row * H * D, w.data() + row * H, H, D, k_codes.data(), k_scales.data(), pos + 1,
                            out);
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
                       run.stride, nullptr, IndexKeyFormat::mxfp4);
  sync();
  run.got = to_host(run.scores_d);
  return run;
}

std::vector<ScoreCase> score_cases() {
  return {
      {32, 4, 16, 1, {1, 300, 17, 128, 129, 64}, 300},  // decode rows, the tiny kimi_k3 indexer
      {32, 4, 16, 5, {5, 300, 41, 6}, 300},             // prompt-like rows, a context of exactly n_q
      {128, 32, 64, 1, {1, 300, 200, 33}, 300},         // the small kimi_k3 indexer's shape
      {128, 64, 16, 3, {3, 300, 97}, 320},              // 64 heads (8192 query bytes); max_ctx above every context
      {256, 16, 16, 2, {250, 2}, 256},
      {64, 8, 16, 4, {300, 100}, 256},                  // a context past max_ctx, cut to it
  };
}

TEST(Mxfp4Scores, MatchCpuIndexerScoresBitForBit) {
  REQUIRE_GPU();
  uint32_t seed = 700;
  for (const ScoreCase& c : score_cases()) {
    SCOPED_TRACE("D " + std::to_string(c.D) + ", H " + std::to_string(c.H) + ", n_q " + std::to_string(c.n_q) +
                 ", max_ctx " + std::to_string(c.max_ctx));
    const Mxfp4ScoreRun run = run_scores(c, seed++);
    const ScoreCounts n = compare_scores(run);
    EXPECT_EQ(n.mismatches, 0);
    EXPECT_GT(n.nan, 0);  // the NaN key and the NaN query head were scored
    EXPECT_GT(n.finite, 0);
    if (c.D > 32) {
      EXPECT_GT(run.rounded_keys, 10);  // keys whose conversion rounds were among them
    }
  }
}

TEST(Mxfp4Scores, TopkOverMxfp4ScoresMatchesCpuTopk) {
  REQUIRE_GPU();
  uint32_t seed = 700;  // the same inputs as the scores test
  for (const ScoreCase& c : score_cases()) {
    const Mxfp4ScoreRun run = run_scores(c, seed++);
    if (*std::max_element(c.ctx.begin(), c.ctx.end()) > c.max_ctx) continue;  // top-k takes uncut contexts
    expect_topk_matches_cpu(c, run);
  }
}

// ---------------------------------------------------------------- sizes and argument checks

TEST(Fp4CacheFormats, EntryBytes) {
  // docs/engine.md: 576 B (fp8) and 352 B (nvfp4) at C = 512, R = 64; tiny models: 80 and 52 B at C = 64, R = 16.
  EXPECT_EQ(latent_format_bytes(LatentFormat::fp8, 512, 64), 576);
  EXPECT_EQ(latent_format_bytes(LatentFormat::nvfp4, 512, 64), 352);
  EXPECT_EQ(latent_format_bytes(LatentFormat::fp8, 64, 16), 80);
  EXPECT_EQ(latent_format_bytes(LatentFormat::nvfp4, 64, 16), 52);
  EXPECT_THROW(latent_format_bytes(LatentFormat::nvfp4, 40, 16), Error);
}

TEST(Fp4CacheArguments, BadArgumentsThrow) {
  // Fake, never dereferenced pointers: each call below fails its checks before anything reaches the device.
  auto* fake_f = reinterpret_cast<float*>(uintptr_t{256});
  auto* fake_b = reinterpret_cast<uint8_t*>(uintptr_t{256});
  auto* fake_l = reinterpret_cast<int64_t*>(uintptr_t{256});
  const Pages latent_pages{fake_b, 16 * 52, 16};
  EXPECT_THROW(mla_latent_write_nvfp4(fake_f, 80, 4, 40, 16, 1.0f, fake_l, latent_pages, nullptr), Error);  // C % 16
  EXPECT_THROW(mla_latent_write_nvfp4(fake_f, 80, 4, 64, 16, kInf, fake_l, latent_pages, nullptr), Error);
  EXPECT_THROW(mla_latent_write_nvfp4(fake_f, 80, 4, 64, 16, 1e37f, fake_l, latent_pages, nullptr), Error);  // 448x
  EXPECT_THROW(mla_latent_write_nvfp4(fake_f, 79, 4, 64, 16, 1.0f, fake_l, latent_pages, nullptr), Error);
  EXPECT_THROW(mla_latent_write_nvfp4(fake_f, 80, 4, 64, 16, 1.0f, fake_l, Pages{fake_b, 16 * 52 - 1, 16}, nullptr),
               Error);
  EXPECT_THROW(index_key_write_mxfp4(fake_f, 4, 16, fake_l, Pages{fake_b, 16 * 9, 16}, nullptr), Error);  // D < 32
  EXPECT_THROW(index_key_write_mxfp4(fake_f, 4, 48, fake_l, Pages{fake_b, 16 * 48, 16}, nullptr), Error);
  EXPECT_THROW(index_key_write_mxfp4(fake_f, 4, 64, fake_l, Pages{fake_b, 16 * 34 - 1, 16}, nullptr), Error);
  // The NVFP4 attention needs pages as wide as its entries.
  auto* fake_i = reinterpret_cast<int32_t*>(uintptr_t{256});
  EXPECT_THROW(mla_attend_generic(fake_f, 3, 4, 64, 16, LatentEntry::nvfp4, fake_i, fake_i,
                                  Pages{fake_b, 16 * 52 - 4, 16}, BlockTable{fake_i, 4}, 1.0f, 0.1f, nullptr, 0, fake_f,
                                  fake_f, nullptr),
               Error);
  IndexQueries q;
  q.batch = 1;
  q.heads = 4;
  q.codes = fake_b;
  q.weights = fake_f;
  EXPECT_THROW(index_scores_generic(q, 16, Pages{fake_b, 16 * 12, 16}, BlockTable{fake_i, 4}, fake_i, 10, fake_f, 10,
                                    nullptr, IndexKeyFormat::mxfp4),
               Error);
}

}  // namespace
}  // namespace kestrel::cuda
