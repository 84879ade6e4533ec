#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "kernels/cuda/kda_launch.h"
#include "kernels/cuda/kda_tc.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {

namespace {

static_assert(detail::kTcChunkHeadBytes <= detail::kWsChunkHead * sizeof(float),
              "a workspace sized for kda_prefill must also serve kda_prefill_tc");
static_assert(detail::kTcChunkHeadBytes % 16 == 0, "every chunk's operands start 16-byte aligned (cp.async)");

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

size_t chunks_bytes(const KdaPrefillPlan& plan) { return plan.chunks().size() * sizeof(KdaPrefillPlan::Chunk); }
size_t seqs_bytes(const KdaPrefillPlan& plan) { return plan.seqs().size() * sizeof(KdaPrefillPlan::Seq); }

// The argument checks of kda_prefill (kda.cpp), for this entry point; the gate and scale through flatten_inputs.
detail::KdaTokenArgs checked_token_args(const KdaInputs& in, int H, int dk, int dv, const float* state_pool,
                                        const int32_t* slots, const float* o) {
  constexpr const char* fn = "kda_prefill_tc";
  KESTREL_CHECK(H > 0 && H <= 65535, "{}: H must be in [1, 65535], got {}", fn, H);
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

size_t kda_prefill_tc_workspace_bytes(const KdaPrefillPlan& plan, int H) {
  KESTREL_CHECK(H > 0, "kda_prefill_tc_workspace_bytes: H must be positive, got {}", H);
  return align256(chunks_bytes(plan)) + align256(seqs_bytes(plan)) +
         plan.chunks().size() * static_cast<size_t>(H) * detail::kTcChunkHeadBytes;
}

void kda_prefill_tc(const KdaPrefillPlan& plan, const KdaInputs& in, int H, int dk, int dv, float* state_pool,
                    const int32_t* slots, float* o, float* checkpoints, void* workspace, size_t workspace_bytes,
                    cudaStream_t stream) {
  const detail::KdaTokenArgs args = checked_token_args(in, H, dk, dv, state_pool, slots, o);
  KESTREL_CHECK(plan.num_checkpoints() == 0 || (checkpoints && aligned16(checkpoints)),
                "kda_prefill_tc: the plan takes {} checkpoints but no 16-byte aligned checkpoint buffer was given",
                plan.num_checkpoints());
  const size_t needed = kda_prefill_tc_workspace_bytes(plan, H);
  KESTREL_CHECK(workspace_bytes >= needed && (workspace || needed == 0),
                "kda_prefill_tc: workspace of {} bytes, the plan needs {}", workspace_bytes, needed);
  KESTREL_CHECK(aligned16(workspace), "kda_prefill_tc: workspace must be 16-byte aligned");
  if (plan.num_seqs() == 0) return;

  auto* base = static_cast<char*>(workspace);
  auto* chunks = reinterpret_cast<KdaPrefillPlan::Chunk*>(base);
  auto* seqs = reinterpret_cast<KdaPrefillPlan::Seq*>(base + align256(chunks_bytes(plan)));
  auto* ws = reinterpret_cast<float*>(base + align256(chunks_bytes(plan)) + align256(seqs_bytes(plan)));
  // From pageable host memory: the copy is staged before cudaMemcpyAsync returns, so the plan may go away.
  if (chunks_bytes(plan) > 0)
    KESTREL_CUDA_CHECK(
        cudaMemcpyAsync(chunks, plan.chunks().data(), chunks_bytes(plan), cudaMemcpyHostToDevice, stream));
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(seqs, plan.seqs().data(), seqs_bytes(plan), cudaMemcpyHostToDevice, stream));

  const detail::KdaPrefillArgs prefill{args,       H,     plan.num_seqs(), plan.num_chunks(), chunks, seqs, ws,
                                       state_pool, slots, o,               checkpoints};
  KESTREL_CUDA_CHECK(detail::launch_kda_prefill_tc(prefill, stream));
}

}  // namespace kestrel::cuda
