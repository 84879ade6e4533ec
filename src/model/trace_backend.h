// A backend that runs another and records every call the model makes of it: weight set-up and each step's ops, with
// their shapes. It shows what the model's single graph asks of a backend -- the same sequence whichever backend runs
// it (tests compare the CPU's trace with the CUDA backend's) -- and costs nothing when not used.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "model/backend.h"

namespace kestrel {

class TraceBackend final : public Backend {
 public:
  explicit TraceBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  Backend& inner() { return *inner_; }
  // One line per call: "add_linear 2x [64,32]BF16 [64,32]BF16", "linear [N,32]->[N,128]", ... (stored shapes and
  // dtypes for the weights; N: the step's tokens).
  const std::vector<std::string>& calls() const { return calls_; }
  void clear() { calls_.clear(); }

  const char* name() const override { return inner_->name(); }
  void configure(const ModelConfig& cfg, const ModelOptions& opts) override;
  EmbeddingW add_embedding(const StoredTensor& table) override;
  LinearW tied_head(EmbeddingW table) override;
  LinearW add_linear(std::span<const StoredLinear> parts) override;
  VecW add_vector(const StoredTensor& t) override;
  MlaAttnW add_mla_attention(const MlaAttnSpec& spec) override;
  KdaW add_kda(const KdaSpec& spec) override;
  MoeW add_moe(const MoeSpec& spec) override;
  void finalize_weights() override;
  void load_lora(int32_t id, const LoraAdapter& a) override { inner_->load_lora(id, a); }
  void unload_lora(int32_t id) override { inner_->unload_lora(id); }
  void run_step(const StepBatch& batch, const std::function<void(StepOps&)>& graph,
                const StepResults& results) override;
  bool samples_rows(const SamplingParams& p) const override { return inner_->samples_rows(p); }
  size_t weight_bytes() const override { return inner_->weight_bytes(); }
  size_t workspace_bytes() const override { return inner_->workspace_bytes(); }

 private:
  std::unique_ptr<Backend> inner_;
  ModelConfig cfg_;
  std::vector<std::string> calls_;
};

// StepOps that record each call (as TraceBackend's lines) and compute nothing: Model::graph over it lists the ops of
// a step without any backend.
std::vector<std::string> trace_graph(const class Model& model, int64_t tokens);

}  // namespace kestrel
