#include "kernels/cuda/kda.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cuda/kda_launch.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {

namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// Validates the arguments every KDA kernel shares and flattens KdaInputs for the kernels.
detail::KdaTokenArgs token_args(const char* fn, const KdaInputs& in, int H, int dk, int dv, const float* state_pool,
                                const int32_t* slots, const float* o) {
  KESTREL_CHECK(H > 0, "{}: H must be positive, got {}", fn, H);
  KESTREL_CHECK(dk == detail::kKdaDim && dv == detail::kKdaDim,
                "{}: only dk = dv = {} is implemented on the GPU, got dk={} dv={}", fn, detail::kKdaDim, dk, dv);
  KESTREL_CHECK(in.q && in.k && in.v && in.gate && in.beta && state_pool && slots && o,
                "{}: q, k, v, gate, beta, state_pool, slots and o must all be set", fn);
  KESTREL_CHECK(aligned16(in.q) && aligned16(in.k) && aligned16(in.v) && aligned16(in.gate) &&
                    aligned16(state_pool) && aligned16(o),
                "{}: q, k, v, gate, state_pool and o must be 16-byte aligned", fn);
  const int64_t state_size = int64_t{H} * dk * dv;
  const detail::KdaTokenArgs args = detail::flatten_inputs(fn, in, state_size);
  KESTREL_CHECK(in.state_stride == 0 || (in.state_stride >= state_size && in.state_stride % 4 == 0),
                "{}: state_stride {} must be 0 or a multiple of 4 of at least H*dk*dv = {}", fn, in.state_stride,
                state_size);
  return args;
}

}  // namespace

detail::KdaTokenArgs detail::flatten_inputs(const char* fn, const KdaInputs& in, int64_t state_size) {
  KESTREL_CHECK((in.A_log == nullptr) == (in.dt_bias == nullptr),
                "{}: the fused gate needs both A_log and dt_bias (or neither)", fn);
  KESTREL_CHECK(!in.gate_lower_bound || in.A_log, "{}: gate_lower_bound only applies to the fused gate", fn);
  KESTREL_CHECK(!in.gate_lower_bound || (std::isfinite(*in.gate_lower_bound) && *in.gate_lower_bound < 0.0f),
                "{}: gate lower bound must be negative, got {}", fn, in.gate_lower_bound.value_or(0.0f));
  KESTREL_CHECK(std::isfinite(in.scale), "{}: scale must be finite, got {}", fn, in.scale);
  return KdaTokenArgs{in.q,
                      in.k,
                      in.v,
                      in.gate,
                      in.beta,
                      in.A_log,
                      in.dt_bias,
                      in.gate_lower_bound.value_or(0.0f),
                      in.gate_lower_bound.has_value(),
                      in.beta_is_logit,
                      in.normalize_qk,
                      in.scale,
                      in.state_stride ? in.state_stride : state_size};
}

void kda_decode(const KdaInputs& in, int N, int H, int dk, int dv, float* state_pool, const int32_t* slots, float* o,
                cudaStream_t stream) {
  KESTREL_CHECK(N >= 0, "kda_decode: N must be non-negative, got {}", N);
  const detail::KdaTokenArgs args = token_args("kda_decode", in, H, dk, dv, state_pool, slots, o);
  KESTREL_CUDA_CHECK(detail::launch_kda_decode(args, N, H, state_pool, slots, o, stream));
}

