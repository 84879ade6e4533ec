#include "model/config.h"

#include <cmath>
#include <fstream>
#include <set>

#include "core/error.h"

namespace kestrel {

using nlohmann::json;

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::kimi_linear: return "kimi_linear";
    case Arch::deepseek_v32: return "deepseek_v32";
    case Arch::kimi_k3: return "kimi_k3";
  }
  return "?";
}

Arch parse_arch(const std::string& model_type) {
  if (model_type == "kimi_linear") return Arch::kimi_linear;
  if (model_type == "deepseek_v32") return Arch::deepseek_v32;
  if (model_type == "kimi_k3") return Arch::kimi_k3;
  fail("unsupported model_type '{}' (Kestrel serves kimi_linear, deepseek_v32, kimi_k3)", model_type);
}

namespace {

const char* architecture_class(Arch a) {
  switch (a) {
    case Arch::kimi_linear: return "KimiLinearForCausalLM";
    case Arch::deepseek_v32: return "DeepseekV32ForCausalLM";
    case Arch::kimi_k3: return "KimiK3ForCausalLM";
  }
  return "?";
}

// Typed field access that names the field (with its parent object) on every failure.
// The dotted names of every field the reader looked at (to tell an override key Kestrel understands from a typo).
thread_local std::set<std::string>* g_read_keys = nullptr;

class Fields {
 public:
  Fields(const json& j, std::string where) : j_(j), where_(std::move(where)) {}

  bool has(const char* k) const {
    if (g_read_keys) g_read_keys->insert(where_ + k);
    return j_.contains(k) && !j_.at(k).is_null();
  }
  const json& raw(const char* k) const {
    if (!has(k)) fail("config.json: missing field '{}{}'", where_, k);
    return j_.at(k);
  }
  int64_t integer(const char* k) const {
    const json& v = raw(k);
    if (!v.is_number_integer()) fail("config.json: field '{}{}' must be an integer, got {}", where_, k, v.dump());
    return v.get<int64_t>();
  }
  int64_t positive(const char* k) const {
    const int64_t v = integer(k);
    if (v <= 0) fail("config.json: field '{}{}' must be positive, got {}", where_, k, v);
    return v;
  }
  int64_t non_negative(const char* k) const {
    const int64_t v = integer(k);
    if (v < 0) fail("config.json: field '{}{}' must be >= 0, got {}", where_, k, v);
    return v;
  }
  double number(const char* k) const {
    const json& v = raw(k);
    if (!v.is_number()) fail("config.json: field '{}{}' must be a number, got {}", where_, k, v.dump());
    return v.get<double>();
  }
  bool boolean(const char* k) const {
    const json& v = raw(k);
    if (!v.is_boolean()) fail("config.json: field '{}{}' must be true or false, got {}", where_, k, v.dump());
    return v.get<bool>();
  }
  std::string string(const char* k) const {
    const json& v = raw(k);
    if (!v.is_string()) fail("config.json: field '{}{}' must be a string, got {}", where_, k, v.dump());
    return v.get<std::string>();
  }
  std::vector<int64_t> int_list(const char* k) const {
    const json& v = raw(k);
    if (!v.is_array()) fail("config.json: field '{}{}' must be a list of integers", where_, k);
    std::vector<int64_t> out;
    for (const json& e : v) {
      if (!e.is_number_integer()) fail("config.json: field '{}{}' must be a list of integers, got {}", where_, k, e.dump());
      out.push_back(e.get<int64_t>());
    }
    return out;
  }
  Fields object(const char* k) const {
    const json& v = raw(k);
    if (!v.is_object()) fail("config.json: field '{}{}' must be an object", where_, k);
    return Fields(v, where_ + k + ".");
  }
  std::string name(const char* k) const { return where_ + k; }

