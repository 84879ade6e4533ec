// GPU tests of deepseek_v32's pieces (src/kernels/cuda/v32_glue.h and the v32 entry of mla_glue.h): RoPE against
// cpu::rope_interleaved / cpu::rope_neox with the tables cpu::rope_inv_freq makes (with and without YaRN, positions
// up to past 2^24), the FP8 latent writer bit for bit against MlaCore::write_latent's deepseek_v32 encoding
// (quantize_fp8_ue8m0 per tile of 128, f32_to_bf16 tail), and the generic absorbed attention over such entries
// against cpu::mla_attend_absorbed on the rows MlaCore::read_latent decodes (dense and with index lists).
#include "kernels/cuda/v32_glue.h"

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
#include "kernels/cuda/mla_glue.h"
#include "kernels/cuda/runtime.h"
#include "attend_check.h"
#include "cuda_test_util.h"

namespace kestrel::cuda {
namespace {

using namespace test_util;

// ---------------------------------------------------------------- RoPE

struct RopeCase {
  RopeStyle style;
  int dim;        // rotated values per vector
  int n_vec;      // vectors per row
  int vec_len;    // vector stride (the rotated part starts at `offset` inside it)
  int offset;
  bool yarn;
};

std::string rope_case_name(const ::testing::TestParamInfo<RopeCase>& info) {
  const RopeCase& c = info.param;
  return std::string(c.style == RopeStyle::neox ? "neox" : "interleaved") + "_dim" + std::to_string(c.dim) + "_vec" +
         std::to_string(c.n_vec) + "x" + std::to_string(c.vec_len) + "_at" + std::to_string(c.offset) +
         (c.yarn ? "_yarn" : "_plain");
}

class RopeRows : public ::testing::TestWithParam<RopeCase> {};

// Bound: the GPU computes the angle fp32(pos) * f_i and the four products and two sums exactly as the CPU (same fp32
// operations, no contraction); only cos and sin may come out one fp32 ulp apart (the GPU rounds a double evaluation,
// the CPU calls cosf / sinf, both within about half an ulp of the true value). One ulp of cos or sin moves an output
// by at most 2^-23 * (|a| + |b|), so 1e-5 * (|a| + |b|) per rotated value is two orders of magnitude of margin;
// values outside the rotated parts must be untouched, bit for bit, and position 0 (cos 1, sin 0) is exact.
TEST_P(RopeRows, MatchesCpuWithinBound) {
  REQUIRE_GPU();
  const RopeCase& rc = GetParam();
  // deepseek_v32's YaRN (rope_scaling of DeepSeek-V3.2: factor 40 over 4096 positions, beta 32 / 1).
  const cpu::YarnParams yarn{40.0, 4096.0, 32.0, 1.0, 1.0, 1.0};
  const std::vector<float> inv_freq = cpu::rope_inv_freq(rc.dim, 10000.0, rc.yarn ? &yarn : nullptr);
  // Small, medium and large positions: up to 163839 (the model's context), 2^20, and past 2^24 where fp32(pos)
  // rounds (16777217 -> 16777216), and the largest int32.
  const std::vector<int32_t> positions = {0,     1,     2,     3,      17,      63,       64,       1000,
                                          4095,  4096,  4097,  32768,  65535,   163839,   1 << 20,  (1 << 24) + 1,
                                          123456789, std::numeric_limits<int32_t>::max()};
  const int64_t rows = static_cast<int64_t>(positions.size());
  const int64_t ldx = int64_t{rc.n_vec} * rc.vec_len + 3;  // padding past the last vector, left untouched
  std::mt19937 rng(700 + rc.dim * 3 + rc.n_vec + rc.offset + (rc.yarn ? 1 : 0) + (rc.style == RopeStyle::neox ? 5 : 0));
  std::normal_distribution<float> n(0.0f, 2.0f);
  std::vector<float> x(static_cast<size_t>(rows * ldx));
  for (float& v : x) v = n(rng);

  std::vector<float> ref = x;
  for (int64_t t = 0; t < rows; ++t) {
    float* at = ref.data() + t * ldx + rc.offset;
    if (rc.style == RopeStyle::neox)
      cpu::rope_neox(at, rc.n_vec, rc.vec_len, rc.dim, positions[static_cast<size_t>(t)], inv_freq.data());
    else
      cpu::rope_interleaved(at, rc.n_vec, rc.vec_len, rc.dim, positions[static_cast<size_t>(t)], inv_freq.data());
  }

  DeviceBuffer<float> x_d = to_device(x);
  const DeviceBuffer<int32_t> pos_d = to_device(positions);
  const DeviceBuffer<float> inv_d = to_device(inv_freq);
  rope_rows(x_d.get() + rc.offset, rows, ldx, rc.n_vec, rc.vec_len, rc.dim, rc.style, pos_d.get(), inv_d.get(), nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> got = to_host(x_d);

  const int half = rc.dim / 2;
  int64_t bad = 0, exact = 0, rotated = 0;
  double worst = 0.0;
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t j = 0; j < ldx; ++j) {
      const size_t at = static_cast<size_t>(t * ldx + j);
      const int64_t rel = j - rc.offset;
      const int64_t in_vec = rel >= 0 ? rel % rc.vec_len : -1;
      const bool in_part = rel >= 0 && rel / rc.vec_len < rc.n_vec && in_vec < rc.dim;
      if (!in_part) {
        if (bits(got[at]) != bits(x[at]) && bad++ < 8)
          ADD_FAILURE() << "row " << t << " element " << j << " outside the rotated parts changed: " << got[at]
                        << " vs " << x[at];
        continue;
      }
      // The pair partner of this value, for the bound.
      const int64_t i = rc.style == RopeStyle::neox ? in_vec % half : in_vec / 2;
      const int64_t first = rc.style == RopeStyle::neox ? i : 2 * i, second = rc.style == RopeStyle::neox ? i + half : 2 * i + 1;
      const int64_t base = static_cast<int64_t>(at) - in_vec;
      const float a = x[static_cast<size_t>(base + first)], b = x[static_cast<size_t>(base + second)];
      const float mag = std::fabs(a) + std::fabs(b);
      const float err = std::fabs(got[at] - ref[at]);
      ++rotated;
      exact += bits(got[at]) == bits(ref[at]);
      if (mag > 0.0f) worst = std::max(worst, double{err} / mag);
      const bool ok = positions[static_cast<size_t>(t)] == 0 ? bits(got[at]) == bits(ref[at]) : err <= 1e-5f * mag;
      if (!ok && bad++ < 8)
        ADD_FAILURE() << "row " << t << " (position " << positions[static_cast<size_t>(t)] << ") element " << j
                      << ": " << got[at] << " vs " << ref[at] << " (bound " << 1e-5f * mag << ")";
    }
  }
  EXPECT_EQ(bad, 0);
  std::printf("rope_rows %s: %lld of %lld rotated values bit for bit the CPU's; largest error / (|a| + |b|) = %.3g "
              "(bound 1e-5)\n",
              rope_case_name({GetParam(), 0}).c_str(), static_cast<long long>(exact), static_cast<long long>(rotated),
              worst);
}

std::vector<RopeCase> rope_cases() {
  std::vector<RopeCase> cases;
  for (bool yarn : {false, true}) {
    // MLA's query (heads of [nope 128 | rope 64]) and latent tail (one vector of 64 after the 512 latent values),
    // the tiny models' 16, and the indexer's query heads (rope over the first 64 of 128) and key.
    cases.push_back({RopeStyle::interleaved, 64, 16, 192, 128, yarn});
    cases.push_back({RopeStyle::interleaved, 64, 1, 576, 512, yarn});
    cases.push_back({RopeStyle::interleaved, 16, 4, 32, 16, yarn});
    cases.push_back({RopeStyle::neox, 64, 64, 128, 0, yarn});
    cases.push_back({RopeStyle::neox, 64, 1, 128, 0, yarn});
    cases.push_back({RopeStyle::neox, 16, 4, 32, 0, yarn});
    // Odd shapes: 6 values in vectors of 10 at an offset, and a dim past the 128 threads of a CTA.
    cases.push_back({RopeStyle::neox, 6, 3, 10, 2, yarn});
    cases.push_back({RopeStyle::interleaved, 6, 3, 10, 2, yarn});
    cases.push_back({RopeStyle::interleaved, 512, 3, 520, 5, yarn});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, RopeRows, ::testing::ValuesIn(rope_cases()), rope_case_name);

// Hand-worked: inv_freq = {1, 0.25}, dim 4, position 2: angles 2 and 0.5. Interleaved rotates (x0, x1) by 2 and
// (x2, x3) by 0.5; NeoX rotates (x0, x2) by 2 and (x1, x3) by 0.5. With x = (1, 0, 0, 1): interleaved gives
// (cos 2, sin 2, -sin 0.5, cos 0.5); NeoX gives (cos 2, -sin 0.5, sin 2, cos 0.5).
TEST(RopeRowsHand, TwoPairs) {
  REQUIRE_GPU();
  const DeviceBuffer<float> inv_d = to_device(std::vector<float>{1.0f, 0.25f});
  const DeviceBuffer<int32_t> pos_d = to_device(std::vector<int32_t>{2});
  const float c2 = std::cos(2.0f), s2 = std::sin(2.0f), ch = std::cos(0.5f), sh = std::sin(0.5f);
  for (RopeStyle style : {RopeStyle::interleaved, RopeStyle::neox}) {
    DeviceBuffer<float> x_d = to_device(std::vector<float>{1.0f, 0.0f, 0.0f, 1.0f});
    rope_rows(x_d.get(), 1, 4, 1, 4, 4, style, pos_d.get(), inv_d.get(), nullptr);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> got = to_host(x_d);
    const std::vector<float> want = style == RopeStyle::interleaved ? std::vector<float>{c2, s2, -sh, ch}
                                                                     : std::vector<float>{c2, -sh, s2, ch};
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[i], want[i], 1e-6f) << (style == RopeStyle::neox ? "neox " : "") << i;
  }
}

// ---------------------------------------------------------------- deepseek_v32 latent entry

// MlaCore::write_latent's deepseek_v32 encoding of one row [c (C) ; k_pe (R)].
void cpu_encode_v32(const float* row, int C, int R, uint8_t* e) {
  for (int t = 0; t < C; t += 128) {
    const float s = quantize_fp8_ue8m0(row + t, 128, e + t);
    std::memcpy(e + C + t / 128 * 4, &s, 4);
  }
  for (int i = 0; i < R; ++i) {
    const uint16_t b = f32_to_bf16(row[C + i]);
    std::memcpy(e + C + C / 128 * 4 + 2 * i, &b, 2);
  }
}

// MlaCore::read_latent's decoding of one entry.
void cpu_decode_v32(const uint8_t* e, int C, int R, float* row) {
  for (int t = 0; t < C; t += 128) {
    float s;
    std::memcpy(&s, e + C + t / 128 * 4, 4);
    dequantize_fp8(e + t, 128, s, row + t);
  }
  for (int i = 0; i < R; ++i) {
    uint16_t b;
    std::memcpy(&b, e + C + C / 128 * 4 + 2 * i, 2);
    row[C + i] = bf16_to_f32(b);
  }
}

TEST(V32LatentEntry, Is656BytesAtDeepSeekWidths) {
  EXPECT_EQ(v32_latent_entry_bytes(512, 64), 656);
  EXPECT_EQ(v32_latent_entry_bytes(128, 16), 128 + 4 + 32);
}

// A latent row exercising every path of the encoding: each tile of 128 at its own magnitude (2^-30 .. 2^20), tiles
// whose largest value is below the 1e-4 amax floor, all-zero tiles and tiles of signed zeros, tiles built on an exact
// power-of-two scale whose values are exact midpoints between neighbouring e4m3 codes (ties to even), values that
// saturate at 448 times the scale; a tail with NaNs of both signs, infinities, bf16 ties and values that round to inf.
std::vector<float> latent_row(std::mt19937& rng, int C, int R) {
  std::vector<float> row(static_cast<size_t>(C + R));
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  auto sign = [&] { return rng() % 2 ? -1.0f : 1.0f; };
  for (int t = 0; t < C; t += 128) {
    float* tile = row.data() + t;
    switch (rng() % 6) {
      case 0: {  // below the amax floor
        for (int i = 0; i < 128; ++i) tile[i] = sign() * 1e-5f * u(rng);
        break;
      }
      case 1: {  // zeros of both signs
        for (int i = 0; i < 128; ++i) tile[i] = rng() % 2 ? 0.0f : -0.0f;
        break;
      }
      case 2: {  // scale exactly 2^e (amax = 400 * 2^e), the rest exact midpoints of two codes
        const float s = std::ldexp(1.0f, static_cast<int>(rng() % 30) - 15);
        for (int i = 0; i < 128; ++i) {
          const uint8_t c = static_cast<uint8_t>(rng() % 0x7D);
          tile[i] = sign() * 0.5f * (e4m3_to_f32(c) + e4m3_to_f32(static_cast<uint8_t>(c + 1))) * s;
        }
        tile[rng() % 128] = sign() * 400.0f * s;
        break;
      }
      default: {  // log-uniform magnitudes around a tile scale
        const float scale = std::exp2(-30.0f + 50.0f * u(rng));
        for (int i = 0; i < 128; ++i) tile[i] = sign() * scale * std::exp2(-12.0f + 12.0f * u(rng));
        break;
      }
    }
  }
  static const float kTail[] = {kNaN, -kNaN, kInf, -kInf, 0.0f, -0.0f, std::numeric_limits<float>::max(),
                                1e-40f, -1e-40f};
  for (int i = 0; i < R; ++i) {
    float& v = row[static_cast<size_t>(C + i)];
    switch (rng() % 4) {
      case 0: v = kTail[rng() % std::size(kTail)]; break;
      case 1: v = std::bit_cast<float>((static_cast<uint32_t>(rng()) & 0xFFFF0000u) | 0x8000u); break;  // a tie
      default: v = sign() * std::exp2(-20.0f + 40.0f * u(rng));
    }
  }
  return row;
}

struct WriteCase {
  int C, R, page_size, T;
};

std::string write_case_name(const ::testing::TestParamInfo<WriteCase>& info) {
  const WriteCase& w = info.param;
  return "C" + std::to_string(w.C) + "_R" + std::to_string(w.R) + "_page" + std::to_string(w.page_size) + "_T" +
         std::to_string(w.T);
}

class MlaLatentWriteV32 : public ::testing::TestWithParam<WriteCase> {};

TEST_P(MlaLatentWriteV32, MatchesCpuEncodingBitForBit) {
  REQUIRE_GPU();
  const WriteCase& wc = GetParam();
  const int C = wc.C, R = wc.R, T = wc.T;
  const int64_t entry = v32_latent_entry_bytes(C, R), ldkv = C + R + 5;
  std::mt19937 rng(8800 + C + R * 7 + T + wc.page_size);

  // A packed-cache-like pool: each page holds page_size latent entries followed by index keys; every byte starts as
  // a sentinel, so a write outside the slots' entries shows up.
  const int num_pages = (T + wc.page_size - 1) / wc.page_size + 3;
  const int64_t page_stride = (wc.page_size * entry + int64_t{wc.page_size} * 132 + 15) / 16 * 16;
  constexpr uint8_t kSentinel = 0xA5;
  std::vector<uint8_t> pool(static_cast<size_t>(num_pages * page_stride), kSentinel);

  std::vector<float> kv(static_cast<size_t>(T * ldkv), kNaN);  // the padding past C + R is never read
  for (int t = 0; t < T; ++t) {
    const std::vector<float> row = latent_row(rng, C, R);
    std::copy(row.begin(), row.end(), kv.begin() + t * ldkv);
  }
  std::vector<int64_t> all_slots(static_cast<size_t>(num_pages) * wc.page_size);
  std::iota(all_slots.begin(), all_slots.end(), 0);
  std::shuffle(all_slots.begin(), all_slots.end(), rng);
  std::vector<int64_t> slots(all_slots.begin(), all_slots.begin() + T);
  for (int t = 0; t < T; ++t)
    if (T > 1 && t % 5 == 0) slots[static_cast<size_t>(t)] = -1 - t;  // skipped tokens

  std::vector<uint8_t> expected = pool;
  int written = 0;
  for (int t = 0; t < T; ++t) {
    const int64_t slot = slots[static_cast<size_t>(t)];
    if (slot < 0) continue;
    ++written;
    cpu_encode_v32(kv.data() + t * ldkv, C, R,
                   expected.data() + slot / wc.page_size * page_stride + slot % wc.page_size * entry);
  }
  ASSERT_GT(written, 0);

  DeviceBuffer<uint8_t> pool_d = to_device(pool);
  const DeviceBuffer<float> kv_d = to_device(kv);
  const DeviceBuffer<int64_t> slots_d = to_device(slots);
  mla_latent_write_v32(kv_d.get(), ldkv, T, C, R, slots_d.get(), Pages{pool_d.get(), page_stride, wc.page_size},
                       nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = to_host(pool_d);

  int64_t bad = 0;
  for (size_t b = 0; b < got.size(); ++b) {
    if (got[b] == expected[b]) continue;
    if (bad++ < 8) {
      const int64_t in_page = static_cast<int64_t>(b) % page_stride;
      ADD_FAILURE() << "byte " << b << " (page " << static_cast<int64_t>(b) / page_stride << ", entry "
                    << in_page / entry << ", offset " << in_page % entry << "): got 0x" << std::hex << int{got[b]}
                    << ", expected 0x" << int{expected[b]} << std::dec;
    }
  }
  EXPECT_EQ(bad, 0) << "bytes differ from the CPU encoding (or were written outside the slots)";
}

INSTANTIATE_TEST_SUITE_P(Shapes, MlaLatentWriteV32,
                         ::testing::Values(WriteCase{512, 64, 64, 45}, WriteCase{512, 64, 16, 70},
                                           WriteCase{128, 16, 16, 77}, WriteCase{256, 10, 64, 9},
                                           WriteCase{128, 16, 64, 1}),
                         write_case_name);

// A non-finite latent value: the CPU reference throws (quantize_fp8_ue8m0 refuses it); the kernel writes its tile as
// NaN codes (0x7F) with a NaN scale, and the entry's other tiles as the CPU encodes them.
TEST(MlaLatentWriteV32NonFinite, TileBecomesNaN) {
  REQUIRE_GPU();
  constexpr int C = 512, R = 64, page_size = 16;
  const int64_t entry = v32_latent_entry_bytes(C, R), page_stride = page_size * entry;
  std::mt19937 rng(31);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> kv(2 * (C + R));
  for (float& v : kv) v = n(rng);
  kv[130] = kInf;            // token 0, tile 1
  kv[(C + R) + 511] = kNaN;  // token 1, tile 3
  const DeviceBuffer<float> kv_d = to_device(kv);
  const DeviceBuffer<int64_t> slots_d = to_device(std::vector<int64_t>{3, 7});
  DeviceBuffer<uint8_t> pool_d = to_device(std::vector<uint8_t>(static_cast<size_t>(page_stride), 0));
  mla_latent_write_v32(kv_d.get(), C + R, 2, C, R, slots_d.get(), Pages{pool_d.get(), page_stride, page_size}, nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = to_host(pool_d);
  for (int t = 0; t < 2; ++t) {
    const int bad_tile = t == 0 ? 1 : 3;
    const uint8_t* e = got.data() + (t == 0 ? 3 : 7) * entry;
    std::vector<float> clean(kv.begin() + t * (C + R), kv.begin() + (t + 1) * (C + R));
    for (int i = 0; i < 128; ++i) clean[static_cast<size_t>(bad_tile * 128 + i)] = 0.0f;
    std::vector<uint8_t> want(static_cast<size_t>(entry));
    cpu_encode_v32(clean.data(), C, R, want.data());
    for (int tile = 0; tile < C / 128; ++tile) {
      float s;
      std::memcpy(&s, e + C + tile * 4, 4);
      if (tile == bad_tile) {
        EXPECT_TRUE(std::isnan(s)) << "token " << t;
        for (int i = 0; i < 128; ++i) EXPECT_EQ(e[tile * 128 + i], 0x7F) << "token " << t << " value " << i;
      } else {
        EXPECT_EQ(std::memcmp(e + tile * 128, want.data() + tile * 128, 128), 0) << "token " << t << " tile " << tile;
        EXPECT_EQ(std::memcmp(e + C + tile * 4, want.data() + C + tile * 4, 4), 0) << "token " << t << " tile " << tile;
      }
    }
    EXPECT_EQ(std::memcmp(e + C + C / 32, want.data() + C + C / 32, 2 * R), 0) << "token " << t << " tail";
  }
}

// ---------------------------------------------------------------- generic attention over v32 entries

// The latent pages of a batch in deepseek_v32's entries: each request's pages handed out in a shuffled order from a
// pool with three unowned pages; a page is page_size entries followed by an index-key area, as a packed cache row.
// Every other byte is 0x7F (NaN codes, and huge scales and bf16 values), so that a read of a wrong byte shows up.
struct V32Pool {
  int page_size = 0, bt_stride = 0;
  int64_t entry = 0, page_stride = 0;
  std::vector<uint8_t> bytes;
  std::vector<int32_t> block_table;
  std::vector<std::vector<float>> values;  // per request: [ctx, C + R] decoded rows (what the CPU attends over)

  V32Pool(std::mt19937& rng, const std::vector<Request>& reqs, int page_size_, int C, int R)
      : page_size(page_size_), entry(v32_latent_entry_bytes(C, R)) {
    page_stride = (page_size * entry + int64_t{page_size} * 132 + 15) / 16 * 16;
    ScatteredPages pages = scatter_pages(rng, contexts(reqs), page_size, /*spare_columns=*/1);
    bt_stride = pages.bt_stride;
    block_table = std::move(pages.block_table);
    bytes.assign(static_cast<size_t>(pages.total_pages * page_stride), 0x7F);

    // Each tile at its own magnitude (scales from 2^-4 to 2^4), the tail smaller: as a normed latent and a k_pe.
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::uniform_int_distribution<int> e(-4, 4);
    const int width = C + R;
    values.resize(reqs.size());
    std::vector<float> row(static_cast<size_t>(width));
    for (size_t r = 0; r < reqs.size(); ++r) {
      values[r].resize(static_cast<size_t>(reqs[r].ctx) * width);
      for (int s = 0; s < reqs[r].ctx; ++s) {
        for (int t = 0; t < C; t += 128) {
          const float m = std::ldexp(1.0f, e(rng));
          for (int i = 0; i < 128; ++i) row[static_cast<size_t>(t + i)] = n(rng) * m;
        }
        for (int i = 0; i < R; ++i) row[static_cast<size_t>(C + i)] = 0.5f * n(rng);
        uint8_t* at = bytes.data() + int64_t{block_table[r * bt_stride + s / page_size]} * page_stride +
                      int64_t{s % page_size} * entry;
        cpu_encode_v32(row.data(), C, R, at);
        cpu_decode_v32(at, C, R, values[r].data() + static_cast<size_t>(s) * width);
      }
    }
  }
};

class MlaAttendGenericV32 : public ::testing::TestWithParam<AttendCase> {};

TEST_P(MlaAttendGenericV32, MatchesCpuWithinBound) {
  REQUIRE_GPU();
  const AttendCase& ac = GetParam();
  const int C = ac.C, R = ac.R, H = ac.H, width = C + R;
  std::mt19937 rng(6100 + C + R * 3 + H * 17 + ac.page_size * 5 + (ac.sparse ? 1 : 0));
  std::normal_distribution<float> n(0.0f, 1.0f);
  // deepseek_v32's entries carry their own scales: the kernel must not apply kv_scale (0.37 here would show).
  const float kv_scale = 0.37f;
  const float softmax_scale = 1.5f / std::sqrt(static_cast<float>(width));

  // Decode rows of three requests (contexts of 301, 1 and 70) around a prefill chunk of 19 rows at positions 45..63
  // and a first chunk of 5 rows at positions 0..4.
  std::vector<int> chunk(19);
  std::iota(chunk.begin(), chunk.end(), 45);
  const std::vector<Request> reqs = {{301, {300}}, {64, chunk}, {1, {0}}, {5, {0, 1, 2, 3, 4}}, {70, {69}}};
  const auto [row_req, row_pos] = query_rows(reqs);
  const int rows = static_cast<int>(row_req.size());
  const V32Pool pool(rng, reqs, ac.page_size, C, R);

  std::vector<float> q(static_cast<size_t>(rows) * H * width);
  for (float& v : q) v = n(rng);

  // Index lists of k = 40 in random order: mostly causal positions, some -1, some past the row (skipped), some
  // repeats (counted twice); the first row of the 5-row chunk gets no valid entry.
  constexpr int k = 40;
  const std::vector<int32_t> indices =
      ac.sparse ? random_index_lists(rng, row_req, row_pos, k, /*empty_request=*/3) : std::vector<int32_t>();

  const DeviceBuffer<uint8_t> pool_d = to_device(pool.bytes);
  const DeviceBuffer<int32_t> bt_d = to_device(pool.block_table);
  const DeviceBuffer<int32_t> req_d = to_device(row_req), pos_d = to_device(row_pos);
  const DeviceBuffer<float> q_d = to_device(q);
  DeviceBuffer<int32_t> idx_d = ac.sparse ? to_device(indices) : DeviceBuffer<int32_t>();
  DeviceBuffer<float> out_d(static_cast<size_t>(rows) * H * C), lse_d(static_cast<size_t>(rows) * H);
  fill_poison(out_d);
  fill_poison(lse_d);
  mla_attend_generic(q_d.get(), rows, H, C, R, LatentEntry::v32_fp8, req_d.get(), pos_d.get(),
                     Pages{pool_d.get(), pool.page_stride, pool.page_size}, BlockTable{bt_d.get(), pool.bt_stride},
                     kv_scale, softmax_scale, ac.sparse ? idx_d.get() : nullptr, ac.sparse ? k : 0, out_d.get(),
                     lse_d.get(), nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> out = to_host(out_d), lse = to_host(lse_d);

  // Bound (as mla_glue_test's for Kimi's entries): both sides are fp32 over the same decoded values (the decode is
  // exact: code * power-of-two scale, bf16 -> fp32) with different summation orders; the scores differ by a few
  // 1e-7 absolute, which moves lse and each probability by about as much, so out is off by a few 1e-7 * max|value|
  // of the attended rows: 1e-5 leaves an order of magnitude.
  const AttendErrors e =
      check_attend_against_cpu(q, H, C, R, row_req, row_pos, pool.values, ac.sparse ? indices.data() : nullptr, k,
                               softmax_scale, out, lse, /*name_request=*/true);
  EXPECT_EQ(e.poisoned, 0) << "outputs never written";
  EXPECT_EQ(e.bad, 0) << "elements over the bound";
  EXPECT_EQ(e.empty_rows, ac.sparse ? 1 : 0) << "the case should hold exactly one row without a valid index";
  print_attend_errors("mla_attend_generic (v32 entries)", attend_case_name({GetParam(), 0}), e);
}

std::vector<AttendCase> attend_cases() {
  std::vector<AttendCase> cases;
  const int shapes[][2] = {{128, 16}, {512, 64}, {256, 10}};
  for (const auto& cr : shapes)
    for (int H : {1, 4, 16})
      for (int page_size : {16, 64})
        for (bool sparse : {false, true}) cases.push_back({cr[0], cr[1], H, page_size, sparse});
  cases.push_back({896, 64, 9, 16, true});  // the widest C that fits kMaxGenericLatentWidth with R = 64
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, MlaAttendGenericV32, ::testing::ValuesIn(attend_cases()), attend_case_name);

// The GPU writer's entries read back by the GPU attention: one position only, so out is that position's decoded c
// (probability 1) -- the round trip write_latent -> read_latent of the CPU, up to the one division by the softmax
// sum (exact: the sum is 1).
TEST(MlaV32RoundTrip, WrittenEntryReadsBackAsDecoded) {
  REQUIRE_GPU();
  constexpr int C = 512, R = 64, H = 2, page_size = 16;
  const int64_t entry = v32_latent_entry_bytes(C, R), page_stride = page_size * entry;
  std::mt19937 rng(77);
  std::normal_distribution<float> n(0.0f, 3.0f);
  std::vector<float> kv(C + R);
  for (float& v : kv) v = n(rng);
  const DeviceBuffer<float> kv_d = to_device(kv);
  const DeviceBuffer<int64_t> slot_d = to_device(std::vector<int64_t>{page_size + 5});  // page 1, row 5
  DeviceBuffer<uint8_t> pool_d = to_device(std::vector<uint8_t>(static_cast<size_t>(2 * page_stride), 0x7F));
  const Pages pages{pool_d.get(), page_stride, page_size};
  mla_latent_write_v32(kv_d.get(), C + R, 1, C, R, slot_d.get(), pages, nullptr);
  // The request's position 5 is on page 1: block table {1}; the query row sits at position 5 and lists only 5.
  const DeviceBuffer<int32_t> bt_d = to_device(std::vector<int32_t>{1});
  const DeviceBuffer<int32_t> req_d = to_device(std::vector<int32_t>{0}), pos_d = to_device(std::vector<int32_t>{5});
  const DeviceBuffer<int32_t> idx_d = to_device(std::vector<int32_t>{5, -1, -1});
  std::vector<float> q(static_cast<size_t>(H) * (C + R));
  for (float& v : q) v = n(rng);
  const DeviceBuffer<float> q_d = to_device(q);
  DeviceBuffer<float> out_d(static_cast<size_t>(H) * C), lse_d(H);
  mla_attend_generic(q_d.get(), 1, H, C, R, LatentEntry::v32_fp8, req_d.get(), pos_d.get(), pages,
                     BlockTable{bt_d.get(), 1}, 1.0f, 0.05f, idx_d.get(), 3, out_d.get(), lse_d.get(), nullptr);
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint8_t> want_entry(static_cast<size_t>(entry));
  cpu_encode_v32(kv.data(), C, R, want_entry.data());
  std::vector<float> decoded(C + R);
  cpu_decode_v32(want_entry.data(), C, R, decoded.data());
  const std::vector<float> out = to_host(out_d), lse = to_host(lse_d);
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < C; ++c) EXPECT_EQ(out[static_cast<size_t>(h) * C + c], decoded[static_cast<size_t>(c)]) << h << " " << c;
    // lse = the one score: (q . row) * scale, a dot of C + R terms in another order than this one: fp32 rounding.
    double dot = 0.0;
    for (int i = 0; i < C + R; ++i) dot += double{q[static_cast<size_t>(h) * (C + R) + i]} * decoded[static_cast<size_t>(i)];
    EXPECT_NEAR(lse[static_cast<size_t>(h)], dot * 0.05, 1e-5 * (1.0 + std::fabs(dot * 0.05))) << h;
  }
}

// ---------------------------------------------------------------- argument checks (no launch: every call throws)

TEST(V32GlueArguments, BadArgumentsThrow) {
  auto* fake_f = reinterpret_cast<float*>(uintptr_t{256});
  auto* fake_b = reinterpret_cast<uint8_t*>(uintptr_t{256});
  auto* fake_i = reinterpret_cast<int32_t*>(uintptr_t{256});
  auto* fake_l = reinterpret_cast<int64_t*>(uintptr_t{256});
  const int64_t entry = v32_latent_entry_bytes(512, 64);
  const Pages pages{fake_b, 16 * entry, 16};

  auto rope = [&](int64_t rows, int64_t ldx, int n_vec, int64_t stride, int dim, const int32_t* pos) {
    rope_rows(fake_f, rows, ldx, n_vec, stride, dim, RopeStyle::interleaved, pos, fake_f, nullptr);
  };
  EXPECT_THROW(rope(4, 64, 1, 64, 7, fake_i), Error);                  // odd dim
  EXPECT_THROW(rope(4, 2048, 1, 2048, 2048, fake_i), Error);           // dim past kMaxRopeDim
  EXPECT_THROW(rope(4, 1024, 4, 32, 64, fake_i), Error);               // vectors overlap
  EXPECT_THROW(rope(4, 255, 4, 64, 64, fake_i), Error);                // ldx too short
  EXPECT_THROW(rope(4, 64, 0, 64, 64, fake_i), Error);                 // no vector
  EXPECT_THROW(rope(-1, 64, 1, 64, 64, fake_i), Error);
  EXPECT_THROW(rope(4, 64, 1, 64, 64, nullptr), Error);
  EXPECT_THROW(rope_rows(fake_f, 4, 64, 1, 64, 64, static_cast<RopeStyle>(7), fake_i, fake_f, nullptr), Error);

  EXPECT_THROW(mla_latent_write_v32(fake_f, 576, 4, 500, 64, fake_l, pages, nullptr), Error);  // C % 128
  EXPECT_THROW(mla_latent_write_v32(fake_f, 576, 4, 512, 63, fake_l, pages, nullptr), Error);  // odd R
  EXPECT_THROW(mla_latent_write_v32(fake_f, 575, 4, 512, 64, fake_l, pages, nullptr), Error);  // ldkv
  EXPECT_THROW(mla_latent_write_v32(fake_f, 576, 4, 512, 64, nullptr, pages, nullptr), Error);
  EXPECT_THROW(mla_latent_write_v32(fake_f, 576, 4, 512, 64, fake_l, Pages{fake_b, 16 * entry - 4, 16}, nullptr),
               Error);  // page too small
  EXPECT_THROW(mla_latent_write_v32(fake_f, 576, 4, 512, 64, fake_l, Pages{fake_b + 2, 16 * entry, 16}, nullptr),
               Error);  // misaligned base
  EXPECT_THROW(mla_latent_write_v32(fake_f, 576, 4, 512, 64, fake_l, Pages{fake_b, 16 * entry + 2, 16}, nullptr),
               Error);  // misaligned stride

  const BlockTable bt{fake_i, 4};
  auto attend = [&](int C, int R, const Pages& p) {
    mla_attend_generic(fake_f, 3, 4, C, R, LatentEntry::v32_fp8, fake_i, fake_i, p, bt, 1.0f, 0.1f, nullptr, 0,
                       fake_f, fake_f, nullptr);
  };
  EXPECT_THROW(attend(500, 64, pages), Error);                                         // C % 128
  EXPECT_THROW(attend(512, 63, pages), Error);                                         // odd R
  EXPECT_THROW(attend(512, 64, Pages{fake_b, 16 * (512 + 64), 16}), Error);            // Kimi-sized pages
  EXPECT_THROW(attend(512, 64, Pages{fake_b + 2, 16 * entry, 16}), Error);             // misaligned base
}

}  // namespace
}  // namespace kestrel::cuda
