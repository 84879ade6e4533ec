// The CPU backend's KDA (the cache side of a KDA layer: short convolutions, gates, the gated delta rule in its
// recurrent and chunked forms, the gated output norm): the reference of the GPU's KDA kernels. It owns the layer's
// conv taps and gate parameters (fp32) and the meaning of a request's KDA state row.
#pragma once
#include <cstdint>
#include <span>

#include "core/tensor.h"
#include "model/config.h"

namespace kestrel {

// One KDA layer's state of one request, inside a state row: the recurrent state, then the short-conv histories.
struct KdaStateView {
  float* state = nullptr;                                         // [H, dk, dv]
  float* conv_q = nullptr, *conv_k = nullptr, *conv_v = nullptr;  // [W-1, H*dk] each, oldest input first
};
KdaStateView kda_state_view(const ModelConfig& cfg, uint8_t* at);
// A copy of the state after the token at position - 1 (a block boundary inside the step).
struct KdaCheckpoint {
  int64_t position = 0;
  KdaStateView dst;
};

class KdaCore {
 public:
  // conv_*: [P, 1, W]; A_log [H]; dt_bias [P]; o_norm [dk] (fp32).
  KdaCore(const ModelConfig& cfg, Tensor conv_q, Tensor conv_k, Tensor conv_v, Tensor A_log, Tensor dt_bias,
          Tensor o_norm);
  // T new tokens at positions pos0 ...: qkv [T, 3P] the raw projections (q ; k ; v), f [T, P] the forget gate's
  // pre-activation, beta [T, H] a logit, g [T, P] the output gate -> o [T, P] (rows contiguous). chunked: the chunked
  // (WY) form with chunks at absolute multiples of 64, else the token-by-token recurrence. Checkpoints (positions in
  // (pos0, pos0 + T], ascending) receive copies of the state and conv histories; in the chunked form their positions
  // must be multiples of checkpoint_every, itself a multiple of the chunk.
  void forward(const float* qkv, const float* f, const float* beta, const float* g, int64_t T, int64_t pos0,
               const KdaStateView& st, bool chunked, std::span<const KdaCheckpoint> checkpoints,
               int64_t checkpoint_every, float* o) const;

 private:
  const ModelConfig& cfg_;
  Tensor conv_q_, conv_k_, conv_v_, A_log_, dt_bias_, o_norm_;
};

}  // namespace kestrel
