// The model on one GPU: a loaded Model's weights uploaded once (bf16 linear weights, MXFP4 experts where the
// checkpoint has them, fp32 norms, gates and router), step workspaces sized for the engine's limits, and a forward
// pass with the contract of Model::forward(StepBatch) over a cache pool in GPU memory. Layers run the CUDA kernels
// of src/kernels/cuda; the CPU reference (Model::forward) is what the GPU tests compare against.
//
// Numerics: activations between layers are fp32 (the residual stream); every linear layer takes bf16 inputs and
// accumulates in fp32 (cuBLASLt); the MoE router is fp32 end to end so that expert choices follow the reference;
// KDA state and attention math are fp32. See docs/gpu.md.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "gpu/device_arena.h"
#include "model/model.h"

namespace kestrel::gpu {

// What a step may hold at most; the workspaces are sized for it once.
struct GpuLimits {
  int64_t max_tokens = 2048;    // tokens per step (--max-num-batched-tokens)
  int max_seqs = 256;           // sequences per step (--max-num-seqs)
  int64_t max_model_len = 0;    // context of one sequence
  int block_size = 64;          // the cache plan's B
};

struct DeviceWeights;
struct StepScratch;
struct DMla;
struct DLayer;
struct Ordered;

class GpuModel {
 public:
  // Uploads `host`'s weights into `arena` and takes the step workspaces for `limits` from it. The model must
  // outlive this object. Error for what the GPU path does not implement yet (named).
  GpuModel(const Model& host, const GpuLimits& limits, DeviceArena& arena);
  ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  const Model& host() const { return host_; }
  const GpuLimits& limits() const { return limits_; }
  cudaStream_t stream() const { return stream_; }
  size_t weight_bytes() const { return weight_bytes_; }
  size_t workspace_bytes() const { return workspace_bytes_; }

  // One step: batch.pool is the device address of the cache pool (laid out by batch.plan). logits: host memory,
  // [wanted positions, vocab], requests in order, as Model::forward. Synchronous (returns when the logits are in
  // host memory).
  void forward(const StepBatch& batch, float* logits);

 private:
  // One MLA layer over the step (x_bf -> y) and one FFN or MoE (h -> post-norm -> y): parts of forward().
  void mla_layer(const DMla& m, size_t layer, const StepBatch& batch, int64_t N, int S, const Ordered& ord,
                 const int64_t* d_slots, const int32_t* d_row_req, const int32_t* d_row_pos, const int32_t* d_ctx,
                 const int32_t* d_bt, int64_t bt_stride);
  void ffn_layer(const DLayer& layer, int64_t N);

  const Model& host_;
  GpuLimits limits_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<DeviceWeights> w_;
  std::unique_ptr<StepScratch> s_;
  size_t weight_bytes_ = 0, workspace_bytes_ = 0;
};

}  // namespace kestrel::gpu
