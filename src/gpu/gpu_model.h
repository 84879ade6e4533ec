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

#include <chrono>
#include <cstdint>
#include <map>
#include <span>
#include <tuple>
#include <utility>
#include <memory>
#include <vector>

#include "gpu/device_arena.h"
#include "engine/step_executor.h"
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
struct StepTables;

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
  // Linear-layer weights whose bf16 copy rounds their value (an FP8 checkpoint whose block scales are not powers of
  // two): such layers differ from the reference by that rounding on the cuBLASLt (bf16) path.
  size_t rounded_weights() const { return rounded_weights_; }
  size_t workspace_bytes() const { return workspace_bytes_; }
  // Steps of single generated tokens replay one CUDA graph per batch size (on by default).
  void set_cuda_graphs(bool on) { graphs_ = on; }
  size_t num_cuda_graphs() const { return graphs_by_size_.size(); }

  // Where a step's time goes (benchmarks): with profiling on, forward() records the host time of preparing the
  // step, the GPU time of its kernels (CUDA events; per layer -- mixer and FFN -- when it does not replay a graph)
  // and the time of the logits' copy to the host.
  struct StepTimes {
    bool graph = false;
    double prepare_ms = 0, gpu_ms = 0, copy_ms = 0;
    std::vector<float> mixer_ms, ffn_ms;  // per layer (empty when replayed from a graph)
  };
  void set_profiling(bool on) { profiling_ = on; }
  const StepTimes& last_step_times() const { return times_; }

  // One step: batch.pool is the device address of the cache pool (laid out by batch.plan). logits: host memory,
  // [wanted positions, vocab], requests in order, as Model::forward. Synchronous (returns when the logits are in
  // host memory).
  void forward(const StepBatch& batch, float* logits);
  // The same step, choosing each row's token on the GPU (kernels/cuda/sampling.h: what sample_token does) instead of
  // copying the logits back: only the tokens (and asked-for log-probabilities) come to the host. Needs every wanted
  // row to be sampled once (no kept logits). Synchronous.
  void forward_sampled(const StepBatch& batch, std::span<const SampleRow> rows, std::vector<SampledToken>& out);
  // Whether steps may sample on the GPU (a vocabulary the kernel takes, and switched on: the default; off, the engine
  // samples on the host from copied logits).
  bool samples_on_gpu() const;
  void set_gpu_sampling(bool on) { sampling_ = on; }
  // Prompts' KDA through the tensor-core chunked prefill (kernels/cuda/kda_tc.h, bf16 products; the default, 2.6x
  // faster on an H200: bench/results/gpu_engine_h200.md) or, off, the fp32 one (reference-quality, used by the tests
  // that hold the GPU to the tightest bound).
  void set_tensor_core_kda_prefill(bool on) { tensor_core_kda_ = on; }

 private:
  // One MLA layer over the step (x_bf -> y) and one FFN or MoE (h -> post-norm -> y): parts of forward().
  // Validates the step, orders its sequences and uploads its tables; false for an empty step.
  bool prepare(const StepBatch& batch, StepTables& t, bool graphs);
  // Every kernel of the step, from the embedding to the first rows of logits in device memory (capturable).
  void run(const StepBatch& batch, const StepTables& t);
  void lm_head(int64_t first_row, int64_t rows);
  void launch(const StepBatch& batch, const StepTables& t);  // run() directly or through the batch size's graph
  void mla_layer(const DMla& m, size_t layer, const StepBatch& batch, const StepTables& t);
  void ffn_layer(const DLayer& layer, int64_t N);
  float* state_at(const StepBatch& batch, int32_t row, size_t layer) const;

  const Model& host_;
  GpuLimits limits_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<DeviceWeights> w_;
  std::unique_ptr<StepScratch> s_;
  size_t weight_bytes_ = 0, workspace_bytes_ = 0, rounded_weights_ = 0;
  std::unique_ptr<StepTables> tables_;
  int64_t max_blocks_ = 0;  // block-table width of a sequence of max_model_len
  bool graphs_ = true;
  std::map<std::tuple<int, uint8_t*, int64_t>, cudaGraphExec_t> graphs_by_size_;  // (S, pool, block-table width)
  bool profiling_ = false;
  bool sampling_ = true;
  bool tensor_core_kda_ = true;
  StepTimes times_;
  std::vector<cudaEvent_t> events_;  // profiling: begin, end, and three per layer
  void mark(size_t i);
  using Clock = std::chrono::steady_clock;
  // With profiling: times_ from the step's host clocks (start, after prepare, after the launch) and events.
  void record_times(const StepTables& t, Clock::time_point t0, Clock::time_point t1, Clock::time_point t2);
};

}  // namespace kestrel::gpu
