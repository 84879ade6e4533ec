// The CPU backend's ops of one step (StepOps): activations in host buffers of the step's own, the dense parts over
// every token at once, attention and KDA per request over its pages and state rows.
#include <algorithm>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "core/formats.h"
#include "cpu/cpu_backend.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/basic.h"

namespace kestrel {

namespace {

class CpuStep final : public StepOps {
 public:
  CpuStep(const CpuBackend& be, const StepBatch& batch, float* logits) : be_(be), batch_(batch), logits_(logits) {
    first_.assign(batch.seqs.size() + 1, 0);
    for (size_t i = 0; i < batch.seqs.size(); ++i)
      first_[i + 1] = first_[i] + static_cast<int64_t>(batch.seqs[i].ids.size());
    N_ = first_.back();
    pos_.resize(static_cast<size_t>(N_));
    for (size_t i = 0; i < batch.seqs.size(); ++i)
      for (int64_t t = 0; t < first_[i + 1] - first_[i]; ++t) pos_[first_[i] + t] = batch.seqs[i].start + t;
    // Each token's LoRA adapter (nullptr: none).
    lora_.assign(static_cast<size_t>(N_), nullptr);
    for (size_t i = 0; i < batch.seqs.size(); ++i)
      if (batch.seqs[i].lora != 0) {
        const CpuBackend::Lora* l = &be.lora(batch.seqs[i].lora);
        for (int64_t t = first_[i]; t < first_[i + 1]; ++t) lora_[t] = l;
        any_lora_ = true;
      }
  }

  int64_t tokens() const override { return N_; }
  void begin_layer(int) override { marks_.push_back(bufs_.size()); }
  void end_layer(int) override {
    bufs_.resize(marks_.back());
    marks_.pop_back();
  }

  Act embed(EmbeddingW table) override {
    const Tensor& e = be_.embedding(table);
    const int64_t D = e.dim(1), V = e.dim(0);
    const Act h = alloc(D);
    for (size_t i = 0; i < batch_.seqs.size(); ++i)
      for (int64_t t = 0; t < first_[i + 1] - first_[i]; ++t) {
        const int32_t id = batch_.seqs[i].ids[t];
        KESTREL_CHECK(id >= 0 && id < V, "token id {} is outside the vocabulary (0..{})", id, V - 1);
        std::copy_n(e.ptr() + int64_t{id} * D, D, row(h, first_[i] + t));
      }
    return h;
  }

  Act rms_norm(Act x, VecW w, float eps) override {
    const Act y = alloc(x.cols);
    for (int64_t t = 0; t < N_; ++t) cpu::rms_norm(row(x, t), be_.vec(w).ptr(), row(y, t), 1, x.cols, eps);
    return y;
  }

  void rms_norm_inplace(Act x, VecW w, float eps) override {
    for (int64_t t = 0; t < N_; ++t) cpu::rms_norm(row(x, t), be_.vec(w).ptr(), row(x, t), 1, x.cols, eps);
  }

  Act linear(LinearW w, Act x) override {
    const CpuLinear& l = be_.linear_weight(w);
    KESTREL_CHECK(x.cols == l.in(), "a linear layer of input width {} applied to {} columns", l.in(), x.cols);
    const Act y = alloc(l.out());
    const std::vector<float> xc = contiguous(x);
    be_.linear(l, xc.data(), N_, row(y, 0));
    // LoRA: each token through its own adapter's deltas of this weight, after the base product.
    if (any_lora_)
      for (int64_t t = 0; t < N_; ++t) {
        if (!lora_[t]) continue;
        const auto it = lora_[t]->linear.find(w.id);
        if (it == lora_[t]->linear.end()) continue;
        for (const CpuBackend::LoraDelta& d : it->second) d.apply(lora_[t]->scale, xc.data() + t * x.cols, row(y, t));
      }
    return y;
  }

  void add(Act h, Act y) override {
    KESTREL_CHECK(h.cols == y.cols, "adding {} columns to {}", y.cols, h.cols);
    for (int64_t t = 0; t < N_; ++t) {
      float* a = row(h, t);
      const float* b = row(y, t);
      for (int64_t i = 0; i < h.cols; ++i) a[i] += b[i];
    }
  }

