// The CUDA backend's MoE op: the fp32 router (expert choice follows the reference), routing (bit for bit the CPU's
// rule) and the routed experts in their stored form (kernels/cuda/moe.h: bf16 and MXFP4 experts take the input in
// bf16, FP8 block-scaled experts in fp32, quantized per 128-column group).
#include "core/error.h"
#include "gpu/cuda_state.h"
#include "kernels/cuda/linear_f32.h"
#include "kernels/cuda/moe.h"

namespace kestrel::gpu {

Act CudaStep::moe(MoeW wh, Act x) {
  const DMoe& m = s_.w.moe.at(wh.id);
  StepScratch& s = s_.s;
  const cudaStream_t st = s_.stream;
  const int64_t N = t_->N, D = x.cols;
  KESTREL_CHECK(x.cols == ld(x) && D == m.experts.D, "the MoE op takes the whole normed input of {} columns",
                m.experts.D);
  cuda::linear_f32(f32(x), N, D, m.router, m.routing.n_experts, s.router_logits, st);
  cuda::moe_route(s.router_logits, m.bias, N, m.routing, s.route_ids, s.route_w, st);
  const Act y = alloc(D);
  float* out = bufs_.at(y.buf).f32;
  if (m.experts.dtype == cuda::ExpertDtype::fp8_block)
    cuda::moe_experts(f32(x), N, s.route_ids, s.route_w, m.routing.top_k, m.experts, out, s.moe_ws, s.moe_ws_bytes, st);
  else
    cuda::moe_experts(bf16(x), N, s.route_ids, s.route_w, m.routing.top_k, m.experts, out, s.moe_ws, s.moe_ws_bytes,
                      st);
  return y;
}

}  // namespace kestrel::gpu
