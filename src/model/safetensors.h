// safetensors checkpoints: memory-mapped reading with every header field validated against the file, a
// sharded view over model.safetensors.index.json, and a writer (used by make-model and the tests).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace kestrel {

struct TensorView {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;  // exactly numel * dtype_size bytes, inside the mapped file
  int64_t numel() const;
};

// One .safetensors file, memory-mapped read-only. The constructor validates: file size >= 8; header length
// fits in the file and is at most 100 MB; header is a JSON object; each entry has dtype/shape/data_offsets of
// the right types; shapes are non-negative and their product does not overflow; end - begin == numel * size;
// offsets are in order, inside the data section, and do not overlap; "__metadata__" is a string map.
// Any violation throws Error naming the file and the tensor.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const;
  const TensorView& get(const std::string& name) const;  // throws Error naming the tensor if absent
  std::vector<std::string> names() const;                // sorted
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Where a tensor of this file starts in it (its bytes' offset from the start of the file).
  int64_t file_offset(const TensorView& t) const { return t.bytes.data() - map_; }

 private:
  std::string path_;
  const uint8_t* map_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: either model.safetensors, or model.safetensors.index.json ("weight_map": name ->
// shard file) with its shards, or (fallback) every *.safetensors file in the directory. Validates that every
// tensor named in the index exists in its shard, and that no tensor appears in two files.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir);
  bool has(const std::string& name) const;
  const TensorView& get(const std::string& name) const;  // throws Error naming the tensor if absent
  std::vector<std::string> names() const;                // sorted
  const SafetensorsFile& file_of(const std::string& name) const;  // the shard holding the tensor
  // Tensor data of every file, in bytes.
  size_t data_bytes() const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> where_;
};

// Writer: collects tensors and writes one file (header padded to a multiple of 8 bytes with spaces).
struct TensorData {
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
void write_safetensors(const std::string& path, const std::map<std::string, TensorData>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// Writes shards of at most max_shard_bytes of tensor data each (named model-0000i-of-0000n.safetensors) and
// model.safetensors.index.json; with one shard it writes model.safetensors and no index.
void write_checkpoint(const std::string& dir, const std::map<std::string, TensorData>& tensors,
                      int64_t max_shard_bytes);

// The same for tensors made one at a time, for checkpoints larger than memory: `tensors` (names, dtypes, shapes) in
// the order their bytes are made; fill(i, out) writes tensor i's bytes into out (its size). Shards as above, in the
// given order.
struct TensorSpec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};
void write_checkpoint_streamed(const std::string& dir, const std::vector<TensorSpec>& tensors,
                               const std::function<void(size_t, std::span<uint8_t>)>& fill, int64_t max_shard_bytes);

}  // namespace kestrel
