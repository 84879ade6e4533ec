// Loads checkpoint tensors by their Hugging Face names into fp32, dequantising on load (FP8 block-scaled,
// MXFP4), checking shapes, and keeping track of which tensors were used so that unexpected ones are reported.
#pragma once
#include <set>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/safetensors.h"

namespace kestrel {

class WeightLoader {
 public:
  WeightLoader(const std::string& dir, int fp8_block, bool bf16_inputs = false)
      : bf16_inputs(bf16_inputs), ckpt_(dir), fp8_block_(fp8_block) {}

  // What the linear layers loaded through this loader do with their inputs (ModelOptions::bf16_activations).
  const bool bf16_inputs;

  // A tensor of exactly `shape` (any float dtype); Error naming the tensor if missing or mis-shaped.
  Tensor get(const std::string& name, const std::vector<int64_t>& shape);
  bool has(const std::string& name) const { return ckpt_.has(name); }
  // A linear weight [out, in] stored as `<prefix>.weight` (bf16/f16/f32, or FP8 e4m3 with
  // `<prefix>.weight_scale_inv` [ceil(out/b), ceil(in/b)], b = fp8_block) or as MXFP4 `<prefix>.weight_packed` [out, in/2]
  // + `<prefix>.weight_scale` [out, in/32].
  Tensor linear(const std::string& prefix, int64_t out, int64_t in);
  // Every tensor of the checkpoint that no get()/linear() consumed (sorted); the model reports these.
  std::vector<std::string> unused() const;

 private:
  const TensorView& view(const std::string& name);
  Checkpoint ckpt_;
  int fp8_block_;
  std::set<std::string> used_;
};

// Decoding of one stored tensor to fp32 (bf16/f16/f32/f64 exactly; F8_E4M3 codes without scales).
std::vector<float> decode_to_f32(const TensorView& v);

}  // namespace kestrel
