#include "kernels/cpu/kda.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/basic.h"

namespace kestrel::cpu {

namespace {

// Both forms keep the state of one head transposed, ST[dv][dk], while they work on it: every reduction of the
// recurrence runs over the key index, and this layout makes those reductions contiguous for cpu::dot.
void load_transposed(const float* s, int dk, int dv, float* st) {
  for (int d = 0; d < dk; ++d)
    for (int j = 0; j < dv; ++j) st[static_cast<int64_t>(j) * dk + d] = s[static_cast<int64_t>(d) * dv + j];
}

void store_transposed(const float* st, int dk, int dv, float* s) {
  for (int d = 0; d < dk; ++d)
    for (int j = 0; j < dv; ++j) s[static_cast<int64_t>(d) * dv + j] = st[static_cast<int64_t>(j) * dk + d];
}

void check_dims(const char* fn, int64_t T, int H, int dk, int dv) {
  KESTREL_CHECK(T >= 0 && H > 0 && dk > 0 && dv > 0, "{}: invalid sizes T={} H={} dk={} dv={}", fn, T, H, dk, dv);
}

// Scratch of the chunked form for one head, sized for a full chunk of n_max rows.
struct ChunkScratch {
  std::vector<float> G, Qg, L, A, T, TT, bKgT, bVT, W, U, KdT, VpT, decay_end, tmp;
  ChunkScratch(int n_max, int dk, int dv) {
    const size_t n = static_cast<size_t>(n_max), k = static_cast<size_t>(dk), v = static_cast<size_t>(dv);
    G.resize(n * k);
    Qg.resize(n * k);
    L.resize(n * n);
    A.resize(n * n);
    T.resize(n * n);
    TT.resize(n * n);
    bKgT.resize(k * n);
    bVT.resize(v * n);
    W.resize(n * k);
    U.resize(n * v);
    KdT.resize(k * n);
    VpT.resize(v * n);
    decay_end.resize(k);
    tmp.resize(k);
  }
};

// One chunk of n tokens of head h, starting at token t0 of the call. st: the head's transposed state [dv][dk],
// advanced over the chunk. Every array below is laid out so that each reduction is a contiguous cpu::dot.
//
// Only exp of non-positive numbers is evaluated. The caller checked g <= 0, so the running sum G (fp32 addition
// of a non-positive number can only round down or stay) is non-increasing in r and <= 0. Hence G_r <= 0,
// G_r - G_s <= 0 for s <= r (fp32 subtraction of a larger-or-equal number rounds to <= 0), and G_end - G_r <= 0.
// exp(-G) alone, which overflows for strongly decaying channels, never appears.
void kda_chunk_head(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t t0,
                    int n, int H, int h, int dk, int dv, float scale, float* st, float* o, ChunkScratch& s) {
  // 64-bit copies of the sizes, so that every index below is computed in int64_t.
  const int64_t N = n, K = dk, V = dv;
  const int64_t qk_stride = H * K, v_stride = H * V;
  auto q_row = [&](int64_t r) { return q + (t0 + r) * qk_stride + h * K; };
  auto k_row = [&](int64_t r) { return k + (t0 + r) * qk_stride + h * K; };
  auto g_row = [&](int64_t r) { return g + (t0 + r) * qk_stride + h * K; };
  auto v_row = [&](int64_t r) { return v + (t0 + r) * v_stride + h * V; };
  auto beta_of = [&](int64_t r) { return beta[(t0 + r) * H + h]; };
  float* G = s.G.data();

  // Chunk-local inclusive cumulative log gate, summed in token order.
  for (int64_t d = 0; d < K; ++d) G[d] = g_row(0)[d];
  for (int64_t r = 1; r < N; ++r)
    for (int64_t d = 0; d < K; ++d) G[r * K + d] = G[(r - 1) * K + d] + g_row(r)[d];
  const float* G_end = G + (N - 1) * K;

  for (int64_t r = 0; r < N; ++r) {
    const float* Gr = G + r * K;
    const float* kr = k_row(r);
    const float* qr = q_row(r);
    const float br = beta_of(r);
    for (int64_t d = 0; d < K; ++d) {
      s.Qg[r * K + d] = qr[d] * std::exp(Gr[d]);
      s.bKgT[d * N + r] = br * (kr[d] * std::exp(Gr[d]));
      s.KdT[d * N + r] = kr[d] * std::exp(G_end[d] - Gr[d]);
    }
    const float* vr = v_row(r);
    for (int64_t j = 0; j < V; ++j) s.bVT[j * N + r] = br * vr[j];
  }
  for (int64_t d = 0; d < K; ++d) s.decay_end[d] = std::exp(G_end[d]);

  // L (strictly lower, with beta_r) and A_qk (lower with the diagonal, with scale) share the decayed key
  // k_c * exp(G_r - G_c), which has to be formed per (r, c) pair: no single reference point keeps both
  // exp(G_r - ref) and exp(ref - G_c) non-positive in the exponent for every pair.
  for (int64_t r = 0; r < N; ++r) {
    const float* Gr = G + r * K;
    const float* kr = k_row(r);
    const float* qr = q_row(r);
    const float br = beta_of(r);
    for (int64_t c = 0; c <= r; ++c) {
      const float* Gc = G + c * K;
      const float* kc = k_row(c);
      for (int64_t d = 0; d < K; ++d) s.tmp[d] = kc[d] * std::exp(Gr[d] - Gc[d]);
      if (c < r) s.L[r * N + c] = br * dot(kr, s.tmp.data(), K);
      s.A[r * N + c] = scale * dot(qr, s.tmp.data(), K);
    }
  }

  // T = (I + L)^-1 by forward substitution, row by row: T[r][c] = -sum_{c<=x<r} L[r][x] T[x][c].
  // TT (= T transposed) makes that sum contiguous; T itself is kept row-major for W and U.
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t c = 0; c < r; ++c) {
      const float t_rc = -dot(s.L.data() + r * N + c, s.TT.data() + c * N + c, r - c);
      s.T[r * N + c] = t_rc;
      s.TT[c * N + r] = t_rc;
    }
    s.T[r * N + r] = 1.0f;
    s.TT[r * N + r] = 1.0f;
  }

