// The CUDA backend: the model's graph on one GPU. One arena of GPU memory (--gpu-memory-utilization) holds the weights
// in their stored precision (gpu/device_weights.h), then the step workspaces, sized once for the engine's limits,
// then the cache pool. A step's sequences run in one pass, ordered so that single generated tokens come first (one
// decode launch covers them); steps of single generated tokens replay a CUDA graph per batch size and block-table
// width. The CPU backend (src/cpu) is the reference the GPU tests compare against.
//
// Numerics: activations between layers are fp32 (the residual stream); a linear layer takes its input in bf16 (bf16
// weights: cuBLASLt, fp32 accumulation) or quantized to FP8 in groups of 128 (FP8 block-scaled weights: cuBLASLt's
// block-scaled FP8); the MoE router and the DSA indexer's projections are fp32; KDA state and attention math are fp32.
// The CPU backend with ModelOptions::gpu_numerics computes the same rounding. docs/gpu.md.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdio>
#include <memory>
#include <span>
#include <vector>

#include "engine/engine.h"
#include "engine/step_executor.h"
#include "gpu/device_arena.h"
#include "model/backend.h"
#include "model/model.h"

namespace kestrel::gpu {

// What a step may hold at most; the workspaces are sized for it once.
struct GpuLimits {
  int64_t max_tokens = 2048;  // tokens per step (--max-num-batched-tokens)
  int max_seqs = 256;         // sequences per step (--max-num-seqs)
  int64_t max_model_len = 0;  // context of one sequence
  int block_size = 64;        // the cache plan's B
};

struct CudaState;

class CudaBackend final : public Backend {
 public:
  // Takes `utilization` of the GPU's memory (less what is already in use) in one allocation. log: the loading progress
  // and the memory split (null: silent).
  CudaBackend(double utilization, std::FILE* log);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  const char* name() const override { return "cuda"; }
  void configure(const ModelConfig& cfg, const ModelOptions& opts) override;
  EmbeddingW add_embedding(const StoredTensor& table) override;
  LinearW tied_head(EmbeddingW table) override;
  LinearW add_linear(std::span<const StoredLinear> parts) override;
  VecW add_vector(const StoredTensor& t) override;
  MlaAttnW add_mla_attention(const MlaAttnSpec& spec) override;
  KdaW add_kda(const KdaSpec& spec) override;
  MoeW add_moe(const MoeSpec& spec) override;
  void finalize_weights() override;
  void run_step(const StepBatch& batch, const std::function<void(StepOps&)>& graph,
                const StepResults& results) override;
  bool samples_rows(const SamplingParams& p) const override;
  size_t weight_bytes() const override;
  size_t workspace_bytes() const override;

  // Sizes the step workspaces for `limits` (once, after the weights; `model` is the model over this backend, whose
  // graph is traced once to size the activations). Error for what the GPU does not implement (named).
  void prepare(const Model& model, const GpuLimits& limits);
  bool prepared() const;
  const GpuLimits& limits() const;
  DeviceArena& arena();
  cudaStream_t stream() const;
  // The memory split: weights by form (against `stored_bytes`, the checkpoint's), workspaces, what is left.
  void print_memory(std::FILE* out, size_t stored_bytes) const;
  // Weights whose bf16 form rounds their value (FP8 kv_b with block scales that are not powers of two).
  size_t rounded_weights() const;

  // Steps of single generated tokens replay one CUDA graph per batch size (on by default).
  void set_cuda_graphs(bool on);
  size_t num_cuda_graphs() const;
  // Whether steps sample on the GPU (a vocabulary the kernel takes; on by default).
  void set_gpu_sampling(bool on);
  // Prompts' KDA through the tensor-core chunked prefill (the default) or, off, the fp32 one (reference quality).
  void set_tensor_core_kda_prefill(bool on);

  // Where a step's time goes (benchmarks): with profiling on, run_step records the host time of preparing the step,
  // the GPU time of its kernels (per layer -- mixer and FFN -- when it does not replay a graph) and the time of the
  // results' copy to the host.
  struct StepTimes {
    bool graph = false;
    double prepare_ms = 0, gpu_ms = 0, copy_ms = 0;
    std::vector<float> layer_ms;  // per layer (empty when replayed from a graph)
  };
  void set_profiling(bool on);
  const StepTimes& last_step_times() const;

 private:
  std::unique_ptr<CudaState> s_;
};

// Points an engine's config at the GPU a model was loaded into (its backend a CudaBackend): sizes the backend's
// workspaces for cfg's limits, then cfg.cache_bytes becomes what is left of the arena (unless cfg.num_rows is set)
// and cfg.executor makes the GPU step executor over a pool taken from the arena. Prints the memory split to `log`
// (null: silent). Returns what must outlive the engine.
std::shared_ptr<void> attach_engine(const Model& model, EngineConfig& cfg, std::FILE* log);

// The CUDA backend of a model (Error when its backend is another).
CudaBackend& cuda_backend(const Model& model);

}  // namespace kestrel::gpu
