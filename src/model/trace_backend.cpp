#include "model/trace_backend.h"

#include <fmt/format.h>

#include "model/model.h"

namespace kestrel {

namespace {

std::string shape(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += fmt::format("{}{}", i ? "," : "", s[i]);
  return r + "]";
}
std::string act(const Act& a) { return fmt::format("[N,{}]", a.cols); }
// A stored tensor: its shape and dtype.
std::string stored(const StoredTensor& t) { return shape(t.shape) + dtype_name(t.dtype); }
std::string stored(const StoredLinear& l) {
  std::string s = stored(l.weight);
  if (l.format != WeightFormat::plain) s += "+" + stored(l.scales);
  return s;
}

// Records each op as a line, then forwards it to `inner` (or, without one, hands back placeholder activations).
class TraceOps final : public StepOps {
 public:
  TraceOps(StepOps* inner, const ModelConfig& cfg, int64_t tokens, std::vector<std::string>& out)
      : inner_(inner), cfg_(cfg), tokens_(tokens), out_(out) {}
  int64_t tokens() const override { return tokens_; }
  void begin_layer(int l) override {
    log(fmt::format("begin_layer {}", l));
    if (inner_) inner_->begin_layer(l);
  }
  void end_layer(int l) override {
    log(fmt::format("end_layer {}", l));
    if (inner_) inner_->end_layer(l);
  }
  Act embed(EmbeddingW t) override {
    log("embed");
    return inner_ ? inner_->embed(t) : fresh(cfg_.hidden_size);
  }
  Act rms_norm(Act x, VecW w, float eps) override {
    log(fmt::format("rms_norm {} eps={}", act(x), eps));
    return inner_ ? inner_->rms_norm(x, w, eps) : fresh(x.cols);
  }
  void rms_norm_inplace(Act x, VecW w, float eps) override {
    log(fmt::format("rms_norm_inplace {} eps={}", act(x), eps));
    if (inner_) inner_->rms_norm_inplace(x, w, eps);
  }
  Act linear(LinearW w, Act x) override {
    log(fmt::format("linear {}->[N,{}]", act(x), w.out));
    return inner_ ? inner_->linear(w, x) : fresh(w.out);
  }
  void add(Act h, Act y) override {
    log(fmt::format("add {}", act(y)));
    if (inner_) inner_->add(h, y);
  }
  void rope(Act x, int heads, int64_t stride, int64_t offset, int dim, RopeStyle style) override {
    log(fmt::format("rope {} heads={} stride={} offset={} dim={} {}", act(x), heads, stride, offset, dim,
                    style == RopeStyle::interleaved ? "interleaved" : "neox"));
    if (inner_) inner_->rope(x, heads, stride, offset, dim, style);
  }
  Act swiglu(Act gu) override {
    log(fmt::format("swiglu {}", act(gu)));
    return inner_ ? inner_->swiglu(gu) : fresh(gu.cols / 2);
  }
  Act moe(MoeW w, Act x) override {
    log(fmt::format("moe {}", act(x)));
    return inner_ ? inner_->moe(w, x) : fresh(x.cols);
  }
  Act kda(KdaW w, int layer, Act qkv, Act f, Act beta, Act g) override {
    log(fmt::format("kda {} {} {} {} {}", layer, act(qkv), act(f), act(beta), act(g)));
    return inner_ ? inner_->kda(w, layer, qkv, f, beta, g) : fresh(f.cols);
  }
  Act mla_attention(MlaAttnW w, int layer, Act x, Act qr, Act q, Act kv) override {
    log(fmt::format("mla_attention {} {} {} {} {}", layer, act(x), qr.valid() ? act(qr) : "-", act(q), act(kv)));
    return inner_ ? inner_->mla_attention(w, layer, x, qr, q, kv)
                  : fresh(int64_t{cfg_.num_attention_heads} * cfg_.v_head_dim);
  }
  void logits(Act h, VecW n, LinearW head) override {
    log(fmt::format("logits {}->[wanted,{}]", act(h), head.out));
    if (inner_) inner_->logits(h, n, head);
  }

 private:
  void log(std::string s) { out_.push_back(std::move(s)); }
  Act fresh(int64_t cols) { return Act{next_++, 0, cols}; }
  StepOps* inner_;
  const ModelConfig& cfg_;
  int64_t tokens_;
  std::vector<std::string>& out_;
  int32_t next_ = 0;
};

}  // namespace

void TraceBackend::configure(const ModelConfig& cfg, const ModelOptions& opts) {
  calls_.push_back("configure");
  cfg_ = cfg;
  inner_->configure(cfg, opts);
}
EmbeddingW TraceBackend::add_embedding(const StoredTensor& t) {
  calls_.push_back("add_embedding " + stored(t));
  return inner_->add_embedding(t);
}
LinearW TraceBackend::tied_head(EmbeddingW t) {
  calls_.push_back("tied_head");
  return inner_->tied_head(t);
}
LinearW TraceBackend::add_linear(std::span<const StoredLinear> parts) {
  std::string s = fmt::format("add_linear {}x", parts.size());
  for (const StoredLinear& p : parts) s += " " + stored(p);
  calls_.push_back(s);
  return inner_->add_linear(parts);
}
VecW TraceBackend::add_vector(const StoredTensor& t) {
  calls_.push_back("add_vector " + stored(t));
  return inner_->add_vector(t);
}
MlaAttnW TraceBackend::add_mla_attention(const MlaAttnSpec& s) {
  std::string line = "add_mla_attention kv_b " + stored(s.kv_b);
  if (s.indexer)
    line += " indexer " + stored(s.indexer->wq_b) + " " + stored(s.indexer->wk) + " " + stored(s.indexer->weights_proj) +
            " " + stored(s.indexer->k_norm_w) + " " + stored(s.indexer->k_norm_b);
  calls_.push_back(line);
  return inner_->add_mla_attention(s);
}
KdaW TraceBackend::add_kda(const KdaSpec& s) {
  calls_.push_back("add_kda " + stored(s.conv_q) + " " + stored(s.conv_k) + " " + stored(s.conv_v) + " " +
                   stored(s.A_log) + " " + stored(s.dt_bias) + " " + stored(s.o_norm));
  return inner_->add_kda(s);
}
MoeW TraceBackend::add_moe(const MoeSpec& s) {
  std::string line = fmt::format("add_moe experts={} top_k={} router {}", s.n_experts, s.top_k, stored(s.router));
  if (s.bias) line += " bias " + stored(*s.bias);
  if (!s.gate.empty())
    line += " expert 0: " + stored(s.gate[0]) + " " + stored(s.up[0]) + " " + stored(s.down[0]);
  calls_.push_back(line);
  return inner_->add_moe(s);
}
void TraceBackend::finalize_weights() {
  calls_.push_back("finalize_weights");
  inner_->finalize_weights();
}
void TraceBackend::run_step(const StepBatch& batch, const std::function<void(StepOps&)>& graph,
                            const StepResults& results) {
  calls_.push_back("run_step");
  int64_t tokens = 0;
  for (const SequenceStep& s : batch.seqs) tokens += static_cast<int64_t>(s.ids.size());
  inner_->run_step(
      batch,
      [&](StepOps& ops) {
        TraceOps t(&ops, cfg_, tokens, calls_);
        graph(t);
      },
      results);
}

std::vector<std::string> trace_graph(const Model& model, int64_t tokens) {
  std::vector<std::string> out;
  TraceOps t(nullptr, model.config(), tokens, out);
  model.graph(t);
  return out;
}

}  // namespace kestrel
