// The CUDA backend's dense ops and the step's activations (a stack in the scratch workspace, rows of the step's
// tokens in the backend's order). The cache-side ops are in kda_layer.cpp, mla_layer.cpp and moe_layer.cpp.
#include <algorithm>

#include "core/error.h"
#include "gpu/cuda_state.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/runtime.h"
#include "kernels/cuda/v32_glue.h"

namespace kestrel::gpu {

namespace {

constexpr size_t kActAlign = 256;
size_t align_up(size_t n) { return (n + kActAlign - 1) / kActAlign * kActAlign; }
// Stack bytes of one activation of `cols` columns over N rows: its fp32 array and its bf16 copy.
size_t act_bytes(int64_t N, int64_t cols) {
  return align_up(static_cast<size_t>(N * cols) * sizeof(float)) + align_up(static_cast<size_t>(N * cols) * 2);
}

// Walks the model's graph with no backend, allocating as CudaStep does: the stack's peak for N tokens.
class StackSizing final : public StepOps {
 public:
  StackSizing(const ModelConfig& cfg, int64_t N) : cfg_(cfg), N_(N) {}
  size_t peak() const { return peak_; }
  int64_t tokens() const override { return N_; }
  void begin_layer(int) override { marks_.push_back(top_); }
  void end_layer(int) override {
    top_ = marks_.back();
    marks_.pop_back();
  }
  Act embed(EmbeddingW) override { return alloc(cfg_.hidden_size); }
  Act rms_norm(Act x, VecW, float) override { return alloc(x.cols); }
  void rms_norm_inplace(Act, VecW, float) override {}
  Act linear(LinearW w, Act) override { return alloc(w.out); }
  void add(Act, Act) override {}
  void rope(Act, int, int64_t, int64_t, int, RopeStyle) override {}
  Act swiglu(Act gu) override { return alloc(gu.cols / 2); }
  Act moe(MoeW, Act x) override { return alloc(x.cols); }
  Act kda(KdaW, int, Act, Act f, Act, Act) override { return alloc(f.cols); }
  Act mla_attention(MlaAttnW, int, Act, Act, Act, Act) override {
    return alloc(int64_t{cfg_.num_attention_heads} * cfg_.v_head_dim);
  }
  void logits(Act, VecW, LinearW) override {}