  void rope(Act x, int heads, int64_t stride, int64_t offset, int dim, RopeStyle style) override {
    const float* f = be_.rope_inv_freq().data();
    KESTREL_CHECK(!be_.rope_inv_freq().empty(), "RoPE on a model without rotary embeddings");
    for (int64_t t = 0; t < N_; ++t) {
      float* r = row(x, t) + offset;
      if (style == RopeStyle::interleaved) cpu::rope_interleaved(r, heads, stride, dim, pos_[t], f);
      else cpu::rope_neox(r, heads, stride, dim, pos_[t], f);
    }
  }

  Act swiglu(Act gu) override {
    const int64_t F = gu.cols / 2;
    const Act y = alloc(F);
    for (int64_t t = 0; t < N_; ++t) cpu::swiglu(row(gu, t), row(gu, t) + F, row(y, t), F);
    return y;
  }

  Act moe(MoeW w, Act x) override {
    const CpuBackend::Moe& m = be_.moe(w);
    const int64_t D = x.cols, T = N_;
    const int E = m.routing.n_experts, K = m.routing.top_k;
    const std::vector<float> xin_all = contiguous(x);
    std::vector<float> logits(static_cast<size_t>(T) * E), weights(static_cast<size_t>(T) * K);
    std::vector<int32_t> ids(static_cast<size_t>(T) * K);
    cpu::linear(xin_all.data(), m.router.ptr(), logits.data(), T, D, E);
    for (int64_t t = 0; t < T; ++t)
      cpu::moe_route(logits.data() + t * E, m.bias.empty() ? nullptr : m.bias.ptr(), m.routing, ids.data() + t * K,
                     weights.data() + t * K);
    if (std::vector<float>* margins = be_.route_margins())
      for (int64_t t = 0; t < T; ++t) {
        const auto p = static_cast<size_t>(pos_[t]);
        if (margins->size() <= p) margins->resize(p + 1, std::numeric_limits<float>::infinity());
        (*margins)[p] = std::min((*margins)[p], cpu::moe_route_margin(logits.data() + t * E,
                                                                      m.bias.empty() ? nullptr : m.bias.ptr(), m.routing));
      }
    // Each expert runs once over the tokens routed to it; every (token, slot) output is kept apart so that each token
    // sums its experts in its own rank order, independent of the batch.
    std::vector<float> slot_out(static_cast<size_t>(T) * K * D);
    for (int e = 0; e < E; ++e) {
      std::vector<int64_t> slots;
      for (int64_t i = 0; i < T * K; ++i)
        if (ids[i] == e) slots.push_back(i);
      if (slots.empty()) continue;
      const int64_t M = static_cast<int64_t>(slots.size()), F = m.gate[e].out();
      std::vector<float> xin(static_cast<size_t>(M) * D), g(static_cast<size_t>(M) * F), u(g.size()),
          out(static_cast<size_t>(M) * D);
      for (int64_t r = 0; r < M; ++r) std::copy_n(xin_all.data() + (slots[r] / K) * D, D, xin.data() + r * D);
      be_.linear(m.gate[e], xin.data(), M, g.data());
      be_.linear(m.up[e], xin.data(), M, u.data());
      // LoRA on the routed experts: each row (a token's slot) through its token's adapter's deltas of this expert.
      auto expert_lora = [&](int which, const float* in, int64_t in_w, float* outp, int64_t out_w) {
        if (!any_lora_) return;
        for (int64_t r = 0; r < M; ++r) {
          const CpuBackend::Lora* l = lora_[slots[r] / K];
          if (!l) continue;
          const auto it = l->expert.find({w.id, e, which});
          if (it != l->expert.end()) it->second.apply(l->scale, in + r * in_w, outp + r * out_w);
        }
      };
      expert_lora(0, xin.data(), D, g.data(), F);
      expert_lora(1, xin.data(), D, u.data(), F);
      cpu::swiglu(g.data(), u.data(), g.data(), static_cast<int64_t>(g.size()));
      be_.linear(m.down[e], g.data(), M, out.data());
      expert_lora(2, g.data(), F, out.data(), D);
      for (int64_t r = 0; r < M; ++r) std::copy_n(out.data() + r * D, D, slot_out.data() + slots[r] * D);
    }
    const Act y = alloc(D);
    for (int64_t t = 0; t < T; ++t) {
      float* yt = row(y, t);
      std::fill_n(yt, D, 0.0f);
      for (int s = 0; s < K; ++s) {
        const float wgt = weights[t * K + s];
        const float* o = slot_out.data() + (t * K + s) * D;
        for (int64_t i = 0; i < D; ++i) yt[i] += wgt * o[i];
      }
    }
    return y;
  }

