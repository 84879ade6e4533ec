#include "cpu/mla_core.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/basic.h"

namespace kestrel {

namespace {
constexpr float kIndexKeyNormEps = 1e-6f;

float inv_sqrt(int n) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))); }

// The page holding position p, and the one a slot points into.
uint8_t* page_of_position(const TokenPages& pg, int64_t p) {
  return pg.base + int64_t{pg.block_table[p / pg.block_size]} * pg.row_bytes;
}
uint8_t* page_of_slot(const TokenPages& pg, int64_t slot) { return pg.base + slot / pg.block_size * pg.row_bytes; }

float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
void store_f32(uint8_t* p, float v) { std::memcpy(p, &v, sizeof v); }
}  // namespace

float mxfp4_key_as_fp8(const uint8_t* packed, const uint8_t* exponents, int D, uint8_t* codes) {
  const int e_max = *std::max_element(exponents, exponents + D / 32);
  for (int i = 0; i < D; ++i) {
    const uint8_t nib = (packed[i / 2] >> (4 * (i % 2))) & 0xF;
    codes[i] = f32_to_e4m3(std::ldexp(e2m1_to_f32(nib), int{exponents[i / 32]} - e_max + 6));
  }
  return std::ldexp(1.0f, e_max - 127 - 6);
}

MlaCore::MlaCore(const ModelConfig& cfg, Tensor kv_b, float kv_scale, std::optional<MlaIndexerWeights> indexer,
                 LatentCacheDtype latent, IndexKeyDtype keys, bool gpu_numerics)
    : cfg_(cfg),
      kv_b_(std::move(kv_b)),
      kv_scale_(kv_scale),
      indexer_(std::move(indexer)),
      latent_(latent),
      keys_(keys),
      gpu_numerics_(gpu_numerics) {
  latent_bytes_ = latent_entry_bytes(cfg, latent);
  if (indexer_) index_key_bytes_ = index_key_entry_bytes(cfg, keys);
  if (cfg.use_rope) inv_freq_ = cpu::rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn ? &*cfg.yarn : nullptr);
}

void MlaCore::write_latent(const float* kv, uint8_t* e) const {
  const int C = cfg_.kv_lora_rank, R = cfg_.qk_rope_head_dim;
  // kimi's FP8 and NVFP4 layouts share one per-layer scale for the e4m3 values (kv_scale, 1 without one).
  auto e4m3_scaled = [&](float v) { return f32_to_e4m3(std::clamp(v / kv_scale_, -kE4m3Max, kE4m3Max)); };
  switch (latent_) {
    case LatentCacheDtype::auto_fp32:
      std::memcpy(e, kv, sizeof(float) * (C + R));
      return;
    case LatentCacheDtype::bf16:
      for (int i = 0; i < C + R; ++i) {
        const uint16_t b = f32_to_bf16(kv[i]);
        std::memcpy(e + 2 * i, &b, 2);
      }
      return;
    case LatentCacheDtype::fp8:
      if (cfg_.arch == Arch::deepseek_v32) {
        for (int t = 0; t < C; t += 128) store_f32(e + C + t / 128 * 4, quantize_fp8_ue8m0(kv + t, 128, e + t));
        for (int i = 0; i < R; ++i) {
          const uint16_t b = f32_to_bf16(kv[C + i]);
          std::memcpy(e + C + C / 128 * 4 + 2 * i, &b, 2);
        }
      } else {
        for (int i = 0; i < C + R; ++i) e[i] = e4m3_scaled(kv[i]);
      }
      return;
    case LatentCacheDtype::nvfp4:
      nvfp4_encode(kv, C, kv_scale_, e, e + C / 2);
      for (int i = 0; i < R; ++i) e[C / 2 + C / 16 + i] = e4m3_scaled(kv[C + i]);
      return;
  }
}

