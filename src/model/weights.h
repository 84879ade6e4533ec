// Loads checkpoint tensors by their Hugging Face names into fp32, dequantising on load (FP8 block-scaled,
// MXFP4), checking shapes, and keeping track of which tensors were used so that unexpected ones are reported.
#pragma once
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/safetensors.h"

namespace kestrel {

// A linear weight [out, in] as an FP8 block-scaled checkpoint stores it (WeightQuant::fp8_block): e4m3 codes and one
// fp32 scale per block x block tile. The loaded fp32 weight is exactly e4m3_to_f32(code) * scale, from which the
// codes and scales cannot in general be recovered (a scale is any fp32 value), so they are kept as stored.
struct Fp8BlockWeight {
  std::vector<uint8_t> codes;  // [out, in]
  std::vector<float> scales;   // [ceil(out / block), ceil(in / block)]
  int block = 0;
};

class WeightLoader {
 public:
  WeightLoader(const std::string& dir, int fp8_block, bool bf16_inputs = false, bool keep_fp8 = false)
      : bf16_inputs(bf16_inputs), keep_fp8(keep_fp8), ckpt_(dir), fp8_block_(fp8_block) {}

  // What the linear layers loaded through this loader do with their inputs (ModelOptions::bf16_activations).
  const bool bf16_inputs;
  // Whether the layers keep their FP8-stored weights' codes and scales (ModelOptions::keep_fp8_weights).
  const bool keep_fp8;

  // A tensor of exactly `shape` (any float dtype); Error naming the tensor if missing or mis-shaped.
  Tensor get(const std::string& name, const std::vector<int64_t>& shape);
  bool has(const std::string& name) const { return ckpt_.has(name); }
  // A linear weight [out, in] stored as `<prefix>.weight` (bf16/f16/f32, or FP8 e4m3 with
  // `<prefix>.weight_scale_inv` [ceil(out/b), ceil(in/b)], b = fp8_block) or as MXFP4 `<prefix>.weight_packed` [out, in/2]
  // + `<prefix>.weight_scale` [out, in/32]. With `raw` set, a weight stored in FP8 also fills *raw with its codes
  // and scales (a weight stored otherwise leaves it empty).
  Tensor linear(const std::string& prefix, int64_t out, int64_t in, std::optional<Fp8BlockWeight>* raw = nullptr);
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