  Act kda(KdaW w, int layer, Act qkv, Act f, Act beta, Act g) override {
    const KdaCore& core = be_.kda(w);
    const ModelConfig& cfg = be_.config();
    const CachePlan& plan = *batch_.plan;
    const int64_t P = int64_t{cfg.kda_num_heads} * cfg.kda_head_dim, H = cfg.kda_num_heads;
    const std::vector<float> qkv_c = contiguous(qkv), f_c = contiguous(f), beta_c = contiguous(beta),
                             g_c = contiguous(g);
    const Act o = alloc(P);
    std::vector<float> oc(static_cast<size_t>(N_ * P));
    const int grp = plan.state_row[layer];
    auto state_at = [&](int32_t r) {
      return kda_state_view(cfg, batch_.pool + int64_t{r} * plan.row_bytes + plan.state_offset[layer]);
    };
    for (size_t i = 0; i < batch_.seqs.size(); ++i) {
      const SequenceStep& s = batch_.seqs[i];
      const int64_t t0 = first_[i], n = first_[i + 1] - first_[i];
      std::vector<KdaCheckpoint> checkpoints;
      for (const CheckpointTarget& c : s.checkpoints) checkpoints.push_back({c.position, state_at(c.rows[grp])});
      core.forward(qkv_c.data() + t0 * 3 * P, f_c.data() + t0 * P, beta_c.data() + t0 * H, g_c.data() + t0 * P, n,
                   s.start, state_at(s.state_rows[grp]), be_.options().kda_chunked_prefill && s.prompt, checkpoints,
                   plan.block_size, oc.data() + t0 * P);
    }
    put(o, oc);
    return o;
  }

  Act mla_attention(MlaAttnW w, int layer, Act x, Act qr, Act q, Act kv) override {
    const MlaCore& core = be_.mla(w);
    const ModelConfig& cfg = be_.config();
    const CachePlan& plan = *batch_.plan;
    const int64_t D = cfg.hidden_size, qlr = cfg.q_lora_rank, dq = cfg.qk_head_dim(), H = cfg.num_attention_heads;
    const int64_t C = cfg.kv_lora_rank, R = cfg.qk_rope_head_dim, dv = cfg.v_head_dim;
    const std::vector<float> xc = contiguous(x), qc = contiguous(q), kvc = contiguous(kv);
    const std::vector<float> qrc = qr.valid() ? contiguous(qr) : std::vector<float>();
    std::vector<float> oc(static_cast<size_t>(N_ * H * dv));
    auto pages_of = [&](const SequenceStep& s) {
      return TokenPages{batch_.pool + plan.page_offset[layer], plan.row_bytes,  plan.block_size,
                        s.block_table.data(),                 s.slots.data(), s.start};
    };
    if (batch_.mla_runner) {
      std::vector<MlaStepRequest> reqs(batch_.seqs.size());
      for (size_t i = 0; i < reqs.size(); ++i) reqs[i] = {pages_of(batch_.seqs[i]), first_[i + 1] - first_[i]};
      batch_.mla_runner->run(core, xc.data(), qr.valid() ? qrc.data() : nullptr, qc.data(), kvc.data(), reqs,
                             oc.data());
    } else {
      for (size_t i = 0; i < batch_.seqs.size(); ++i) {
        const int64_t t0 = first_[i], n = first_[i + 1] - first_[i];
        core.forward(xc.data() + t0 * D, qr.valid() ? qrc.data() + t0 * qlr : nullptr, qc.data() + t0 * H * dq,
                     kvc.data() + t0 * (C + R), n, pages_of(batch_.seqs[i]), oc.data() + t0 * H * dv);
      }
    }
    const Act o = alloc(H * dv);
    put(o, oc);
    return o;
  }

