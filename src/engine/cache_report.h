// What `kestrel inspect-cache` prints (spec CACHE.md): per GPU, the cache bytes per token of each format, the
// row layout the planner chooses (B, row size, grouping, padding), the KDA state per request, and how many
// tokens and full-length requests a per-GPU cache budget holds under TP and DCP.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "cache/cache_plan.h"
#include "model/config.h"
#include "model/cache_formats.h"

namespace kestrel {

struct CacheReportOptions {
  LatentCacheDtype latent = LatentCacheDtype::fp8;
  IndexKeyDtype index_keys = IndexKeyDtype::fp8;
  int tp = 1, dcp = 1;
  double cache_gib = 0.0;     // per-GPU cache budget; 0: no capacity table
  int block_size = 0;         // 0: the planner's choice
  int64_t max_model_len = 0;  // 0: the config's context length (ModelConfig::context_length)
};

// Bytes per token per GPU of one cache format, over all attention layers (TP replicates them).
struct FormatBytes {
  std::string name;
  bool defined = true;  // false: the architecture has no such format (NVFP4 latent on deepseek_v32)
  int64_t latent_bytes = 0, index_key_bytes = 0;  // per token per layer
  int64_t token_bytes = 0;                        // per token, every attention layer
};

struct CapacityLine {
  int tp = 1, dcp = 1;
  CachePlan plan;
  int64_t state_bytes_per_request = 0;  // KDA states of one request on one GPU
  int64_t rows = 0;                     // rows of the budget
  int64_t tokens = 0;                   // the longest context one request can have: (rows - state rows) * B * dcp
  int64_t requests = 0;                 // full-length (max_model_len) requests that fit at once
};

struct CacheReport {
  std::string title;
  ModelConfig config;
  CacheReportOptions options;
  int64_t max_model_len = 0;
  std::vector<FormatBytes> formats;  // FP8 latent only, FP8 latent + FP8 keys, NVFP4 latent + MXFP4 keys
  std::vector<CapacityLine> configs; // the selected TP/DCP first, then TP8 and TP8 + DCP8 where they apply
};

CacheReport inspect_cache(const ModelConfig& cfg, const std::string& title, const CacheReportOptions& opts);
std::string format_cache_report(const CacheReport& r);
// 16992 -> "16,992"
std::string with_thousands(int64_t v);

}  // namespace kestrel
