// NumPy .npy files: the logits dump (`kestrel generate --dump-logits`) and reference arrays for tests.
// Written as format version 1.0, little-endian, C order, header padded so the data starts at a multiple of 64
// bytes (what numpy itself writes). Read: versions 1.0 and 2.0, C order only, little-endian or one-byte dtypes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kestrel {

struct NpyArray {
  std::string dtype;           // the header's descr, e.g. "<f4", "<i4", "|u1"
  std::vector<int64_t> shape;  // empty for a 0-d array (which holds one element)
  std::vector<uint8_t> data;   // the raw little-endian element bytes, C order

  int64_t numel() const;
  // Copies of the data; throw kestrel::Error unless dtype is "<f4" (resp. "<i4").
  std::vector<float> to_f32() const;
  std::vector<int32_t> to_i32() const;
};

// Write `data` (numel(shape) elements, C order) as '<f4' / '<i4'. Throw kestrel::Error on a negative dimension
// or when the file cannot be written.
void write_npy(const std::string& path, const float* data, const std::vector<int64_t>& shape);
void write_npy(const std::string& path, const int32_t* data, const std::vector<int64_t>& shape);

// Read and validate a whole file: magic, version, the header dict (exactly the keys descr, fortran_order,
// shape; fortran_order False; a supported dtype; non-negative dimensions) and that the file size is exactly
// header + numel * itemsize. Anything else throws kestrel::Error naming the file and the problem.
NpyArray read_npy(const std::string& path);

}  // namespace kestrel
