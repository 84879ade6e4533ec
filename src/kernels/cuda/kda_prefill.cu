// KDA chunked prefill over a varlen batch, chunk 64, fp32 throughout (see spec kda_kimi_linear.md §2.1).
//
// Two kernels:
//  1. kda_intra_kernel, one block per (chunk, head), all chunks of all sequences in parallel: gate (fused or
//     given), chunk-local cumulative log gate G, L2 norm of q and k, beta; then
//       L[r,s] = beta_r sum_d k_r k_s exp(G_r - G_s) (s < r),  A[r,s] = scale sum_d q_r k_s exp(G_r - G_s) (s <= r),
//       T = (I + L)^-1,  W = T diag(beta) (exp(G) ⊙ K),  U = T diag(beta) V,
//     and the decayed rows that the state pass needs, all written to the workspace.
//  2. kda_state_kernel, one block per (sequence, head, tile of 32 value columns), sequential over the sequence's
//     chunks with the state tile on chip:  V' = U - W S;  O = (scale exp(G) ⊙ Q) S + A V';
//     S = diag(exp(G_end)) S + (exp(G_end - G) ⊙ K)^T V'; checkpoints after the chunks the plan marks.
//
// Stability: only exp of non-positive numbers is evaluated. For the off-diagonal 16x16 blocks of L and A, the
// pair factor exp(G_r - G_s) is split at the first row n of the row block: exp(G_r - G_n) exp(G_n - G_s), both
// factors <= 1 (s < n <= r), which turns the block into a plain dot of pre-decayed rows. Inside the diagonal
// blocks no common reference keeps both factors <= 1, so exp(G_r - G_s) is formed per pair.
#include "kernels/cuda/kda_device.cuh"