void MlaCore::read_latent(const TokenPages& pg, int64_t n, float* rows) const {
  const int C = cfg_.kv_lora_rank, R = cfg_.qk_rope_head_dim;
  for (int64_t p = 0; p < n; ++p) {
    const uint8_t* e = page_of_position(pg, p) + (p % pg.block_size) * latent_bytes_;
    float* row = rows + p * (C + R);
    switch (latent_) {
      case LatentCacheDtype::auto_fp32:
        std::memcpy(row, e, sizeof(float) * (C + R));
        break;
      case LatentCacheDtype::bf16:
        for (int i = 0; i < C + R; ++i) {
          uint16_t b;
          std::memcpy(&b, e + 2 * i, 2);
          row[i] = bf16_to_f32(b);
        }
        break;
      case LatentCacheDtype::fp8:
        if (cfg_.arch == Arch::deepseek_v32) {
          for (int t = 0; t < C; t += 128) dequantize_fp8(e + t, 128, load_f32(e + C + t / 128 * 4), row + t);
          for (int i = 0; i < R; ++i) {
            uint16_t b;
            std::memcpy(&b, e + C + C / 128 * 4 + 2 * i, 2);
            row[C + i] = bf16_to_f32(b);
          }
        } else {
          for (int i = 0; i < C + R; ++i) row[i] = e4m3_to_f32(e[i]) * kv_scale_;
        }
        break;
      case LatentCacheDtype::nvfp4:
        nvfp4_decode(e, e + C / 2, C, kv_scale_, row);
        for (int i = 0; i < R; ++i) row[C + i] = e4m3_to_f32(e[C / 2 + C / 16 + i]) * kv_scale_;
        break;
    }
  }
}

void MlaCore::write_index_key(const float* k, const TokenPages& pg, int64_t slot) const {
  const int D = cfg_.index_head_dim;
  const int64_t B = pg.block_size, off = slot % B;
  uint8_t* keys = page_of_slot(pg, slot) + B * latent_bytes_;
  if (keys_ == IndexKeyDtype::fp8) {
    store_f32(keys + B * D + off * 4, quantize_fp8_ue8m0(k, D, keys + off * D));
  } else {
    mxfp4_encode(k, D, keys + off * (D / 2), keys + B * (D / 2) + off * (D / 32));
  }
}

void MlaCore::read_index_keys(const TokenPages& pg, int64_t n, uint8_t* codes, float* scales) const {
  const int D = cfg_.index_head_dim;
  const int64_t B = pg.block_size;
  for (int64_t p = 0; p < n; ++p) {
    const int64_t off = p % B;
    const uint8_t* keys = page_of_position(pg, p) + B * latent_bytes_;
    uint8_t* out = codes + p * D;
    if (keys_ == IndexKeyDtype::fp8) {
      std::memcpy(out, keys + off * D, D);
      scales[p] = load_f32(keys + B * D + off * 4);
      continue;
    }
    scales[p] = mxfp4_key_as_fp8(keys + off * (D / 2), keys + B * (D / 2) + off * (D / 32), D, out);
  }
}

std::vector<int32_t> MlaCore::select(const float* x_t, const float* qr_t, int64_t pos, const uint8_t* key_codes,
                                          const float* key_scales) const {
  const MlaIndexerWeights& ix = *indexer_;
  const int Hi = cfg_.index_n_heads, Dh = cfg_.index_head_dim, R = cfg_.qk_rope_head_dim;
  const int64_t q_in = ix.wq_b.dim(1), D = cfg_.hidden_size;
  std::vector<float> q(static_cast<size_t>(Hi) * Dh), wts(Hi);
  cpu::linear(qr_t, ix.wq_b.ptr(), q.data(), 1, q_in, int64_t{Hi} * Dh);
  if (cfg_.use_rope) cpu::rope_neox(q.data(), Hi, Dh, R, pos, inv_freq_.data());
  cpu::linear(x_t, ix.weights_proj.ptr(), wts.data(), 1, D, Hi);
  std::vector<uint8_t> q_codes(q.size());
  const float c_heads = inv_sqrt(Hi), c_dim = inv_sqrt(Dh);
  for (int j = 0; j < Hi; ++j) {
    cpu::hadamard_inplace(q.data() + j * Dh, Dh);
    const float q_scale = quantize_fp8_ue8m0(q.data() + j * Dh, Dh, q_codes.data() + j * Dh);
    wts[j] = wts[j] * c_heads * q_scale * c_dim;
  }
  const int64_t n = pos + 1;
  std::vector<float> scores(n);
  cpu::indexer_scores(q_codes.data(), wts.data(), Hi, Dh, key_codes, key_scales, n, scores.data());
  const int k = static_cast<int>(std::min<int64_t>(cfg_.index_topk, n));
  std::vector<int32_t> idx(k);
  cpu::topk_indices(scores.data(), n, k, idx.data());
  // Attention is order-independent in exact arithmetic; visiting the rows in position order makes a top-k that
  // selects every causal token bit-identical to dense attention.
  std::sort(idx.begin(), idx.end());
  return idx;
}

