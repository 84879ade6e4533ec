// Dummy weights (--load-format dummy): the bytes of a tensor of any stored shape and dtype, made from a seed and
// the tensor's key by a counter-based generator, so that every element is computed on its own (in parallel, on
// the host or on the GPU: kernels/cuda/dummy_weights.h writes the same bytes into device memory).
//
// Element i of a part draws u_i in (-1, 1) (dummy_weights_element.h: splitmix64's output i + 1 from a state made
// of seed, key and the stream, then the odd multiples of 2^-23 from its top 23 bits, so u is symmetric about 0).
// What the bytes mean, per layout (A = amplitude):
//   plain        F32, BF16, F16: offset + A * u, rounded (fp32 products and sums) then to the dtype (nearest-even).
//                Uniform over offset +- A: mean offset, variance A^2 / 3.
//   fp8_codes    F8_E4M3 [..., N, K], an FP8 block-scaled weight (DeepSeek's layout; each trailing [N, K] matrix in
//                tiles of fp8_block x fp8_block): code = e4m3(A * u / s) for its tile's scale s, one code lower in
//                magnitude when rounding went past A / s. Decoded, e4m3(code) * s, values are uniform over +- A to
//                e4m3's precision and never beyond A.
//   fp8_scales   F32 [..., ceil(N / B), ceil(K / B)]: the weight_scale_inv of the same weight (value = e4m3(code) *
//                scale), powers of two as in DeepSeek-V3.2's ue8m0 checkpoints: s0 * 2^r with r in 0..3 drawn per
//                tile, s0 the smallest power of two with A / s0 <= 448.
//   mxfp4_codes  U8 [..., N, K / 2], two e2m1 codes per byte, element 2j in the low nibble: e2m1(6 u), rounded to
//                nearest-even.
//   mxfp4_scales U8 or F8_E8M0 [..., N, K / 32]: one E8M0 exponent e per block of 32 (value = e2m1 * 2^(e - 127)),
//                e = e0 - r with r in 0..1 drawn per block, 2^(e0 - 127) the largest power of two with 6 * it <= A.
//                Decoded values lie within +- A (their largest magnitude is 6 * 2^(e0 - 127), in (A / 2, A]).
// The two parts of a quantised weight are two calls with the same seed, key, amplitude (and fp8_block); their
// shapes must correspond as above. Quantised layouts take offset 0 and an amplitude in [2^-100, 2^100].
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/dummy_weights_element.h"

namespace kestrel {

struct DummySpec {
  uint64_t seed = 0;
  uint64_t key = 0;  // tensor_key of the weight's name; the same for both parts of a quantised weight
  DummyLayout layout = DummyLayout::plain;
  DType dtype = DType::BF16;
  std::vector<int64_t> shape;  // of this part
  float amplitude = 0.0f;
  float offset = 0.0f;
  int64_t fp8_block = 128;  // fp8_codes: the tile edge of the block scales (a checkpoint's weight_block_size)
};

const char* dummy_layout_name(DummyLayout layout);

// A stable 64-bit key of a tensor name: splitmix64's mix of the name's FNV-1a 64 hash. The same on every host.
uint64_t tensor_key(std::string_view name);

// The generator's parameters for `spec`; throws Error naming what is wrong (layout and dtype that do not go
// together, a shape the layout cannot have, an amplitude or offset out of range, a size that overflows).
DummyParams dummy_params(const DummySpec& spec);

// numel(shape) * dtype_size(dtype), after dummy_params' checks.
size_t dummy_bytes(const DummySpec& spec);

// Writes the tensor's bytes (little-endian) into out, whose size must be dummy_bytes(spec). Multithreaded (OpenMP).
void fill_dummy(const DummySpec& spec, std::span<uint8_t> out);

}  // namespace kestrel
