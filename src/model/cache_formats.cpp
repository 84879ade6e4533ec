#include "model/cache_formats.h"

#include "core/error.h"

namespace kestrel {

const char* latent_cache_dtype_name(LatentCacheDtype d) {
  switch (d) {
    case LatentCacheDtype::auto_fp32: return "fp32";
    case LatentCacheDtype::bf16: return "bf16";
    case LatentCacheDtype::fp8: return "fp8";
    case LatentCacheDtype::nvfp4: return "nvfp4";
  }
  return "?";
}

int64_t latent_entry_bytes(const ModelConfig& cfg, LatentCacheDtype d) {
  const int64_t C = cfg.kv_lora_rank, R = cfg.qk_rope_head_dim;
  switch (d) {
    case LatentCacheDtype::auto_fp32:
      return (C + R) * int64_t{sizeof(float)};
    case LatentCacheDtype::bf16:
      return (C + R) * 2;
    case LatentCacheDtype::fp8:
      // deepseek_v32: C e4m3 in tiles of 128, one fp32 scale per tile, the RoPE tail in bf16 (656 B at C = 512).
      // kimi: C + R e4m3 with one scale per layer (576 B).
      if (cfg.arch == Arch::deepseek_v32) {
        KESTREL_CHECK(C % 128 == 0,
                      "--kv-cache-dtype fp8 for deepseek_v32 stores the latent in tiles of 128 values; kv_lora_rank {} "
                      "is not a multiple of 128",
                      C);
        return C + C / 128 * 4 + R * 2;
      }
      return C + R;
    case LatentCacheDtype::nvfp4:
      // C e2m1 values in blocks of 16 with an e4m3 scale each, then the R-value tail in e4m3 (352 B at C = 512).
      KESTREL_CHECK(cfg.arch != Arch::deepseek_v32,
                    "--kv-cache-dtype nvfp4 is defined for kimi_k3 and kimi_linear; deepseek_v32 uses fp8 (656-B "
                    "layout) or auto");
      KESTREL_CHECK(C % 16 == 0, "--kv-cache-dtype nvfp4 needs kv_lora_rank divisible by 16, got {}", C);
      return C / 2 + C / 16 + R;
  }
  fail("unknown latent cache dtype");
}

int64_t index_key_entry_bytes(const ModelConfig& cfg, IndexKeyDtype d) {
  if (!cfg.has_indexer) return 0;
  const int64_t D = cfg.index_head_dim;
  if (d == IndexKeyDtype::fp8) return D + int64_t{sizeof(float)};  // 132 B at D = 128
  KESTREL_CHECK(D % 32 == 0, "--index-dtype mxfp4 needs index_head_dim divisible by 32, got {}", D);
  return D / 2 + D / 32;  // 68 B at D = 128
}

int64_t kda_state_bytes(const ModelConfig& cfg, int heads) {
  const int64_t dk = cfg.kda_head_dim, hist = cfg.short_conv_kernel_size - 1;
  return (int64_t{heads} * dk * dk + 3 * hist * heads * dk) * int64_t{sizeof(float)};
}

}  // namespace kestrel
