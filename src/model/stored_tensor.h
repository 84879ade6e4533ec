// A checkpoint tensor as a backend receives it: its stored dtype and shape, and either its bytes in the memory-mapped
// safetensors file (with the file and offset, so a backend may also read them itself) or, for --load-format dummy, the
// recipe of the random values to make in its place (on the backend's device, bit-identical everywhere).
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/dummy_weights.h"
#include "model/safetensors.h"

namespace kestrel {

struct StoredTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;    // checkpoint bytes (empty for a dummy tensor)
  const std::string* file = nullptr;  // the shard they are in, and where
  int64_t file_offset = 0;
  std::optional<DummySpec> dummy;   // --load-format dummy: the recipe (core/dummy_weights.h), its dtype and shape these

  bool present() const { return !name.empty(); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
};

}  // namespace kestrel
