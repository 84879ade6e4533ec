// GPU tests of the dummy-weight fill (src/kernels/cuda/dummy_weights.h): the device's bytes equal fill_dummy's on the
// host, byte for byte, for every layout and dtype on shapes of odd sizes, at aligned and unaligned destinations, with
// the bytes around the destination poisoned and checked untouched; and the fill's rate on 1 GiB tensors.
#include "kernels/cuda/dummy_weights.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/dummy_weights.h"
#include "core/error.h"
#include "kernels/cuda/runtime.h"
#include "cuda_test_util.h"

namespace kestrel::cuda {
namespace {

constexpr uint8_t kPoison = 0xA5;
constexpr size_t kGuard = 64;  // poisoned bytes before and after the destination

DummySpec spec_of(DummyLayout layout, DType dtype, std::vector<int64_t> shape, float amplitude, float offset = 0.0f) {
  DummySpec s;
  s.seed = 2024;
  s.key = tensor_key("model.layers.7.mlp.experts.3.gate_proj.weight");
  s.layout = layout;
  s.dtype = dtype;
  s.shape = std::move(shape);
  s.amplitude = amplitude;
  s.offset = offset;
  return s;
}

std::vector<DummySpec> every_layout_on_odd_shapes() {
  std::vector<DummySpec> specs;
  for (DType d : {DType::F32, DType::BF16, DType::F16})
    for (std::vector<int64_t> shape : {std::vector<int64_t>{1}, {7}, {15}, {17}, {3, 333}, {1000003}, {0}})
      specs.push_back(spec_of(DummyLayout::plain, d, shape, 0.25f, d == DType::F16 ? -1.0f : 0.5f));
  for (std::vector<int64_t> batch : {std::vector<int64_t>{}, {3}})
    for (auto [N, K] : {std::pair<int64_t, int64_t>{1, 1}, {130, 257}, {300, 200}, {1024, 7168}}) {
      std::vector<int64_t> codes = batch, scales = batch;
      codes.insert(codes.end(), {N, K});
      scales.insert(scales.end(), {(N + 127) / 128, (K + 127) / 128});
      specs.push_back(spec_of(DummyLayout::fp8_codes, DType::F8_E4M3, codes, 0.03f));
      specs.push_back(spec_of(DummyLayout::fp8_scales, DType::F32, scales, 0.03f));
    }
  for (auto [N, K] : {std::pair<int64_t, int64_t>{1, 32}, {5, 96}, {129, 2048}, {2880, 2880}}) {
    specs.push_back(spec_of(DummyLayout::mxfp4_codes, DType::U8, {N, K / 2}, 0.1f));
    specs.push_back(spec_of(DummyLayout::mxfp4_scales, DType::U8, {N, K / 32}, 0.1f));
    specs.push_back(spec_of(DummyLayout::mxfp4_scales, DType::F8_E8M0, {N, K / 32}, 0.1f));
  }
  return specs;
}

std::string describe(const DummySpec& s) {
  std::string d = dummy_layout_name(s.layout);
  d += ' ';
  d += dtype_name(s.dtype);
  d += " [";
  for (size_t i = 0; i < s.shape.size(); ++i) {
    if (i) d += ',';
    d += std::to_string(s.shape[i]);
  }
  d += ']';
  return d;
}

TEST(DummyWeightsCuda, DeviceBytesEqualHostBytes) {
  REQUIRE_GPU();
  for (const DummySpec& spec : every_layout_on_odd_shapes()) {
    const size_t bytes = dummy_bytes(spec);
    std::vector<uint8_t> host(bytes);
    fill_dummy(spec, host);
    for (size_t misalign : {size_t{0}, size_t{1}, size_t{6}}) {
      SCOPED_TRACE(describe(spec) + " at offset " + std::to_string(misalign));
      DeviceBuffer<uint8_t> d(bytes + 2 * kGuard + misalign);
      KESTREL_CUDA_CHECK(cudaMemset(d.get(), kPoison, d.size()));
      fill_dummy_device(spec, d.get() + kGuard + misalign, bytes, nullptr);
      test_util::sync();
      const std::vector<uint8_t> back = to_host(d);
      for (size_t i = 0; i < kGuard + misalign; ++i) ASSERT_EQ(back[i], kPoison) << "wrote before the tensor at " << i;
      for (size_t i = 0; i < bytes; ++i)
        ASSERT_EQ(back[kGuard + misalign + i], host[i]) << "byte " << i << " of " << bytes;
      for (size_t i = kGuard + misalign + bytes; i < back.size(); ++i)
        ASSERT_EQ(back[i], kPoison) << "wrote past the tensor at " << i;
    }
  }
}

TEST(DummyWeightsCuda, BadArgumentsThrow) {
  REQUIRE_GPU();
  const DummySpec spec = spec_of(DummyLayout::plain, DType::BF16, {4, 4}, 1.0f);
  DeviceBuffer<uint8_t> d(64);
  EXPECT_THROW(fill_dummy_device(spec, d.get(), 31, nullptr), Error);
  EXPECT_THROW(fill_dummy_device(spec, nullptr, 32, nullptr), Error);
  DummySpec bad = spec;
  bad.layout = DummyLayout::fp8_codes;
  EXPECT_THROW(fill_dummy_device(bad, d.get(), 16, nullptr), Error);
}

// 1 GiB of each element width, the median of 5 timed fills; "tens of GB/s" is the goal (a checkpoint of 100 GB in
// seconds), so below 20 GB/s fails.
TEST(DummyWeightsCuda, FillsTensOfGigabytesPerSecond) {
  REQUIRE_GPU();
  const int64_t gib = int64_t{1} << 30;
  const std::vector<DummySpec> specs = {
      spec_of(DummyLayout::plain, DType::BF16, {gib / 2}, 0.02f),
      spec_of(DummyLayout::plain, DType::F32, {gib / 4}, 0.02f),
      spec_of(DummyLayout::fp8_codes, DType::F8_E4M3, {gib / 7168, 7168}, 0.02f),
      spec_of(DummyLayout::mxfp4_codes, DType::U8, {gib / 1440, 1440}, 0.02f),
  };
  DeviceBuffer<uint8_t> d(static_cast<size_t>(gib));
  cudaEvent_t a, b;
  KESTREL_CUDA_CHECK(cudaEventCreate(&a));
  KESTREL_CUDA_CHECK(cudaEventCreate(&b));
  for (const DummySpec& spec : specs) {
    const size_t bytes = dummy_bytes(spec);
    fill_dummy_device(spec, d.get(), bytes, nullptr);
    std::vector<float> ms;
    for (int i = 0; i < 5; ++i) {
      KESTREL_CUDA_CHECK(cudaEventRecord(a));
      fill_dummy_device(spec, d.get(), bytes, nullptr);
      KESTREL_CUDA_CHECK(cudaEventRecord(b));
      KESTREL_CUDA_CHECK(cudaEventSynchronize(b));
      KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms.emplace_back(), a, b));
    }
    std::sort(ms.begin(), ms.end());
    const double gbps = static_cast<double>(bytes) / (ms[2] * 1e-3) / 1e9;
    std::printf("fill %s: %.1f GB/s (%.3f ms for %zu bytes)\n", describe(spec).c_str(), gbps, ms[2], bytes);
    EXPECT_GT(gbps, 20.0) << describe(spec);
  }
  // The bytes of the last (largest-index) region still match the host's: the rate was not bought with wrong bytes.
  const DummySpec& last = specs.back();
  std::vector<uint8_t> host(dummy_bytes(last));
  fill_dummy(last, host);
  std::vector<uint8_t> back(host.size());
  KESTREL_CUDA_CHECK(cudaMemcpy(back.data(), d.get(), back.size(), cudaMemcpyDeviceToHost));
  EXPECT_TRUE(back == host);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

}  // namespace
}  // namespace kestrel::cuda
