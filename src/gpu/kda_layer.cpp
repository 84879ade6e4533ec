// The CUDA backend's KDA op: the short convolutions of the raw q, k, v projections (with their histories), the
// recurrence or chunked prefill over each sequence's state row (kernels/cuda/kda.h, kda_tc.h, kda_glue.h), KDA
// checkpoints, and the gated output norm. Single generated tokens run one decode launch, chunked prompts one prefill
// launch, the rest the token-by-token recurrence (the CPU's KdaCore computes the same function).
#include <cmath>

#include "core/error.h"
#include "gpu/cuda_state.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/kda_glue.h"
#include "kernels/cuda/kda_tc.h"
#include "kernels/cuda/runtime.h"
#include "kernels/cuda/short_conv_parts.h"

namespace kestrel::gpu {

Act CudaStep::kda(KdaW wh, int layer, Act qkv, Act f, Act beta, Act g) {
  const ModelConfig& cfg = s_.cfg;
  const StepBatch& batch = *batch_;
  const StepTables& t = *t_;
  const CachePlan& plan = *batch.plan;
  const auto& seqs = batch.seqs;
  const Ordered& ord = t.ord;
  StepScratch& s = s_.s;
  const cudaStream_t st = s_.stream;
  const DKda& k = s_.w.kda.at(wh.id);
  const size_t l = static_cast<size_t>(layer);
  const int64_t N = t.N;
  const int S = t.S;
  const int64_t Wc = cfg.short_conv_kernel_size, Hk = cfg.kda_num_heads, dk = cfg.kda_head_dim, P = Hk * dk;
  const int64_t hist_floats = (Wc - 1) * P;
  KESTREL_CHECK(qkv.cols == 3 * P && qkv.cols == ld(qkv) && f.cols == P && f.cols == ld(f) && beta.cols == Hk &&
                    beta.cols == ld(beta) && g.cols == P && g.cols == ld(g),
                "the KDA op takes whole activations of 3P, P, H and P columns");
  auto state_base = [&](int32_t row) { return s_.state_at(batch, row, l); };
  const int grp = plan.state_row[l];
  float* pool_states = reinterpret_cast<float*>(batch.pool + plan.state_offset[l]);
  const float* raw = f32(qkv);

  // Conv-history checkpoints, from the raw inputs before the convolution advances the histories.
  for (int j = 0; j < S; ++j) {
    const SequenceStep& q = seqs[ord.seq[j]];
    const float* hist = state_base(q.state_rows[grp]) + Hk * dk * dk;
    for (const CheckpointTarget& ck : q.checkpoints) {
      float* dst = state_base(ck.rows[grp]) + Hk * dk * dk;
      for (int64_t i = 0; i < Wc - 1; ++i) {
        // Row i of the q, k and v histories (hist_floats apart): one token's raw q, k, v (P apart) or an older row of
        // the histories.
        const int64_t rel = ck.position - (Wc - 1) + i - q.start;
        const float* src = rel >= 0 ? raw + (ord.first[j] + rel) * 3 * P : hist + (rel + Wc - 1) * P;
        const int64_t src_pitch = rel >= 0 ? P : hist_floats;
        KESTREL_CUDA_CHECK(cudaMemcpy2DAsync(dst + i * P, hist_floats * sizeof(float), src, src_pitch * sizeof(float),
                                             P * sizeof(float), 3, cudaMemcpyDeviceToDevice, st));
      }
    }
  }
  cuda::short_conv_silu_varlen_parts(raw, 3 * P, t.cu, S, 3, P, k.conv_qkv, static_cast<int>(Wc), t.hist[l],
                                     hist_floats, s.q, s.k - s.q, st);

  cuda::KdaInputs in;
  in.q = s.q;
  in.k = s.k;
  in.v = s.v;
  in.gate = f32(f);
  in.beta = f32(beta);
  in.A_log = k.A_log;
  in.dt_bias = k.dt_bias;
  in.gate_lower_bound = cfg.kda_gate_lower_bound;
  in.beta_is_logit = true;
  in.normalize_qk = true;
  in.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)));
  in.state_stride = plan.row_bytes / static_cast<int64_t>(sizeof(float));
  auto at_token = [&](cuda::KdaInputs x, int64_t t0) {
    x.q += t0 * P;
    x.k += t0 * P;
    x.v += t0 * P;
    x.gate += t0 * P;
    x.beta += t0 * Hk;
    return x;
  };
  const int H = static_cast<int>(Hk), d = static_cast<int>(dk);
  float* o = s.kda_o;
  if (t.fast_kda && ord.decode > 0) {
    cuda::kda_decode(in, ord.decode, H, d, d, pool_states, t.state_rows[grp], o, st);
    // A single token's checkpoint (recurrent-prefill mode names blocks that generated tokens complete) is the state
    // after it: copied once the decode has updated the state in place.
    for (int j = 0; j < ord.decode; ++j)
      for (const CheckpointTarget& ck : seqs[ord.seq[j]].checkpoints)
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(state_base(ck.rows[grp]), state_base(seqs[ord.seq[j]].state_rows[grp]),
                                           Hk * dk * dk * sizeof(float), cudaMemcpyDeviceToDevice, st));
  }
  if (t.fast_kda && ord.chunked > 0) {
    const int b0 = ord.decode, b1 = ord.decode + ord.chunked;
    const int64_t t0 = ord.first[b0];
    std::vector<int64_t> pcu{0}, pstart;
    bool any_ck = false;
    for (int j = b0; j < b1; ++j) {
      pcu.push_back(ord.first[j + 1] - t0);
      pstart.push_back(seqs[ord.seq[j]].start);
      any_ck |= !seqs[ord.seq[j]].checkpoints.empty();
    }
    const int64_t every = plan.block_size;
    const cuda::KdaPrefillPlan pp(pcu, pstart, any_ck ? every : 0);
    KESTREL_CHECK(pp.workspace_bytes(H) <= s.kda_ws_bytes &&
                      static_cast<size_t>(pp.num_checkpoints()) <= s.kda_checkpoint_states,
                  "the KDA prefill of this step needs more workspace than was set aside");
    float* checkpoints = pp.num_checkpoints() ? s.kda_checkpoints : nullptr;
    if (s_.tensor_core_kda)
      cuda::kda_prefill_tc(pp, at_token(in, t0), H, d, d, pool_states, t.state_rows[grp] + b0, o + t0 * P, checkpoints,
                           s.kda_ws, s.kda_ws_bytes, st);
    else
      cuda::kda_prefill(pp, at_token(in, t0), H, d, d, pool_states, t.state_rows[grp] + b0, o + t0 * P, checkpoints,
                        s.kda_ws, s.kda_ws_bytes, st);
    for (int j = b0; j < b1; ++j) {
      const SequenceStep& q = seqs[ord.seq[j]];
      const int64_t first_boundary = q.start / every + 1;  // the first multiple of `every` after start
      for (const CheckpointTarget& ck : q.checkpoints) {
        const int64_t idx = pp.first_checkpoint(j - b0) + ck.position / every - first_boundary;
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(state_base(ck.rows[grp]), s.kda_checkpoints + idx * Hk * dk * dk,
                                           Hk * dk * dk * sizeof(float), cudaMemcpyDeviceToDevice, st));
      }
    }
  }
  if (t.recurrent_cu) {
    const int64_t t0 = ord.first[t.first_recurrent];
    cuda::kda_recurrent_varlen(at_token(in, t0), t.recurrent_cu, S - t.first_recurrent, H, d, d, pool_states,
                               t.state_rows[grp] + t.first_recurrent, o + t0 * P, st);
  }
  for (const StepTables::Segment& sg : t.segments) {
    const SequenceStep& q = seqs[ord.seq[sg.seq]];
    if (sg.len > 0)
      cuda::kda_recurrent_varlen(at_token(in, sg.t0), sg.cu, 1, H, d, d, pool_states, t.state_rows[grp] + sg.seq,
                                 o + sg.t0 * P, st);
    if (sg.checkpoint)
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(state_base(sg.checkpoint->rows[grp]), state_base(q.state_rows[grp]),
                                         Hk * dk * dk * sizeof(float), cudaMemcpyDeviceToDevice, st));
  }
  // The output gate and norm, in fp32 and bf16 (o_proj's input either way).
  const Act out = alloc(P);
  Buffer& b = bufs_.at(out.buf);
  cuda::kda_gated_rmsnorm(o, f32(g), k.o_norm, N, H, d, cfg.rms_norm_eps, b.f32, b.bf16, st);
  b.bf16_valid = true;
  return out;
}

}  // namespace kestrel::gpu
