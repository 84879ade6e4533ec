// GPU tests of src/kernels/cuda/mla_glue.h: the FP8 latent writer bit for bit against MlaCore::write_latent's
// encoding, the bf16 latent writer bit for bit against f32_to_bf16, the generic absorbed attention over Kimi's FP8
// and the bf16 entry against cpu::mla_attend_absorbed on the decoded rows (scattered pages, a batch mixing prefill
// and decode rows, dense and with index lists; the bf16 entry at every width, kv_lora_rank 64 included), the bf16
// writer's entries read back by the attention, and the bf16 row conversion bit for bit against f32_to_bf16.
#include "kernels/cuda/mla_glue.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/runtime.h"
#include "attend_check.h"
#include "cuda_test_util.h"

namespace kestrel::cuda {
namespace {

using namespace test_util;

// MlaCore::write_latent's encoding of one value (fp8 latent, Kimi layout).
uint8_t cpu_latent_code(float v, float kv_scale) { return f32_to_e4m3(std::clamp(v / kv_scale, -kE4m3Max, kE4m3Max)); }

// ---------------------------------------------------------------- latent writer

struct WriteCase {
  int C, R;
  float kv_scale;
  int page_size;
  int T;
};

std::string write_case_name(const ::testing::TestParamInfo<WriteCase>& info) {
  const WriteCase& w = info.param;
  return "C" + std::to_string(w.C) + "_R" + std::to_string(w.R) + "_scale" +
         std::to_string(static_cast<int>(w.kv_scale * 1000)) + "m_page" + std::to_string(w.page_size) + "_T" +
         std::to_string(w.T);
}

// A value drawn to exercise every path of the encoding, relative to kv_scale: log-uniform magnitudes from far below
// e4m3's smallest subnormal to far beyond 448, exact midpoints between neighbouring codes (ties to even), the
// saturation edge, and specials (+-0, +-inf, NaN of both signs, fp32 subnormals, FLT_MAX).
float write_value(std::mt19937& rng, float kv_scale) {
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const float sign = rng() % 2 ? -1.0f : 1.0f;
  switch (rng() % 8) {
    case 0: {
      static const float kSpecial[] = {0.0f, -0.0f, kInf, -kInf, kNaN, -kNaN, 1e-40f, -1e-40f,
                                       std::numeric_limits<float>::max(), -std::numeric_limits<float>::max()};
      return kSpecial[rng() % std::size(kSpecial)];
    }
    case 1: {  // midpoint of two neighbouring finite codes, or the saturation edge
      static const float kEdge[] = {448.0f, 464.0f, 449.0f, 480.0f, 1e6f};
      if (rng() % 4 == 0) return sign * kEdge[rng() % std::size(kEdge)] * kv_scale;
      const uint8_t c = static_cast<uint8_t>(rng() % 0x7E);
      return sign * 0.5f * (e4m3_to_f32(c) + e4m3_to_f32(static_cast<uint8_t>(c + 1))) * kv_scale;
    }
    default:
      return sign * std::exp2(-14.0f + 26.0f * u(rng)) * kv_scale;
  }
}

class MlaLatentWriteFp8 : public ::testing::TestWithParam<WriteCase> {};

TEST_P(MlaLatentWriteFp8, MatchesCpuEncodingBitForBit) {
  REQUIRE_GPU();
  const WriteCase& wc = GetParam();
  const int width = wc.C + wc.R, T = wc.T;
  const int64_t ldkv = width + 3;
  std::mt19937 rng(9100 + wc.C * 7 + wc.R + wc.T + wc.page_size);

  // A packed-cache-like pool: each page holds page_size latent entries followed by other data (index keys here),
  // so the page stride is larger than the latent part. Every byte starts as a sentinel.
  const int num_pages = (T + wc.page_size - 1) / wc.page_size + 3;
  const int64_t page_stride = int64_t{wc.page_size} * width + int64_t{wc.page_size} * 132;
  constexpr uint8_t kSentinel = 0xA5;
  std::vector<uint8_t> pool(static_cast<size_t>(num_pages * page_stride), kSentinel);

  std::vector<float> kv(static_cast<size_t>(T * ldkv));
  for (float& v : kv) v = write_value(rng, wc.kv_scale);
  // Distinct slots scattered over the pool; every fifth token (and token 0 when T > 1) is skipped by a negative slot.
  std::vector<int64_t> all_slots(static_cast<size_t>(num_pages) * wc.page_size);
  std::iota(all_slots.begin(), all_slots.end(), 0);
  std::shuffle(all_slots.begin(), all_slots.end(), rng);
  std::vector<int64_t> slots(all_slots.begin(), all_slots.begin() + T);
  for (int t = 0; t < T; ++t)
    if (T > 1 && t % 5 == 0) slots[static_cast<size_t>(t)] = t == 0 ? -1 : -1 - t;

  std::vector<uint8_t> expected = pool;
  int written = 0;
  for (int t = 0; t < T; ++t) {
    const int64_t slot = slots[static_cast<size_t>(t)];
    if (slot < 0) continue;
    ++written;
    uint8_t* e = expected.data() + slot / wc.page_size * page_stride + slot % wc.page_size * width;
    for (int i = 0; i < width; ++i) e[i] = cpu_latent_code(kv[static_cast<size_t>(t * ldkv + i)], wc.kv_scale);
  }
  ASSERT_GT(written, 0);

  DeviceBuffer<uint8_t> pool_d = to_device(pool);
  const DeviceBuffer<float> kv_d = to_device(kv);
  const DeviceBuffer<int64_t> slots_d = to_device(slots);
  mla_latent_write_fp8(kv_d.get(), ldkv, T, wc.C, wc.R, wc.kv_scale, slots_d.get(),
                       Pages{pool_d.get(), page_stride, wc.page_size}, nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = to_host(pool_d);

  int64_t bad = 0;
  for (size_t b = 0; b < got.size(); ++b) {
    if (got[b] == expected[b]) continue;
    if (bad++ < 8) {
      const int64_t page = static_cast<int64_t>(b) / page_stride, in_page = static_cast<int64_t>(b) % page_stride;
      ADD_FAILURE() << "byte " << b << " (page " << page << ", offset " << in_page << "): got 0x" << std::hex
                    << int{got[b]} << ", expected 0x" << int{expected[b]} << std::dec;
    }
  }
  EXPECT_EQ(bad, 0) << "bytes differ from the CPU encoding (or were written outside the slots)";
}

INSTANTIATE_TEST_SUITE_P(Shapes, MlaLatentWriteFp8,
                         ::testing::Values(WriteCase{64, 16, 1.0f, 16, 77}, WriteCase{128, 16, 0.37f, 64, 150},
                                           WriteCase{512, 64, 4.0f / 448.0f, 64, 45},
                                           WriteCase{512, 64, 0.125f, 16, 33}, WriteCase{37, 5, 2.5f, 16, 20},
                                           WriteCase{64, 16, 0.37f, 16, 1}),
                         write_case_name);

// ---------------------------------------------------------------- bf16 latent writer

// A value drawn to exercise every path of f32_to_bf16: random bit patterns (every exponent, NaNs with payloads in
// either half, infinities, subnormals), values whose dropped half is exactly a tie (to even, both ways), values near
// FLT_MAX that round to inf, and ordinary values.
float bf16_test_value(std::mt19937& rng) {
  std::normal_distribution<float> n(0.0f, 3.0f);
  switch (rng() % 4) {
    case 0: return std::bit_cast<float>(static_cast<uint32_t>(rng()));
    case 1: return std::bit_cast<float>((static_cast<uint32_t>(rng()) & 0xFFFF0000u) | 0x8000u);
    case 2: return (rng() % 2 ? 1.0f : -1.0f) * std::numeric_limits<float>::max() * (1.0f - 1e-3f * (rng() % 3));
    default: return n(rng);
  }
}

struct Bf16WriteCase {
  int C, R, page_size, T;
};

std::string bf16_write_case_name(const ::testing::TestParamInfo<Bf16WriteCase>& info) {
  const Bf16WriteCase& w = info.param;
  std::string name = "C";
  name.append(std::to_string(w.C)).append("_R").append(std::to_string(w.R)).append("_page");
  name.append(std::to_string(w.page_size)).append("_T").append(std::to_string(w.T));
  return name;
}

class MlaLatentWriteBf16 : public ::testing::TestWithParam<Bf16WriteCase> {};

// Every written entry is f32_to_bf16 of its row, little-endian words at 2 (C + R) bytes per row of its slot's page;
// every other byte of the pool (skipped tokens, the index-key area of each page, unused rows) keeps its sentinel.
TEST_P(MlaLatentWriteBf16, MatchesCpuEncodingBitForBit) {
  REQUIRE_GPU();
  const Bf16WriteCase& wc = GetParam();
  const int width = wc.C + wc.R, T = wc.T;
  const int64_t entry = bf16_latent_entry_bytes(wc.C, wc.R), ldkv = width + 5;
  std::mt19937 rng(9700 + wc.C * 7 + wc.R + wc.T + wc.page_size);

  const int num_pages = (T + wc.page_size - 1) / wc.page_size + 3;
  const int64_t page_stride = int64_t{wc.page_size} * entry + int64_t{wc.page_size} * 132;
  constexpr uint8_t kSentinel = 0xA5;
  std::vector<uint8_t> pool(static_cast<size_t>(num_pages * page_stride), kSentinel);

  std::vector<float> kv(static_cast<size_t>(T * ldkv));
  for (float& v : kv) v = bf16_test_value(rng);
  std::vector<int64_t> all_slots(static_cast<size_t>(num_pages) * wc.page_size);
  std::iota(all_slots.begin(), all_slots.end(), 0);
  std::shuffle(all_slots.begin(), all_slots.end(), rng);
  std::vector<int64_t> slots(all_slots.begin(), all_slots.begin() + T);
  for (int t = 0; t < T; ++t)
    if (T > 1 && t % 5 == 0) slots[static_cast<size_t>(t)] = t == 0 ? -1 : -1 - t;

  std::vector<uint8_t> expected = pool;
  int written = 0;
  for (int t = 0; t < T; ++t) {
    const int64_t slot = slots[static_cast<size_t>(t)];
    if (slot < 0) continue;
    ++written;
    uint8_t* e = expected.data() + slot / wc.page_size * page_stride + slot % wc.page_size * entry;
    for (int i = 0; i < width; ++i) {
      const uint16_t b = f32_to_bf16(kv[static_cast<size_t>(t * ldkv + i)]);
      e[2 * i] = static_cast<uint8_t>(b & 0xFF);
      e[2 * i + 1] = static_cast<uint8_t>(b >> 8);
    }
  }
  ASSERT_GT(written, 0);

  DeviceBuffer<uint8_t> pool_d = to_device(pool);
  const DeviceBuffer<float> kv_d = to_device(kv);
  const DeviceBuffer<int64_t> slots_d = to_device(slots);
  mla_latent_write_bf16(kv_d.get(), ldkv, T, wc.C, wc.R, slots_d.get(), Pages{pool_d.get(), page_stride, wc.page_size},
                        nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = to_host(pool_d);

  int64_t bad = 0;
  for (size_t b = 0; b < got.size(); ++b) {
    if (got[b] == expected[b]) continue;
    if (bad++ < 8) {
      const int64_t page = static_cast<int64_t>(b) / page_stride, in_page = static_cast<int64_t>(b) % page_stride;
      ADD_FAILURE() << "byte " << b << " (page " << page << ", offset " << in_page << "): got 0x" << std::hex
                    << int{got[b]} << ", expected 0x" << int{expected[b]} << std::dec;
    }
  }
  EXPECT_EQ(bad, 0) << "bytes differ from f32_to_bf16 (or were written outside the slots)";
}

INSTANTIATE_TEST_SUITE_P(Shapes, MlaLatentWriteBf16,
                         ::testing::Values(Bf16WriteCase{64, 16, 16, 77}, Bf16WriteCase{128, 16, 64, 150},
                                           Bf16WriteCase{512, 64, 64, 45}, Bf16WriteCase{512, 64, 16, 33},
                                           Bf16WriteCase{37, 5, 16, 20}, Bf16WriteCase{1000, 24, 16, 9},
                                           Bf16WriteCase{64, 16, 16, 1}),
                         bf16_write_case_name);

// ---------------------------------------------------------------- generic absorbed attention

// The latent pages of a batch in Kimi's FP8 entry or the bf16 entry: each request's pages handed out in a shuffled
// order from a pool with three unowned pages; a page is page_size entries followed by an index-key area, as a packed
// cache row. Every byte that is not a cached entry of a request is 0x7F (the e4m3 NaN code; 0x7F7F is a bf16 NaN),
// so that a read of a wrong row shows up as NaN.
struct LatentPool {
  int page_size = 0, width = 0, bt_stride = 0;
  int64_t entry_bytes = 0, page_stride = 0;
  std::vector<uint8_t> bytes;
  std::vector<int32_t> block_table;
  std::vector<std::vector<float>> values;  // per request: [ctx, C + R] decoded rows (what the CPU sees)

  LatentPool(std::mt19937& rng, const std::vector<Request>& reqs, int page_size_, int C, int R, LatentEntry entry,
             float kv_scale)
      : page_size(page_size_), width(C + R),
        entry_bytes(entry == LatentEntry::bf16 ? bf16_latent_entry_bytes(C, R) : int64_t{C} + R),
        page_stride(int64_t{page_size_} * entry_bytes + int64_t{page_size_} * 132) {
    // A spare column past every request's pages, left at -1.
    ScatteredPages pages = scatter_pages(rng, contexts(reqs), page_size, /*spare_columns=*/1);
    bt_stride = pages.bt_stride;
    block_table = std::move(pages.block_table);
    bytes.assign(static_cast<size_t>(pages.total_pages * page_stride), 0x7F);

    std::normal_distribution<float> n(0.0f, 1.0f);
    values.resize(reqs.size());
    for (size_t r = 0; r < reqs.size(); ++r) {
      values[r].resize(static_cast<size_t>(reqs[r].ctx) * width);
      for (int s = 0; s < reqs[r].ctx; ++s) {
        uint8_t* row = bytes.data() + int64_t{block_table[r * bt_stride + s / page_size]} * page_stride +
                       int64_t{s % page_size} * entry_bytes;
        float* ref = values[r].data() + static_cast<size_t>(s) * width;
        for (int c = 0; c < width; ++c) {
          const float v = n(rng) * (c < C ? 1.0f : 0.5f);
          if (entry == LatentEntry::bf16) {
            const uint16_t b = f32_to_bf16(v);
            std::memcpy(row + 2 * c, &b, 2);
            ref[c] = bf16_to_f32(b);
          } else {
            const uint8_t code = cpu_latent_code(v, kv_scale);
            row[c] = code;
            ref[c] = e4m3_to_f32(code) * kv_scale;
          }
        }
      }
    }
  }
};

// mla_attend_generic over `entry` (Kimi's FP8 or the bf16 entry) on a batch of prefill and decode rows, against
// cpu::mla_attend_absorbed over the decoded rows.
void check_attend_generic(const AttendCase& ac, LatentEntry entry) {
  const int C = ac.C, R = ac.R, H = ac.H, width = C + R;
  const bool bf16 = entry == LatentEntry::bf16;
  std::mt19937 rng(5300 + C + R * 3 + H * 17 + ac.page_size * 5 + (ac.sparse ? 1 : 0) + (bf16 ? 11 : 0));
  std::normal_distribution<float> n(0.0f, 1.0f);
  // FP8: not a power of two, so a dequantised value is a rounded product. bf16 entries have no scale: the kernel must
  // not apply it (0.37 would show).
  const float kv_scale = 0.37f;
  const float softmax_scale = 1.5f / std::sqrt(static_cast<float>(width));

  // Decode rows of three requests (contexts of 301 positions, 1 and 70) around a prefill chunk of 19 rows at
  // positions 45..63 and a first chunk of 5 rows at positions 0..4.
  std::vector<int> chunk(19);
  std::iota(chunk.begin(), chunk.end(), 45);
  const std::vector<Request> reqs = {{301, {300}}, {64, chunk}, {1, {0}}, {5, {0, 1, 2, 3, 4}}, {70, {69}}};
  const auto [row_req, row_pos] = query_rows(reqs);
  const int rows = static_cast<int>(row_req.size());
  const LatentPool pool(rng, reqs, ac.page_size, C, R, entry, kv_scale);

  std::vector<float> q(static_cast<size_t>(rows) * H * width);
  for (float& v : q) v = n(rng);

  // Index lists of k = 40 (more than one tile of 32, not a multiple of it), in random order: mostly causal
  // positions, some -1 padding, some positions past the row (skipped), some repeats (counted twice). The first row
  // of the 5-row chunk (position 0) gets no valid entry at all.
  constexpr int k = 40;
  const std::vector<int32_t> indices =
      ac.sparse ? random_index_lists(rng, row_req, row_pos, k, /*empty_request=*/3) : std::vector<int32_t>();

  const DeviceBuffer<uint8_t> pool_d = to_device(pool.bytes);
  const DeviceBuffer<int32_t> bt_d = to_device(pool.block_table);
  const DeviceBuffer<int32_t> req_d = to_device(row_req), pos_d = to_device(row_pos);
  const DeviceBuffer<float> q_d = to_device(q);
  DeviceBuffer<int32_t> idx_d = ac.sparse ? to_device(indices) : DeviceBuffer<int32_t>();
  DeviceBuffer<float> out_d(static_cast<size_t>(rows) * H * C), lse_d(static_cast<size_t>(rows) * H);
  auto run = [&] {
    fill_poison(out_d);
    fill_poison(lse_d);
    mla_attend_generic(q_d.get(), rows, H, C, R, entry, req_d.get(), pos_d.get(),
                       Pages{pool_d.get(), pool.page_stride, pool.page_size}, BlockTable{bt_d.get(), pool.bt_stride},
                       kv_scale, softmax_scale, ac.sparse ? idx_d.get() : nullptr, ac.sparse ? k : 0, out_d.get(),
                       lse_d.get(), nullptr);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    return std::make_pair(to_host(out_d), to_host(lse_d));
  };
  const auto [out, lse] = run();
  const auto [out2, lse2] = run();
  EXPECT_EQ(std::memcmp(out.data(), out2.data(), out.size() * sizeof(float)), 0) << "second launch differs (out)";
  EXPECT_EQ(std::memcmp(lse.data(), lse2.data(), lse.size() * sizeof(float)), 0) << "second launch differs (lse)";

  // Bound: both sides are fp32 over the same decoded values (FP8: the kernel's fp32(code * kv_scale) is the CPU's
  // product; bf16: the value itself) with different summation orders (8-lane dots and one softmax pass on the CPU;
  // 32-lane dots, a butterfly and an online softmax over tiles on the GPU). The scores' rounding differences are a
  // few 1e-7 absolute for these magnitudes, which moves lse by about as much and each probability by about as much
  // relative, so out is off by a few 1e-7 * max|value| of the attended rows: 1e-5 leaves an order of magnitude.
  const AttendErrors e =
      check_attend_against_cpu(q, H, C, R, row_req, row_pos, pool.values, ac.sparse ? indices.data() : nullptr, k,
                               softmax_scale, out, lse, /*name_request=*/true);
  EXPECT_EQ(e.poisoned, 0) << "outputs never written";
  EXPECT_EQ(e.bad, 0) << "elements over the bound";
  EXPECT_EQ(e.empty_rows, ac.sparse ? 1 : 0) << "the case should hold exactly one row without a valid index";
  print_attend_errors(bf16 ? "mla_attend_generic (bf16 entries)" : "mla_attend_generic",
                      attend_case_name({ac, 0}), e);
}

class MlaAttendGeneric : public ::testing::TestWithParam<AttendCase> {};

TEST_P(MlaAttendGeneric, MatchesCpuWithinBound) {
  REQUIRE_GPU();
  check_attend_generic(GetParam(), LatentEntry::kimi_fp8);
}

// The bf16 entry at every width of attend_cases(): kv_lora_rank 64 (deepseek_v32's small configurations), 128, 512,
// and widths that are not multiples of the kernel's 128-column passes, up to the largest row.
class MlaAttendGenericBf16 : public ::testing::TestWithParam<AttendCase> {};

TEST_P(MlaAttendGenericBf16, MatchesCpuWithinBound) {
  REQUIRE_GPU();
  check_attend_generic(GetParam(), LatentEntry::bf16);
}

std::vector<AttendCase> attend_cases() {
  std::vector<AttendCase> cases;
  const int shapes[][2] = {{64, 16}, {128, 16}, {512, 64}};
  for (const auto& cr : shapes)
    for (int H : {1, 4, 12, 16})
      for (int page_size : {16, 64})
        for (bool sparse : {false, true}) cases.push_back({cr[0], cr[1], H, page_size, sparse});
  // Widths where C is not a multiple of the 128 value columns per thread pass, up to the largest row.
  cases.push_back({200, 24, 9, 16, false});
  cases.push_back({1000, 24, 3, 64, true});
  cases.push_back({1000, 24, 8, 16, false});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, MlaAttendGeneric, ::testing::ValuesIn(attend_cases()), attend_case_name);
INSTANTIATE_TEST_SUITE_P(Shapes, MlaAttendGenericBf16, ::testing::ValuesIn(attend_cases()), attend_case_name);

// The bf16 writer's entries read back by the generic attention: a query row that attends to one position only gets
// that position's c (probability 1, the sum 1: exact) -- the round trip f32_to_bf16 -> bf16_to_f32 -- at
// kv_lora_rank 64 and 512, with a kv_scale the entry must ignore.
TEST(MlaBf16RoundTrip, WrittenEntryReadsBackAsDecoded) {
  REQUIRE_GPU();
  for (const auto& [C, R] : {std::pair{64, 16}, std::pair{512, 64}}) {
    constexpr int H = 3, page_size = 16;
    const int width = C + R;
    const int64_t entry = bf16_latent_entry_bytes(C, R), page_stride = page_size * entry + 64;
    std::mt19937 rng(78 + C);
    std::normal_distribution<float> n(0.0f, 3.0f);
    std::vector<float> kv(static_cast<size_t>(width));
    for (float& v : kv) v = n(rng);
    const DeviceBuffer<float> kv_d = to_device(kv);
    const DeviceBuffer<int64_t> slot_d = to_device(std::vector<int64_t>{page_size + 5});  // page 1, row 5
    DeviceBuffer<uint8_t> pool_d = to_device(std::vector<uint8_t>(static_cast<size_t>(2 * page_stride), 0x7F));
    const Pages pages{pool_d.get(), page_stride, page_size};
    mla_latent_write_bf16(kv_d.get(), width, 1, C, R, slot_d.get(), pages, nullptr);
    // The request's position 5 is on page 1: block table {1}; one dense row at position 5 would see positions 0..4
    // too (NaN rows), so the row lists position 5 only.
    const DeviceBuffer<int32_t> bt_d = to_device(std::vector<int32_t>{1});
    const DeviceBuffer<int32_t> req_d = to_device(std::vector<int32_t>{0}), pos_d = to_device(std::vector<int32_t>{5});
    const DeviceBuffer<int32_t> idx_d = to_device(std::vector<int32_t>{5, -1, -1});
    std::vector<float> q(static_cast<size_t>(H) * width);
    for (float& v : q) v = n(rng);
    const DeviceBuffer<float> q_d = to_device(q);
    DeviceBuffer<float> out_d(static_cast<size_t>(H) * C), lse_d(H);
    fill_poison(out_d);
    fill_poison(lse_d);
    mla_attend_generic(q_d.get(), 1, H, C, R, LatentEntry::bf16, req_d.get(), pos_d.get(), pages,
                       BlockTable{bt_d.get(), 1}, 0.37f, 0.05f, idx_d.get(), 3, out_d.get(), lse_d.get(), nullptr);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> out = to_host(out_d), lse = to_host(lse_d);
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < C; ++c)
        EXPECT_EQ(out[static_cast<size_t>(h) * C + c], bf16_to_f32(f32_to_bf16(kv[static_cast<size_t>(c)])))
            << "C " << C << " head " << h << " col " << c;
      // lse = the one score, (q . row) * scale, a dot of C + R terms in another order than this one: fp32 rounding.
      double dot = 0.0;
      for (int i = 0; i < width; ++i)
        dot += double{q[static_cast<size_t>(h) * width + i]} * bf16_to_f32(f32_to_bf16(kv[static_cast<size_t>(i)]));
      EXPECT_NEAR(lse[static_cast<size_t>(h)], dot * 0.05, 1e-5 * (1.0 + std::fabs(dot * 0.05))) << "C " << C;
    }
  }
}

// Hand-worked: C = 8, R = 4, kv_scale 1; position 0 holds 1.0 everywhere (code 0x38), position 1 holds 2.0 (0x40);
// q = 1 everywhere and softmax_scale = ln 2 / 12, so the scores are ln 2 and 2 ln 2 (exp: 2 and 4).
// Dense: a row at position 1 gets out = (2 * 1 + 4 * 2) / 6 = 5/3, lse = ln 6; a row at position 0 gets 1, ln 2.
// Index lists of k = 4: {0, -1, -1, -1} at position 1 sees position 0 only (1, ln 2); {1, 1, -1, 1} at position 0
// sees nothing (0, -inf); {1, 0, -1, 1} at position 1 counts position 1 twice: out = (4 * 2 + 2 * 1 + 4 * 2) / 10 =
// 1.8, lse = ln 10.
TEST(MlaAttendGenericHand, TwoPositions) {
  REQUIRE_GPU();
  constexpr int C = 8, R = 4, W = C + R, page_size = 16;
  std::vector<uint8_t> page(page_size * W, 0x7F);
  std::fill_n(page.begin(), W, uint8_t{0x38});
  std::fill_n(page.begin() + W, W, uint8_t{0x40});
  const DeviceBuffer<uint8_t> page_d = to_device(page);
  const DeviceBuffer<int32_t> bt_d = to_device(std::vector<int32_t>{0});
  const DeviceBuffer<int32_t> req_d = to_device(std::vector<int32_t>{0, 0, 0});
  const DeviceBuffer<int32_t> pos_d = to_device(std::vector<int32_t>{1, 0, 1});
  const DeviceBuffer<float> q_d = to_device(std::vector<float>(3 * W, 1.0f));
  const float scale = std::log(2.0f) / 12.0f;
  DeviceBuffer<float> out_d(3 * C), lse_d(3);
  const Pages pages{page_d.get(), int64_t{page_size} * W, page_size};

  mla_attend_generic(q_d.get(), 2, 1, C, R, req_d.get(), pos_d.get(), pages, BlockTable{bt_d.get(), 1}, 1.0f, scale,
                     nullptr, 0, out_d.get(), lse_d.get(), nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> out = to_host(out_d), lse = to_host(lse_d);
  for (int c = 0; c < C; ++c) {
    EXPECT_NEAR(out[c], 5.0f / 3.0f, 1e-6f);
    EXPECT_NEAR(out[C + c], 1.0f, 1e-6f);
  }
  EXPECT_NEAR(lse[0], std::log(6.0f), 1e-6f);
  EXPECT_NEAR(lse[1], std::log(2.0f), 1e-6f);

  const DeviceBuffer<int32_t> idx3_d = to_device(std::vector<int32_t>{0, -1, -1, -1, 1, 1, -1, 1, 1, 0, -1, 1});
  constexpr int k = 4;
  mla_attend_generic(q_d.get(), 3, 1, C, R, req_d.get(), pos_d.get(), pages, BlockTable{bt_d.get(), 1}, 1.0f, scale,
                     idx3_d.get(), k, out_d.get(), lse_d.get(), nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  out = to_host(out_d);
  lse = to_host(lse_d);
  for (int c = 0; c < C; ++c) {
    EXPECT_NEAR(out[c], 1.0f, 1e-6f);
    EXPECT_EQ(out[C + c], 0.0f);
    EXPECT_NEAR(out[2 * C + c], 1.8f, 1e-6f);
  }
  EXPECT_NEAR(lse[0], std::log(2.0f), 1e-6f);
  EXPECT_EQ(lse[1], -kInf);
  EXPECT_NEAR(lse[2], std::log(10.0f), 1e-6f);
}

// ---------------------------------------------------------------- fp32 -> bf16 rows

TEST(ToBf16Rows, MatchesCpuBitForBit) {
  REQUIRE_GPU();
  std::mt19937 rng(4242);
  struct Shape {
    int64_t rows, cols, ldx, ldy;
  };
  for (const Shape& sh : {Shape{1, 1, 1, 1}, Shape{7, 37, 41, 40}, Shape{300, 576, 576, 600}, Shape{3, 1000, 1003, 1000}}) {
    std::vector<float> x(static_cast<size_t>(sh.rows * sh.ldx));
    for (float& v : x) v = bf16_test_value(rng);
    constexpr uint16_t kSentinel = 0xDEAD;
    std::vector<uint16_t> y(static_cast<size_t>(sh.rows * sh.ldy), kSentinel);
    const DeviceBuffer<float> x_d = to_device(x);
    DeviceBuffer<uint16_t> y_d = to_device(y);
    to_bf16_rows(x_d.get(), sh.ldx, sh.rows, sh.cols, y_d.get(), sh.ldy, nullptr);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = to_host(y_d);
    int64_t bad = 0;
    for (int64_t r = 0; r < sh.rows; ++r)
      for (int64_t j = 0; j < sh.ldy; ++j) {
        const uint16_t want = j < sh.cols ? f32_to_bf16(x[static_cast<size_t>(r * sh.ldx + j)]) : kSentinel;
        const uint16_t g = got[static_cast<size_t>(r * sh.ldy + j)];
        if (g != want && bad++ < 8)
          ADD_FAILURE() << sh.rows << "x" << sh.cols << ": y[" << r << ", " << j << "] = 0x" << std::hex << g
                        << ", expected 0x" << want << std::dec;
      }
    EXPECT_EQ(bad, 0);
  }
}

// ---------------------------------------------------------------- argument checks (no launch: every call throws)

TEST(MlaGlueArguments, BadArgumentsThrow) {
  // Fake, never dereferenced pointers: each call below fails its checks before anything reaches the device.
  auto* fake_f = reinterpret_cast<float*>(uintptr_t{256});
  auto* fake_b = reinterpret_cast<uint8_t*>(uintptr_t{256});
  auto* fake_i = reinterpret_cast<int32_t*>(uintptr_t{256});
  auto* fake_l = reinterpret_cast<int64_t*>(uintptr_t{256});
  auto* fake_h = reinterpret_cast<uint16_t*>(uintptr_t{256});
  const Pages pages{fake_b, 16 * 80, 16};
  const BlockTable bt{fake_i, 4};

  EXPECT_THROW(mla_latent_write_fp8(fake_f, 80, 4, 64, 16, 0.0f, fake_l, pages, nullptr), Error);
  EXPECT_THROW(mla_latent_write_fp8(fake_f, 80, 4, 64, 16, kInf, fake_l, pages, nullptr), Error);
  EXPECT_THROW(mla_latent_write_fp8(fake_f, 79, 4, 64, 16, 1.0f, fake_l, pages, nullptr), Error);
  EXPECT_THROW(mla_latent_write_fp8(fake_f, 80, -1, 64, 16, 1.0f, fake_l, pages, nullptr), Error);
  EXPECT_THROW(mla_latent_write_fp8(fake_f, 80, 4, 64, 16, 1.0f, nullptr, pages, nullptr), Error);
  EXPECT_THROW(mla_latent_write_fp8(fake_f, 80, 4, 64, 16, 1.0f, fake_l, Pages{fake_b, 16 * 80 - 1, 16}, nullptr),
               Error);
  EXPECT_THROW(mla_latent_write_fp8(fake_f, 80, 4, 64, 16, 1.0f, fake_l, Pages{nullptr, 16 * 80, 16}, nullptr),
               Error);

  auto attend = [&](int H, int C, int R, const Pages& p, const BlockTable& b, float kv_scale, const int32_t* idx,
                    int k, float* out) {
    mla_attend_generic(fake_f, 3, H, C, R, fake_i, fake_i, p, b, kv_scale, 0.1f, idx, k, out, fake_f, nullptr);
  };
  EXPECT_THROW(attend(0, 64, 16, pages, bt, 1.0f, nullptr, 0, fake_f), Error);
  EXPECT_THROW(attend(4, 1000, 25, Pages{fake_b, 16 * 1025, 16}, bt, 1.0f, nullptr, 0, fake_f), Error);
  EXPECT_THROW(attend(4, 64, 16, Pages{fake_b, 16 * 80 - 16, 16}, bt, 1.0f, nullptr, 0, fake_f), Error);
  EXPECT_THROW(attend(4, 64, 16, pages, BlockTable{fake_i, 0}, 1.0f, nullptr, 0, fake_f), Error);
  EXPECT_THROW(attend(4, 64, 16, pages, BlockTable{nullptr, 4}, 1.0f, nullptr, 0, fake_f), Error);
  EXPECT_THROW(attend(4, 64, 16, pages, bt, -1.0f, nullptr, 0, fake_f), Error);
  EXPECT_THROW(attend(4, 64, 16, pages, bt, 1.0f, fake_i, -2, fake_f), Error);
  EXPECT_THROW(attend(4, 64, 16, pages, bt, 1.0f, nullptr, 0, nullptr), Error);

  // bf16 entries: 2 (C + R) bytes per row in the page, 16-bit words.
  const Pages bf16_pages{fake_b, 16 * 160, 16};
  EXPECT_NO_THROW(mla_latent_write_bf16(fake_f, 80, 0, 64, 16, fake_l, bf16_pages, nullptr));  // T = 0: nothing
  EXPECT_THROW(mla_latent_write_bf16(fake_f, 79, 4, 64, 16, fake_l, bf16_pages, nullptr), Error);
  EXPECT_THROW(mla_latent_write_bf16(fake_f, 80, -1, 64, 16, fake_l, bf16_pages, nullptr), Error);
  EXPECT_THROW(mla_latent_write_bf16(fake_f, 80, 4, 0, 16, fake_l, bf16_pages, nullptr), Error);
  EXPECT_THROW(mla_latent_write_bf16(fake_f, 80, 4, 64, 16, nullptr, bf16_pages, nullptr), Error);
  EXPECT_THROW(mla_latent_write_bf16(fake_f, 80, 4, 64, 16, fake_l, pages, nullptr), Error);  // FP8-sized pages
  EXPECT_THROW(mla_latent_write_bf16(fake_f, 80, 4, 64, 16, fake_l, Pages{fake_b + 1, 16 * 160, 16}, nullptr), Error);
  EXPECT_THROW(mla_latent_write_bf16(fake_f, 80, 4, 64, 16, fake_l, Pages{fake_b, 16 * 160 + 1, 16}, nullptr), Error);
  auto attend_bf16 = [&](int C, int R, const Pages& p) {
    mla_attend_generic(fake_f, 3, 4, C, R, LatentEntry::bf16, fake_i, fake_i, p, bt, 1.0f, 0.1f, nullptr, 0, fake_f,
                       fake_f, nullptr);
  };
  EXPECT_THROW(attend_bf16(64, 16, pages), Error);                              // FP8-sized pages
  EXPECT_THROW(attend_bf16(64, 16, Pages{fake_b + 1, 16 * 160, 16}), Error);    // odd base
  EXPECT_THROW(attend_bf16(64, 16, Pages{fake_b, 16 * 160 + 1, 16}), Error);    // odd stride
  EXPECT_THROW(attend_bf16(1000, 25, Pages{fake_b, 16 * 2050, 16}), Error);     // wider than the kernel takes
  EXPECT_THROW(mla_attend_generic(fake_f, 3, 4, 64, 16, static_cast<LatentEntry>(9), fake_i, fake_i, bf16_pages, bt,
                                  1.0f, 0.1f, nullptr, 0, fake_f, fake_f, nullptr),
               Error);

  EXPECT_THROW(to_bf16_rows(fake_f, 10, 4, 11, fake_h, 11, nullptr), Error);
  EXPECT_THROW(to_bf16_rows(fake_f, 11, 4, 11, fake_h, 10, nullptr), Error);
  EXPECT_THROW(to_bf16_rows(fake_f, 11, -1, 11, fake_h, 11, nullptr), Error);
  EXPECT_THROW(to_bf16_rows(nullptr, 11, 4, 11, fake_h, 11, nullptr), Error);
}

}  // namespace
}  // namespace kestrel::cuda
