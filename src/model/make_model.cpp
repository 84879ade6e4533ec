#include "model/make_model.h"

#include "model/dummy_checkpoint.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "core/error.h"
#include "core/formats.h"
#include "model/safetensors.h"
#include "model/tokenizer_files.h"

namespace kestrel {

namespace {

ModelConfig kimi_base(Arch arch) {
  ModelConfig c;
  c.arch = arch;
  c.architecture = arch == Arch::kimi_k3 ? "KimiK3ForCausalLM" : "KimiLinearForCausalLM";
  c.rms_norm_eps = 1e-5f;
  c.first_k_dense_replace = 1;
  c.moe_layer_freq = 1;
  c.norm_topk_prob = true;
  c.short_conv_kernel_size = 4;
  return c;
}

void set_layers(ModelConfig& c, const std::vector<int>& full_one_based) {
  c.layer_kinds.assign(c.num_hidden_layers, LayerKind::kda);
  for (int l : full_one_based) c.layer_kinds[l - 1] = LayerKind::mla;
}

ModelConfig tiny_kimi(Arch arch) {
  ModelConfig c = kimi_base(arch);
  c.vocab_size = 4096;
  c.hidden_size = 64;
  c.num_hidden_layers = 6;
  set_layers(c, {3, 6});
  c.intermediate_size = 128;
  c.num_attention_heads = 4;
  c.q_lora_rank = arch == Arch::kimi_k3 ? 48 : 0;
  c.kv_lora_rank = 64;
  c.qk_nope_head_dim = 16;
  c.qk_rope_head_dim = 16;
  c.v_head_dim = 16;
  c.kda_num_heads = 2;
  c.kda_head_dim = 32;
  c.n_routed_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 32;
  c.n_shared_experts = 1;
  c.routed_scaling_factor = 2.446f;
  c.max_position_embeddings = 4096;
  c.bos_token_id = kTinyBosId;
  c.eos_token_id = kTinyEosId;
  if (arch == Arch::kimi_k3) {
    c.has_indexer = true;
    c.index_n_heads = 4;
    c.index_head_dim = 32;
    c.index_topk = 16;
    c.kda_gate_lower_bound = -5.0f;
    c.weight_quant = WeightQuant::mxfp4;
  }
  return c;
}

ModelConfig tiny_deepseek() {
  ModelConfig c;
  c.arch = Arch::deepseek_v32;
  c.architecture = "DeepseekV32ForCausalLM";
  c.vocab_size = 4096;
  c.hidden_size = 64;
  c.num_hidden_layers = 3;
  c.layer_kinds.assign(3, LayerKind::mla);
  c.intermediate_size = 128;
  c.rms_norm_eps = 1e-6f;
  c.num_attention_heads = 4;
  c.q_lora_rank = 48;
  c.kv_lora_rank = 128;
  c.qk_nope_head_dim = 16;
  c.qk_rope_head_dim = 16;
  c.v_head_dim = 16;
  c.use_rope = true;
  c.rope_theta = 10000.0;
  c.yarn = YarnConfig{40.0, 4096.0, 32.0, 1.0, 1.0, 1.0};
  c.has_indexer = true;
  c.index_n_heads = 4;
  c.index_head_dim = 32;
  c.index_topk = 16;
  c.first_k_dense_replace = 1;
  c.n_routed_experts = 8;
  c.num_experts_per_tok = 2;
  c.n_group = 4;
  c.topk_group = 2;
  c.moe_intermediate_size = 32;
  c.n_shared_experts = 1;
  c.routed_scaling_factor = 2.5f;
  c.norm_topk_prob = true;
  c.weight_quant = WeightQuant::fp8_block;
  c.weight_block_size = 128;
  c.max_position_embeddings = 163840;
  c.num_nextn_predict_layers = 1;
  c.bos_token_id = kTinyBosId;
  c.eos_token_id = kTinyEosId;
  return c;
}

// kimi_k3 at the real per-layer attention widths, with fewer layers, heads and experts.
ModelConfig small_k3() {
  ModelConfig c = kimi_base(Arch::kimi_k3);
  c.vocab_size = 4096;
  c.hidden_size = 1024;
  c.num_hidden_layers = 4;
  set_layers(c, {4});
  c.intermediate_size = 2048;
  c.num_attention_heads = 16;
  c.q_lora_rank = 768;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.has_indexer = true;
  c.index_n_heads = 32;
  c.index_head_dim = 128;
  c.index_topk = 2048;
  c.kda_num_heads = 4;
  c.kda_head_dim = 128;
  c.kda_gate_lower_bound = -5.0f;
  c.n_routed_experts = 16;
  c.num_experts_per_tok = 4;
  c.moe_intermediate_size = 256;
  c.n_shared_experts = 1;
  c.routed_scaling_factor = 2.446f;
  c.weight_quant = WeightQuant::mxfp4;
  c.max_position_embeddings = 1048576;
  c.bos_token_id = kTinyBosId;
  c.eos_token_id = kTinyEosId;
  return c;
}

// kimi_linear at Kimi-Linear-48B's per-layer widths (KDA 32 heads of 128, MLA 32 heads, latent 512 + 64, bf16
// weights, no indexer), with small_k3's layers, experts and vocabulary: what the GPU path's fast kernels run on.
ModelConfig small_kimi_linear() {
  ModelConfig c = small_k3();
  c.arch = Arch::kimi_linear;
  c.architecture = "KimiLinearForCausalLM";
  c.num_attention_heads = 32;
  c.q_lora_rank = 0;
  c.has_indexer = false;
  c.index_n_heads = c.index_head_dim = c.index_topk = 0;
  c.kda_num_heads = 32;
  c.kda_gate_lower_bound.reset();
  c.weight_quant = WeightQuant::none;
  return c;
}

// deepseek_v32 at DeepSeek-V3.2's per-layer attention widths (latent 512 + 64, q_lora_rank-compressed queries with
// 128 + 64 dims per head, indexer 64 heads of 128 with top-2048, YaRN) with fewer layers (one dense, then MoE), heads
// and experts (grouped routing kept), and small_k3's hidden size and vocabulary.
ModelConfig small_deepseek() {
  ModelConfig c = tiny_deepseek();
  c.hidden_size = 1024;
  c.num_hidden_layers = 3;
  c.layer_kinds.assign(3, LayerKind::mla);
  c.intermediate_size = 2048;
  c.num_attention_heads = 16;
  c.q_lora_rank = 768;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.index_n_heads = 64;
  c.index_head_dim = 128;
  c.index_topk = 2048;
  c.first_k_dense_replace = 1;
  c.n_routed_experts = 16;
  c.num_experts_per_tok = 4;
  c.n_group = 4;
  c.topk_group = 2;
  c.moe_intermediate_size = 256;
  c.n_shared_experts = 1;
  return c;
}

ModelConfig k31_pro() {
  ModelConfig c = kimi_base(Arch::kimi_k3);
  c.vocab_size = 163840;
  c.hidden_size = 7168;
  c.num_hidden_layers = 93;
  std::vector<int> full;
  for (int l = 4; l <= 92; l += 4) full.push_back(l);
  full.push_back(93);
  set_layers(c, full);
  c.intermediate_size = 18432;
  c.num_attention_heads = 96;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.has_indexer = true;
  c.index_n_heads = 32;
  c.index_head_dim = 128;
  c.index_topk = 2048;
  c.kda_num_heads = 160;
  c.kda_head_dim = 128;
  c.kda_gate_lower_bound = -5.0f;
  c.n_routed_experts = 896;
  c.num_experts_per_tok = 16;
  c.moe_intermediate_size = 1536;
  c.n_shared_experts = 2;
  c.routed_scaling_factor = 2.446f;
  c.weight_quant = WeightQuant::mxfp4;
  c.max_position_embeddings = 1048576;
  c.bos_token_id = 163584;
  c.eos_token_id = 163586;
  return c;
}

ModelConfig kimi_linear_48b() {
  ModelConfig c = kimi_base(Arch::kimi_linear);
  c.vocab_size = 163840;
  c.hidden_size = 2304;
  c.num_hidden_layers = 27;
  set_layers(c, {4, 8, 12, 16, 20, 24, 27});
  c.intermediate_size = 9216;
  c.num_attention_heads = 32;
  c.q_lora_rank = 0;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.kda_num_heads = 32;
  c.kda_head_dim = 128;
  c.n_routed_experts = 256;
  c.num_experts_per_tok = 8;
  c.moe_intermediate_size = 1024;
  c.n_shared_experts = 1;
  c.routed_scaling_factor = 2.446f;
  c.max_position_embeddings = 1048576;
  c.bos_token_id = 163584;
  c.eos_token_id = 163586;
  return c;
}

ModelConfig deepseek_v32_full() {
  ModelConfig c = tiny_deepseek();
  c.vocab_size = 129280;
  c.hidden_size = 7168;
  c.num_hidden_layers = 61;
  c.layer_kinds.assign(61, LayerKind::mla);
  c.intermediate_size = 18432;
  c.num_attention_heads = 128;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.index_n_heads = 64;
  c.index_head_dim = 128;
  c.index_topk = 2048;
  c.first_k_dense_replace = 3;
  c.n_routed_experts = 256;
  c.num_experts_per_tok = 8;
  c.n_group = 8;
  c.topk_group = 4;
  c.moe_intermediate_size = 2048;
  c.num_nextn_predict_layers = 1;
  c.bos_token_id = 0;
  c.eos_token_id = 1;
  return c;
}

// ---- deterministic weights ----

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

class Rng {
 public:
  Rng(uint64_t seed, const std::string& name) : s_(seed) {
    for (unsigned char ch : name) s_ = (s_ ^ ch) * 0x100000001B3ull;  // FNV-1a over the tensor name
  }
  // Uniform in [-a, a) from 24 random bits (exact in fp32).
  float uniform(float a) {
    const float u = static_cast<float>(splitmix64(s_) >> 40) * (1.0f / 16777216.0f);
    return (2.0f * u - 1.0f) * a;
  }

