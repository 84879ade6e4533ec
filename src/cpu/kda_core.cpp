#include "cpu/kda_core.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/basic.h"
#include "kernels/cpu/kda.h"

namespace kestrel {

namespace {
constexpr float kL2NormEps = 1e-6f;
float inv_sqrt(int n) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))); }
}  // namespace

KdaStateView kda_state_view(const ModelConfig& cfg, uint8_t* at) {
  const int64_t H = cfg.kda_num_heads, dk = cfg.kda_head_dim, hist = (cfg.short_conv_kernel_size - 1) * H * dk;
  KdaStateView v;
  v.state = reinterpret_cast<float*>(at);
  v.conv_q = v.state + H * dk * dk;
  v.conv_k = v.conv_q + hist;
  v.conv_v = v.conv_k + hist;
  return v;
}

KdaCore::KdaCore(const ModelConfig& cfg, Tensor conv_q, Tensor conv_k, Tensor conv_v, Tensor A_log, Tensor dt_bias,
                 Tensor o_norm)
    : cfg_(cfg),
      conv_q_(std::move(conv_q)),
      conv_k_(std::move(conv_k)),
      conv_v_(std::move(conv_v)),
      A_log_(std::move(A_log)),
      dt_bias_(std::move(dt_bias)),
      o_norm_(std::move(o_norm)) {}

void KdaCore::forward(const float* qkv, const float* f, const float* beta_logit, const float* gate_out, int64_t T,
                      int64_t pos0, const KdaStateView& st, bool chunked, std::span<const KdaCheckpoint> checkpoints,
                      int64_t checkpoint_every, float* o_out) const {
  const int H = cfg_.kda_num_heads, dk = cfg_.kda_head_dim, Wc = cfg_.short_conv_kernel_size;
  const int64_t P = int64_t{H} * dk, n = T * P, state_size = P * dk;
  for (size_t c = 0; c < checkpoints.size(); ++c)
    KESTREL_CHECK(checkpoints[c].position > pos0 && checkpoints[c].position <= pos0 + T &&
                      (c == 0 || checkpoints[c].position >= checkpoints[c - 1].position),
                  "KDA checkpoint at {} is not inside the step ({}, {}] in ascending order", checkpoints[c].position,
                  pos0, pos0 + T);

  // Each projection goes through its short conv; a checkpoint keeps the W-1 raw inputs before its position, taken
  // from the history at the start of the step and this step's inputs.
  std::vector<float> raw(n), q(n), k(n), v(n);
  auto convolve = [&](int part, const Tensor& w, float* hist, float* KdaStateView::*conv, float* out) {
    for (int64_t t = 0; t < T; ++t) std::copy_n(qkv + t * 3 * P + part * P, P, raw.data() + t * P);
    for (const KdaCheckpoint& c : checkpoints)
      for (int i = 0; i < Wc - 1; ++i) {
        const int64_t rel = c.position - (Wc - 1) + i - pos0;
        const float* src = rel >= 0 ? raw.data() + rel * P : hist + (rel + Wc - 1) * P;
        std::copy_n(src, P, c.dst.*conv + i * P);
      }
    cpu::short_conv_silu(raw.data(), T, P, w.ptr(), Wc, hist, out);
  };
  convolve(0, conv_q_, st.conv_q, &KdaStateView::conv_q, q.data());
  convolve(1, conv_k_, st.conv_k, &KdaStateView::conv_k, k.data());
  convolve(2, conv_v_, st.conv_v, &KdaStateView::conv_v, v.data());
  cpu::l2_normalize_rows(q.data(), T * H, dk, kL2NormEps);
  cpu::l2_normalize_rows(k.data(), T * H, dk, kL2NormEps);

  std::vector<float> g(n), beta(beta_logit, beta_logit + T * H);
  cpu::kda_gate(f, T, H, dk, A_log_.ptr(), dt_bias_.ptr(), cfg_.kda_gate_lower_bound, g.data());
  for (float& b : beta) b = cpu::sigmoid(b);

  std::vector<float> o(n);
  const float scale = inv_sqrt(dk);
  if (chunked && checkpoints.empty()) {
    cpu::kda_chunked(q.data(), k.data(), v.data(), g.data(), beta.data(), T, H, dk, dk, scale, st.state, o.data(),
                     pos0);
  } else if (chunked) {
    // The chunked kernel copies the state at every multiple of checkpoint_every; the wanted ones are kept.
    const int64_t first = pos0 / checkpoint_every, count = (pos0 + T) / checkpoint_every - first;
    std::vector<float> states(static_cast<size_t>(count * state_size));
    cpu::kda_chunked(q.data(), k.data(), v.data(), g.data(), beta.data(), T, H, dk, dk, scale, st.state, o.data(),
                     pos0, 64, states.data(), checkpoint_every);
    for (const KdaCheckpoint& c : checkpoints) {
      KESTREL_CHECK(c.position % checkpoint_every == 0, "KDA checkpoint at {} is not a multiple of {}", c.position,
                    checkpoint_every);
      std::copy_n(states.data() + (c.position / checkpoint_every - first - 1) * state_size, state_size, c.dst.state);
    }
  } else {
    // The recurrence is token by token, so cutting it at the checkpoints changes nothing.
    int64_t t = 0;
    auto run = [&](int64_t len) {
      cpu::kda_recurrent(q.data() + t * P, k.data() + t * P, v.data() + t * P, g.data() + t * P,
                         beta.data() + t * H, len, H, dk, dk, scale, st.state, o.data() + t * P);
      t += len;
    };
    for (const KdaCheckpoint& c : checkpoints) {
      run(c.position - pos0 - t);
      std::copy_n(st.state, state_size, c.dst.state);
    }
    run(T - t);
  }

  cpu::kda_gated_rmsnorm(o.data(), gate_out, o_norm_.ptr(), T, H, dk, cfg_.rms_norm_eps, o_out);
}

}  // namespace kestrel
