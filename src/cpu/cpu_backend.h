// The CPU backend: the numerical reference. It decodes every weight to fp32 on load (FP8 block-scaled and MXFP4
// exactly), keeps the FP8 codes and block scales of FP8-stored linears for the GPU-numerics mode, and runs each op of
// the model's graph over the reference kernels (src/kernels/cpu) in fp32. A step's activations live in host buffers
// of its own, so that several threads may run steps of one model at once (the simulated ranks of src/parallel).
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "cpu/kda_core.h"
#include "cpu/mla_core.h"
#include "kernels/cpu/moe.h"
#include "model/backend.h"
#include "model/model.h"

namespace kestrel {

// A linear weight on the CPU: fp32 values [out, in] and, per stacked part, its FP8 codes and block scales when the
// checkpoint stores it in FP8.
struct CpuLinear {
  struct Fp8 {
    std::vector<uint8_t> codes;  // [rows, in]
    std::vector<float> scales;   // [ceil(rows / block), ceil(in / block)]
    int block = 0;
  };
  struct Part {
    int64_t row0 = 0, rows = 0;
    std::optional<Fp8> fp8;
  };
  Tensor w;
  std::vector<Part> parts;
  int64_t out() const { return w.dim(0); }
  int64_t in() const { return w.dim(1); }
};

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }
  void configure(const ModelConfig& cfg, const ModelOptions& opts) override;
  EmbeddingW add_embedding(const StoredTensor& table) override;
  LinearW tied_head(EmbeddingW table) override;
  LinearW add_linear(std::span<const StoredLinear> parts) override;
  VecW add_vector(const StoredTensor& t) override;
  MlaAttnW add_mla_attention(const MlaAttnSpec& spec) override;
  KdaW add_kda(const KdaSpec& spec) override;
  MoeW add_moe(const MoeSpec& spec) override;
  void finalize_weights() override {}
  void run_step(const StepBatch& batch, const std::function<void(StepOps&)>& graph,
                const StepResults& results) override;
  size_t weight_bytes() const override { return weight_bytes_; }
  size_t workspace_bytes() const override { return 0; }

  // y[T, out] = x[T, in] . w^T in the backend's numerics (gpu_numerics: the input rounded as the GPU takes it).
  void linear(const CpuLinear& w, const float* x, int64_t T, float* y) const;

  // What the ops read (src/cpu/cpu_step.cpp).
  const ModelConfig& config() const { return cfg_; }
  const ModelOptions& options() const { return opts_; }
  const Tensor& embedding(EmbeddingW w) const { return embeddings_.at(w.id); }
  const CpuLinear& linear_weight(LinearW w) const { return *linears_.at(w.id); }
  const Tensor& vec(VecW w) const { return vectors_.at(w.id); }
  const MlaCore& mla(MlaAttnW w) const { return *mla_.at(w.id); }
  const KdaCore& kda(KdaW w) const { return *kda_.at(w.id); }
  struct Moe {
    cpu::MoeRouting routing;
    Tensor router, bias;
    std::vector<CpuLinear> gate, up, down;  // per expert
  };
  const Moe& moe(MoeW w) const { return moe_.at(w.id); }
  const std::vector<float>& rope_inv_freq() const { return inv_freq_; }

  // A diagnostic for comparisons with other backends: while set, every MoE layer writes, at each token's position p,
  // by_position[p] = min(by_position[p], cpu::moe_route_margin of its routing) (the vector grows with +infinity).
  // Where that margin is within rounding noise, an implementation that rounds otherwise may pick other experts.
  void record_route_margins(std::vector<float>* by_position) const { route_margins_ = by_position; }
  std::vector<float>* route_margins() const { return route_margins_; }

 private:
  Tensor values(const StoredTensor& t, const std::vector<int64_t>& shape);
  CpuLinear decode(std::span<const StoredLinear> parts);

  ModelConfig cfg_;
  ModelOptions opts_;
  std::vector<Tensor> embeddings_, vectors_;
  std::vector<std::shared_ptr<CpuLinear>> linears_;  // a tied head shares the embedding's values
  std::vector<std::unique_ptr<MlaCore>> mla_;
  std::vector<std::unique_ptr<KdaCore>> kda_;
  std::vector<Moe> moe_;
  std::vector<float> inv_freq_;
  size_t weight_bytes_ = 0;
  mutable std::vector<float>* route_margins_ = nullptr;
};

// A model on the CPU backend: Model::load(dir, opts, a new CpuBackend, lo).
std::unique_ptr<Model> load_cpu_model(const std::string& dir, const ModelOptions& opts = {},
                                      const LoadOptions& lo = {});

}  // namespace kestrel