 private:
  uint64_t s_;
};

enum class Store { bf16, f32, fp8_block, mxfp4 };

class CheckpointBuilder {
 public:
  CheckpointBuilder(uint64_t seed, int fp8_block) : seed_(seed), fp8_block_(fp8_block) {}

  // Values uniform with the given standard deviation around `center`.
  std::vector<float> draw(const std::string& name, int64_t n, float stddev, float center = 0.0f) const {
    Rng rng(seed_, name);
    std::vector<float> v(static_cast<size_t>(n));
    const float a = stddev * std::sqrt(3.0f);
    for (float& x : v) x = center + rng.uniform(a);
    return v;
  }

  void add(const std::string& name, const std::vector<int64_t>& shape, const std::vector<float>& v, Store s) {
    TensorData t;
    t.shape = shape;
    if (s == Store::f32) {
      t.dtype = DType::F32;
      t.bytes.resize(v.size() * 4);
      std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
    } else {
      t.dtype = DType::BF16;
      t.bytes.resize(v.size() * 2);
      for (size_t i = 0; i < v.size(); ++i) {
        const uint16_t b = f32_to_bf16(v[i]);
        std::memcpy(t.bytes.data() + 2 * i, &b, 2);
      }
    }
    tensors_[name] = std::move(t);
  }

