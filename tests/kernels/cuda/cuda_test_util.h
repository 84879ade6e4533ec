// Helpers shared by the GPU kernel tests (tests/kernels/cuda/*_test.cpp): each test is an executable of its own, so
// everything here is inline.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cuda/runtime.h"

#define REQUIRE_GPU() \
  if (::kestrel::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"

namespace kestrel::cuda::test_util {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr uint32_t kPoisonBits = 0x7FBADBADu;  // a NaN payload no kernel writes

inline void sync() { KESTREL_CUDA_CHECK(cudaDeviceSynchronize()); }
inline uint32_t bits(float x) { return std::bit_cast<uint32_t>(x); }
inline float poison_float() { return std::bit_cast<float>(kPoisonBits); }

// Bit for bit, except that any NaN matches any NaN (the CPU's NaN payloads are not specified).
inline bool same_float(float a, float b) { return (std::isnan(a) && std::isnan(b)) || bits(a) == bits(b); }

// Sets every element of d to the poison, so that an output a kernel never writes shows up.
inline void fill_poison(DeviceBuffer<float>& d) {
  const std::vector<float> poison(d.size(), poison_float());
  d.upload(poison.data());
}

// Requests' pages handed out in a shuffled order from a pool that also holds three pages nobody owns, as the
// kernels' pools are. block_table is [requests, bt_stride], -1 past each request's pages; bt_stride is the most
// pages of a request plus spare_columns (columns the kernels must never read), at least 1.
struct ScatteredPages {
  int total_pages = 0, bt_stride = 1;
  std::vector<int32_t> block_table;
};

inline ScatteredPages scatter_pages(std::mt19937& rng, const std::vector<int>& ctx, int page_size, int spare_columns) {
  ScatteredPages s;
  s.total_pages = 3;
  for (int c : ctx) {
    const int pages = (c + page_size - 1) / page_size;
    s.bt_stride = std::max(s.bt_stride, pages + spare_columns);
    s.total_pages += pages;
  }
  std::vector<int32_t> order(static_cast<size_t>(s.total_pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  s.block_table.assign(ctx.size() * static_cast<size_t>(s.bt_stride), -1);
  size_t next = 0;
  for (size_t r = 0; r < ctx.size(); ++r)
    for (int i = 0; i < (ctx[r] + page_size - 1) / page_size; ++i) s.block_table[r * s.bt_stride + i] = order[next++];
  return s;
}

}  // namespace kestrel::cuda::test_util