void MlaCore::read_context(const TokenPages& pages, int64_t n, MlaContext& ctx) const {
  ctx.positions = n;
  ctx.rows.resize(static_cast<size_t>(n) * (cfg_.kv_lora_rank + cfg_.qk_rope_head_dim));
  read_latent(pages, n, ctx.rows.data());
  if (indexer_) {
    ctx.key_codes.resize(static_cast<size_t>(n) * cfg_.index_head_dim);
    ctx.key_scales.resize(n);
    read_index_keys(pages, n, ctx.key_codes.data(), ctx.key_scales.data());
  }
}

void MlaCore::attend(const float* q_t, const float* x_t, const float* qr_t, int64_t pos, const MlaContext& ctx,
                          float* o_t) const {
  const int H = cfg_.num_attention_heads, C = cfg_.kv_lora_rank, R = cfg_.qk_rope_head_dim;
  const int dn = cfg_.qk_nope_head_dim, dv = cfg_.v_head_dim;
  KESTREL_CHECK(pos >= 0 && pos < ctx.positions, "query at position {} outside a context of {} positions", pos,
                ctx.positions);
  std::vector<float> q_abs(static_cast<size_t>(H) * (C + R)), obar(static_cast<size_t>(H) * C), lse(H);
  if (gpu_numerics_) {
    // As the GPU: q_nope enters the absorption in bf16 (q_pe stays fp32).
    std::vector<float> q(q_t, q_t + int64_t{H} * (dn + R));
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < dn; ++d) q[h * (dn + R) + d] = round_to_bf16(q[h * (dn + R) + d]);
    cpu::mla_absorb_query(q.data(), kv_b_.ptr(), H, dn, dv, C, R, q_abs.data());
  } else {
    cpu::mla_absorb_query(q_t, kv_b_.ptr(), H, dn, dv, C, R, q_abs.data());
  }
  const float scale = cfg_.softmax_scale();
  if (indexer_) {
    const std::vector<int32_t> idx =
        select(x_t, cfg_.q_lora_rank ? qr_t : x_t, pos, ctx.key_codes.data(), ctx.key_scales.data());
    cpu::mla_attend_absorbed(q_abs.data(), H, C, R, ctx.rows.data(), pos + 1, idx.data(),
                             static_cast<int64_t>(idx.size()), scale, obar.data(), lse.data());
  } else {
    cpu::mla_attend_absorbed(q_abs.data(), H, C, R, ctx.rows.data(), pos + 1, nullptr, 0, scale, obar.data(),
                             lse.data());
  }
  if (gpu_numerics_)
    for (float& v : obar) v = round_to_bf16(v);
  cpu::mla_unabsorb_output(obar.data(), kv_b_.ptr(), H, dn, dv, C, o_t);
}

void MlaCore::write_cache(const float* x, const float* kv, int64_t T, const TokenPages& pages) const {
  const int64_t C = cfg_.kv_lora_rank, R = cfg_.qk_rope_head_dim, B = pages.block_size, D = cfg_.hidden_size;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = pages.slots[t];
    write_latent(kv + t * (C + R), page_of_slot(pages, slot) + slot % B * latent_bytes_);
  }
  if (!indexer_) return;
  const int Dh = cfg_.index_head_dim;
  std::vector<float> k(static_cast<size_t>(T) * Dh);
  cpu::linear(x, indexer_->wk.ptr(), k.data(), T, D, Dh);
  cpu::layer_norm(k.data(), indexer_->k_norm_w.ptr(), indexer_->k_norm_b.ptr(), k.data(), T, Dh, kIndexKeyNormEps);
  for (int64_t t = 0; t < T; ++t) {
    float* kt = k.data() + t * Dh;
    if (cfg_.use_rope) cpu::rope_neox(kt, 1, Dh, static_cast<int>(R), pages.pos0 + t, inv_freq_.data());
    cpu::hadamard_inplace(kt, Dh);
    write_index_key(kt, pages, pages.slots[t]);
  }
}

void MlaCore::forward(const float* x, const float* qr, const float* q, const float* kv, int64_t T,
                      const TokenPages& pages, float* o) const {
  const int H = cfg_.num_attention_heads, dq = cfg_.qk_head_dim(), dv = cfg_.v_head_dim;
  const int64_t D = cfg_.hidden_size, qlr = cfg_.q_lora_rank;
  // Write the new tokens' entries before attending: a token attends to itself.
  write_cache(x, kv, T, pages);
  // The reference reads back decoded values: every cached position once per call.
  MlaContext ctx;
  read_context(pages, pages.pos0 + T, ctx);
#pragma omp parallel for schedule(dynamic)
  for (int64_t t = 0; t < T; ++t)
    attend(q + t * H * dq, x + t * D, qr ? qr + t * qlr : nullptr, pages.pos0 + t, ctx, o + t * H * dv);
}

}  // namespace kestrel
