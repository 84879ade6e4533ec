// LoRA adapters in PEFT's format (issue #20): a directory with adapter_config.json (r, lora_alpha,
// target_modules) and adapter_model.safetensors holding, for each adapted linear layer of the base model,
// base_model.model.<module>.lora_A.weight [r, in] and base_model.model.<module>.lora_B.weight [out, r]. An adapted
// layer computes y = W x + scale * B (A x) with scale = lora_alpha / r. The values are kept in fp32; which modules
// of a model an adapter may name, and their shapes, the backend checks when it takes the adapter
// (Backend::load_lora).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace kestrel {

constexpr int kMaxLoraRank = 64;  // --max-lora-rank's largest value

// The linear layers' names (the last component of a module path) an adapter may target: every attention
// projection the graph computes as a linear layer (MLA q_proj / q_a_proj / q_b_proj / kv_a_proj_with_mqa / o_proj,
// KDA q/k/v/f_a/f_b/b/g_a/g_b/o_proj), the dense and shared-expert MLPs (gate_proj, up_proj, down_proj) and the
// routed experts (Kimi's w1, w3, w2; DeepSeek's gate_proj, up_proj, down_proj).
const std::vector<std::string>& lora_target_names();

struct LoraModule {
  int64_t out = 0, in = 0;
  std::vector<float> a;  // [r, in]
  std::vector<float> b;  // [out, r]
};

struct LoraAdapter {
  std::string path;  // the directory it was read from (error messages)
  int rank = 0;
  float alpha = 0.0f, scale = 0.0f;  // scale = alpha / rank
  std::vector<std::string> target_modules;
  std::map<std::string, LoraModule> modules;  // by module path, e.g. "model.layers.0.self_attn.o_proj"
};

// Reads and checks an adapter directory: Error naming the file (and tensor) for a missing or malformed config, a
// rank outside [1, max_rank], an unknown target module, a tensor that is not a lora_A / lora_B weight of a module
// matching target_modules, an A or B of the wrong rank or shape, or a module with only one of them.
LoraAdapter load_lora_adapter(const std::string& dir, int max_rank = kMaxLoraRank);

// Writes a PEFT-format adapter directory (tests, make-model): `modules` are (module path, (out, in)); A and B drawn
// uniformly in [-amplitude, amplitude) from `seed`, stored as `dtype` ("F32" or "BF16").
void write_lora_adapter(const std::string& dir, int rank, float alpha,
                        const std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>>& modules,
                        uint64_t seed, float amplitude = 0.05f, const std::string& dtype = "F32");

}  // namespace kestrel
