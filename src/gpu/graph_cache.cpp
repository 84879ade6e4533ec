// CUDA graphs for steps of single generated tokens: one graph per (batch size, pool, block-table width), captured the
// second time the step's shape occurs and replayed after. The first time runs eagerly, so that whatever a library
// sets up on first use of a shape (cuBLASLt's heuristics, plans) happens outside a capture. A replay skips the model's graph entirely: the same kernels
// on the same addresses, the step's tables (token ids, positions, block tables, context lengths) read on the device.
#include "core/error.h"
#include "gpu/cuda_state.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::gpu {

void CudaState::launch(const StepBatch& batch, const std::function<void(StepOps&)>& graph) {
  const StepTables& t = tables;
  if (!t.graph) {
    step.reset(batch, t);
    graph(step);
    return;
  }
  const auto key = std::make_tuple(t.S, batch.pool, t.bt_stride);
  auto it = graphs.find(key);
  if (it == graphs.end()) {
    graphs.emplace(key, nullptr);
    step.reset(batch, t);
    graph(step);
    return;
  }
  cudaGraphExec_t& exec = it->second;
  if (!exec) {
    cudaGraph_t g = nullptr;
    KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      step.reset(batch, t);
      graph(step);
    } catch (...) {
      cudaStreamEndCapture(stream, &g);
      if (g) cudaGraphDestroy(g);
      exec = nullptr;
      throw;
    }
    KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    const cudaError_t inst = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    KESTREL_CUDA_CHECK(inst);
  }
  KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
}

}  // namespace kestrel::gpu