  // W = T diag(beta) (exp(G) ⊙ K), U = T diag(beta) V; T is lower, so row r only needs columns 0..r.
  for (int64_t r = 0; r < N; ++r) {
    const float* Tr = s.T.data() + r * N;
    for (int64_t d = 0; d < K; ++d) s.W[r * K + d] = dot(Tr, s.bKgT.data() + d * N, r + 1);
    for (int64_t j = 0; j < V; ++j) s.U[r * V + j] = dot(Tr, s.bVT.data() + j * N, r + 1);
  }

  // V' = U - W S, against the state at the start of the chunk.
  for (int64_t r = 0; r < N; ++r)
    for (int64_t j = 0; j < V; ++j) s.VpT[j * N + r] = s.U[r * V + j] - dot(s.W.data() + r * K, st + j * K, K);

  // O = scale (exp(G) ⊙ Q) S + A_qk V', also against the state at the start of the chunk.
  for (int64_t r = 0; r < N; ++r) {
    float* orow = o + (t0 + r) * v_stride + h * V;
    for (int64_t j = 0; j < V; ++j)
      orow[j] = scale * dot(s.Qg.data() + r * K, st + j * K, K) + dot(s.A.data() + r * N, s.VpT.data() + j * N, r + 1);
  }

  // S = diag(exp(G_end)) S + (exp(G_end - G) ⊙ K)^T V'.
  for (int64_t j = 0; j < V; ++j) {
    float* stj = st + j * K;
    const float* vpj = s.VpT.data() + j * N;
    for (int64_t d = 0; d < K; ++d) stj[d] = s.decay_end[d] * stj[d] + dot(s.KdT.data() + d * N, vpj, N);
  }
}

}  // namespace

void short_conv_silu(const float* x, int64_t T, int64_t C, const float* w, int W, float* hist, float* out) {
  KESTREL_CHECK(T >= 0 && C > 0 && W >= 1, "short_conv_silu: invalid sizes T={} C={} W={}", T, C, W);
#pragma omp parallel
  {
    // window[i] is the input at t - (W-1) + i, so window[W-1] is the current token and lines up with tap W-1.
    std::vector<float> window(static_cast<size_t>(W));
#pragma omp for schedule(static)
    for (int64_t c = 0; c < C; ++c) {
      for (int i = 0; i < W - 1; ++i) window[i] = hist[i * C + c];
      for (int64_t t = 0; t < T; ++t) {
        window[W - 1] = x[t * C + c];
        out[t * C + c] = silu(dot(w + c * W, window.data(), W));
        for (int i = 0; i < W - 1; ++i) window[i] = window[i + 1];
      }
      for (int i = 0; i < W - 1; ++i) hist[i * C + c] = window[i];
    }
  }
}

void kda_gate(const float* f, int64_t T, int H, int dk, const float* A_log, const float* dt_bias,
              std::optional<float> lower_bound, float* g) {
  KESTREL_CHECK(T >= 0 && H > 0 && dk > 0, "kda_gate: invalid sizes T={} H={} dk={}", T, H, dk);
  // The bound is the most negative value g can reach; a positive one would turn exp(g) into a growth factor,
  // which the chunked form cannot evaluate safely.
  KESTREL_CHECK(!lower_bound || (std::isfinite(*lower_bound) && *lower_bound < 0.0f),
                "kda_gate: lower bound must be negative, got {}", lower_bound.value_or(0.0f));
  const int64_t width = static_cast<int64_t>(H) * dk;
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      const float a = std::exp(A_log[h]);
      for (int d = 0; d < dk; ++d) {
        const int64_t i = static_cast<int64_t>(h) * dk + d;
        const float x = f[t * width + i] + dt_bias[i];
        g[t * width + i] = lower_bound ? *lower_bound * sigmoid(a * x) : -a * softplus(x);
      }
    }
}