 private:
  Act alloc(int64_t cols) {
    top_ += act_bytes(N_, cols);
    peak_ = std::max(peak_, top_);
    return Act{0, 0, cols};
  }
  const ModelConfig& cfg_;
  int64_t N_;
  size_t top_ = 0, peak_ = 0;
  std::vector<size_t> marks_;
};

}  // namespace

size_t activation_stack_bytes(const Model& model, int64_t N) {
  StackSizing sizing(model.config(), N);
  model.graph(sizing);
  return sizing.peak();
}

void CudaStep::reset(const StepBatch& batch, const StepTables& t) {
  batch_ = &batch;
  t_ = &t;
  bufs_.clear();
  marks_.clear();
  top_ = 0;
}

int64_t CudaStep::tokens() const { return t_->N; }

void CudaStep::begin_layer(int layer) {
  marks_.emplace_back(bufs_.size(), top_);
  if (!t_->graph) s_.mark(2 + static_cast<size_t>(layer));
}

void CudaStep::end_layer(int layer) {
  bufs_.resize(marks_.back().first);
  top_ = marks_.back().second;
  marks_.pop_back();
  if (!t_->graph) s_.mark(3 + static_cast<size_t>(layer));
}

Act CudaStep::alloc(int64_t cols) {
  const int64_t N = t_->N;
  const size_t f = align_up(static_cast<size_t>(N * cols) * sizeof(float));
  const size_t need = act_bytes(N, cols);
  KESTREL_CHECK(top_ + need <= s_.s.act_bytes, "the step's activations need more than the {} bytes set aside",
                s_.s.act_bytes);
  Buffer b;
  b.f32 = reinterpret_cast<float*>(s_.s.act_base + top_);
  b.bf16 = reinterpret_cast<uint16_t*>(s_.s.act_base + top_ + f);
  b.width = cols;
  top_ += need;
  bufs_.push_back(b);
  return Act{static_cast<int32_t>(bufs_.size() - 1), 0, cols};
}

int64_t CudaStep::ld(Act a) const { return bufs_.at(a.buf).width; }

float* CudaStep::f32(Act a) { return bufs_.at(a.buf).f32 + a.col; }

uint16_t* CudaStep::bf16(Act a) {
  Buffer& b = bufs_.at(a.buf);
  if (!b.bf16_valid) {
    cuda::to_bf16(b.f32, t_->N * b.width, b.bf16, s_.stream);
    b.bf16_valid = true;
  }
  return b.bf16 + a.col;
}

void CudaStep::wrote_f32(Act a) { bufs_.at(a.buf).bf16_valid = false; }

Act CudaStep::embed(EmbeddingW table) {
  const int64_t D = s_.cfg.hidden_size;
  const Act h = alloc(D);
  cuda::embed_bf16(t_->ids, t_->N, s_.w.embeddings.at(table.id), D, f32(h), s_.stream);
  return h;
}

Act CudaStep::rms_norm(Act x, VecW w, float eps) {
  const Act y = alloc(x.cols);
  Buffer& b = bufs_.at(y.buf);
  cuda::rms_norm_dual(f32(x), ld(x), s_.w.vectors.at(w.id), t_->N, x.cols, eps, b.f32, b.bf16, y.cols, s_.stream);
  b.bf16_valid = true;
  return y;
}

void CudaStep::rms_norm_inplace(Act x, VecW w, float eps) {
  float* p = f32(x);
  cuda::rms_norm_f32(p, ld(x), s_.w.vectors.at(w.id), t_->N, x.cols, eps, p, ld(x), s_.stream);
  wrote_f32(x);
}

void CudaStep::linear_into(const DLinear& w, Act x, float* y, int64_t ldy) {
  KESTREL_CHECK(x.cols == w.in, "a linear layer of input width {} applied to {} columns", w.in, x.cols);
  const int64_t N = t_->N;
  for (const DLinear::Part& p : w.parts) {
    if (p.fp8)
      s_.fp8_gemm->linear(f32(x), N, ld(x), *p.fp8, y + p.row0, ldy, s_.s.fp8_ws, s_.s.fp8_ws_bytes, s_.stream);
    else
      s_.gemm.linear(bf16(x), N, w.in, ld(x), p.bf16, p.rows, y + p.row0, ldy, s_.stream);
  }
}

Act CudaStep::linear(LinearW w, Act x) {
  const DLinear& l = s_.w.linears.at(w.id);
  const Act y = alloc(l.out);
  linear_into(l, x, bufs_.at(y.buf).f32, l.out);
  return y;
}

void CudaStep::add(Act h, Act y) {
  KESTREL_CHECK(h.cols == y.cols && h.cols == ld(h) && y.cols == ld(y),
                "add: whole activations of equal width only ({} and {} columns)", h.cols, y.cols);
  cuda::add_inplace(f32(h), f32(y), t_->N * h.cols, s_.stream);
  wrote_f32(h);
}

void CudaStep::rope(Act x, int heads, int64_t head_stride, int64_t offset, int dim, RopeStyle style) {
  KESTREL_CHECK(s_.w.rope_inv_freq != nullptr, "RoPE on a model without rotary embeddings");
  cuda::rope_rows(f32(x) + offset, t_->N, ld(x), heads, head_stride, dim,
                  style == RopeStyle::interleaved ? cuda::RopeStyle::interleaved : cuda::RopeStyle::neox, t_->row_pos,
                  s_.w.rope_inv_freq, s_.stream);
  wrote_f32(x);
}

Act CudaStep::swiglu(Act gu) {
  KESTREL_CHECK(gu.cols == ld(gu) && gu.cols % 2 == 0, "swiglu of a whole [gate ; up] activation only");
  const int64_t F = gu.cols / 2;
  const Act y = alloc(F);
  Buffer& b = bufs_.at(y.buf);
  cuda::swiglu(f32(gu), t_->N, F, b.f32, b.bf16, s_.stream);
  b.bf16_valid = true;
  return y;
}

void CudaStep::logits(Act h, VecW final_norm, LinearW head) {
  const StepTables& t = *t_;
  StepScratch& s = s_.s;
  const int64_t D = s_.cfg.hidden_size, V = s_.cfg.vocab_size;
  const DLinear& l = s_.w.linears.at(head.id);
  KESTREL_CHECK(l.parts.size() == 1 && l.out == V, "the LM head must be one weight of {} rows", V);
  s.head_bf16 = l.parts[0].bf16;
  s.head_fp8 = l.parts[0].fp8;
  cuda::gather_rows(f32(h), D, t.out_rows, t.wanted, s.hw, s_.stream);
  cuda::rms_norm_dual(s.hw, D, s_.w.vectors.at(final_norm.id), t.wanted, D, s_.cfg.rms_norm_eps, s.hw, s.hw_bf, D,
                      s_.stream);
  // The first logits_rows rows here (inside the step's graph); run_step computes the rest, if any.
  const int64_t rows = std::min(s.logits_rows, t.wanted);
  if (rows == 0) return;
  if (s.head_fp8)
    s_.fp8_gemm->linear(s.hw, rows, D, *s.head_fp8, s.logits, V, s.fp8_ws, s.fp8_ws_bytes, s_.stream);
  else
    s_.gemm.linear(s.hw_bf, rows, D, D, s.head_bf16, V, s.logits, V, s_.stream);
}

}  // namespace kestrel::gpu