  // A linear weight [out, in] with std 1/sqrt(in), stored as `s`.
  void linear(const std::string& prefix, int64_t out, int64_t in, Store s) {
    const std::vector<float> w = draw(prefix + ".weight", out * in, 1.0f / std::sqrt(static_cast<float>(in)));
    if (s == Store::fp8_block) return add_fp8(prefix, out, in, w);
    if (s == Store::mxfp4) return add_mxfp4(prefix, out, in, w);
    add(prefix + ".weight", {out, in}, w, s);
  }

  std::map<std::string, TensorData>& tensors() { return tensors_; }

 private:
  void add_fp8(const std::string& prefix, int64_t out, int64_t in, const std::vector<float>& w) {
    const int64_t b = fp8_block_, rb = (out + b - 1) / b, cb = (in + b - 1) / b;
    std::vector<float> scales(static_cast<size_t>(rb * cb));
    TensorData q{DType::F8_E4M3, {out, in}, std::vector<uint8_t>(static_cast<size_t>(out * in))};
    for (int64_t i = 0; i < rb; ++i)
      for (int64_t j = 0; j < cb; ++j) {
        float amax = 0.0f;
        for (int64_t r = i * b; r < std::min(out, (i + 1) * b); ++r)
          for (int64_t c = j * b; c < std::min(in, (j + 1) * b); ++c) amax = std::max(amax, std::fabs(w[r * in + c]));
        // The config says scale_fmt ue8m0 (as DeepSeek-V3.2's checkpoints): a power of two, rounded up.
        const float s = amax > 0.0f ? round_up_pow2(amax / kE4m3Max) : 1.0f;
        scales[i * cb + j] = s;
        for (int64_t r = i * b; r < std::min(out, (i + 1) * b); ++r)
          for (int64_t c = j * b; c < std::min(in, (j + 1) * b); ++c) q.bytes[r * in + c] = f32_to_e4m3(w[r * in + c] / s);
      }
    tensors_[prefix + ".weight"] = std::move(q);
    add(prefix + ".weight_scale_inv", {rb, cb}, scales, Store::f32);
  }

