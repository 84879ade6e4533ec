#include "cache/cache_plan.h"

#include <algorithm>
#include <bit>

#include "core/error.h"

namespace kestrel {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool is_pow2(int64_t x) { return x > 0 && std::has_single_bit(static_cast<uint64_t>(x)); }

CachePlan lay_out(const std::vector<LayerCacheSpec>& layers, int block_size, int dcp) {
  CachePlan p;
  p.block_size = block_size;
  p.dcp = dcp;
  const size_t n = layers.size();
  p.page_offset.assign(n, -1);
  p.latent_bytes.assign(n, 0);
  p.index_key_bytes.assign(n, 0);
  p.state_row.assign(n, -1);
  p.state_offset.assign(n, -1);
  int64_t offset = 0;
  for (size_t l = 0; l < n; ++l) {
    const LayerCacheSpec& s = layers[l];
    const int64_t per_token = s.latent_bytes + s.index_key_bytes;
    if (per_token > 0) {
      p.page_offset[l] = offset;
      p.latent_bytes[l] = s.latent_bytes;
      p.index_key_bytes[l] = s.index_key_bytes;
      offset += per_token * block_size;
      p.token_bytes += per_token;
      ++p.num_token_layers;
    } else if (s.state_bytes > 0) {
      if (p.state_layer_bytes == 0) p.state_layer_bytes = s.state_bytes;
      ++p.num_state_layers;
    }
  }
  p.token_row_bytes = offset;
  p.row_bytes = std::max(p.token_row_bytes, p.state_layer_bytes);
  if (p.num_state_layers > 0) {
    p.layers_per_state_row = static_cast<int>(p.row_bytes / p.state_layer_bytes);
    p.state_rows_per_request = static_cast<int>(ceil_div(p.num_state_layers, p.layers_per_state_row));
    int k = 0;
    for (size_t l = 0; l < n; ++l) {
      if (layers[l].state_bytes == 0 || p.page_offset[l] >= 0) continue;
      p.state_row[l] = k / p.layers_per_state_row;
      p.state_offset[l] = int64_t{k % p.layers_per_state_row} * p.state_layer_bytes;
      ++k;
    }
  }
  return p;
}

}  // namespace

int64_t CachePlan::token_rows_for(int64_t tokens) const {
  if (num_token_layers == 0 || tokens <= 0) return 0;
  return ceil_div(ceil_div(tokens, dcp), block_size);
}

int64_t CachePlan::rows_per_request(int64_t tokens) const { return token_rows_for(tokens) + state_rows_per_request; }

int64_t CachePlan::state_padding_per_request() const {
  return int64_t{state_rows_per_request} * row_bytes - int64_t{num_state_layers} * state_layer_bytes;
}

double CachePlan::padding_fraction(int64_t tokens) const {
  const double allocated = static_cast<double>(rows_per_request(tokens)) * static_cast<double>(row_bytes);
  if (allocated == 0.0) return 0.0;
  const double used = static_cast<double>(num_token_layers ? ceil_div(tokens, dcp) : 0) * token_bytes +
                      static_cast<double>(num_state_layers) * state_layer_bytes;
  return 1.0 - used / allocated;
}

CachePlan plan_cache(const std::vector<LayerCacheSpec>& layers, const CachePlanOptions& o) {
  KESTREL_CHECK(o.dcp >= 1, "cache planner: dcp must be >= 1, got {}", o.dcp);
  int64_t state_bytes = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerCacheSpec& s = layers[l];
    KESTREL_CHECK(s.latent_bytes >= 0 && s.index_key_bytes >= 0 && s.state_bytes >= 0,
                  "cache planner: layer {} has a negative width", l);
    KESTREL_CHECK(s.latent_bytes + s.index_key_bytes == 0 || s.state_bytes == 0,
                  "cache planner: layer {} keeps both per-token entries and a per-request state", l);
    if (s.state_bytes == 0) continue;
    KESTREL_CHECK(state_bytes == 0 || state_bytes == s.state_bytes,
                  "cache planner: KDA layers differ in state size ({} and {} bytes)", state_bytes, s.state_bytes);
    state_bytes = s.state_bytes;
  }
  if (o.block_size != 0) {
    KESTREL_CHECK(is_pow2(o.block_size), "block size must be a power of two, got {}", o.block_size);
    KESTREL_CHECK(o.block_size % o.min_block_size == 0,
                  "block size {} must be a multiple of {} (the KDA chunk, so that a prefill resumes bit-exactly at "
                  "every block boundary)",
                  o.block_size, o.min_block_size);
    return lay_out(layers, o.block_size, o.dcp);
  }
  KESTREL_CHECK(is_pow2(o.min_block_size) && is_pow2(o.max_block_size) && o.min_block_size <= o.max_block_size,
                "cache planner: block size range [{}, {}] must be powers of two, smallest first", o.min_block_size,
                o.max_block_size);
  KESTREL_CHECK(o.max_model_len > 0, "cache planner: choosing the block size needs max_model_len");
  std::vector<CachePlan> candidates;
  std::vector<double> padding;
  for (int b = o.min_block_size; b <= o.max_block_size; b *= 2) {
    candidates.push_back(lay_out(layers, b, o.dcp));
    padding.push_back(candidates.back().padding_fraction(o.max_model_len));
  }
  const double best = *std::min_element(padding.begin(), padding.end());
  size_t pick = 0;
  while (padding[pick] > best + 0.01) ++pick;
  return std::move(candidates[pick]);
}

}  // namespace kestrel