  void logits(Act h, VecW final_norm, LinearW head) override {
    const CpuLinear& l = be_.linear_weight(head);
    const int64_t D = h.cols;
    std::vector<float> x;
    for (size_t i = 0; i < batch_.seqs.size(); ++i)
      for (int64_t t = first_[i] + batch_.seqs[i].logits_from; t < first_[i + 1]; ++t) {
        x.resize(x.size() + D);
        cpu::rms_norm(row(h, t), be_.vec(final_norm).ptr(), x.data() + x.size() - D, 1, D, be_.config().rms_norm_eps);
      }
    const int64_t wanted = static_cast<int64_t>(x.size()) / D;
    if (wanted == 0) return;
    KESTREL_CHECK(logits_ != nullptr, "a step that wants logits needs a buffer for them");
    be_.linear(l, x.data(), wanted, logits_);
  }

  Act host_rows(std::span<const float> rows, int64_t cols) override {
    KESTREL_CHECK(static_cast<int64_t>(rows.size()) == N_ * cols, "{} host values for {} rows of {}", rows.size(), N_,
                  cols);
    const Act a = alloc(cols);
    put(a, std::vector<float>(rows.begin(), rows.end()));
    return a;
  }

  void scale_rows(Act x, std::span<const float> factors) override {
    KESTREL_CHECK(static_cast<int64_t>(factors.size()) == N_, "{} row factors for {} rows", factors.size(), N_);
    for (int64_t t = 0; t < N_; ++t) {
      float* r = row(x, t);
      for (int64_t i = 0; i < x.cols; ++i) r[i] *= factors[t];
    }
  }

  void copy_out(Act x, float* dst, int64_t row_stride) override {
    for (int64_t t = 0; t < N_; ++t) std::copy_n(row(x, t), x.cols, dst + t * row_stride);
  }

 private:
  struct Buffer {
    std::vector<float> v;
    int64_t width = 0;
  };
  Act alloc(int64_t cols) {
    bufs_.push_back({std::vector<float>(static_cast<size_t>(N_ * cols)), cols});
    return Act{static_cast<int32_t>(bufs_.size() - 1), 0, cols};
  }
  float* row(Act a, int64_t t) {
    Buffer& b = bufs_.at(a.buf);
    return b.v.data() + t * b.width + a.col;
  }
  // The activation's rows back to back.
  std::vector<float> contiguous(Act a) {
    std::vector<float> out(static_cast<size_t>(N_ * a.cols));
    for (int64_t t = 0; t < N_; ++t) std::copy_n(row(a, t), a.cols, out.data() + t * a.cols);
    return out;
  }
  void put(Act a, const std::vector<float>& rows) {
    for (int64_t t = 0; t < N_; ++t) std::copy_n(rows.data() + t * a.cols, a.cols, row(a, t));
  }

  const CpuBackend& be_;
  const StepBatch& batch_;
  float* logits_;
  int64_t N_ = 0;
  std::vector<int64_t> first_, pos_;
  std::vector<const CpuBackend::Lora*> lora_;  // per token
  bool any_lora_ = false;
  std::vector<Buffer> bufs_;
  std::vector<size_t> marks_;
};

}  // namespace

void CpuBackend::run_step(const StepBatch& batch, const std::function<void(StepOps&)>& graph,
                          const StepResults& results) {
  KESTREL_CHECK(results.sampled == nullptr, "the CPU backend does not sample: the engine samples from the logits");
  CpuStep step(*this, batch, results.logits);
  graph(step);
}

}  // namespace kestrel
