#include "model/lora.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/formats.h"
#include "core/tensor.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace kestrel {

namespace {
const std::string kPrefix = "base_model.model.";
const std::string kA = ".lora_A.weight", kB = ".lora_B.weight";

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
std::string last_component(const std::string& module) {
  const size_t dot = module.rfind('.');
  return dot == std::string::npos ? module : module.substr(dot + 1);
}
}  // namespace

const std::vector<std::string>& lora_target_names() {
  static const std::vector<std::string> names = {
      "q_proj",   "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj",  "k_proj",    "v_proj", "f_a_proj",
      "f_b_proj", "b_proj",   "g_a_proj", "g_b_proj",           "gate_proj", "up_proj", "down_proj", "w1",
      "w2",       "w3"};
  return names;
}

LoraAdapter load_lora_adapter(const std::string& dir, int max_rank) {
  namespace fs = std::filesystem;
  LoraAdapter a;
  a.path = dir;
  const std::string cfg_path = dir + "/adapter_config.json", st_path = dir + "/adapter_model.safetensors";
  KESTREL_CHECK(fs::exists(cfg_path), "LoRA adapter '{}': {} does not exist", dir, cfg_path);
  KESTREL_CHECK(fs::exists(st_path), "LoRA adapter '{}': {} does not exist", dir, st_path);
  nlohmann::json j;
  try {
    std::ifstream f(cfg_path);
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON: {}", cfg_path, e.what());
  }
  KESTREL_CHECK(j.is_object(), "{}: must be a JSON object", cfg_path);
  KESTREL_CHECK(j.contains("r") && j["r"].is_number_integer(), "{}: 'r' (the rank) must be an integer", cfg_path);
  a.rank = j["r"].get<int>();
  KESTREL_CHECK(a.rank >= 1 && a.rank <= max_rank, "{}: rank r = {} is outside [1, {}] (--max-lora-rank)", cfg_path,
                a.rank, max_rank);
  KESTREL_CHECK(j.contains("lora_alpha") && j["lora_alpha"].is_number(), "{}: 'lora_alpha' must be a number",
                cfg_path);
  a.alpha = j["lora_alpha"].get<float>();
  a.scale = a.alpha / static_cast<float>(a.rank);
  auto flag = [&](const char* key) { return j.contains(key) && j[key].is_boolean() && j[key].get<bool>(); };
  if (flag("use_rslora")) fail("{}: rank-stabilized LoRA (use_rslora) is not supported", cfg_path);
  if (flag("use_dora")) fail("{}: DoRA adapters (use_dora) are not supported", cfg_path);
  KESTREL_CHECK(j.contains("target_modules") && j["target_modules"].is_array(),
                "{}: 'target_modules' must be a list of module names", cfg_path);
  const std::vector<std::string>& known = lora_target_names();
  for (const auto& t : j["target_modules"]) {
    KESTREL_CHECK(t.is_string(), "{}: target_modules holds a non-string", cfg_path);
    const std::string name = t.get<std::string>();
    KESTREL_CHECK(std::find(known.begin(), known.end(), name) != known.end(),
                  "{}: unknown target module '{}' (Kestrel adapts: {})", cfg_path, name, fmt::join(known, ", "));
    a.target_modules.push_back(name);
  }
  KESTREL_CHECK(!a.target_modules.empty(), "{}: target_modules is empty", cfg_path);

  const SafetensorsFile file(st_path);
  std::set<std::string> seen_a, seen_b;
  for (const std::string& name : file.names()) {
    const bool is_a = ends_with(name, kA), is_b = ends_with(name, kB);
    KESTREL_CHECK(name.rfind(kPrefix, 0) == 0 && (is_a || is_b),
                  "{}: tensor '{}' is not a LoRA weight base_model.model.<module>.lora_A.weight / lora_B.weight",
                  st_path, name);
    const std::string module = name.substr(kPrefix.size(), name.size() - kPrefix.size() - kA.size());
    const std::string target = last_component(module);
    KESTREL_CHECK(std::find(a.target_modules.begin(), a.target_modules.end(), target) != a.target_modules.end(),
                  "{}: tensor '{}' adapts '{}', which is not in target_modules", st_path, name, target);
    const TensorView& v = file.get(name);
    KESTREL_CHECK(v.dtype == DType::F32 || v.dtype == DType::BF16 || v.dtype == DType::F16,
                  "{}: tensor '{}' is {}, not F32, BF16 or F16", st_path, name, dtype_name(v.dtype));
    KESTREL_CHECK(v.shape.size() == 2, "{}: tensor '{}' has shape {}, expected a matrix", st_path, name,
                  shape_str(v.shape));
    LoraModule& m = a.modules[module];
    if (is_a) {
      KESTREL_CHECK(v.shape[0] == a.rank, "{}: tensor '{}' has rank {} (shape {}), the config's r is {}", st_path,
                    name, v.shape[0], shape_str(v.shape), a.rank);
      m.in = v.shape[1];
      m.a = decode_to_f32(v.dtype, v.bytes, name);
      seen_a.insert(module);
    } else {
      KESTREL_CHECK(v.shape[1] == a.rank, "{}: tensor '{}' has rank {} (shape {}), the config's r is {}", st_path,
                    name, v.shape[1], shape_str(v.shape), a.rank);
      m.out = v.shape[0];
      m.b = decode_to_f32(v.dtype, v.bytes, name);
      seen_b.insert(module);
    }
  }
  for (const auto& [module, m] : a.modules) {
    KESTREL_CHECK(seen_a.count(module), "{}: module '{}' has {}{} but no {}{}", st_path, module, kPrefix + module, kB,
                  kPrefix + module, kA);
    KESTREL_CHECK(seen_b.count(module), "{}: module '{}' has {}{} but no {}{}", st_path, module, kPrefix + module, kA,
                  kPrefix + module, kB);
  }
  KESTREL_CHECK(!a.modules.empty(), "{}: no LoRA weights", st_path);
  return a;
}

void write_lora_adapter(const std::string& dir, int rank, float alpha,
                        const std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>>& modules,
                        uint64_t seed, float amplitude, const std::string& dtype) {
  std::filesystem::create_directories(dir);
  std::set<std::string> targets;
  std::map<std::string, TensorData> tensors;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-amplitude, amplitude);
  const DType dt = dtype == "BF16" ? DType::BF16 : DType::F32;
  auto make = [&](int64_t rows, int64_t cols) {
    TensorData t{dt, {rows, cols}, {}};
    const int64_t n = rows * cols;
    t.bytes.resize(static_cast<size_t>(n) * dtype_size(dt));
    for (int64_t i = 0; i < n; ++i) {
      const float v = u(rng);
      if (dt == DType::BF16) {
        const uint16_t b = f32_to_bf16(v);
        std::memcpy(t.bytes.data() + 2 * i, &b, 2);
      } else {
        std::memcpy(t.bytes.data() + 4 * i, &v, 4);
      }
    }
    return t;
  };
  for (const auto& [module, shape] : modules) {
    targets.insert(last_component(module));
    tensors[kPrefix + module + kA] = make(rank, shape.second);
    tensors[kPrefix + module + kB] = make(shape.first, rank);
  }
  write_safetensors(dir + "/adapter_model.safetensors", tensors);
  nlohmann::json j;
  j["peft_type"] = "LORA";
  j["r"] = rank;
  j["lora_alpha"] = alpha;
  j["target_modules"] = std::vector<std::string>(targets.begin(), targets.end());
  j["bias"] = "none";
  std::ofstream(dir + "/adapter_config.json") << j.dump(2) << "\n";
}

}  // namespace kestrel