 private:
  const json& j_;
  std::string where_;
};

// Bounds far above any published model's and far below what would exhaust memory: per-layer and per-head tables are
// allocated from these counts before any weight is read, so a config with num_hidden_layers 1e9 is refused here
// instead of after gigabytes of allocation.
constexpr int64_t kMaxLayers = 1024, kMaxHeads = 4096, kMaxHeadDim = 1 << 16, kMaxExperts = 1 << 16;
constexpr int64_t kMaxVocab = 1 << 24, kMaxHidden = 1 << 18, kMaxIntermediate = 1 << 20, kMaxConvKernel = 64;

int64_t at_most(int64_t v, const std::string& field, int64_t limit) {
  if (v > limit) fail("config.json: field '{}' is too large ({}; at most {})", field, v, limit);
  return v;
}

int to_int(int64_t v, const std::string& field, int64_t limit = int64_t{1} << 30) {
  return static_cast<int>(at_most(v, field, limit));
}

void require_string(const Fields& f, const char* k, const char* expected) {
  const std::string v = f.string(k);
  if (v != expected) fail("config.json: field '{}' must be '{}', got '{}'", f.name(k), expected, v);
}

void parse_mla(const Fields& f, ModelConfig& c) {
  c.num_attention_heads = to_int(f.positive("num_attention_heads"), "num_attention_heads", kMaxHeads);
  c.q_lora_rank = f.has("q_lora_rank") ? at_most(f.positive("q_lora_rank"), "q_lora_rank", kMaxHeadDim) : 0;
  c.kv_lora_rank = to_int(f.positive("kv_lora_rank"), "kv_lora_rank", kMaxHeadDim);
  c.qk_nope_head_dim = to_int(f.positive("qk_nope_head_dim"), "qk_nope_head_dim", kMaxHeadDim);
  c.qk_rope_head_dim = to_int(f.positive("qk_rope_head_dim"), "qk_rope_head_dim", kMaxHeadDim);
  c.v_head_dim = to_int(f.positive("v_head_dim"), "v_head_dim", kMaxHeadDim);
  if (c.qk_rope_head_dim % 2) fail("config.json: field 'qk_rope_head_dim' must be even, got {}", c.qk_rope_head_dim);
}

void parse_indexer(const Fields& f, ModelConfig& c) {
  c.has_indexer = true;
  c.index_n_heads = to_int(f.positive("index_n_heads"), "index_n_heads", kMaxHeads);
  c.index_head_dim = to_int(f.positive("index_head_dim"), "index_head_dim", kMaxHeadDim);
  c.index_topk = to_int(f.positive("index_topk"), "index_topk");
  if (c.index_head_dim & (c.index_head_dim - 1))
    fail("config.json: field 'index_head_dim' must be a power of two (Hadamard transform), got {}", c.index_head_dim);
  if (c.use_rope && c.qk_rope_head_dim > c.index_head_dim)
    fail("config.json: 'qk_rope_head_dim' ({}) exceeds 'index_head_dim' ({})", c.qk_rope_head_dim, c.index_head_dim);
}

void parse_kimi_layers(const Fields& f, ModelConfig& c) {
  const Fields la = f.object("linear_attn_config");
  const auto kda = la.int_list("kda_layers");
  const auto full = la.int_list("full_attn_layers");
  c.kda_num_heads = to_int(la.positive("num_heads"), la.name("num_heads"), kMaxHeads);
  c.kda_head_dim = to_int(la.positive("head_dim"), la.name("head_dim"), kMaxHeadDim);
  c.short_conv_kernel_size = to_int(la.positive("short_conv_kernel_size"), la.name("short_conv_kernel_size"), kMaxConvKernel);
  if (la.has("kda_gate_lower_bound")) c.kda_gate_lower_bound = static_cast<float>(la.number("kda_gate_lower_bound"));
  std::vector<int> seen(c.num_hidden_layers, 0);
  c.layer_kinds.assign(c.num_hidden_layers, LayerKind::kda);
  // Layers listed beyond num_hidden_layers are not there (a config cut to fewer layers, e.g. by --hf-overrides),
  // as vLLM reads the lists: layer by layer.
  auto mark = [&](const std::vector<int64_t>& list, const char* field, LayerKind kind) {
    for (int64_t one_based : list) {
      if (one_based < 1)
        fail("config.json: 'linear_attn_config.{}' lists layer {} (layers are 1-based)", field, one_based);
      if (one_based > c.num_hidden_layers) continue;
      if (seen[one_based - 1]++)
        fail("config.json: layer {} is listed twice in 'linear_attn_config' ({})", one_based, field);
      c.layer_kinds[one_based - 1] = kind;
    }
  };
  mark(kda, "kda_layers", LayerKind::kda);
  mark(full, "full_attn_layers", LayerKind::mla);
  for (int i = 0; i < c.num_hidden_layers; ++i)
    if (!seen[i])
      fail("config.json: layer {} (1-based) is in neither 'linear_attn_config.kda_layers' nor 'full_attn_layers'",
           i + 1);
}

YarnConfig parse_yarn(const Fields& rs) {
  YarnConfig y;
  const std::string type = rs.has("type") ? rs.string("type") : rs.string("rope_type");
  if (type != "yarn") fail("config.json: 'rope_scaling.type' '{}' is not supported (only 'yarn')", type);
  y.factor = rs.number("factor");
  y.original_max_position_embeddings = rs.number("original_max_position_embeddings");
  if (rs.has("beta_fast")) y.beta_fast = rs.number("beta_fast");
  if (rs.has("beta_slow")) y.beta_slow = rs.number("beta_slow");
  if (rs.has("mscale")) y.mscale = rs.number("mscale");
  if (rs.has("mscale_all_dim")) y.mscale_all_dim = rs.number("mscale_all_dim");
  if (y.factor <= 0) fail("config.json: 'rope_scaling.factor' must be positive");
  return y;
}

void check_moe(ModelConfig& c) {
  if (c.n_routed_experts == 0) return;
  if (c.num_experts_per_tok > c.n_routed_experts)
    fail("config.json: experts per token ({}) exceeds the number of experts ({})", c.num_experts_per_tok,
         c.n_routed_experts);
  if (c.n_group < 1 || c.n_routed_experts % c.n_group)
    fail("config.json: the number of experts ({}) is not divisible by the expert groups ({})", c.n_routed_experts,
         c.n_group);
  if (c.topk_group < 1 || c.topk_group > c.n_group)
    fail("config.json: 'topk_group' ({}) must be in 1..{}", c.topk_group, c.n_group);
  if (c.n_group > 1 && c.num_experts_per_tok > c.topk_group * (c.n_routed_experts / c.n_group))
    fail("config.json: experts per token ({}) exceed what {} groups of {} experts hold", c.num_experts_per_tok,
         c.topk_group, c.n_routed_experts / c.n_group);
  if (c.moe_layer_freq < 1) fail("config.json: 'moe_layer_freq' must be >= 1");
}

void parse_quant(const Fields& f, ModelConfig& c) {
  if (!f.has("quantization_config")) return;
  const Fields q = f.object("quantization_config");
  const std::string method = q.string("quant_method");
  if (method == "fp8") {
    c.weight_quant = WeightQuant::fp8_block;
    if (q.has("weight_block_size")) {
      const auto b = q.int_list("weight_block_size");
      if (b.size() != 2 || b[0] != b[1] || b[0] <= 0)
        fail("config.json: 'quantization_config.weight_block_size' must be [N, N] with N > 0");
      c.weight_block_size = to_int(b[0], "weight_block_size");
    }
  } else if (method == "mxfp4") {
    c.weight_quant = WeightQuant::mxfp4;
  } else {
    fail("config.json: 'quantization_config.quant_method' '{}' is not supported (fp8, mxfp4)", method);
  }
}

// A float field as the decimal a person would write (1e-05, not 9.999999747378752e-06).
json decimal(float v) { return std::stod(fmt::format("{}", v)); }
// A double that holds a whole number is written as an integer, as Hugging Face configs do.
json number_json(double v) {
  return v == std::floor(v) && std::fabs(v) < 9e15 ? json(static_cast<int64_t>(v)) : json(v);
}

}  // namespace

