// Test helpers: the first MLA layer's attention core of a checkpoint on a CPU backend of its own, and random inputs
// for it (what the model's graph would hand it: normed input, query latent, queries, latent).
#pragma once
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu_backend.h"
#include "model/model.h"
#include "model/weights.h"

namespace kestrel::test {

struct MlaLayer {
  CpuBackend backend;
  const MlaCore* core = nullptr;
  MlaLayer(const std::string& dir, const ModelConfig& cfg, LatentCacheDtype latent,
           IndexKeyDtype keys = IndexKeyDtype::fp8) {
    ModelOptions o;
    o.latent_cache = latent;
    o.index_keys = keys;
    backend.configure(cfg, o);
    int layer = 0;
    while (cfg.layer_kinds[layer] != LayerKind::mla) ++layer;
    WeightLoader w(dir, backend.config());
    const MlaLayerWeights m =
        load_mla_weights(backend.config(), w, backend, "model.layers." + std::to_string(layer) + ".self_attn.");
    core = &backend.mla(m.attn);
  }
};

inline std::vector<float> normal_values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  for (float& v : x) v = nd(rng);
  return x;
}

// Random inputs of T tokens for an MLA layer of `c`; run() feeds tokens [t0, t0 + T) of them.
struct MlaInputs {
  std::vector<float> x, qr, q, kv;
  MlaInputs(const ModelConfig& c, int64_t T, uint32_t seed)
      : x(normal_values(T * c.hidden_size, seed)),
        qr(normal_values(T * std::max<int64_t>(c.q_lora_rank, 1), seed + 1)),
        q(normal_values(T * c.num_attention_heads * c.qk_head_dim(), seed + 2)),
        kv(normal_values(T * (c.kv_lora_rank + c.qk_rope_head_dim), seed + 3)) {}
  void run(const MlaCore& core, int64_t t0, int64_t T, const TokenPages& pages, std::vector<float>& o) const {
    const ModelConfig& c = core.config();
    core.forward(x.data() + t0 * c.hidden_size, c.q_lora_rank ? qr.data() + t0 * c.q_lora_rank : nullptr,
                 q.data() + t0 * c.num_attention_heads * c.qk_head_dim(),
                 kv.data() + t0 * (c.kv_lora_rank + c.qk_rope_head_dim), T, pages,
                 o.data() + t0 * c.num_attention_heads * c.v_head_dim);
  }
};

}  // namespace kestrel::test