  void add_mxfp4(const std::string& prefix, int64_t out, int64_t in, const std::vector<float>& w) {
    KESTREL_CHECK(in % 32 == 0, "MXFP4 weight {} needs an input width divisible by 32", prefix);
    TensorData packed{DType::U8, {out, in / 2}, std::vector<uint8_t>(static_cast<size_t>(out * in / 2))};
    TensorData scales{DType::U8, {out, in / 32}, std::vector<uint8_t>(static_cast<size_t>(out * in / 32))};
    mxfp4_encode(w.data(), out * in, packed.bytes.data(), scales.bytes.data());
    tensors_[prefix + ".weight_packed"] = std::move(packed);
    tensors_[prefix + ".weight_scale"] = std::move(scales);
  }

  uint64_t seed_;
  int fp8_block_;
  std::map<std::string, TensorData> tensors_;
};

void norm(CheckpointBuilder& b, const std::string& name, int64_t n, Store s) {
  b.add(name, {n}, b.draw(name, n, 0.05f, 1.0f), s);
}

void ffn(CheckpointBuilder& b, const std::string& p, const char* const names[3], int64_t d, int64_t f, Store s) {
  b.linear(p + names[0], f, d, s);
  b.linear(p + names[1], f, d, s);
  b.linear(p + names[2], d, f, s);
}

void mla_weights(CheckpointBuilder& b, const ModelConfig& c, const std::string& p, Store lin, Store nrm) {
  const int64_t D = c.hidden_size, H = c.num_attention_heads, C = c.kv_lora_rank, R = c.qk_rope_head_dim;
  if (c.q_lora_rank) {
    b.linear(p + "q_a_proj", c.q_lora_rank, D, lin);
    norm(b, p + "q_a_layernorm.weight", c.q_lora_rank, nrm);
    b.linear(p + "q_b_proj", H * c.qk_head_dim(), c.q_lora_rank, lin);
  } else {
    b.linear(p + "q_proj", H * c.qk_head_dim(), D, lin);
  }
  b.linear(p + "kv_a_proj_with_mqa", C + R, D, lin);
  norm(b, p + "kv_a_layernorm.weight", C, nrm);
  b.linear(p + "kv_b_proj", H * (c.qk_nope_head_dim + c.v_head_dim), C, lin);
  b.linear(p + "o_proj", D, H * c.v_head_dim, lin);
  if (c.has_indexer) {
    const int64_t Hi = c.index_n_heads, Dh = c.index_head_dim;
    b.linear(p + "indexer.wq_b", Hi * Dh, c.q_lora_rank ? c.q_lora_rank : D, lin);
    b.linear(p + "indexer.wk", Dh, D, lin);
    norm(b, p + "indexer.k_norm.weight", Dh, nrm);
    b.add(p + "indexer.k_norm.bias", {Dh}, b.draw(p + "indexer.k_norm.bias", Dh, 0.05f), nrm);
    b.linear(p + "indexer.weights_proj", Hi, D, Store::bf16);
  }
}

void kda_weights(CheckpointBuilder& b, const ModelConfig& c, const std::string& p) {
  const int64_t D = c.hidden_size, H = c.kda_num_heads, dk = c.kda_head_dim, P = H * dk, W = c.short_conv_kernel_size;
  for (const char* n : {"q_proj", "k_proj", "v_proj"}) b.linear(p + n, P, D, Store::bf16);
  for (const char* n : {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"})
    b.add(p + n, {P, 1, W}, b.draw(p + n, P * W, 1.0f / std::sqrt(static_cast<float>(W))), Store::bf16);
  b.linear(p + "f_a_proj", dk, D, Store::bf16);
  b.linear(p + "f_b_proj", P, dk, Store::bf16);
  b.add(p + "dt_bias", {P}, b.draw(p + "dt_bias", P, 0.5f), Store::f32);
  // A = exp(A_log) spread over [1, 16] as in Kimi Linear's initialisation.
  std::vector<float> a_log = b.draw(p + "A_log", H, 0.8f, 1.386f);
  b.add(p + "A_log", {1, 1, H, 1}, a_log, Store::f32);
  b.linear(p + "b_proj", H, D, Store::bf16);
  b.linear(p + "g_a_proj", dk, D, Store::bf16);
  b.linear(p + "g_b_proj", P, dk, Store::bf16);
  norm(b, p + "o_norm.weight", dk, Store::bf16);
  b.linear(p + "o_proj", D, P, Store::bf16);
}

void moe_weights(CheckpointBuilder& b, const ModelConfig& c, const std::string& p, const char* const names[3],
                 Store experts, Store dense) {
  static const char* const kShared[3] = {"gate_proj", "up_proj", "down_proj"};
  const int64_t D = c.hidden_size, E = c.n_routed_experts;
  b.add(p + "gate.weight", {E, D}, b.draw(p + "gate.weight", E * D, 1.0f / std::sqrt(static_cast<float>(D))),
        Store::bf16);
  b.add(p + "gate.e_score_correction_bias", {E}, b.draw(p + "gate.e_score_correction_bias", E, 0.05f), Store::f32);
  for (int64_t e = 0; e < E; ++e)
    ffn(b, p + "experts." + std::to_string(e) + ".", names, D, c.moe_intermediate_size, experts);
  if (c.n_shared_experts) ffn(b, p + "shared_experts.", kShared, D, c.moe_intermediate_size * c.n_shared_experts, dense);
}

std::map<std::string, TensorData> build_weights(const ModelConfig& c, uint64_t seed) {
  static const char* const kDense[3] = {"gate_proj", "up_proj", "down_proj"};
  static const char* const kKimiExperts[3] = {"w1", "w3", "w2"};
  CheckpointBuilder b(seed, c.weight_block_size);
  const bool ds = c.arch == Arch::deepseek_v32;
  const Store lin = c.weight_quant == WeightQuant::fp8_block ? Store::fp8_block : Store::bf16;
  const Store nrm = ds ? Store::f32 : Store::bf16;
  const Store experts = c.weight_quant == WeightQuant::mxfp4 ? Store::mxfp4 : lin;
  const int64_t D = c.hidden_size, V = c.vocab_size;
  b.add("model.embed_tokens.weight", {V, D}, b.draw("model.embed_tokens.weight", V * D, 1.0f), Store::bf16);
  auto layer = [&](int l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    norm(b, p + "input_layernorm.weight", D, nrm);
    norm(b, p + "post_attention_layernorm.weight", D, nrm);
    if (l < c.num_hidden_layers && c.layer_kinds[l] == LayerKind::kda)
      kda_weights(b, c, p + "self_attn.");
    else
      mla_weights(b, c, p + "self_attn.", lin, nrm);
    if (!c.is_moe_layer(l))
      ffn(b, p + "mlp.", kDense, D, c.intermediate_size, lin);
    else if (ds)
      moe_weights(b, c, p + "mlp.", kDense, experts, lin);
    else
      moe_weights(b, c, p + "block_sparse_moe.", kKimiExperts, experts, lin);
  };
  for (int l = 0; l < c.num_hidden_layers; ++l) layer(l);
  // DeepSeek-V3's MTP modules after the decoder layers: a decoder layer (MoE past first_k_dense_replace) with enorm,
  // hnorm, eh_proj and shared_head; their embed_tokens and shared_head.head are copies of the model's, as in
  // DeepSeek's checkpoints.
  KESTREL_CHECK(c.num_nextn_predict_layers == 0 || ds, "make-model writes MTP layers only for deepseek_v32");
  for (int l = c.num_hidden_layers; l < c.num_hidden_layers + c.num_nextn_predict_layers; ++l) {
    layer(l);
    const std::string p = "model.layers." + std::to_string(l) + ".";
    norm(b, p + "enorm.weight", D, nrm);
    norm(b, p + "hnorm.weight", D, nrm);
    b.linear(p + "eh_proj", D, 2 * D, Store::bf16);
    norm(b, p + "shared_head.norm.weight", D, nrm);
    b.add(p + "embed_tokens.weight", {V, D}, b.draw("model.embed_tokens.weight", V * D, 1.0f), Store::bf16);
    b.add(p + "shared_head.head.weight", {V, D},
          b.draw("lm_head.weight", V * D, 1.0f / std::sqrt(static_cast<float>(D))), Store::bf16);
  }
  norm(b, "model.norm.weight", D, nrm);
  if (!c.tie_word_embeddings)
    b.add("lm_head.weight", {V, D}, b.draw("lm_head.weight", V * D, 1.0f / std::sqrt(static_cast<float>(D))),
          Store::bf16);
  return std::move(b.tensors());
}

}  // namespace

const std::vector<Preset>& presets() {
  static const std::vector<Preset> all = {
      {"tiny", Arch::kimi_k3, true, ""},
      {"tiny", Arch::kimi_linear, true, ""},
      {"tiny", Arch::deepseek_v32, true, ""},
      {"small", Arch::kimi_k3, true, ""},
      {"small", Arch::kimi_linear, true, ""},
      {"small", Arch::deepseek_v32, true, ""},
      {"k3.1-pro", Arch::kimi_k3, false,
       "From the seed: 93 layers (69 KDA + 24 full attention), 96 MLA heads, latent 512+64, indexer 32x128 top-2048, "
       "896 experts top-16 MXFP4, 1M context. Assumptions chosen to match 2.8T total / 104B active: hidden 7168, "
       "vocab 163840, KDA 160 heads x 128, expert width 1536, 2 shared experts, q_lora_rank 1536, dense layer 0 of "
       "width 18432, full-attention layers at 4, 8, ..., 92 and 93, KDA gate lower bound -5."},
      {"kimi-linear-48b", Arch::kimi_linear, false, "moonshotai/Kimi-Linear-48B-A3B (kda_kimi_linear.md section 3)."},
      {"deepseek-v3.2", Arch::deepseek_v32, false, "deepseek-ai/DeepSeek-V3.2 (dsa_mla.md section 4)."},
  };
  return all;
}

const Preset& find_preset(Arch arch, const std::string& name) {
  std::string valid;
  for (const Preset& p : presets()) {
    if (p.arch != arch) continue;
    if (p.name == name) return p;
    valid += (valid.empty() ? "" : ", ") + p.name;
  }
  fail("no preset '{}' for --arch {} (available: {})", name, arch_name(arch), valid);
}

ModelConfig preset_config(const Preset& p) {
  // What the preset writes is what config.json says: the config read back from its JSON (derived fields included).
  auto read_back = [](const ModelConfig& c) { return ModelConfig::from_json(c.to_json()); };
  if (p.name == "tiny") return read_back(p.arch == Arch::deepseek_v32 ? tiny_deepseek() : tiny_kimi(p.arch));
  if (p.name == "small" && p.arch == Arch::deepseek_v32) return read_back(small_deepseek());
  if (p.name == "small") return read_back(p.arch == Arch::kimi_linear ? small_kimi_linear() : small_k3());
  if (p.name == "k3.1-pro") return read_back(k31_pro());
  if (p.name == "kimi-linear-48b") return read_back(kimi_linear_48b());
  if (p.name == "deepseek-v3.2") return read_back(deepseek_v32_full());
  fail("preset '{}' has no configuration", p.name);
}

ParameterCount count_parameters(const ModelConfig& c) {
  const int64_t D = c.hidden_size, V = c.vocab_size, H = c.num_attention_heads, C = c.kv_lora_rank;
  const int64_t R = c.qk_rope_head_dim;
  int64_t mla = (c.q_lora_rank ? D * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * H * c.qk_head_dim()
                               : D * H * c.qk_head_dim()) +
                D * (C + R) + C + C * H * (c.qk_nope_head_dim + c.v_head_dim) + H * c.v_head_dim * D;
  if (c.has_indexer) {
    const int64_t Hi = c.index_n_heads, Dh = c.index_head_dim;
    mla += (c.q_lora_rank ? c.q_lora_rank : D) * Hi * Dh + D * Dh + 2 * Dh + D * Hi;
  }
  const int64_t H2 = c.kda_num_heads, dk = c.kda_head_dim, P = H2 * dk;
  const int64_t kda = 4 * D * P + 3 * P * c.short_conv_kernel_size + 2 * (D * dk + dk * P) + P + H2 + D * H2 + dk;
  const int64_t expert = 3 * D * c.moe_intermediate_size;
  ParameterCount n;
  n.total = 2 * D * V + D;
  if (c.tie_word_embeddings) n.total -= D * V;
  n.active = n.total;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    int64_t common = 2 * D + (c.layer_kinds[l] == LayerKind::kda ? kda : mla);
    if (c.is_moe_layer(l)) {
      common += c.n_routed_experts * D + c.n_routed_experts + expert * c.n_shared_experts;
      n.total += common + expert * c.n_routed_experts;
      n.active += common + expert * c.num_experts_per_tok;
    } else {
      common += 3 * D * c.intermediate_size;
      n.total += common;
      n.active += common;
    }
  }
  return n;
}

void make_model(const Preset& p, const std::string& out, uint64_t seed, const MakeModelOptions& o) {
  const ModelConfig cfg = ModelConfig::from_json(preset_config(p).to_json(), o.hf_overrides);
  std::filesystem::create_directories(out);
  {
    std::ofstream f(out + "/config.json");
    if (!f) fail("cannot write {}/config.json", out);
    f << cfg.to_json().dump(2) << "\n";
  }
  if (o.tokenizer || p.has_weights) write_model_tokenizer(out, cfg);
  if (o.dummy_weights) {
    write_dummy_checkpoint(out, seed, int64_t{5} << 30);
    return;
  }
  if (!p.has_weights) return;
  write_checkpoint(out, build_weights(cfg, seed), int64_t{2} << 30);
}

}  // namespace kestrel
