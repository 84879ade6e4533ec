// What a model keeps in the cache per token and per request, by format: the sizes the cache planner lays rows out by
// and every backend reads and writes (the byte layouts themselves: docs/reference-numerics.md, the CPU backend's
// src/cpu/mla_core.cpp and kda_core.cpp, and the CUDA writers).
#pragma once
#include <cstdint>

#include "model/config.h"

namespace kestrel {

// How the MLA latent is kept (--kv-cache-dtype): fp32 values (the CPU's auto), bf16 values (the GPU's auto: the
// model's dtype, as vLLM), Kimi's 576-B / deepseek_v32's 656-B FP8 layouts, or Kimi's 352-B NVFP4 layout. How index
// keys are kept (--index-dtype): FP8 132 B or MXFP4 68 B.
enum class LatentCacheDtype { auto_fp32, bf16, fp8, nvfp4 };
enum class IndexKeyDtype { fp8, mxfp4 };
const char* latent_cache_dtype_name(LatentCacheDtype d);

// Bytes per token of one MLA layer's latent entry and index-key entry (0 for a model without an indexer), and of one
// KDA layer's per-request state when `heads` of its heads live on this GPU. Error for a format the architecture does
// not define.
int64_t latent_entry_bytes(const ModelConfig& cfg, LatentCacheDtype d);
int64_t index_key_entry_bytes(const ModelConfig& cfg, IndexKeyDtype d);
int64_t kda_state_bytes(const ModelConfig& cfg, int heads);

}  // namespace kestrel
