#include "model/layers.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/formats.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/basic.h"
#include "kernels/cpu/kda.h"
#include "model/weights.h"

namespace kestrel {

namespace {
constexpr float kLatentNormEps = 1e-6f;  // q_a_layernorm and kv_a_layernorm in every architecture (MODEL.md)
constexpr float kIndexKeyNormEps = 1e-6f;
constexpr float kL2NormEps = 1e-6f;

// keep_fp8 = false for the linears the GPU engine does not run as bf16 GEMMs (the DSA indexer's are fp32).
Linear load_linear(WeightLoader& w, const std::string& prefix, int64_t out, int64_t in, bool keep_fp8 = true) {
  Linear l;
  l.bf16_inputs = w.bf16_inputs;
  l.w = w.linear(prefix, out, in, keep_fp8 && w.keep_fp8 ? &l.fp8 : nullptr);
  return l;
}

// x rounded to bf16 (ModelOptions::bf16_activations).
std::vector<float> bf16_copy(const float* x, int64_t n) {
  std::vector<float> r(x, x + n);
  for (float& v : r) v = round_to_bf16(v);
  return r;
}

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

int64_t latent_entry_bytes(const ModelConfig& cfg, LatentCacheDtype d) {
  const int64_t C = cfg.kv_lora_rank, R = cfg.qk_rope_head_dim;
  switch (d) {
    case LatentCacheDtype::auto_fp32:
      return (C + R) * int64_t{sizeof(float)};
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

float mxfp4_key_as_fp8(const uint8_t* packed, const uint8_t* exponents, int D, uint8_t* codes) {
  const int e_max = *std::max_element(exponents, exponents + D / 32);
  for (int i = 0; i < D; ++i) {
    const uint8_t nib = (packed[i / 2] >> (4 * (i % 2))) & 0xF;
    codes[i] = f32_to_e4m3(std::ldexp(e2m1_to_f32(nib), int{exponents[i / 32]} - e_max + 6));
  }
  return std::ldexp(1.0f, e_max - 127 - 6);
}

KdaStateView kda_state_view(const ModelConfig& cfg, uint8_t* at) {
  const int64_t H = cfg.kda_num_heads, dk = cfg.kda_head_dim, hist = (cfg.short_conv_kernel_size - 1) * H * dk;
  KdaStateView v;
  v.state = reinterpret_cast<float*>(at);
  v.conv_q = v.state + H * dk * dk;
  v.conv_k = v.conv_q + hist;
  v.conv_v = v.conv_k + hist;
  return v;
}

void Linear::operator()(const float* x, int64_t T, float* y) const {
  if (!bf16_inputs) {
    cpu::linear(x, w.ptr(), y, T, in(), out());
    return;
  }
  const std::vector<float> xr = bf16_copy(x, T * in());
  cpu::linear(xr.data(), w.ptr(), y, T, in(), out());
}

// ---------------------------------------------------------------- MLA + indexer

MlaAttention::MlaAttention(const ModelConfig& cfg, WeightLoader& w, const std::string& p, LatentCacheDtype latent,
                           IndexKeyDtype keys)
    : cfg_(cfg), bf16_(w.bf16_inputs), latent_(latent), keys_(keys) {
  const int64_t D = cfg.hidden_size, H = cfg.num_attention_heads, C = cfg.kv_lora_rank, R = cfg.qk_rope_head_dim;
  const int64_t qdim = H * cfg.qk_head_dim();
  if (cfg.q_lora_rank) {
    q_a_ = load_linear(w, p + "q_a_proj", cfg.q_lora_rank, D);
    q_a_norm_ = w.get(p + "q_a_layernorm.weight", {cfg.q_lora_rank});
    q_b_ = load_linear(w, p + "q_b_proj", qdim, cfg.q_lora_rank);
  } else {
    q_proj_ = load_linear(w, p + "q_proj", qdim, D);
  }
  kv_a_ = load_linear(w, p + "kv_a_proj_with_mqa", C + R, D);
  kv_a_norm_ = w.get(p + "kv_a_layernorm.weight", {C});
  kv_b_ = w.linear(p + "kv_b_proj", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), C);
  o_proj_ = load_linear(w, p + "o_proj", D, H * cfg.v_head_dim);
  if (w.has(p + "kv_scale")) kv_scale_ = w.get(p + "kv_scale", {}).data[0];
  latent_bytes_ = latent_entry_bytes(cfg, latent);
  if (cfg.has_indexer) {
    Indexer ix;
    ix.n_heads = cfg.index_n_heads;
    ix.head_dim = cfg.index_head_dim;
    const int64_t qin = cfg.q_lora_rank ? cfg.q_lora_rank : D;
    ix.wq_b = load_linear(w, p + "indexer.wq_b", int64_t{ix.n_heads} * ix.head_dim, qin, false);
    ix.wk = load_linear(w, p + "indexer.wk", ix.head_dim, D, false);
    ix.k_norm_w = w.get(p + "indexer.k_norm.weight", {ix.head_dim});
    ix.k_norm_b = w.get(p + "indexer.k_norm.bias", {ix.head_dim});
    ix.weights_proj = load_linear(w, p + "indexer.weights_proj", ix.n_heads, D, false);
    // The indexer's products stay fp32 in every mode: they feed FP8 quantisation and a top-k (the GPU does them in
    // fp32 too).
    ix.wq_b.bf16_inputs = ix.wk.bf16_inputs = ix.weights_proj.bf16_inputs = false;
    indexer_ = std::move(ix);
    index_key_bytes_ = index_key_entry_bytes(cfg, keys_);
  }
  if (cfg.use_rope) {
    inv_freq_ = cpu::rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn ? &*cfg.yarn : nullptr);
  }
}

void MlaAttention::write_latent(const float* kv, uint8_t* e) const {
  const int C = cfg_.kv_lora_rank, R = cfg_.qk_rope_head_dim;
  // kimi's FP8 and NVFP4 layouts share one per-layer scale for the e4m3 values (kv_scale, 1 without one).
  auto e4m3_scaled = [&](float v) { return f32_to_e4m3(std::clamp(v / kv_scale_, -kE4m3Max, kE4m3Max)); };
  switch (latent_) {
    case LatentCacheDtype::auto_fp32:
      std::memcpy(e, kv, sizeof(float) * (C + R));
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

void MlaAttention::read_latent(const TokenPages& pg, int64_t n, float* rows) const {
  const int C = cfg_.kv_lora_rank, R = cfg_.qk_rope_head_dim;
  for (int64_t p = 0; p < n; ++p) {
    const uint8_t* e = page_of_position(pg, p) + (p % pg.block_size) * latent_bytes_;
    float* row = rows + p * (C + R);
    switch (latent_) {
      case LatentCacheDtype::auto_fp32:
        std::memcpy(row, e, sizeof(float) * (C + R));
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

void MlaAttention::write_index_key(const float* k, const TokenPages& pg, int64_t slot) const {
  const int D = indexer_->head_dim;
  const int64_t B = pg.block_size, off = slot % B;
  uint8_t* keys = page_of_slot(pg, slot) + B * latent_bytes_;
  if (keys_ == IndexKeyDtype::fp8) {
    store_f32(keys + B * D + off * 4, quantize_fp8_ue8m0(k, D, keys + off * D));
  } else {
    mxfp4_encode(k, D, keys + off * (D / 2), keys + B * (D / 2) + off * (D / 32));
  }
}

void MlaAttention::read_index_keys(const TokenPages& pg, int64_t n, uint8_t* codes, float* scales) const {
  const int D = indexer_->head_dim;
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

std::vector<int32_t> MlaAttention::select(const float* x_t, const float* qr_t, int64_t pos, const uint8_t* key_codes,
                                          const float* key_scales) const {
  const Indexer& ix = *indexer_;
  const int Hi = ix.n_heads, Dh = ix.head_dim, R = cfg_.qk_rope_head_dim;
  std::vector<float> q(static_cast<size_t>(Hi) * Dh), wts(Hi);
  ix.wq_b(qr_t, 1, q.data());
  if (cfg_.use_rope) cpu::rope_neox(q.data(), Hi, Dh, R, pos, inv_freq_.data());
  ix.weights_proj(x_t, 1, wts.data());
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

void MlaAttention::write_cache(const float* x, int64_t T, const TokenPages& pages) const {
  const int C = cfg_.kv_lora_rank, R = cfg_.qk_rope_head_dim;
  const int64_t pos0 = pages.pos0, B = pages.block_size;
  std::vector<float> kv(static_cast<size_t>(T) * (C + R));
  kv_a_(x, T, kv.data());
  for (int64_t t = 0; t < T; ++t) {
    float* row = kv.data() + t * (C + R);
    cpu::rms_norm(row, kv_a_norm_.ptr(), row, 1, C, kLatentNormEps);
    if (cfg_.use_rope) cpu::rope_interleaved(row + C, 1, R, R, pos0 + t, inv_freq_.data());
    const int64_t slot = pages.slots[t];
    write_latent(row, page_of_slot(pages, slot) + slot % B * latent_bytes_);
  }
  if (indexer_) {
    const int Dh = indexer_->head_dim;
    std::vector<float> k(static_cast<size_t>(T) * Dh);
    indexer_->wk(x, T, k.data());
    cpu::layer_norm(k.data(), indexer_->k_norm_w.ptr(), indexer_->k_norm_b.ptr(), k.data(), T, Dh, kIndexKeyNormEps);
    for (int64_t t = 0; t < T; ++t) {
      float* kt = k.data() + t * Dh;
      if (cfg_.use_rope) cpu::rope_neox(kt, 1, Dh, R, pos0 + t, inv_freq_.data());
      cpu::hadamard_inplace(kt, Dh);
      write_index_key(kt, pages, pages.slots[t]);
    }
  }
}

void MlaAttention::project_queries(const float* x, int64_t T, int64_t pos0, int head_begin, int head_end, float* q,
                                   float* qr) const {
  const int H = cfg_.num_attention_heads, dq = cfg_.qk_head_dim(), R = cfg_.qk_rope_head_dim;
  KESTREL_CHECK(0 <= head_begin && head_begin <= head_end && head_end <= H, "heads [{}, {}) of an MLA layer of {}",
                head_begin, head_end, H);
  const int heads = head_end - head_begin;
  // The query weights of heads [head_begin, head_end) are consecutive rows of q_b_proj (or q_proj).
  const int64_t first_row = int64_t{head_begin} * dq, rows = int64_t{heads} * dq;
  if (q_a_) {
    std::vector<float> qa(static_cast<size_t>(T) * cfg_.q_lora_rank);
    (*q_a_)(x, T, qa.data());
    cpu::rms_norm(qa.data(), q_a_norm_.ptr(), qr, T, cfg_.q_lora_rank, kLatentNormEps);
    const std::vector<float> qr_in = bf16_ ? bf16_copy(qr, T * q_b_->in()) : std::vector<float>(qr, qr + T * q_b_->in());
    cpu::linear(qr_in.data(), q_b_->w.ptr() + first_row * q_b_->in(), q, T, q_b_->in(), rows);
  } else {
    const std::vector<float> x_in = bf16_ ? bf16_copy(x, T * q_proj_->in()) : std::vector<float>(x, x + T * q_proj_->in());
    cpu::linear(x_in.data(), q_proj_->w.ptr() + first_row * q_proj_->in(), q, T, q_proj_->in(), rows);
  }
  if (cfg_.use_rope)
    for (int64_t t = 0; t < T; ++t)
      cpu::rope_interleaved(q + t * rows + cfg_.qk_nope_head_dim, heads, dq, R, pos0 + t, inv_freq_.data());
}

void MlaAttention::read_context(const TokenPages& pages, int64_t n, MlaContext& ctx) const {
  ctx.positions = n;
  ctx.rows.resize(static_cast<size_t>(n) * (cfg_.kv_lora_rank + cfg_.qk_rope_head_dim));
  read_latent(pages, n, ctx.rows.data());
  if (indexer_) {
    ctx.key_codes.resize(static_cast<size_t>(n) * indexer_->head_dim);
    ctx.key_scales.resize(n);
    read_index_keys(pages, n, ctx.key_codes.data(), ctx.key_scales.data());
  }
}

void MlaAttention::attend(const float* q_t, const float* x_t, const float* qr_t, int64_t pos, const MlaContext& ctx,
                          float* o_t) const {
  const int H = cfg_.num_attention_heads, C = cfg_.kv_lora_rank, R = cfg_.qk_rope_head_dim;
  const int dn = cfg_.qk_nope_head_dim, dv = cfg_.v_head_dim;
  KESTREL_CHECK(pos >= 0 && pos < ctx.positions, "query at position {} outside a context of {} positions", pos,
                ctx.positions);
  std::vector<float> q_abs(static_cast<size_t>(H) * (C + R)), obar(static_cast<size_t>(H) * C), lse(H);
  if (bf16_) {
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
        select(x_t, q_a_ ? qr_t : x_t, pos, ctx.key_codes.data(), ctx.key_scales.data());
    cpu::mla_attend_absorbed(q_abs.data(), H, C, R, ctx.rows.data(), pos + 1, idx.data(),
                             static_cast<int64_t>(idx.size()), scale, obar.data(), lse.data());
  } else {
    cpu::mla_attend_absorbed(q_abs.data(), H, C, R, ctx.rows.data(), pos + 1, nullptr, 0, scale, obar.data(),
                             lse.data());
  }
  if (bf16_)
    for (float& v : obar) v = round_to_bf16(v);
  cpu::mla_unabsorb_output(obar.data(), kv_b_.ptr(), H, dn, dv, C, o_t);
}

void MlaAttention::project_output(const float* o, int64_t T, int head_begin, int head_end, float* y) const {
  const int H = cfg_.num_attention_heads, dv = cfg_.v_head_dim;
  KESTREL_CHECK(0 <= head_begin && head_begin <= head_end && head_end <= H, "heads [{}, {}) of an MLA layer of {}",
                head_begin, head_end, H);
  if (head_begin == 0 && head_end == H) {
    o_proj_(o, T, y);
    return;
  }
  // The columns of the heads, as a [hidden, heads * dv] weight of their own.
  const int64_t D = o_proj_.out(), in = o_proj_.in(), first = int64_t{head_begin} * dv;
  const int64_t cols = int64_t{head_end - head_begin} * dv;
  std::vector<float> w(static_cast<size_t>(D * cols));
  for (int64_t r = 0; r < D; ++r) std::copy_n(o_proj_.w.ptr() + r * in + first, cols, w.data() + r * cols);
  cpu::linear(o, w.data(), y, T, cols, D);
}

void MlaAttention::forward(const float* x, int64_t T, const TokenPages& pages, float* y) const {
  const int H = cfg_.num_attention_heads, dq = cfg_.qk_head_dim(), dv = cfg_.v_head_dim;
  const int64_t D = cfg_.hidden_size, qlr = cfg_.q_lora_rank;
  // Write the new tokens' entries before attending: a token attends to itself.
  write_cache(x, T, pages);
  std::vector<float> q(static_cast<size_t>(T) * H * dq), qr(static_cast<size_t>(T) * qlr);
  project_queries(x, T, pages.pos0, 0, H, q.data(), qr.data());
  // The reference reads back decoded values: every cached position once per call.
  MlaContext ctx;
  read_context(pages, pages.pos0 + T, ctx);
  std::vector<float> o(static_cast<size_t>(T) * H * dv);
#pragma omp parallel for schedule(dynamic)
  for (int64_t t = 0; t < T; ++t)
    attend(q.data() + t * H * dq, x + t * D, qr.data() + t * qlr, pages.pos0 + t, ctx, o.data() + t * H * dv);
  project_output(o.data(), T, 0, H, y);
}

// ---------------------------------------------------------------- KDA

KdaMixer::KdaMixer(const ModelConfig& cfg, WeightLoader& w, const std::string& p) : cfg_(cfg) {
  const int64_t D = cfg.hidden_size, H = cfg.kda_num_heads, dk = cfg.kda_head_dim, P = H * dk;
  const int64_t Wc = cfg.short_conv_kernel_size;
  q_ = load_linear(w, p + "q_proj", P, D);
  k_ = load_linear(w, p + "k_proj", P, D);
  v_ = load_linear(w, p + "v_proj", P, D);
  conv_q_ = w.get(p + "q_conv1d.weight", {P, 1, Wc});
  conv_k_ = w.get(p + "k_conv1d.weight", {P, 1, Wc});
  conv_v_ = w.get(p + "v_conv1d.weight", {P, 1, Wc});
  // The gate and output-gate bottlenecks have rank head_dim (128 in the released checkpoints).
  f_a_ = load_linear(w, p + "f_a_proj", dk, D);
  f_b_ = load_linear(w, p + "f_b_proj", P, dk);
  dt_bias_ = w.get(p + "dt_bias", {P});
  A_log_ = w.get(p + "A_log", {1, 1, H, 1});
  b_ = load_linear(w, p + "b_proj", H, D);
  g_a_ = load_linear(w, p + "g_a_proj", dk, D);
  g_b_ = load_linear(w, p + "g_b_proj", P, dk);
  o_norm_ = w.get(p + "o_norm.weight", {dk});
  o_ = load_linear(w, p + "o_proj", D, P);
}

void KdaMixer::forward(const float* x, int64_t T, int64_t pos0, const KdaStateView& st, bool chunked,
                       std::span<const KdaCheckpoint> checkpoints, int64_t checkpoint_every, float* y) const {
  const int H = cfg_.kda_num_heads, dk = cfg_.kda_head_dim, Wc = cfg_.short_conv_kernel_size;
  const int64_t P = int64_t{H} * dk, n = T * P, state_size = P * dk;
  for (size_t c = 0; c < checkpoints.size(); ++c)
    KESTREL_CHECK(checkpoints[c].position > pos0 && checkpoints[c].position <= pos0 + T &&
                      (c == 0 || checkpoints[c].position > checkpoints[c - 1].position),
                  "KDA checkpoint at {} is not inside the step ({}, {}] in ascending order", checkpoints[c].position,
                  pos0, pos0 + T);

  // Each projection goes through its short conv; a checkpoint keeps the W-1 raw inputs before its position, taken
  // from the history at the start of the step and this step's inputs.
  std::vector<float> raw(n), q(n), k(n), v(n);
  auto project_and_convolve = [&](const Linear& proj, const Tensor& w, float* hist, float* KdaStateView::*conv,
                                  float* out) {
    proj(x, T, raw.data());
    for (const KdaCheckpoint& c : checkpoints)
      for (int i = 0; i < Wc - 1; ++i) {
        const int64_t rel = c.position - (Wc - 1) + i - pos0;
        const float* src = rel >= 0 ? raw.data() + rel * P : hist + (rel + Wc - 1) * P;
        std::copy_n(src, P, c.dst.*conv + i * P);
      }
    cpu::short_conv_silu(raw.data(), T, P, w.ptr(), Wc, hist, out);
  };
  project_and_convolve(q_, conv_q_, st.conv_q, &KdaStateView::conv_q, q.data());
  project_and_convolve(k_, conv_k_, st.conv_k, &KdaStateView::conv_k, k.data());
  project_and_convolve(v_, conv_v_, st.conv_v, &KdaStateView::conv_v, v.data());
  cpu::l2_normalize_rows(q.data(), T * H, dk, kL2NormEps);
  cpu::l2_normalize_rows(k.data(), T * H, dk, kL2NormEps);

  std::vector<float> low(static_cast<size_t>(T) * dk), g(n), beta(static_cast<size_t>(T) * H);
  f_a_(x, T, low.data());
  f_b_(low.data(), T, raw.data());
  cpu::kda_gate(raw.data(), T, H, dk, A_log_.ptr(), dt_bias_.ptr(), cfg_.kda_gate_lower_bound, g.data());
  b_(x, T, beta.data());
  for (float& b : beta) b = cpu::sigmoid(b);

  std::vector<float> o(n);
  const float scale = inv_sqrt(dk);
  if (chunked && checkpoints.empty()) {
    cpu::kda_chunked(q.data(), k.data(), v.data(), g.data(), beta.data(), T, H, dk, dk, scale, st.state, o.data(),
                     pos0);
  } else if (chunked) {
    // The chunked kernel copies the state at every multiple of checkpoint_every; the wanted ones are kept.
    const int64_t first = pos0 / checkpoint_every, count = (pos0 + T) / checkpoint_every - first;
    std::vector<float> states(static_cast<size_t>(count * state_size));
    cpu::kda_chunked(q.data(), k.data(), v.data(), g.data(), beta.data(), T, H, dk, dk, scale, st.state, o.data(),
                     pos0, 64, states.data(), checkpoint_every);
    for (const KdaCheckpoint& c : checkpoints) {
      KESTREL_CHECK(c.position % checkpoint_every == 0, "KDA checkpoint at {} is not a multiple of {}", c.position,
                    checkpoint_every);
      std::copy_n(states.data() + (c.position / checkpoint_every - first - 1) * state_size, state_size, c.dst.state);
    }
  } else {
    // The recurrence is token by token, so cutting it at the checkpoints changes nothing.
    int64_t t = 0;
    auto run = [&](int64_t len) {
      cpu::kda_recurrent(q.data() + t * P, k.data() + t * P, v.data() + t * P, g.data() + t * P,
                         beta.data() + t * H, len, H, dk, dk, scale, st.state, o.data() + t * P);
      t += len;
    };
    for (const KdaCheckpoint& c : checkpoints) {
      run(c.position - pos0 - t);
      std::copy_n(st.state, state_size, c.dst.state);
    }
    run(T - t);
  }

  g_a_(x, T, low.data());
  g_b_(low.data(), T, raw.data());
  cpu::kda_gated_rmsnorm(o.data(), raw.data(), o_norm_.ptr(), T, H, dk, cfg_.rms_norm_eps, q.data());
  o_(q.data(), T, y);
}

// ---------------------------------------------------------------- FFN

void FeedForward::forward(const float* x, int64_t T, float* y) const {
  const int64_t F = gate.out();
  std::vector<float> g(static_cast<size_t>(T) * F), u(g.size());
  gate(x, T, g.data());
  up(x, T, u.data());
  cpu::swiglu(g.data(), u.data(), g.data(), static_cast<int64_t>(g.size()));
  down(g.data(), T, y);
}

FeedForward load_ffn(WeightLoader& w, const std::string& p, const char* const names[3], int64_t hidden,
                     int64_t width, bool keep_fp8) {
  return FeedForward{load_linear(w, p + names[0], width, hidden, keep_fp8),
                     load_linear(w, p + names[1], width, hidden, keep_fp8),
                     load_linear(w, p + names[2], hidden, width, keep_fp8)};
}

MoE::MoE(const ModelConfig& cfg, WeightLoader& w, const std::string& p, const char* const expert_names[3]) {
  const int64_t D = cfg.hidden_size, E = cfg.n_routed_experts;
  routing_ = cpu::MoeRouting{cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group,
                             cfg.topk_group,       cfg.norm_topk_prob,      cfg.routed_scaling_factor};
  router_ = w.get(p + "gate.weight", {E, D});
  if (w.has(p + "gate.e_score_correction_bias")) bias_ = w.get(p + "gate.e_score_correction_bias", {E});
  experts_.reserve(E);
  for (int64_t e = 0; e < E; ++e)
    experts_.push_back(
        load_ffn(w, p + "experts." + std::to_string(e) + ".", expert_names, D, cfg.moe_intermediate_size, false));
  if (cfg.n_shared_experts > 0) {
    static const char* const kSharedNames[3] = {"gate_proj", "up_proj", "down_proj"};
    shared_ = load_ffn(w, p + "shared_experts.", kSharedNames, D, cfg.moe_intermediate_size * cfg.n_shared_experts);
  }
}

void MoE::forward(const float* x, int64_t T, float* y) const {
  const int64_t D = router_.dim(1);
  const int E = routing_.n_experts, K = routing_.top_k;
  std::vector<float> logits(static_cast<size_t>(T) * E), weights(static_cast<size_t>(T) * K);
  std::vector<int32_t> ids(static_cast<size_t>(T) * K);
  cpu::linear(x, router_.ptr(), logits.data(), T, D, E);
  for (int64_t t = 0; t < T; ++t)
    cpu::moe_route(logits.data() + t * E, bias_.empty() ? nullptr : bias_.ptr(), routing_, ids.data() + t * K,
                   weights.data() + t * K);

  // Run each expert once over the tokens routed to it; keep every (token, slot) output separately so that each
  // token sums its experts in its own rank order, independent of the batch.
  std::vector<float> slot_out(static_cast<size_t>(T) * K * D);
  for (int e = 0; e < E; ++e) {
    std::vector<int64_t> slots;
    for (int64_t i = 0; i < T * K; ++i)
      if (ids[i] == e) slots.push_back(i);
    if (slots.empty()) continue;
    const int64_t M = static_cast<int64_t>(slots.size());
    std::vector<float> xin(static_cast<size_t>(M) * D), out(static_cast<size_t>(M) * D);
    for (int64_t m = 0; m < M; ++m) std::copy_n(x + (slots[m] / K) * D, D, xin.data() + m * D);
    experts_[e].forward(xin.data(), M, out.data());
    for (int64_t m = 0; m < M; ++m) std::copy_n(out.data() + m * D, D, slot_out.data() + slots[m] * D);
  }
  std::vector<float> shared;
  if (shared_) {
    shared.resize(static_cast<size_t>(T) * D);
    shared_->forward(x, T, shared.data());
  }
  for (int64_t t = 0; t < T; ++t) {
    float* yt = y + t * D;
    std::fill_n(yt, D, 0.0f);
    for (int s = 0; s < K; ++s) {
      const float wgt = weights[t * K + s];
      const float* o = slot_out.data() + (t * K + s) * D;
      for (int64_t i = 0; i < D; ++i) yt[i] += wgt * o[i];
    }
    if (shared_)
      for (int64_t i = 0; i < D; ++i) yt[i] += shared[t * D + i];
  }
}

}  // namespace kestrel
