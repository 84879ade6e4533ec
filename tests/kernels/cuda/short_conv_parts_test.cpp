// short_conv_silu_varlen_parts (kernels/cuda/short_conv_parts.h) against short_conv_silu_varlen (kda_glue.h, itself
// checked against the CPU reference in kda_glue_test) run once per part on the part's columns copied out: the
// header promises the same fp32 operations in the same order, so outputs and histories must match bit for bit.
#include "kernels/cuda/short_conv_parts.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "cuda_test_util.h"
#include "kernels/cuda/kda_glue.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {
namespace {

using test_util::bits;
using test_util::fill_poison;
using test_util::poison_float;

std::vector<float> normal_vector(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& e : v) e = normal(rng);
  return v;
}

struct Case {
  std::vector<int64_t> lengths;
  int parts;
  int64_t C;
  int W;
  int64_t ldx_pad;        // ldx = parts*C + ldx_pad (the padding columns are random and must not be read)
  int64_t hist_pad;       // hist_part_stride = (W-1)*C + hist_pad
  int64_t out_pad;        // out_part_stride = T*C + out_pad (the gaps must stay untouched)
  uint32_t seed;
};

void check(const Case& k) {
  SCOPED_TRACE(testing::Message() << "parts=" << k.parts << " C=" << k.C << " W=" << k.W << " seed=" << k.seed);
  std::mt19937 rng(k.seed);
  const int B = static_cast<int>(k.lengths.size());
  std::vector<int64_t> cu(B + 1, 0);
  for (int b = 0; b < B; ++b) cu[b + 1] = cu[b] + k.lengths[b];
  const int64_t T = cu[B], C = k.C, W = k.W, parts = k.parts;
  const int64_t ldx = parts * C + k.ldx_pad, hist_stride = (W - 1) * C + k.hist_pad, out_stride = T * C + k.out_pad;
  const std::vector<float> x = normal_vector(static_cast<size_t>(T * ldx), rng);
  const std::vector<float> w = normal_vector(static_cast<size_t>(parts * C * W), rng);
  // Each sequence's histories (parts of them, hist_stride apart) sit in a shuffled slot of a pool with one spare
  // slot, which must stay untouched, as must the padding between parts.
  const int64_t slot = parts * hist_stride;
  const int pool = B + 1;
  std::vector<int> order(pool);
  for (int i = 0; i < pool; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  const std::vector<float> hist0 = normal_vector(static_cast<size_t>(pool * slot), rng);

  const DeviceBuffer<float> d_x = to_device(x), d_w = to_device(w);
  const DeviceBuffer<int64_t> d_cu = to_device(cu);
  DeviceBuffer<float> d_hist_fused(hist0.size()), d_hist_ref(hist0.size());
  d_hist_fused.upload(hist0.data());
  d_hist_ref.upload(hist0.data());
  auto pointers = [&](DeviceBuffer<float>& h, int64_t part) {
    std::vector<float*> p(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b) p[b] = h.get() + order[b] * slot + part * hist_stride;
    return to_device(p);
  };

  // Fused: all parts at once.
  const DeviceBuffer<float*> d_ptrs_fused = pointers(d_hist_fused, 0);
  DeviceBuffer<float> d_out(static_cast<size_t>(std::max<int64_t>(parts * out_stride, 1)));
  fill_poison(d_out);
  short_conv_silu_varlen_parts(d_x.get(), ldx, d_cu.get(), B, k.parts, C, d_w.get(), k.W,
                               W > 1 ? d_ptrs_fused.get() : nullptr, hist_stride, d_out.get(), out_stride, nullptr);

  // Reference: one short_conv_silu_varlen per part on that part's columns, copied out contiguous.
  std::vector<std::vector<float>> want(static_cast<size_t>(parts));
  for (int64_t p = 0; p < parts; ++p) {
    std::vector<float> xp(static_cast<size_t>(std::max<int64_t>(T * C, 1)));
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(xp.data() + t * C, x.data() + t * ldx + p * C, static_cast<size_t>(C) * sizeof(float));
    const DeviceBuffer<float> d_xp = to_device(xp);
    const DeviceBuffer<float*> d_ptrs = pointers(d_hist_ref, p);
    DeviceBuffer<float> d_outp(xp.size());
    short_conv_silu_varlen(d_xp.get(), d_cu.get(), B, C, d_w.get() + p * C * W, k.W, W > 1 ? d_ptrs.get() : nullptr,
                           d_outp.get(), nullptr);
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    want[p] = to_host(d_outp);
  }
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());

  const std::vector<float> got = to_host(d_out);
  for (int64_t p = 0; p < parts; ++p) {
    for (int64_t i = 0; i < T * C; ++i) {
      const float g = got[p * out_stride + i], r = want[p][i];
      ASSERT_EQ(bits(g), bits(r)) << "part " << p << " out[" << i / C << ", " << i % C << "]: got " << g << " want "
                                  << r;
    }
    for (int64_t i = T * C; i < out_stride; ++i)
      ASSERT_EQ(bits(got[p * out_stride + i]), bits(poison_float())) << "part " << p << " wrote past its output";
  }
  const std::vector<float> hist_fused = to_host(d_hist_fused), hist_ref = to_host(d_hist_ref);
  EXPECT_EQ(std::memcmp(hist_fused.data(), hist_ref.data(), hist_ref.size() * sizeof(float)), 0)
      << "histories (spare slot and padding included) differ from the per-part convolutions'";
}

