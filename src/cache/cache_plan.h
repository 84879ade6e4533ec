// The cache planner: how the cache of one GPU is cut into rows of one size (spec CACHE.md).
// A token row holds B consecutive tokens of one request for every attention layer (layer 0's latent page, then
// its index-key page, then layer 1's, ...); a state row holds the recurrent states of a group of KDA layers of
// one request. The planner sees only byte widths: the layer modules own what the bytes mean.
#pragma once
#include <cstdint>
#include <vector>

namespace kestrel {

// What one decoder layer keeps per GPU. An attention layer keeps per-token entries (latent and, with a DSA
// indexer, index key); a recurrent layer keeps one state per request. A layer has one kind or the other.
struct LayerCacheSpec {
  int64_t latent_bytes = 0;     // per token
  int64_t index_key_bytes = 0;  // per token
  int64_t state_bytes = 0;      // per request
};

struct CachePlanOptions {
  int block_size = 0;        // B; 0 lets the planner choose in [min_block_size, max_block_size]
  int min_block_size = 16;   // a resumable chunked KDA prefill needs B to be a multiple of its chunk (64)
  int max_block_size = 1024;
  int dcp = 1;               // decode context parallelism: a GPU holds ceil(tokens / dcp) of a request's tokens
  int64_t max_model_len = 0; // the request length the automatic choice of B minimises padding for
};

struct CachePlan {
  int block_size = 0;
  int dcp = 1;
  int64_t row_bytes = 0;
  int64_t token_bytes = 0;        // per token, every attention layer (local tokens of this GPU)
  int64_t token_row_bytes = 0;    // block_size * token_bytes: the used part of a token row
  int64_t state_layer_bytes = 0;  // one KDA layer's state
  int num_token_layers = 0, num_state_layers = 0;
  int layers_per_state_row = 0;
  int state_rows_per_request = 0;
  // Per decoder layer (-1 where the layer keeps nothing of that kind):
  std::vector<int64_t> page_offset;      // its page in a token row: B latent entries, then B index-key entries
  std::vector<int64_t> latent_bytes;     // per token
  std::vector<int64_t> index_key_bytes;  // per token
  std::vector<int> state_row;            // which of the request's state rows holds its state
  std::vector<int64_t> state_offset;     // where in that row

  bool has_state() const { return num_state_layers > 0; }
  // Token rows a GPU needs for `tokens` tokens of one request (its ceil(tokens / dcp) local ones).
  int64_t token_rows_for(int64_t tokens) const;
  // Token rows plus state rows of one request of `tokens` tokens.
  int64_t rows_per_request(int64_t tokens) const;
  int64_t token_row_padding() const { return row_bytes - token_row_bytes; }
  // Unused bytes of a request's state rows, all of them together.
  int64_t state_padding_per_request() const;
  // Fraction of the bytes of a request of `tokens` tokens that hold no data (row padding and the unused tail of
  // its last token row).
  double padding_fraction(int64_t tokens) const;
};

// Lays out rows for the given layers. Throws Error when the options are inconsistent or the KDA layers differ in
// state size. With block_size 0 the planner tries every power of two in [min_block_size, max_block_size] and
// takes the smallest whose padding for a max_model_len request is within one percentage point of the least:
// smaller blocks give finer prefix-cache hits.
CachePlan plan_cache(const std::vector<LayerCacheSpec>& layers, const CachePlanOptions& opts);

}  // namespace kestrel
