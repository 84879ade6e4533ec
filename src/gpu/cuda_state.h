// Inside the CUDA backend: its state, the per-step tables and the ops of one step. Split by concept over the files of
// src/gpu: cuda_backend.cpp (set-up, weights, the step's run and results), step_tables.cpp (ordering a step and its
// device tables), cuda_step.cpp (the dense ops and the activations), kda_layer.cpp, mla_layer.cpp, moe_layer.cpp (one
// op each), graph_cache.cpp (CUDA graphs).
#pragma once
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "gpu/cuda_backend.h"
#include "gpu/device_arena.h"
#include "gpu/device_weights.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_fp8_block.h"

namespace kestrel::gpu {

// Host-side staging of a step's small tables (pinned) and their device copy: put() appends, flush() copies all at
// once. Capacity is fixed at start-up from the limits.
class Staging {
 public:
  Staging(DeviceArena& arena, size_t capacity);
  ~Staging();
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  void reset() { used_ = 0; }
  template <typename T>
  T* put(const std::vector<T>& v) {
    return static_cast<T*>(put_bytes(v.data(), v.size() * sizeof(T)));
  }
  void flush(cudaStream_t s);

 private:
  void* put_bytes(const void* p, size_t n);
  uint8_t* dev_ = nullptr;
  uint8_t* host_ = nullptr;
  size_t capacity_ = 0, used_ = 0;
};

// The step's sequences in the order the GPU runs them: single generated tokens first (one KDA decode launch and one
// MLA decode launch cover them), then chunked-KDA prompts, then the rest (multi-token non-prompt steps).
struct Ordered {
  std::vector<int> seq;        // internal position -> index in batch.seqs
  std::vector<int64_t> first;  // internal position -> first token (internal token order), size S + 1
  int decode = 0, chunked = 0;  // counts of the first two groups
};

// A step's tables on the device (in the staging buffer) and how the step is cut into launches.
struct StepTables {
  Ordered ord;
  int64_t N = 0, wanted = 0, bt_stride = 1;
  int S = 0;
  bool graph = false;  // replayed from a CUDA graph
  const int32_t *ids = nullptr, *row_req = nullptr, *row_pos = nullptr, *ctx = nullptr, *bt = nullptr;
  const int32_t* out_rows = nullptr;
  const int64_t *slots = nullptr, *cu = nullptr;
  std::vector<const int32_t*> state_rows;  // per state group: each sequence's state row
  std::vector<float* const*> hist;         // per layer: conv-history pointers of q (k's and v's follow)
  // KDA through the recurrence (every sequence when dk is not the fast kernels' 128, else those the fast kernels
  // do not take): one launch over sequences [first_recurrent, S) with recurrent_cu, or, when one of them asks for
  // a checkpoint, each sequence in segments cut at its checkpoints.
  bool fast_kda = false;
  int first_recurrent = 0;
  const int64_t* recurrent_cu = nullptr;
  struct Segment {
    int seq;            // internal position
    int64_t t0, len;    // tokens (internal order)
    const int64_t* cu;  // device {0, len}
    const CheckpointTarget* checkpoint;  // taken after the segment, or null
  };
  std::vector<Segment> segments;
};

// The workspaces of the ops, sized once by CudaBackend::prepare for the limits.
struct StepScratch {
  // Activations: a stack of rows, each Act an fp32 array and its bf16 copy [max_tokens, cols].
  uint8_t* act_base = nullptr;
  size_t act_bytes = 0;
  // Linear layers with FP8 weights: the quantized activations (and staged outputs) of the largest product.
  void* fp8_ws = nullptr;
  size_t fp8_ws_bytes = 0;
  // KDA
  float *q = nullptr, *k = nullptr, *v = nullptr;
  float* kda_o = nullptr;
  float* kda_checkpoints = nullptr;
  size_t kda_checkpoint_states = 0;
  void* kda_ws = nullptr;
  size_t kda_ws_bytes = 0;
  // MLA
  uint16_t* mq_bf = nullptr;
  float *q_abs = nullptr, *obar = nullptr, *lse = nullptr;
  uint16_t *q_abs_bf = nullptr, *obar_bf = nullptr;
  void* mla_ws = nullptr;
  size_t mla_ws_bytes = 0;
  int32_t* indices = nullptr;  // DSA: the selected positions of every token
  int index_topk = 0;
  void* sparse_ws = nullptr;
  size_t sparse_ws_bytes = 0;
  // MoE
  float *router_logits = nullptr, *route_w = nullptr;
  int32_t* route_ids = nullptr;
  void* moe_ws = nullptr;
  size_t moe_ws_bytes = 0;
  // LM head
  float *hw = nullptr, *logits = nullptr;
  uint16_t* hw_bf = nullptr;
  int64_t logits_rows = 0;
  const uint16_t* head_bf16 = nullptr;  // the step's head (logits()), for the rows past logits_rows
  std::optional<cuda::Fp8BlockWeight> head_fp8;
  // Sampling on the GPU: outputs, workspace, and the rows' parameters and penalty lists.
  int64_t sample_rows = 0;
  size_t sample_penalty_capacity = 0;
  int32_t *sampled_tokens = nullptr, *sampled_top_ids = nullptr;
  float *sampled_logprobs = nullptr, *sampled_top_logprobs = nullptr;
  void* sample_ws = nullptr;
  size_t sample_ws_bytes = 0;
  std::unique_ptr<Staging> staging, sample_staging;
};

struct CudaState;

// The ops of one step on the GPU (StepOps). Activations live on the scratch stack; each has an fp32 array and a bf16
// copy, which ops that can write both at once fill (the norms, SwiGLU, KDA's output) and which is otherwise made when
// an op first needs it (a linear layer's bf16 input) and dropped when the fp32 array changes.
class CudaStep final : public StepOps {
 public:
  explicit CudaStep(CudaState& st) : s_(st) {}
  // Starts a step (its tables already prepared).
  void reset(const StepBatch& batch, const StepTables& t);

