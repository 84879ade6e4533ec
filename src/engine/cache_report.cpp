#include "engine/cache_report.h"

#include <fmt/format.h>

#include "core/error.h"
#include "model/model.h"

namespace kestrel {

std::string with_thousands(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

namespace {

FormatBytes format_bytes(const ModelConfig& cfg, const std::string& name, LatentCacheDtype latent,
                         const IndexKeyDtype* keys) {
  FormatBytes f;
  f.name = name;
  if (latent == LatentCacheDtype::nvfp4 && cfg.arch == Arch::deepseek_v32) {
    f.defined = false;
    return f;
  }
  f.latent_bytes = latent_entry_bytes(cfg, latent);
  f.index_key_bytes = keys ? index_key_entry_bytes(cfg, *keys) : 0;
  f.token_bytes = cfg.num_layers_of(LayerKind::mla) * (f.latent_bytes + f.index_key_bytes);
  return f;
}

CapacityLine capacity(const ModelConfig& cfg, const CacheReportOptions& o, int tp, int dcp, int64_t max_len) {
  KESTREL_CHECK(tp >= 1 && dcp >= 1 && tp % dcp == 0, "--dcp {} must divide --tp {} (DCP shards within the TP group)",
                dcp, tp);
  ModelOptions mo;
  mo.latent_cache = o.latent;
  mo.index_keys = o.index_keys;
  CapacityLine c;
  c.tp = tp;
  c.dcp = dcp;
  const bool has_kda = cfg.num_layers_of(LayerKind::kda) > 0;
  c.plan = plan_cache(model_cache_specs(cfg, mo, tp), {.block_size = o.block_size,
                                                        .min_block_size = has_kda ? 64 : 16,
                                                        .max_block_size = 1024,
                                                        .dcp = dcp,
                                                        .max_model_len = max_len});
  c.state_bytes_per_request = int64_t{c.plan.num_state_layers} * c.plan.state_layer_bytes;
  if (o.cache_gib > 0) {
    c.rows = static_cast<int64_t>(o.cache_gib * 1073741824.0) / c.plan.row_bytes;
    c.tokens = std::max<int64_t>(c.rows - c.plan.state_rows_per_request, 0) * c.plan.block_size * dcp;
    c.requests = c.rows / c.plan.rows_per_request(max_len);
  }
  return c;
}

}  // namespace

CacheReport inspect_cache(const ModelConfig& cfg, const std::string& title, const CacheReportOptions& o) {
  CacheReport r;
  r.title = title;
  r.config = cfg;
  r.options = o;
  r.max_model_len = o.max_model_len ? o.max_model_len : cfg.context_length;
  KESTREL_CHECK(r.max_model_len >= 1, "--max-model-len must be positive");
  const IndexKeyDtype fp8 = IndexKeyDtype::fp8, mxfp4 = IndexKeyDtype::mxfp4;
  r.formats.push_back(format_bytes(cfg, "FP8 latent only (K3 style)", LatentCacheDtype::fp8, nullptr));
  r.formats.push_back(format_bytes(cfg, "FP8 latent + FP8 index keys", LatentCacheDtype::fp8, &fp8));
  r.formats.push_back(format_bytes(cfg, "NVFP4 latent + MXFP4 index keys", LatentCacheDtype::nvfp4, &mxfp4));
  r.configs.push_back(capacity(cfg, o, o.tp, o.dcp, r.max_model_len));
  const bool heads_split = cfg.num_layers_of(LayerKind::kda) == 0 || cfg.kda_num_heads % 8 == 0;
  for (const auto& [tp, dcp] : {std::pair{8, 1}, std::pair{8, 8}})
    if (heads_split && !(tp == o.tp && dcp == o.dcp)) r.configs.push_back(capacity(cfg, o, tp, dcp, r.max_model_len));
  return r;
}

std::string format_cache_report(const CacheReport& r) {
  const ModelConfig& c = r.config;
  const int n_mla = c.num_layers_of(LayerKind::mla), n_kda = c.num_layers_of(LayerKind::kda);
  std::string s = fmt::format("{} ({}): {} layers = {} attention (MLA{}) + {} KDA; max_model_len {}\n\n", r.title,
                              arch_name(c.arch), c.num_hidden_layers, n_mla, c.has_indexer ? " + DSA indexer" : "",
                              n_kda, with_thousands(r.max_model_len));
  s += "Cache bytes per token per GPU, attention layers (TP replicates them; DCP W divides them by W):\n";
  for (const FormatBytes& f : r.formats) {
    if (!f.defined) {
      s += fmt::format("  {:<34} not defined for {}\n", f.name, arch_name(c.arch));
      continue;
    }
    s += fmt::format("  {:<34} {:>5} + {:>3} B per layer  ->  {:>7} B per token\n", f.name, f.latent_bytes,
                     f.index_key_bytes, with_thousands(f.token_bytes));
  }
  static const char* latent_names[] = {"auto", "fp8", "nvfp4"};
  const CacheReportOptions& o = r.options;
  for (const CapacityLine& k : r.configs) {
    const CachePlan& p = k.plan;
    s += fmt::format("\nTP{}{}, --kv-cache-dtype {} --index-dtype {}:\n", k.tp,
                     k.dcp > 1 ? fmt::format(" + DCP{}", k.dcp) : "", latent_names[static_cast<int>(o.latent)],
                     o.index_keys == IndexKeyDtype::fp8 ? "fp8" : "mxfp4");
    s += fmt::format("  per token: {} B per GPU", with_thousands(p.token_bytes / k.dcp));
    s += k.dcp > 1 ? fmt::format(" ({} B for each token it holds: 1 of every {})\n", with_thousands(p.token_bytes), k.dcp)
                   : "\n";
    if (n_kda)
      s += fmt::format("  KDA state: {} B per layer ({} of {} heads), {} B per request\n",
                       with_thousands(p.state_layer_bytes), c.kda_num_heads / k.tp, c.kda_num_heads,
                       with_thousands(k.state_bytes_per_request));
    s += fmt::format("  B = {} tokens per row (prefix-cache hits every {} tokens); row {} B; token row {} B\n",
                     p.block_size, p.block_size * k.dcp, with_thousands(p.row_bytes),
                     with_thousands(p.token_row_bytes));
    if (n_kda)
      s += fmt::format("  state rows: {} KDA layer(s) per row, {} row(s) per request\n", p.layers_per_state_row,
                       p.state_rows_per_request);
    s += fmt::format("  padding: {} B per token row, {} B in a request's state rows; {:.2f}% of a {}-token request\n",
                     with_thousands(p.token_row_padding()), with_thousands(p.state_padding_per_request()),
                     100.0 * p.padding_fraction(r.max_model_len), with_thousands(r.max_model_len));
    if (o.cache_gib > 0)
      s += fmt::format("  {:g} GiB per GPU: {} rows; one request up to {} tokens; {} full {}-token requests\n",
                       o.cache_gib, with_thousands(k.rows), with_thousands(k.tokens), with_thousands(k.requests),
                       with_thousands(r.max_model_len));
  }
  return s;
}

}  // namespace kestrel