namespace kestrel::cuda::detail {
namespace {

constexpr int C = kKdaChunk;  // 64
constexpr int D = kKdaDim;    // 128
// Row pitch of [rows][128] tiles in shared memory: a multiple of 4 floats for 16-byte accesses, and 4 banks
// further per row, so 8 consecutive rows read as float4 at the same column fall in 8 distinct bank quads.
constexpr int kPitch = D + 4;
// Pitch of 64x64 matrices read one float at a time down a column: rows one bank apart.
constexpr int kSqPitch = C + 1;
constexpr int kSub = 16;        // sub-chunk (row block) size
constexpr int kXRows = 2 * kSub + C - kSub;  // pre-decayed rows of one row block: 16 k, 16 q, up to 48 earlier k

constexpr int kIntraThreads = 256;
constexpr int kIntraWarps = kIntraThreads / 32;
constexpr int kIntraSmemFloats = 3 * C * kPitch + kXRows * kPitch + 3 * C * kSqPitch + C;

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ float4 mul4(float a, float4 v) { return make_float4(a * v.x, a * v.y, a * v.z, a * v.w); }
__device__ __forceinline__ float4 mul4(float4 a, float4 v) {
  return make_float4(a.x * v.x, a.y * v.y, a.z * v.z, a.w * v.w);
}
__device__ __forceinline__ float4 exp4(float4 v) { return make_float4(expf(v.x), expf(v.y), expf(v.z), expf(v.w)); }
__device__ __forceinline__ float4 sub4(float4 a, float4 b) {
  return make_float4(a.x - b.x, a.y - b.y, a.z - b.z, a.w - b.w);
}
__device__ __forceinline__ float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }
__device__ __forceinline__ void fma4(float4& acc, float a, float4 v) {
  acc.x += a * v.x;
  acc.y += a * v.y;
  acc.z += a * v.z;
  acc.w += a * v.w;
}

__global__ void __launch_bounds__(kIntraThreads, 1) kda_intra_kernel(KdaPrefillArgs a) {
  extern __shared__ __align__(16) float smem[];
  float* sK = smem;             // [64][kPitch] k, later beta exp(G) ⊙ k
  float* sQ = sK + C * kPitch;  // [64][kPitch] q, later beta v
  float* sG = sQ + C * kPitch;  // [64][kPitch] log gate, then its chunk-local cumulative sum G
  float* sX = sG + C * kPitch;  // [kXRows][kPitch] pre-decayed rows of one row block; later scratch of T
  float* sL = sX + kXRows * kPitch;  // [64][kSqPitch] L, strictly lower
  float* sA = sL + C * kSqPitch;     // [64][kSqPitch] A_qk, lower with the diagonal
  float* sT = sA + C * kSqPitch;     // [64][kSqPitch] T = (I + L)^-1, unit lower
  float* sBeta = sT + C * kSqPitch;  // [64]

  const KdaTokenArgs& in = a.in;
  const int H = a.H;
  const int64_t ci = blockIdx.x;
  const int h = blockIdx.y;
  const KdaPrefillPlan::Chunk ch = a.chunks[ci];
  const int n = ch.n;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  for (int i = tid; i < 3 * C * kSqPitch; i += kIntraThreads) sL[i] = 0.0f;  // sL, sA, sT are contiguous

  // Rows of the chunk (zeros past its end, so that padded rows add nothing anywhere below): one warp per row,
  // four channels per lane.
  for (int r = warp; r < C; r += kIntraWarps) {
    float4 q4 = make_float4(0, 0, 0, 0), k4 = q4, g4 = q4;
    float beta = 0.0f;
    if (r < n) {
      const int64_t row = (ch.t0 + r) * H + h;
      q4 = ld4(in.q + row * D + lane * 4);
      k4 = ld4(in.k + row * D + lane * 4);
      const float4 x4 = ld4(in.gate + row * D + lane * 4);
      if (in.normalize_qk) {
        q4 = mul4(1.0f / sqrtf(warp_sum(dot4(q4, q4)) + 1e-6f), q4);
        k4 = mul4(1.0f / sqrtf(warp_sum(dot4(k4, k4)) + 1e-6f), k4);
      }
      g4 = make_float4(kda_log_gate(in, h, lane * 4, x4.x), kda_log_gate(in, h, lane * 4 + 1, x4.y),
                       kda_log_gate(in, h, lane * 4 + 2, x4.z), kda_log_gate(in, h, lane * 4 + 3, x4.w));
      beta = kda_beta(in, in.beta[row]);
    }
    st4(sQ + r * kPitch + lane * 4, q4);
    st4(sK + r * kPitch + lane * 4, k4);
    st4(sG + r * kPitch + lane * 4, g4);
    if (lane == 0) sBeta[r] = beta;
  }
  __syncthreads();

  // Chunk-local inclusive cumulative sum, in token order (as the CPU reference).
  if (tid < D) {
    float acc = 0.0f;
    for (int r = 0; r < C; ++r) {
      acc += sG[r * kPitch + tid];
      sG[r * kPitch + tid] = acc;
    }
  }
  __syncthreads();

  // Diagonal 16x16 blocks of L and A, pairwise: the 4 x 136 lower-triangle pairs (s <= r) spread over threads.
  for (int p = tid; p < 4 * (kSub * (kSub + 1) / 2); p += kIntraThreads) {
    const int b = p / (kSub * (kSub + 1) / 2);
    int rl = 0, sl = p % (kSub * (kSub + 1) / 2);
    while (sl > rl) {  // row rl of a lower triangle holds rl + 1 pairs
      sl -= rl + 1;
      ++rl;
    }
    const int r = b * kSub + rl, s = b * kSub + sl;
    float acc_l = 0.0f, acc_a = 0.0f;
    for (int d = 0; d < D; d += 4) {
      const float4 ks = mul4(ld4(sK + s * kPitch + d), exp4(sub4(ld4(sG + r * kPitch + d), ld4(sG + s * kPitch + d))));
      acc_l += dot4(ld4(sK + r * kPitch + d), ks);
      acc_a += dot4(ld4(sQ + r * kPitch + d), ks);
    }
    if (s < r) sL[r * kSqPitch + s] = sBeta[r] * acc_l;
    sA[r * kSqPitch + s] = in.scale * acc_a;
  }

  // Off-diagonal blocks, one row block i at a time, with reference row n0 = 16 i.
  for (int i = 1; i < C / kSub; ++i) {
    const int n0 = i * kSub;
    const float* Gn = sG + n0 * kPitch;
    // sX rows 0..15: k_r exp(G_r - G_n0), rows 16..31: q_r exp(G_r - G_n0) for r = n0 + 0..15;
    // rows 32..32+n0-1: k_s exp(G_n0 - G_s) for s < n0.
    const int items = (2 * kSub + n0) * (D / 4);
    for (int it = tid; it < items; it += kIntraThreads) {
      const int xr = it / (D / 4), d = (it % (D / 4)) * 4;
      const float4 gn = ld4(Gn + d);
      float4 out;
      if (xr < 2 * kSub) {
        const int r = n0 + (xr % kSub);
        const float* src = xr < kSub ? sK : sQ;
        out = mul4(ld4(src + r * kPitch + d), exp4(sub4(ld4(sG + r * kPitch + d), gn)));
      } else {
        const int s = xr - 2 * kSub;
        out = mul4(ld4(sK + s * kPitch + d), exp4(sub4(gn, ld4(sG + s * kPitch + d))));
      }
      st4(sX + xr * kPitch + d, out);
    }
    __syncthreads();
    const int rl = tid / kSub, sg = tid % kSub;
    float acc_l[C / kSub - 1] = {}, acc_a[C / kSub - 1] = {};
    for (int d = 0; d < D; d += 4) {
      const float4 kl = ld4(sX + rl * kPitch + d), ql = ld4(sX + (kSub + rl) * kPitch + d);
#pragma unroll
      for (int m = 0; m < C / kSub - 1; ++m)
        if (m < i) {
          const float4 kr = ld4(sX + (2 * kSub + m * kSub + sg) * kPitch + d);
          acc_l[m] += dot4(kl, kr);
          acc_a[m] += dot4(ql, kr);
        }
    }
    const int r = n0 + rl;
#pragma unroll
    for (int m = 0; m < C / kSub - 1; ++m)
      if (m < i) {
        const int s = m * kSub + sg;
        sL[r * kSqPitch + s] = sBeta[r] * acc_l[m];
        sA[r * kSqPitch + s] = in.scale * acc_a[m];
      }
    __syncthreads();  // sX is refilled by the next row block
  }

  // T = (I + L)^-1. Diagonal blocks: warp b inverts block b by forward substitution, lane c owning column c
  // (t[x] = 0 above the diagonal, so every row sums over all earlier rows).
  if (warp < C / kSub && lane < kSub) {
    const int base = warp * kSub, c = lane;
    float t[kSub];
#pragma unroll
    for (int r = 0; r < kSub; ++r) {
      float acc = 0.0f;
#pragma unroll
      for (int x = 0; x < r; ++x) acc += sL[(base + r) * kSqPitch + base + x] * t[x];
      t[r] = r < c ? 0.0f : (r == c ? 1.0f : -acc);
    }
#pragma unroll
    for (int r = 0; r < kSub; ++r) sT[(base + r) * kSqPitch + base + c] = t[r];
  }
  __syncthreads();
  // Off-diagonal blocks, row block by row block: T_ij = -T_ii sum_{j <= x < i} L_ix T_xj.
  {
    float* sM = sX;  // [3][16][16]
    const int rl = tid / kSub, cl = tid % kSub;
    for (int i = 1; i < C / kSub; ++i) {
      const int r = i * kSub + rl;
      for (int j = 0; j < i; ++j) {
        float acc = 0.0f;
        for (int x = j * kSub; x < i * kSub; ++x) acc += sL[r * kSqPitch + x] * sT[x * kSqPitch + j * kSub + cl];
        sM[(j * kSub + rl) * kSub + cl] = acc;
      }
      __syncthreads();
      for (int j = 0; j < i; ++j) {
        float acc = 0.0f;
#pragma unroll
        for (int y = 0; y < kSub; ++y) acc += sT[r * kSqPitch + i * kSub + y] * sM[(j * kSub + y) * kSub + cl];
        sT[r * kSqPitch + j * kSub + cl] = -acc;
      }
      __syncthreads();
    }
  }

  // Decayed rows for the state pass, A_qk, exp(G_end); then, in place, the right-hand sides of W and U.
  float* ws = a.ws + (ci * H + h) * kWsChunkHead;
  const float* Gend = sG + (C - 1) * kPitch;  // padded rows repeat G_{n-1}
  for (int it = tid; it < C * D / 4; it += kIntraThreads) {
    const int r = it / (D / 4), d = (it % (D / 4)) * 4;
    const float4 g = ld4(sG + r * kPitch + d), eg = exp4(g);
    const float4 q = ld4(sQ + r * kPitch + d), k = ld4(sK + r * kPitch + d);
    st4(ws + kWsQg + r * D + d, mul4(in.scale, mul4(q, eg)));
    st4(ws + kWsKd + r * D + d, mul4(k, exp4(sub4(ld4(Gend + d), g))));
    const float b = sBeta[r];
    st4(sK + r * kPitch + d, mul4(b, mul4(k, eg)));
    const float4 v = r < n ? ld4(in.v + ((ch.t0 + r) * H + h) * D + d) : make_float4(0, 0, 0, 0);
    st4(sQ + r * kPitch + d, mul4(b, v));
  }
  if (tid < D / 4) st4(ws + kWsDecay + tid * 4, exp4(ld4(Gend + tid * 4)));
  for (int it = tid; it < C * C; it += kIntraThreads) ws[kWsA + it] = sA[(it / C) * kSqPitch + it % C];
  __syncthreads();

  // W = T (beta exp(G) ⊙ K), U = T (beta V): thread owns rows 4 ty .. +3 and columns 4 tx .. +3, 64 + 4 tx .. +3.
  {
    const int ty = tid / 16, tx = tid % 16;
    for (int pass = 0; pass < 2; ++pass) {
      const float* B = pass == 0 ? sK : sQ;
      float4 acc[4][2];
#pragma unroll
      for (int y = 0; y < 4; ++y) acc[y][0] = acc[y][1] = make_float4(0, 0, 0, 0);
      for (int x = 0; x < 4 * ty + 4; ++x) {  // T is lower: row 4 ty + y needs x <= 4 ty + y
        const float4 b0 = ld4(B + x * kPitch + 4 * tx), b1 = ld4(B + x * kPitch + D / 2 + 4 * tx);
#pragma unroll
        for (int y = 0; y < 4; ++y) {
          const float tv = sT[(4 * ty + y) * kSqPitch + x];
          fma4(acc[y][0], tv, b0);
          fma4(acc[y][1], tv, b1);
        }
      }
      float* out = ws + (pass == 0 ? kWsW : kWsU);
#pragma unroll
      for (int y = 0; y < 4; ++y) {
        st4(out + (4 * ty + y) * D + 4 * tx, acc[y][0]);
        st4(out + (4 * ty + y) * D + D / 2 + 4 * tx, acc[y][1]);
      }
    }
  }
}

constexpr int kTileV = 32;
constexpr int kTiles = D / kTileV;
constexpr int kStateThreads = 256;
constexpr int kVPitch = kTileV + 4;
constexpr int kAPitch = C + 4;
constexpr int kStateSmemFloats = 3 * C * kPitch + C * kAPitch + C * kVPitch + D * kVPitch + D;

__global__ void __launch_bounds__(kStateThreads, 1) kda_state_kernel(KdaPrefillArgs a) {
  extern __shared__ __align__(16) float smem[];
  float* sW = smem;                  // [64][kPitch]
  float* sQg = sW + C * kPitch;      // [64][kPitch]
  float* sKd = sQg + C * kPitch;     // [64][kPitch]
  float* sA = sKd + C * kPitch;      // [64][kAPitch]
  float* sVp = sA + C * kAPitch;     // [64][kVPitch] U, then V' = U - W S (this tile's columns)
  float* sS = sVp + C * kVPitch;     // [128][kVPitch] state tile at the start of the chunk
  float* sDecay = sS + D * kVPitch;  // [128]

  const int H = a.H;
  const int tile = blockIdx.x % kTiles;
  const int seq_head = blockIdx.x / kTiles;
  const int h = seq_head % H;
  const int b = seq_head / H;
  const KdaPrefillPlan::Seq seq = a.seqs[b];
  const int tid = threadIdx.x;
  const int tx = tid % 8;  // columns 4 tx .. +3 of the tile
  const int ty = tid / 8;  // rows 2 ty, 2 ty + 1 of the chunk; key rows 4 ty .. +3 of the state

  const int64_t state_size = static_cast<int64_t>(H) * D * D;
  const int64_t head_offset = static_cast<int64_t>(h) * D * D + tile * kTileV + 4 * tx;
  float* S_slot = a.state_pool + static_cast<int64_t>(a.slots[b]) * a.in.state_stride + head_offset;
  float4 s[4];
#pragma unroll
  for (int y = 0; y < 4; ++y) {
    s[y] = ld4(S_slot + (4 * ty + y) * D);
    st4(sS + (4 * ty + y) * kVPitch + 4 * tx, s[y]);
  }

  const int r0 = 2 * ty, r1 = 2 * ty + 1;
  for (int64_t c = 0; c < seq.num_chunks; ++c) {
    const int64_t ci = seq.first_chunk + c;
    const KdaPrefillPlan::Chunk ch = a.chunks[ci];
    const float* ws = a.ws + (ci * H + h) * kWsChunkHead;
    for (int it = tid; it < C * D / 4; it += kStateThreads) {
      const int r = it / (D / 4), d = (it % (D / 4)) * 4;
      st4(sW + r * kPitch + d, ld4(ws + kWsW + r * D + d));
      st4(sQg + r * kPitch + d, ld4(ws + kWsQg + r * D + d));
      st4(sKd + r * kPitch + d, ld4(ws + kWsKd + r * D + d));
    }
    for (int it = tid; it < C * C / 4; it += kStateThreads) {
      const int r = it / (C / 4), x = (it % (C / 4)) * 4;
      st4(sA + r * kAPitch + x, ld4(ws + kWsA + r * C + x));
    }
    for (int it = tid; it < C * kTileV / 4; it += kStateThreads) {
      const int r = it / (kTileV / 4), j = (it % (kTileV / 4)) * 4;
      st4(sVp + r * kVPitch + j, ld4(ws + kWsU + r * D + tile * kTileV + j));
    }
    if (tid < D / 4) st4(sDecay + tid * 4, ld4(ws + kWsDecay + tid * 4));
    __syncthreads();

    // V' = U - W S and the inter-chunk part of O, both against the state at the start of the chunk.
    float4 v0 = ld4(sVp + r0 * kVPitch + 4 * tx), v1 = ld4(sVp + r1 * kVPitch + 4 * tx);
    float4 o0 = make_float4(0, 0, 0, 0), o1 = o0;
    for (int d = 0; d < D; d += 4) {
      const float4 w0 = ld4(sW + r0 * kPitch + d), w1 = ld4(sW + r1 * kPitch + d);
      const float4 q0 = ld4(sQg + r0 * kPitch + d), q1 = ld4(sQg + r1 * kPitch + d);
      const float4 sd[4] = {ld4(sS + d * kVPitch + 4 * tx), ld4(sS + (d + 1) * kVPitch + 4 * tx),
                            ld4(sS + (d + 2) * kVPitch + 4 * tx), ld4(sS + (d + 3) * kVPitch + 4 * tx)};
      const float w0s[4] = {w0.x, w0.y, w0.z, w0.w}, w1s[4] = {w1.x, w1.y, w1.z, w1.w};
      const float q0s[4] = {q0.x, q0.y, q0.z, q0.w}, q1s[4] = {q1.x, q1.y, q1.z, q1.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        fma4(v0, -w0s[e], sd[e]);
        fma4(v1, -w1s[e], sd[e]);
        fma4(o0, q0s[e], sd[e]);
        fma4(o1, q1s[e], sd[e]);
      }
    }
    st4(sVp + r0 * kVPitch + 4 * tx, v0);  // each thread overwrites only the U entries it read itself
    st4(sVp + r1 * kVPitch + 4 * tx, v1);
    __syncthreads();

    // O += A V' (A is lower: row r needs s <= r).
    for (int x = 0; x <= r1; ++x) {
      const float4 vp = ld4(sVp + x * kVPitch + 4 * tx);
      fma4(o0, sA[r0 * kAPitch + x], vp);
      fma4(o1, sA[r1 * kAPitch + x], vp);
    }
    const int64_t o_col = static_cast<int64_t>(h) * D + tile * kTileV + 4 * tx;
    if (r0 < ch.n) st4(a.o + (ch.t0 + r0) * H * D + o_col, o0);
    if (r1 < ch.n) st4(a.o + (ch.t0 + r1) * H * D + o_col, o1);

    // S = diag(exp(G_end)) S + Kd^T V'.
#pragma unroll
    for (int y = 0; y < 4; ++y) {
      const float dcy = sDecay[4 * ty + y];
      s[y] = make_float4(dcy * s[y].x, dcy * s[y].y, dcy * s[y].z, dcy * s[y].w);
    }
    for (int r = 0; r < C; ++r) {
      const float4 kd = ld4(sKd + r * kPitch + 4 * ty);
      const float4 vp = ld4(sVp + r * kVPitch + 4 * tx);
      fma4(s[0], kd.x, vp);
      fma4(s[1], kd.y, vp);
      fma4(s[2], kd.z, vp);
      fma4(s[3], kd.w, vp);
    }
#pragma unroll
    for (int y = 0; y < 4; ++y) st4(sS + (4 * ty + y) * kVPitch + 4 * tx, s[y]);
    if (ch.checkpoint >= 0) {
      float* ck = a.checkpoints + ch.checkpoint * state_size + head_offset;
#pragma unroll
      for (int y = 0; y < 4; ++y) st4(ck + (4 * ty + y) * D, s[y]);
    }
    __syncthreads();  // the next chunk overwrites the tiles and reads the new state
  }
#pragma unroll
  for (int y = 0; y < 4; ++y) st4(S_slot + (4 * ty + y) * D, s[y]);
}

}  // namespace

cudaError_t launch_kda_prefill(const KdaPrefillArgs& args, cudaStream_t stream) {
  constexpr size_t intra_smem = kIntraSmemFloats * sizeof(float);
  constexpr size_t state_smem = kStateSmemFloats * sizeof(float);
  cudaError_t status = cudaFuncSetAttribute(kda_intra_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(intra_smem));
  if (status != cudaSuccess) return status;
  status = cudaFuncSetAttribute(kda_state_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(state_smem));
  if (status != cudaSuccess) return status;
  if (args.num_chunks > 0) {
    kda_intra_kernel<<<dim3(static_cast<unsigned>(args.num_chunks), static_cast<unsigned>(args.H)), kIntraThreads,
                       intra_smem, stream>>>(args);
    status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  if (args.num_seqs > 0) {
    const int64_t blocks = static_cast<int64_t>(args.num_seqs) * args.H * kTiles;
    kda_state_kernel<<<static_cast<unsigned>(blocks), kStateThreads, state_smem, stream>>>(args);
    status = cudaGetLastError();
  }
  return status;
}

}  // namespace kestrel::cuda::detail