  int64_t tokens() const override;
  void begin_layer(int layer) override;
  void end_layer(int layer) override;
  Act embed(EmbeddingW table) override;
  Act rms_norm(Act x, VecW w, float eps) override;
  void rms_norm_inplace(Act x, VecW w, float eps) override;
  Act linear(LinearW w, Act x) override;
  void add(Act h, Act y) override;
  void rope(Act x, int heads, int64_t head_stride, int64_t offset, int dim, RopeStyle style) override;
  Act swiglu(Act gu) override;
  Act moe(MoeW w, Act x) override;
  Act kda(KdaW w, int layer, Act qkv, Act f, Act beta, Act g) override;
  Act mla_attention(MlaAttnW w, int layer, Act x, Act qr, Act q, Act kv) override;
  void logits(Act h, VecW final_norm, LinearW head) override;

  // Device views of an activation: its fp32 array and its bf16 copy (made from the fp32 array if stale), at its
  // first column; ld() is its buffer's row length.
  float* f32(Act a);
  uint16_t* bf16(Act a);
  int64_t ld(Act a) const;
  // A new activation of `cols` columns (an op writes its fp32 values; its bf16 copy is stale until made).
  Act alloc(int64_t cols);
  // An op changed the fp32 values in place: the bf16 copy is stale.
  void wrote_f32(Act a);
  // y = x . W^T for x's rows: y an fp32 array with leading dimension ldy.
  void linear_into(const DLinear& w, Act x, float* y, int64_t ldy);

 private:
  struct Buffer {
    float* f32 = nullptr;
    uint16_t* bf16 = nullptr;
    int64_t width = 0;
    bool bf16_valid = false;
  };
  CudaState& s_;
  const StepBatch* batch_ = nullptr;
  const StepTables* t_ = nullptr;
  std::vector<Buffer> bufs_;
  std::vector<std::pair<size_t, size_t>> marks_;  // (buffers, stack bytes) at each begin_layer
  size_t top_ = 0;                                 // stack bytes in use
};

// The activation stack's peak for a step of N tokens: the model's graph walked once with no backend, allocating as
// CudaStep does (cuda_step.cpp).
size_t activation_stack_bytes(const Model& model, int64_t N);

struct CudaState {
  std::FILE* log = nullptr;
  std::unique_ptr<DeviceArena> arena;
  size_t budget = 0;
  double utilization = 0;
  ModelConfig cfg;
  ModelOptions opts;
  DeviceWeights w;
  std::unique_ptr<WeightUploader> uploader;  // during loading
  GpuLimits limits;
  bool prepared = false;
  size_t workspace_bytes = 0;
  int64_t max_blocks = 0;  // block-table width of a sequence of max_model_len
  cudaStream_t stream = nullptr;
  cuda::Gemm gemm;
  std::unique_ptr<cuda::Fp8BlockGemm> fp8_gemm;
  StepScratch s;
  StepTables tables;
  CudaStep step{*this};
  // CUDA graphs: one per (batch size, pool, block-table width); null until the shape's second step captures it.
  bool graphs_on = true;
  std::map<std::tuple<int, uint8_t*, int64_t>, cudaGraphExec_t> graphs;
  bool sampling_on = true;
  bool tensor_core_kda = true;
  bool profiling = false;
  CudaBackend::StepTimes times;
  std::vector<cudaEvent_t> events;  // profiling: begin, end, and one per layer boundary

  ~CudaState();
  // Validates the step, orders its sequences and uploads its tables; false for an empty step (step_tables.cpp).
  bool prepare_tables(const StepBatch& batch);
  // Runs graph() directly or through the batch size's CUDA graph (graph_cache.cpp).
  void launch(const StepBatch& batch, const std::function<void(StepOps&)>& graph);
  void mark(size_t i);
  float* state_at(const StepBatch& batch, int32_t row, size_t layer) const;
};

}  // namespace kestrel::gpu