KdaPrefillPlan::KdaPrefillPlan(std::span<const int64_t> cu_seqlens, std::span<const int64_t> start_pos,
                               int64_t checkpoint_every)
    : checkpoint_every_(checkpoint_every) {
  KESTREL_CHECK(!cu_seqlens.empty() && cu_seqlens[0] == 0, "KdaPrefillPlan: cu_seqlens must start with 0");
  const size_t B = cu_seqlens.size() - 1;
  KESTREL_CHECK(start_pos.size() == B, "KdaPrefillPlan: {} sequences but {} start positions", B, start_pos.size());
  KESTREL_CHECK(checkpoint_every >= 0 && checkpoint_every % kChunk == 0,
                "KdaPrefillPlan: checkpoint_every ({}) must be 0 or a positive multiple of {}", checkpoint_every,
                kChunk);
  first_checkpoint_.push_back(0);
  for (size_t b = 0; b < B; ++b) {
    const int64_t len = cu_seqlens[b + 1] - cu_seqlens[b], start = start_pos[b];
    KESTREL_CHECK(len >= 0, "KdaPrefillPlan: cu_seqlens decreases at sequence {}", b);
    KESTREL_CHECK(start >= 0, "KdaPrefillPlan: start_pos[{}] = {} is negative", b, start);
    Seq seq{static_cast<int64_t>(chunks_.size()), 0};
    for (int64_t t = 0; t < len;) {
      const int64_t pos = start + t;
      const int64_t end = std::min((pos / kChunk + 1) * kChunk, start + len);
      const int64_t checkpoint = checkpoint_every > 0 && end % checkpoint_every == 0 ? num_checkpoints_++ : -1;
      chunks_.push_back(Chunk{cu_seqlens[b] + t, static_cast<int32_t>(end - pos), static_cast<int32_t>(b), checkpoint});
      t += end - pos;
    }
    seq.num_chunks = static_cast<int64_t>(chunks_.size()) - seq.first_chunk;
    seqs_.push_back(seq);
    first_checkpoint_.push_back(num_checkpoints_);
  }
  num_tokens_ = cu_seqlens[B];
}

size_t KdaPrefillPlan::workspace_bytes(int H) const {
  return align256(chunks_.size() * sizeof(Chunk)) + align256(seqs_.size() * sizeof(Seq)) +
         chunks_.size() * static_cast<size_t>(H) * detail::kWsChunkHead * sizeof(float);
}

void kda_prefill(const KdaPrefillPlan& plan, const KdaInputs& in, int H, int dk, int dv, float* state_pool,
                 const int32_t* slots, float* o, float* checkpoints, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream) {
  const detail::KdaTokenArgs args = token_args("kda_prefill", in, H, dk, dv, state_pool, slots, o);
  KESTREL_CHECK(plan.num_checkpoints() == 0 || (checkpoints && aligned16(checkpoints)),
                "kda_prefill: the plan takes {} checkpoints but no 16-byte aligned checkpoint buffer was given",
                plan.num_checkpoints());
  KESTREL_CHECK(workspace_bytes >= plan.workspace_bytes(H) && (workspace || plan.workspace_bytes(H) == 0),
                "kda_prefill: workspace of {} bytes, the plan needs {}", workspace_bytes, plan.workspace_bytes(H));
  KESTREL_CHECK(aligned16(workspace), "kda_prefill: workspace must be 16-byte aligned");
  if (plan.num_seqs() == 0) return;

  auto* base = static_cast<char*>(workspace);
  const size_t chunks_bytes = plan.chunks().size() * sizeof(KdaPrefillPlan::Chunk);
  const size_t seqs_bytes = plan.seqs().size() * sizeof(KdaPrefillPlan::Seq);
  auto* chunks = reinterpret_cast<KdaPrefillPlan::Chunk*>(base);
  auto* seqs = reinterpret_cast<KdaPrefillPlan::Seq*>(base + align256(chunks_bytes));
  auto* ws = reinterpret_cast<float*>(base + align256(chunks_bytes) + align256(seqs_bytes));
  // From pageable host memory: the copy is staged before cudaMemcpyAsync returns, so the plan may go away.
  if (chunks_bytes > 0)
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(chunks, plan.chunks().data(), chunks_bytes, cudaMemcpyHostToDevice, stream));
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(seqs, plan.seqs().data(), seqs_bytes, cudaMemcpyHostToDevice, stream));

  const detail::KdaPrefillArgs prefill{args,        H,     plan.num_seqs(), plan.num_chunks(), chunks, seqs, ws,
                                       state_pool, slots, o,               checkpoints};
  KESTREL_CUDA_CHECK(detail::launch_kda_prefill(prefill, stream));
}

}  // namespace kestrel::cuda
