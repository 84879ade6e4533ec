// A checkpoint of dummy weights on disk: the safetensors files of a model of `dir`'s config.json, every tensor the
// model definition reads, in its stored dtype and shape, with the values of --load-format dummy (core/dummy_weights.h)
// -- for measuring loading from disk at real sizes without downloading a checkpoint. Made one tensor at a time, so
// that the host holds at most the largest tensor.
#pragma once
#include <cstdint>
#include <string>

namespace kestrel {

// Writes the safetensors of the model whose config.json is in `dir` (written there already) into `dir`, shards of at
// most max_shard_bytes. Returns the bytes of tensor data written.
uint64_t write_dummy_checkpoint(const std::string& dir, uint64_t seed, int64_t max_shard_bytes);

}  // namespace kestrel