int ModelConfig::num_layers_of(LayerKind k) const {
  int n = 0;
  for (LayerKind l : layer_kinds) n += (l == k);
  return n;
}

float ModelConfig::softmax_scale() const {
  double s = 1.0 / std::sqrt(static_cast<double>(qk_head_dim()));
  if (yarn && yarn->factor > 1.0) {
    const double m = 0.1 * yarn->mscale_all_dim * std::log(yarn->factor) + 1.0;
    s *= m * m;
  }
  return static_cast<float>(s);
}

ModelConfig ModelConfig::from_json(const json& j) {
  if (!j.is_object()) fail("config.json: the top level must be a JSON object");
  const Fields f(j, "");
  ModelConfig c;
  c.arch = parse_arch(f.string("model_type"));
  const json& archs = f.raw("architectures");
  if (!archs.is_array() || archs.empty() || !archs[0].is_string())
    fail("config.json: field 'architectures' must be a non-empty list of strings");
  c.architecture = archs[0].get<std::string>();
  if (c.architecture != architecture_class(c.arch))
    fail("config.json: 'architectures[0]' is '{}' but model_type '{}' needs '{}'", c.architecture, arch_name(c.arch),
         architecture_class(c.arch));

  c.vocab_size = at_most(f.positive("vocab_size"), "vocab_size", kMaxVocab);
  c.hidden_size = at_most(f.positive("hidden_size"), "hidden_size", kMaxHidden);
  c.num_hidden_layers = to_int(f.positive("num_hidden_layers"), "num_hidden_layers", kMaxLayers);
  c.intermediate_size = at_most(f.positive("intermediate_size"), "intermediate_size", kMaxIntermediate);
  c.rms_norm_eps = static_cast<float>(f.number("rms_norm_eps"));
  if (c.rms_norm_eps <= 0) fail("config.json: field 'rms_norm_eps' must be positive");
  if (f.has("tie_word_embeddings")) c.tie_word_embeddings = f.boolean("tie_word_embeddings");
  if (f.has("max_position_embeddings")) c.max_position_embeddings = f.positive("max_position_embeddings");
  for (const char* key : {"max_position_embeddings", "model_max_length", "max_seq_len", "seq_length",
                          "max_sequence_length"})
    if (f.has(key)) {
      const int64_t v = f.positive(key);
      if (c.context_length == 0 || v < c.context_length) {
        c.context_length = v;
        c.context_length_key = key;
      }
    }
  if (f.has("bos_token_id")) c.bos_token_id = f.integer("bos_token_id");
  if (f.has("eos_token_id")) c.eos_token_id = f.integer("eos_token_id");
  parse_mla(f, c);
  c.first_k_dense_replace = to_int(f.non_negative("first_k_dense_replace"), "first_k_dense_replace");
  c.moe_layer_freq = f.has("moe_layer_freq") ? to_int(f.positive("moe_layer_freq"), "moe_layer_freq") : 1;
  c.routed_scaling_factor = static_cast<float>(f.number("routed_scaling_factor"));
  if (f.has("num_nextn_predict_layers"))
    c.num_nextn_predict_layers = to_int(f.non_negative("num_nextn_predict_layers"), "num_nextn_predict_layers", 16);

  if (c.arch == Arch::deepseek_v32) {
    c.use_rope = true;
    c.layer_kinds.assign(c.num_hidden_layers, LayerKind::mla);
    c.rope_theta = f.number("rope_theta");
    if (f.has("rope_scaling")) c.yarn = parse_yarn(f.object("rope_scaling"));
    parse_indexer(f, c);
    c.n_routed_experts = to_int(f.positive("n_routed_experts"), "n_routed_experts", kMaxExperts);
    c.num_experts_per_tok = to_int(f.positive("num_experts_per_tok"), "num_experts_per_tok", kMaxExperts);
    c.moe_intermediate_size = at_most(f.positive("moe_intermediate_size"), "moe_intermediate_size", kMaxIntermediate);
    c.n_shared_experts = to_int(f.non_negative("n_shared_experts"), "n_shared_experts", kMaxExperts);
    c.n_group = f.has("n_group") ? to_int(f.positive("n_group"), "n_group") : 1;
    c.topk_group = f.has("topk_group") ? to_int(f.positive("topk_group"), "topk_group") : 1;
    c.norm_topk_prob = f.boolean("norm_topk_prob");
    require_string(f, "scoring_func", "sigmoid");
    if (f.has("topk_method")) require_string(f, "topk_method", "noaux_tc");
    if (f.has("indexer_rope_interleave") && f.boolean("indexer_rope_interleave"))
      fail("config.json: 'indexer_rope_interleave' = true is not supported (DeepSeek-V3.2's indexer uses NeoX RoPE)");
  } else {
    if (f.has("mla_use_nope") && !f.boolean("mla_use_nope"))
      fail("config.json: 'mla_use_nope' = false is not supported for {} (its MLA layers are NoPE)", arch_name(c.arch));
    parse_kimi_layers(f, c);
    if (f.has("kda_gate_lower_bound")) c.kda_gate_lower_bound = static_cast<float>(f.number("kda_gate_lower_bound"));
    if (c.kda_gate_lower_bound && *c.kda_gate_lower_bound >= 0)
      fail("config.json: 'kda_gate_lower_bound' must be negative, got {}", *c.kda_gate_lower_bound);
    if (c.arch == Arch::kimi_k3) parse_indexer(f, c);
    else if (f.has("index_topk"))
      fail("config.json: kimi_linear has no indexer but 'index_topk' is set (use model_type kimi_k3)");
    c.n_routed_experts = to_int(f.positive("num_experts"), "num_experts", kMaxExperts);
    c.num_experts_per_tok = to_int(f.positive("num_experts_per_token"), "num_experts_per_token", kMaxExperts);
    c.moe_intermediate_size = at_most(f.positive("moe_intermediate_size"), "moe_intermediate_size", kMaxIntermediate);
    c.n_shared_experts = to_int(f.non_negative("num_shared_experts"), "num_shared_experts", kMaxExperts);
    const bool grouped = f.has("use_grouped_topk") && f.boolean("use_grouped_topk");
    c.n_group = grouped ? to_int(f.positive("num_expert_group"), "num_expert_group") : 1;
    c.topk_group = grouped ? to_int(f.positive("topk_group"), "topk_group") : 1;
    c.norm_topk_prob = f.has("moe_renormalize") ? f.boolean("moe_renormalize") : true;
    if (f.has("moe_router_activation_func")) require_string(f, "moe_router_activation_func", "sigmoid");
    if (c.kda_head_dim <= 0) fail("config.json: 'linear_attn_config.head_dim' must be positive");
  }
  if (c.num_layers_of(LayerKind::mla) > 0 && c.has_indexer && c.index_topk < 1)
    fail("config.json: 'index_topk' must be positive");
  check_moe(c);
  parse_quant(f, c);
  if (c.weight_quant == WeightQuant::mxfp4 && c.arch != Arch::kimi_k3)
    fail("config.json: MXFP4 expert weights ('quantization_config.quant_method' = mxfp4) are defined for kimi_k3 only");
  return c;
}

