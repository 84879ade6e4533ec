// Finds the checkpoint tensors of a model definition by their Hugging Face names and hands them to the backend as
// stored (StoredTensor / StoredLinear: dtype, shape, bytes in the memory-mapped file), checking names, shapes and
// dtypes, and keeping track of which tensors were used so that unexpected ones are reported. With --load-format dummy
// there is no checkpoint: each tensor is described by the shape the model asks for, the dtype the config's
// quantization stores it in, and the recipe of its random values (scaled so that activations stay O(1)).
#pragma once
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/backend.h"
#include "model/config.h"
#include "core/dummy_weights.h"
#include "model/safetensors.h"

namespace kestrel {

// How a dummy tensor's values are drawn: uniform with this standard deviation around `center`.
struct Init {
  float stddev = 0.0f, center = 0.0f;
};

// Which stored formats a linear weight may have: Quant::dense follows the config's FP8 block quantization
// (quantization_config quant_method fp8); Quant::expert also MXFP4 (quant_method mxfp4: routed experts only);
// Quant::none is plain in dummy weights (the indexer's weights_proj) and never MXFP4.
enum class Quant { none, dense, expert };

class WeightLoader {
 public:
  // A checkpoint directory's safetensors files.
  WeightLoader(const std::string& dir, const ModelConfig& cfg);
  // Dummy weights from `seed`.
  WeightLoader(const ModelConfig& cfg, uint64_t seed);

  bool dummy() const { return !ckpt_; }
  // A tensor of exactly `shape` (any float dtype); Error naming it if missing or mis-shaped. Dummy: `dtype` filled as
  // `init` says.
  StoredTensor tensor(const std::string& name, const std::vector<int64_t>& shape, Init init,
                      DType dtype = DType::BF16);
  // The same for a tensor a checkpoint may leave out (none when absent; a dummy model has it when `dummy_has`).
  std::optional<StoredTensor> optional_tensor(const std::string& name, const std::vector<int64_t>& shape, Init init,
                                              DType dtype, bool dummy_has);
  // A linear weight [out, in] stored as `<prefix>.weight` (bf16/f16/f32, or FP8 e4m3 with `<prefix>.weight_scale_inv`
  // [ceil(out/b), ceil(in/b)], b = the config's weight_block_size) or as MXFP4 `<prefix>.weight_packed` [out, in/2]
  // + `<prefix>.weight_scale` [out, in/32] (routed experts only: Quant::expert; elsewhere an Error naming it).
  StoredLinear linear(const std::string& prefix, int64_t out, int64_t in, Quant q = Quant::dense);
  // Every tensor of the checkpoint that no call consumed (sorted); the model reports these.
  std::vector<std::string> unused() const;
  // The checkpoint's tensor data in bytes (0 for dummy weights).
  size_t checkpoint_bytes() const;
  // Bytes of every tensor handed out so far, as stored (a dummy checkpoint's bytes for dummy weights).
  size_t handed_bytes() const { return handed_; }

 private:
  StoredTensor stored(const std::string& name);
  StoredLinear find_linear(const std::string& prefix, int64_t out, int64_t in, Quant q);
  // A dummy tensor; the parts of one quantised weight share the key of `key_name` (its prefix).
  StoredTensor made(const std::string& name, DType dtype, std::vector<int64_t> shape, Init init,
                    DummyLayout layout = DummyLayout::plain, const std::string& key_name = "") const;
  const ModelConfig& cfg_;
  std::unique_ptr<Checkpoint> ckpt_;
  uint64_t seed_ = 0;
  std::set<std::string> used_;
  size_t handed_ = 0;
};

// Decoding of one stored tensor's values to fp32 (bf16/f16/f32/f64 exactly; F8_E4M3 codes without scales).
std::vector<float> decode_to_f32(DType dtype, std::span<const uint8_t> bytes, const std::string& name);

}  // namespace kestrel
