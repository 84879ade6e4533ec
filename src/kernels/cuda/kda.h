// Kimi Delta Attention on the GPU: recurrent decode and chunked (WY/UT, chunk 64) varlen prefill.
// Same function as kestrel::cpu::kda_recurrent / kda_chunked (src/kernels/cpu/kda.h), over device pointers in the
// same layouts: q, k [T, H, dk]; v, o [T, H, dv]; the recurrent state of one sequence S[H][dk][dv] fp32 (key index
// as rows). Decode and prefill share that state layout. All math is fp32 (no tensor cores). Only dk = dv = 128 is
// implemented (Kimi Linear and K3); other sizes are rejected with kestrel::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace kestrel::cuda {

// The per-token inputs of a KDA call (device pointers) and which preprocessing the kernels fuse in.
struct KdaInputs {
  const float* q = nullptr;     // [T, H, dk]
  const float* k = nullptr;     // [T, H, dk]
  const float* v = nullptr;     // [T, H, dv]
  const float* gate = nullptr;  // [T, H*dk]: the log gate g (<= 0), or the gate projection f when A_log is set
  const float* beta = nullptr;  // [T, H]: beta in (0, 1], or its logit when beta_is_logit
  // Fused gate (A_log and dt_bias both set): g = -exp(A_log[h]) * softplus(f + dt_bias) (Kimi Linear), or
  // g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)) when gate_lower_bound = lb (Kimi K3); as cpu::kda_gate.
  const float* A_log = nullptr;    // [H]
  const float* dt_bias = nullptr;  // [H*dk]
  std::optional<float> gate_lower_bound;
  bool beta_is_logit = false;  // beta = sigmoid(beta input)
  bool normalize_qk = false;   // q, k are raw: each head vector is divided by sqrt(sum x^2 + 1e-6), as the model does
  float scale = 0.0f;          // multiplies q after normalisation (dk^-1/2 in the model)
  // Floats from one slot's state to the next in state_pool; 0: H*dk*dv (a pool of bare states). The engine's
  // packed cache keeps each state inside a larger row, so there it is the row size in floats (a multiple of 4).
  int64_t state_stride = 0;
};

// One token for each of N sequences. Sequence i's state is state_pool + slots[i] * H*dk*dv (slots: device array
// of N distinct int32 slot indices) and is updated in place: decay, delta-rule update, then o = S^T (scale q).
// o: [N, H, dv]. Asynchronous on `stream`.
void kda_decode(const KdaInputs& in, int N, int H, int dk, int dv, float* state_pool, const int32_t* slots, float* o,
                cudaStream_t stream);

// Where the chunks and checkpoints of a varlen prefill batch fall. Host-side; build it once per batch.
class KdaPrefillPlan {
 public:
  static constexpr int kChunk = 64;

  // cu_seqlens: B+1 offsets of the B sequences in the packed token arrays (0, ..., T). start_pos[b]: absolute
  // position of sequence b's first token; chunks end at absolute multiples of 64 (a sequence that resumes
  // mid-chunk begins with a partial chunk), exactly as cpu::kda_chunked's start_pos. checkpoint_every: 0 (none) or
  // a positive multiple of 64: the state after every token at absolute position p with (p + 1) % checkpoint_every
  // == 0 is saved.
  KdaPrefillPlan(std::span<const int64_t> cu_seqlens, std::span<const int64_t> start_pos,
                 int64_t checkpoint_every = 0);

  // One chunk of one sequence: tokens [t0, t0 + n) of the packed batch.
  struct Chunk {
    int64_t t0;
    int32_t n;
    int32_t seq;
    int64_t checkpoint;  // index of the checkpoint taken after this chunk, or -1
  };
  struct Seq {
    int64_t first_chunk;
    int64_t num_chunks;
  };

  int num_seqs() const { return static_cast<int>(seqs_.size()); }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_chunks() const { return static_cast<int64_t>(chunks_.size()); }
  int64_t checkpoint_every() const { return checkpoint_every_; }
  // Checkpoints are stored sequence after sequence, each in token order: sequence b's j-th checkpoint is number
  // first_checkpoint(b) + j of the checkpoint buffer, each H*dk*dv floats in the state layout.
  int64_t num_checkpoints() const { return num_checkpoints_; }
  int64_t first_checkpoint(int seq) const { return first_checkpoint_[seq]; }
  int64_t checkpoints_of(int seq) const { return first_checkpoint_[seq + 1] - first_checkpoint_[seq]; }
  // Device scratch that kda_prefill needs for H heads (dk = dv = 128): the chunk tables plus, per chunk and head,
  // the intra-chunk matrices (W, U, decayed Q and K, A_qk), about 145 KB.
  size_t workspace_bytes(int H) const;

  const std::vector<Chunk>& chunks() const { return chunks_; }
  const std::vector<Seq>& seqs() const { return seqs_; }

 private:
  std::vector<Chunk> chunks_;
  std::vector<Seq> seqs_;
  std::vector<int64_t> first_checkpoint_;
  int64_t num_tokens_ = 0, checkpoint_every_ = 0, num_checkpoints_ = 0;
};

// Chunked prefill of a varlen batch: sequence b's tokens are [cu_seqlens[b], cu_seqlens[b+1]) of the packed
// inputs, its initial state is read from state_pool + slots[b] * H*dk*dv (slots: device array of distinct int32)
// and its final state is written back there. o: [T, H, dv]. checkpoints: device buffer of
// plan.num_checkpoints() states (may be null when there are none). workspace: device memory of at least
// plan.workspace_bytes(H) bytes. Asynchronous on `stream`; the plan's tables are copied from host memory.
void kda_prefill(const KdaPrefillPlan& plan, const KdaInputs& in, int H, int dk, int dv, float* state_pool,
                 const int32_t* slots, float* o, float* checkpoints, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream);

}  // namespace kestrel::cuda