namespace {

// `base` with `over` merged in: objects key by key, null removes the key (as JSON merge patch, RFC 7396, and as a
// Hugging Face config reads an attribute set to None: e.g. {"quantization_config": null} is an unquantized model),
// anything else replaced. Keys `over` adds that `base` lacks are collected (dotted) in `added`.
void merge_into(json& base, const json& over, const std::string& where, std::vector<std::string>& added) {
  for (auto it = over.begin(); it != over.end(); ++it) {
    const std::string name = where + it.key();
    if (it->is_null()) {
      base.erase(it.key());
      continue;
    }
    if (!base.contains(it.key())) added.push_back(name);
    if (it->is_object() && base.contains(it.key()) && base[it.key()].is_object())
      merge_into(base[it.key()], *it, name + ".", added);
    else
      base[it.key()] = *it;
  }
}

}  // namespace

ModelConfig ModelConfig::from_json(const json& j, const json& overrides) {
  if (overrides.is_null() || (overrides.is_object() && overrides.empty())) return from_json(j);
  if (!overrides.is_object()) fail("--hf-overrides must be a JSON object, got {}", overrides.dump());
  if (!j.is_object()) fail("config.json: the top level must be a JSON object");
  json merged = j;
  std::vector<std::string> added;
  merge_into(merged, overrides, "", added);
  std::set<std::string> read;
  g_read_keys = &read;
  ModelConfig c;
  try {
    c = from_json(merged);
  } catch (...) {
    g_read_keys = nullptr;
    throw;
  }
  g_read_keys = nullptr;
  for (const std::string& k : added)
    if (!read.count(k))
      fail("--hf-overrides: '{}' is not a field of this config.json, nor one Kestrel reads for model_type '{}'", k,
           arch_name(c.arch));
  return c;
}

