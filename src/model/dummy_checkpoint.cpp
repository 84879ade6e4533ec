#include "model/dummy_checkpoint.h"

#include <vector>

#include "core/dummy_weights.h"
#include "core/error.h"
#include "model/model.h"
#include "model/safetensors.h"

namespace kestrel {

namespace {

// A backend that keeps the stored tensors it is handed (dummy recipes) and computes nothing.
class RecordingBackend final : public Backend {
 public:
  std::vector<StoredTensor> tensors;
  const char* name() const override { return "recording"; }
  void configure(const ModelConfig&, const ModelOptions&) override {}
  EmbeddingW add_embedding(const StoredTensor& t) override {
    keep(t);
    return {};
  }
  LinearW tied_head(EmbeddingW) override { return {}; }
  LinearW add_linear(std::span<const StoredLinear> parts) override {
    for (const StoredLinear& p : parts) keep(p);
    return {};
  }
  VecW add_vector(const StoredTensor& t) override {
    keep(t);
    return {};
  }
  MlaAttnW add_mla_attention(const MlaAttnSpec& s) override {
    keep(s.kv_b);
    if (s.indexer) {
      keep(s.indexer->wq_b);
      keep(s.indexer->wk);
      keep(s.indexer->k_norm_w);
      keep(s.indexer->k_norm_b);
      keep(s.indexer->weights_proj);
    }
    return {};
  }
  KdaW add_kda(const KdaSpec& s) override {
    for (const StoredTensor* t : {&s.conv_q, &s.conv_k, &s.conv_v, &s.A_log, &s.dt_bias, &s.o_norm}) keep(*t);
    return {};
  }
  MoeW add_moe(const MoeSpec& s) override {
    keep(s.router);
    if (s.bias) keep(*s.bias);
    for (size_t e = 0; e < s.gate.size(); ++e) {
      keep(s.gate[e]);
      keep(s.up[e]);
      keep(s.down[e]);
    }
    return {};
  }
  void finalize_weights() override {}
  void run_step(const StepBatch&, const std::function<void(StepOps&)>&, const StepResults&) override {
    fail("a recording backend runs no step");
  }
  size_t weight_bytes() const override { return 0; }
  size_t workspace_bytes() const override { return 0; }

 private:
  void keep(const StoredTensor& t) { tensors.push_back(t); }
  void keep(const StoredLinear& l) {
    keep(l.weight);
    if (l.format != WeightFormat::plain) keep(l.scales);
  }
};

}  // namespace

uint64_t write_dummy_checkpoint(const std::string& dir, uint64_t seed, int64_t max_shard_bytes) {
  auto rec = std::make_unique<RecordingBackend>();
  RecordingBackend* r = rec.get();
  LoadOptions lo;
  lo.load_format = "dummy";
  lo.seed = seed;
  const auto model = Model::load(dir, {}, std::move(rec), lo);
  std::vector<TensorSpec> specs;
  uint64_t total = 0;
  for (const StoredTensor& t : r->tensors) {
    KESTREL_CHECK(t.dummy.has_value(), "tensor '{}' has no dummy recipe", t.name);
    specs.push_back({t.name, t.dtype, t.shape});
    total += t.nbytes();
  }
  write_checkpoint_streamed(
      dir, specs, [&](size_t i, std::span<uint8_t> out) { fill_dummy(*r->tensors[i].dummy, out); }, max_shard_bytes);
  return total;
}

}  // namespace kestrel
