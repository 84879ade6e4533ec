// The CPU backend: the numerical reference. It decodes every weight to fp32 on load (FP8 block-scaled and MXFP4
// exactly), keeps the FP8 codes and block scales of FP8-stored linears for the GPU-numerics mode, and runs each op of
// the model's graph over the reference kernels (src/kernels/cpu) in fp32. A step's activations live in host buffers
// of its own, so that several threads may run steps of one model at once (the simulated ranks of src/parallel).
#pragma once
#include <map>
#include <memory>
#include <tuple>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "cpu/kda_core.h"
#include "cpu/mla_core.h"
#include "kernels/cpu/moe.h"
#include "model/backend.h"
#include "model/model.h"
#include "model/lora.h"

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

  // LoRA (Backend::load_lora): per adapter, the deltas of each adapted linear weight (by LinearW id) and routed
  // expert (by MoeW id, expert, gate / up / down), applied per token in fp32: y[row0 + o] += scale * B (A x).
  void load_lora(int32_t id, const LoraAdapter& adapter) override;
  void unload_lora(int32_t id) override { loras_.erase(id); }
  struct LoraDelta {
    int64_t row0 = 0, out = 0, in = 0;
    int rank = 0;
    std::vector<float> a, b;  // [rank, in], [out, rank]
    // y[row0 .. row0 + out) += scale * B (A x), the sums in a fixed order (fp32).
    void apply(float scale, const float* x, float* y) const;
  };
  struct Lora {
    float scale = 1.0f;
    std::map<int32_t, std::vector<LoraDelta>> linear;
    std::map<std::tuple<int32_t, int, int>, LoraDelta> expert;  // (MoeW id, expert, 0 gate / 1 up / 2 down)
  };
  const Lora& lora(int32_t id) const;
  // The fp32 rows [out, in] of the linear weight (or routed expert's) `module` (e.g.
  // "model.layers.0.self_attn.o_proj") as this backend computes with them (tests build merged weights in them;
  // with gpu_numerics FP8 parts compute from their codes instead). Error for a name that is not one.
  float* module_weight(const std::string& module, int64_t* out = nullptr, int64_t* in = nullptr);
  // Every module an adapter may target in this model (lora_target_names), with its (out, in): what a random
  // adapter for it covers.
  std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> lora_modules() const;

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
  // Where each linear weight of the model is, by module path (the stored weight's name less ".weight"): LoRA's
  // targets.
  struct Site {
    int32_t linear = -1;  // a LinearW id, or
    int32_t moe = -1;     // a MoeW id with its expert and 0 gate / 1 up / 2 down
    int expert = 0, which = 0;
    int64_t row0 = 0, out = 0, in = 0;
  };
  void add_sites(std::span<const StoredLinear> parts, int32_t linear, int32_t moe, int expert, int which);
  std::map<std::string, Site> sites_;
  std::map<int32_t, Lora> loras_;
};

// A model on the CPU backend: Model::load(dir, opts, a new CpuBackend, lo).
std::unique_ptr<Model> load_cpu_model(const std::string& dir, const ModelOptions& opts = {},
                                      const LoadOptions& lo = {});

}  // namespace kestrel