void kda_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                   int H, int dk, int dv, float scale, float* state, float* o) {
  check_dims("kda_recurrent", T, H, dk, dv);
  const int64_t qk_stride = static_cast<int64_t>(H) * dk, v_stride = static_cast<int64_t>(H) * dv;
#pragma omp parallel for schedule(static)
  for (int h = 0; h < H; ++h) {
    std::vector<float> st(static_cast<size_t>(dk) * dv), sq(static_cast<size_t>(dk)), decay(static_cast<size_t>(dk));
    float* sh = state + static_cast<int64_t>(h) * dk * dv;
    load_transposed(sh, dk, dv, st.data());
    for (int64_t t = 0; t < T; ++t) {
      const float* qt = q + t * qk_stride + static_cast<int64_t>(h) * dk;
      const float* kt = k + t * qk_stride + static_cast<int64_t>(h) * dk;
      const float* gt = g + t * qk_stride + static_cast<int64_t>(h) * dk;
      const float* vt = v + t * v_stride + static_cast<int64_t>(h) * dv;
      float* ot = o + t * v_stride + static_cast<int64_t>(h) * dv;
      const float bt = beta[t * H + h];
      for (int d = 0; d < dk; ++d) {
        sq[d] = scale * qt[d];
        decay[d] = std::exp(gt[d]);
      }
      for (int j = 0; j < dv; ++j) {
        float* stj = st.data() + static_cast<int64_t>(j) * dk;
        for (int d = 0; d < dk; ++d) stj[d] *= decay[d];
        const float delta = bt * (vt[j] - dot(stj, kt, dk));
        for (int d = 0; d < dk; ++d) stj[d] += kt[d] * delta;
        ot[j] = dot(stj, sq.data(), dk);
      }
    }
    store_transposed(st.data(), dk, dv, sh);
  }
}

int kda_chunked(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t T,
                int H, int dk, int dv, float scale, float* state, float* o, int64_t start_pos, int chunk,
                float* checkpoints, int64_t checkpoint_every) {
  check_dims("kda_chunked", T, H, dk, dv);
  KESTREL_CHECK(chunk > 0, "kda_chunked: chunk must be positive, got {}", chunk);
  KESTREL_CHECK(start_pos >= 0, "kda_chunked: start_pos must be non-negative, got {}", start_pos);
  if (checkpoints)
    KESTREL_CHECK(checkpoint_every > 0 && checkpoint_every % chunk == 0,
                  "kda_chunked: checkpoint_every ({}) must be a positive multiple of chunk ({})", checkpoint_every,
                  chunk);
  const int64_t n_gates = T * H * dk;
  for (int64_t i = 0; i < n_gates; ++i)
    KESTREL_CHECK(std::isfinite(g[i]) && g[i] <= 0.0f, "kda_chunked: log gate g[{}] = {} is not finite and <= 0", i,
                  g[i]);
  if (T == 0) return 0;

  const int64_t state_size = static_cast<int64_t>(H) * dk * dv;
#pragma omp parallel for schedule(static)
  for (int h = 0; h < H; ++h) {
    ChunkScratch scratch(chunk, dk, dv);
    std::vector<float> st(static_cast<size_t>(dk) * dv);
    float* sh = state + static_cast<int64_t>(h) * dk * dv;
    load_transposed(sh, dk, dv, st.data());
    int n_written = 0;
    for (int64_t t0 = 0; t0 < T;) {
      const int64_t pos = start_pos + t0;
      const int64_t chunk_end = std::min<int64_t>((pos / chunk + 1) * chunk, start_pos + T);
      const int n = static_cast<int>(chunk_end - pos);
      kda_chunk_head(q, k, v, g, beta, t0, n, H, h, dk, dv, scale, st.data(), o, scratch);
      if (checkpoints && chunk_end % checkpoint_every == 0)
        store_transposed(st.data(), dk, dv, checkpoints + n_written++ * state_size + static_cast<int64_t>(h) * dk * dv);
      t0 += n;
    }
    store_transposed(st.data(), dk, dv, sh);
  }
  if (!checkpoints) return 0;
  return static_cast<int>((start_pos + T) / checkpoint_every - start_pos / checkpoint_every);
}

void kda_gated_rmsnorm(const float* o, const float* r, const float* w, int64_t T, int H, int dv, float eps, float* y) {
  KESTREL_CHECK(T >= 0 && H > 0 && dv > 0, "kda_gated_rmsnorm: invalid sizes T={} H={} dv={}", T, H, dv);
  const int64_t rows = T * H;
  for (int64_t row = 0; row < rows; ++row) {
    const float* orow = o + row * dv;
    const float* rrow = r + row * dv;
    float* yrow = y + row * dv;
    const float inv = 1.0f / std::sqrt(sum_sq(orow, dv) / static_cast<float>(dv) + eps);
    for (int j = 0; j < dv; ++j) yrow[j] = orow[j] * inv * w[j] * sigmoid(rrow[j]);
  }
}

}  // namespace kestrel::cpu
