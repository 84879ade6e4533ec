// Multi-head latent attention (MLA), RoPE/YaRN and the DSA lightning indexer: CPU reference.
// See spec dsa_mla.md. C = kv_lora_rank (latent), R = qk_rope_head_dim (key tail), dn = qk_nope_head_dim,
// dv = v_head_dim. A cached token row is [c (C) ; k_pe (R)] = C+R floats.
#pragma once
#include <cstdint>
#include <vector>

namespace kestrel::cpu {

// ---------------- RoPE ----------------
struct YarnParams {
  double factor = 1.0;
  double original_max_position_embeddings = 4096;
  double beta_fast = 32;
  double beta_slow = 1;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
};
// Inverse frequencies f_i = theta^(-2i/dim), i < dim/2, with the YaRN blend when `yarn` is given (dsa_mla.md §1.4).
// Computed in fp64 and rounded to fp32 once.
std::vector<float> rope_inv_freq(int dim, double theta, const YarnParams* yarn);
// YaRN softmax-scale multiplier: mscale(factor, mscale_all_dim) = 0.1*m*ln(factor)+1 (1 if factor <= 1).
double yarn_mscale(double factor, double m);

// Rotate n_vec vectors of length `dim` (stride `stride` floats between vectors) in place at position `pos`.
// Interleaved: pairs (x[2i], x[2i+1]) rotated by pos*f_i (MLA). NeoX: pairs (x[i], x[i+dim/2]) (DSA indexer).
// The angle pos*f_i is computed in fp32 as float(pos) * f_i, then cos/sin in fp32.
void rope_interleaved(float* x, int64_t n_vec, int64_t stride, int dim, int64_t pos, const float* inv_freq);
void rope_neox(float* x, int64_t n_vec, int64_t stride, int dim, int64_t pos, const float* inv_freq);

// ---------------- MLA ----------------
// Absorbed (MQA) attention of one query token over a list of cached rows.
// q_abs: [H, C+R] (absorbed query [W_UK^T q_nope ; q_pe]); kv: cached rows [n_kv, C+R];
// idx: the row numbers to attend to (n_idx of them; entries < 0 or >= n_kv are skipped), or nullptr for all
// rows 0..n_kv-1. Scores s = (q_abs . row) * scale, softmax over the attended rows (max-subtracted, fp32),
// out[h] = sum_t p_t c_t : [H, C]. lse[h] = max + log(sum exp(s - max)), natural log.
// No valid row: out = 0 and lse = -inf (never NaN). Rows are visited in the order given.
// The result depends on the order of idx through fp32 rounding: the fixed-order sums (cpu::sum/cpu::dot) run
// over the attended rows in visiting order, so a permuted idx agrees only to rounding (~1e-6 relative), and idx
// holding every row 0..n_kv-1 in ascending order (invalid entries anywhere) gives bit for bit the idx == nullptr
// result. A row listed twice counts twice.
void mla_attend_absorbed(const float* q_abs, int H, int C, int R, const float* kv, int64_t n_kv,
                         const int32_t* idx, int64_t n_idx, float scale, float* out, float* lse);

// The absorbed query of one token: q: [H, dn+R] ([q_nope | q_pe] per head, q_pe already rotated);
// wkv_b: [H*(dn+dv), C] (per head rows [W_UK (dn) | W_UV (dv)]). q_abs[h] = [W_UK,h^T q_nope,h ; q_pe,h].
void mla_absorb_query(const float* q, const float* wkv_b, int H, int dn, int dv, int C, int R, float* q_abs);
// Un-absorb: o[h] = W_UV,h . obar[h]; obar: [H, C] -> o: [H, dv].
void mla_unabsorb_output(const float* obar, const float* wkv_b, int H, int dn, int dv, int C, float* o);

// Non-absorbed ("MHA mode") attention of one query token, for testing the absorbed form against:
// k_h = [W_UK,h c_t ; k_pe_t], v_h = W_UV,h c_t, s = (q_h . k_h) * scale. Same idx/empty semantics.
// q: [H, dn+R]; kv rows [n_kv, C+R]; out: [H, dv].
void mla_attend_mha(const float* q, const float* wkv_b, int H, int dn, int dv, int C, int R, const float* kv,
                    int64_t n_kv, const int32_t* idx, int64_t n_idx, float scale, float* out, float* lse);

// ---------------- DSA lightning indexer ----------------
// Orthonormal Sylvester-Hadamard transform of n values (n a power of two), scale n^-1/2, in place.
void hadamard_inplace(float* x, int n);

// Indexer score of one query token against S cached keys:
//   I_s = k_scale[s] * sum_{j<Hi} w[j] * ReLU(dot_j,s),   dot_j,s = sum_d e4m3(q_codes[j,d]) * e4m3(k_codes[s,d])
// dot_j,s is computed exactly (as an integer multiple of 2^-18 in int64; every e4m3 value is a multiple of 2^-9)
// and rounded to fp32 once; the head sum runs j = 0..Hi-1 in order in fp32; then one multiply by k_scale.
// w: [Hi] folded weights (weights_proj output * Hi^-1/2 * q_scale_j * D^-1/2). q_codes: [Hi, D]; k_codes: [S, D].
// A NaN code (0x7F/0xFF) makes that head's dot, and so the score, NaN (which topk_indices never selects).
void indexer_scores(const uint8_t* q_codes, const float* w, int Hi, int D, const uint8_t* k_codes,
                    const float* k_scale, int64_t S, float* scores);

// Top-k selection with Kestrel's one tie rule: higher score first, then lower position; -0 ranks as +0;
// -inf candidates are never selected; NaN is treated as -inf. Writes k entries in rank order, padding with -1
// when fewer than k candidates are selectable. Candidates are positions 0..n-1.
void topk_indices(const float* scores, int64_t n, int k, int32_t* out);

}  // namespace kestrel::cpu