class ShortConvParts : public ::testing::Test {
 protected:
  void SetUp() override { REQUIRE_GPU(); }
};

// The KDA mixer's layout: three parts, x rows [q | k | v] (ldx = 3C), histories back to back in the state row.
// Lengths 1 and 2 are shorter than W - 1 = 3 (their new history keeps older rows); 70 tokens split over blocks.
TEST_F(ShortConvParts, MixerLayoutMatchesPerPartConvolutions) {
  check({{1, 2, 70}, 3, 96, 4, 0, 0, 0, 201});
  check({{1, 2, 70}, 3, 512, 4, 0, 0, 0, 202});
}

// A decode batch (many one-token sequences), an empty sequence, C not a multiple of the 128-channel tile so tiles
// straddle parts, padded rows, histories and outputs, and the widths 1, 2 and 8.
TEST_F(ShortConvParts, PaddingWidthsEmptySequenceAndDecodeBatch) {
  check({std::vector<int64_t>(37, 1), 3, 200, 4, 0, 0, 0, 211});
  check({{0, 3, 1, 130}, 3, 33, 2, 5, 7, 3, 212});
  check({{5, 0, 9}, 2, 130, 1, 1, 2, 9, 213});
  check({{3, 12, 7}, 3, 40, 8, 16, 4, 0, 214});
  check({{4, 1}, 1, 64, 4, 8, 0, 0, 215});
}

TEST(ShortConvPartsArgs, RejectsBadLayouts) {
  float* p = reinterpret_cast<float*>(uintptr_t{256});
  const int64_t* cu = reinterpret_cast<const int64_t*>(uintptr_t{512});
  float* const* h = reinterpret_cast<float* const*>(uintptr_t{768});
  float* o = reinterpret_cast<float*>(uintptr_t{1024});
  // ldx below parts*C.
  EXPECT_THROW(short_conv_silu_varlen_parts(p, 95, cu, 1, 3, 32, p, 4, h, 96, o, 100, nullptr), Error);
  // Overlapping parts' histories.
  EXPECT_THROW(short_conv_silu_varlen_parts(p, 96, cu, 1, 3, 32, p, 4, h, 95, o, 100, nullptr), Error);
  // Overlapping parts' outputs.
  EXPECT_THROW(short_conv_silu_varlen_parts(p, 96, cu, 1, 3, 32, p, 4, h, 96, o, 31, nullptr), Error);
  // Width out of range, no history for W > 1, in place.
  EXPECT_THROW(short_conv_silu_varlen_parts(p, 96, cu, 1, 3, 32, p, kShortConvMaxWidth + 1, h, 300, o, 100, nullptr),
               Error);
  EXPECT_THROW(short_conv_silu_varlen_parts(p, 96, cu, 1, 3, 32, p, 4, nullptr, 96, o, 100, nullptr), Error);
  EXPECT_THROW(short_conv_silu_varlen_parts(p, 96, cu, 1, 3, 32, p, 4, h, 96, p, 100, nullptr), Error);
}

}  // namespace
}  // namespace kestrel::cuda
