// A plain fp32 host tensor: row-major, owns its data. The CPU reference works on these; kernels take raw
// pointers and sizes so that they see plain memory and never a container.
#pragma once
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"

namespace kestrel {

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;

  Tensor() = default;
  explicit Tensor(std::vector<int64_t> s, float fill = 0.0f) : shape(std::move(s)) {
    data.assign(static_cast<size_t>(numel_of(shape)), fill);
  }

  static int64_t numel_of(const std::vector<int64_t>& s) {
    return std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<int64_t>());
  }
  int64_t numel() const { return static_cast<int64_t>(data.size()); }
  int64_t dim(size_t i) const { return shape.at(i); }
  size_t rank() const { return shape.size(); }
  float* ptr() { return data.data(); }
  const float* ptr() const { return data.data(); }
  bool empty() const { return data.empty(); }
};

std::string shape_str(const std::vector<int64_t>& s);

}  // namespace kestrel