ModelConfig ModelConfig::load(const std::string& path, const json& overrides) {
  std::ifstream in(path);
  if (!in) fail("cannot open {}", path);
  json j;
  try {
    j = json::parse(in);
  } catch (const json::parse_error& e) {
    fail("{}: not valid JSON: {}", path, e.what());
  }
  return from_json(j, overrides);
}

json ModelConfig::to_json() const {
  json j;
  j["architectures"] = {architecture_class(arch)};
  j["model_type"] = arch_name(arch);
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["intermediate_size"] = intermediate_size;
  j["rms_norm_eps"] = decimal(rms_norm_eps);
  j["tie_word_embeddings"] = tie_word_embeddings;
  if (max_position_embeddings) j["max_position_embeddings"] = max_position_embeddings;
  if (bos_token_id >= 0) j["bos_token_id"] = bos_token_id;
  if (eos_token_id >= 0) j["eos_token_id"] = eos_token_id;
  j["hidden_act"] = "silu";
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_attention_heads;
  j["q_lora_rank"] = q_lora_rank ? json(q_lora_rank) : json(nullptr);
  j["kv_lora_rank"] = kv_lora_rank;
  j["qk_nope_head_dim"] = qk_nope_head_dim;
  j["qk_rope_head_dim"] = qk_rope_head_dim;
  j["v_head_dim"] = v_head_dim;
  j["first_k_dense_replace"] = first_k_dense_replace;
  j["moe_layer_freq"] = moe_layer_freq;
  j["routed_scaling_factor"] = decimal(routed_scaling_factor);
  if (num_nextn_predict_layers > 0) j["num_nextn_predict_layers"] = num_nextn_predict_layers;
  j["moe_intermediate_size"] = moe_intermediate_size;
  if (has_indexer) {
    j["index_n_heads"] = index_n_heads;
    j["index_head_dim"] = index_head_dim;
    j["index_topk"] = index_topk;
  }
  if (arch == Arch::deepseek_v32) {
    j["rope_theta"] = number_json(rope_theta);
    if (yarn) {
      j["rope_scaling"] = {{"type", "yarn"},
                           {"factor", number_json(yarn->factor)},
                           {"original_max_position_embeddings", number_json(yarn->original_max_position_embeddings)},
                           {"beta_fast", number_json(yarn->beta_fast)},
                           {"beta_slow", number_json(yarn->beta_slow)},
                           {"mscale", number_json(yarn->mscale)},
                           {"mscale_all_dim", number_json(yarn->mscale_all_dim)}};
    }
    j["n_routed_experts"] = n_routed_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["n_shared_experts"] = n_shared_experts;
    j["n_group"] = n_group;
    j["topk_group"] = topk_group;
    j["norm_topk_prob"] = norm_topk_prob;
    j["scoring_func"] = "sigmoid";
    j["topk_method"] = "noaux_tc";
  } else {
    json kda = json::array(), full = json::array();
    for (int i = 0; i < num_hidden_layers; ++i) (layer_kinds[i] == LayerKind::kda ? kda : full).push_back(i + 1);
    j["linear_attn_config"] = {{"kda_layers", kda},
                               {"full_attn_layers", full},
                               {"num_heads", kda_num_heads},
                               {"head_dim", kda_head_dim},
                               {"short_conv_kernel_size", short_conv_kernel_size}};
    if (kda_gate_lower_bound) j["kda_gate_lower_bound"] = decimal(*kda_gate_lower_bound);
    j["mla_use_nope"] = true;
    j["rope_theta"] = number_json(rope_theta);
    j["num_experts"] = n_routed_experts;
    j["num_experts_per_token"] = num_experts_per_tok;
    j["num_shared_experts"] = n_shared_experts;
    j["use_grouped_topk"] = n_group > 1;
    j["num_expert_group"] = n_group;
    j["topk_group"] = topk_group;
    j["moe_renormalize"] = norm_topk_prob;
    j["moe_router_activation_func"] = "sigmoid";
  }
  if (weight_quant == WeightQuant::fp8_block) {
    j["quantization_config"] = {{"quant_method", "fp8"},
                                {"fmt", "e4m3"},
                                {"activation_scheme", "dynamic"},
                                {"scale_fmt", "ue8m0"},
                                {"weight_block_size", {weight_block_size, weight_block_size}}};
  } else if (weight_quant == WeightQuant::mxfp4) {
    j["quantization_config"] = {{"quant_method", "mxfp4"}};
  }
  return j;
}

}  // namespace kestrel
