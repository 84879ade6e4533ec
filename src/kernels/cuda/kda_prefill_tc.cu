// KDA chunked prefill over a varlen batch on bf16 tensor cores (chunk 64, dk = dv = 128): the algorithm of
// kda_prefill.cu (spec kda_kimi_linear.md §2.1) with its large products on mma.sync m16n8k16 (bf16 inputs, fp32
// accumulation). Two kernels, as there:
//
//  1. kda_tc_intra_kernel, one block of 8 warps per (chunk, head), all chunks in parallel, two blocks per SM:
//     gates, chunk-local cumulative log gate G (fp32, token order), L2 norms, beta; then
//       L[r,s] = beta_r sum_d k_r k_s exp(G_r - G_s) (s < r),  A[r,s] = scale sum_d q_r k_s exp(G_r - G_s) (s <= r).
//     Warp w owns rows 8w .. 8w+7. Pairs inside its 8x8 diagonal block are formed one per lane in fp32 with the
//     pair's own decay exp(G_r - G_s). For s < 8w the decay splits at the reference row rho = 8w:
//     exp(G_r - G_rho) exp(G_rho - G_s), both factors <= 1, so those entries are one product of pre-decayed rows:
//     L^T = (k_s exp(G_rho - G_s)) (k_r exp(G_r - G_rho))^T on tensor cores (the warp's 8 rows are the mma's n = 8).
//     T = (I + L)^-1 in fp32 (16x16 diagonal blocks by forward substitution, then the off-diagonal blocks);
//     W = T (beta exp(G) ⊙ K) and U = T (beta V) on tensor cores. Written per (chunk, head): W, scale exp(G) ⊙ Q,
//     exp(G_end - G) ⊙ K and A in bf16, U and exp(G_end) in fp32 (layout: kda_tc.h).
//  2. kda_tc_state_kernel, one block per (sequence, head, 32 value columns), sequential over the sequence's
//     chunks with the fp32 state tile in registers (as mma accumulators) and a bf16 copy of it in shared memory;
//     the next chunk's operands arrive by cp.async while the current one is processed:
//       V' = U - W S,  O = Qg S + A V',  S = diag(exp(G_end)) S + Kd^T V'   (W S, Qg S, A V', Kd^T V' on mma).
//
// Only exp of non-positive numbers is evaluated (G is non-increasing): a pair decay, a split at a reference row
// between the pair, exp(G), exp(G_end - G). Rows past a chunk's end are zero in every operand (beta = q = k = v
// = 0 and g = 0 there), so they add nothing. The tensor-core primitives (mma, ldmatrix, cp.async) are dsa's.
#include <cuda_bf16.h>

#include "kernels/cuda/dsa_common.cuh"
#include "kernels/cuda/kda_device.cuh"
#include "kernels/cuda/kda_tc.h"

namespace kestrel::cuda::detail {
namespace {

using dsa::cp_async_16;
using dsa::cp_async_commit;
using dsa::cp_async_wait;
using dsa::ldmatrix_x4;
using dsa::ldmatrix_x4_trans;
using dsa::mma_bf16;

constexpr int C = kKdaChunk;  // 64
constexpr int D = kKdaDim;    // 128
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Row pitches in shared memory. [64][128] fp32 tiles: 136 floats, so that the fragment reads (8 rows x 8 floats
// as float2) of a half warp fall in distinct banks. bf16 tiles of 128 and 64 columns: 136 and 72 elements (272
// and 144 bytes), so that the 8 row addresses of an ldmatrix fall in distinct banks. L/T in fp32: 68 floats.
constexpr int kF32Pitch = D + 8;
constexpr int kBfPitch = D + 8;
constexpr int kSqPitch = C + 8;
constexpr int kLtPitch = C + 4;

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float2 ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ float4 mul4(float a, float4 v) { return make_float4(a * v.x, a * v.y, a * v.z, a * v.w); }
__device__ __forceinline__ float4 mul4(float4 a, float4 v) {
  return make_float4(a.x * v.x, a.y * v.y, a.z * v.z, a.w * v.w);
}
__device__ __forceinline__ float4 sub4(float4 a, float4 b) {
  return make_float4(a.x - b.x, a.y - b.y, a.z - b.z, a.w - b.w);
}
__device__ __forceinline__ float4 exp4(float4 v) { return make_float4(expf(v.x), expf(v.y), expf(v.z), expf(v.w)); }
__device__ __forceinline__ float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&b);
}
__device__ __forceinline__ uint16_t to_bf16(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
__device__ __forceinline__ void st_bf16x4(uint16_t* p, float4 v) {
  *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
}
__device__ __forceinline__ float4 ld_bf16x4(const uint16_t* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xFFFF0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xFFFF0000u));
}
__device__ __forceinline__ float2 ld_bf16x2(const uint16_t* p) {
  const uint32_t u = *reinterpret_cast<const uint32_t*>(p);
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xFFFF0000u));
}

// ---------------------------------------------------------------------------------------------- intra-chunk

// Shared memory of the intra kernel, byte offsets. Later phases reuse regions whose contents are dead.
constexpr size_t kInK = 0;                                   // fp32 [64][136] k; later bf16 beta V
constexpr size_t kInG = kInK + C * kF32Pitch * 4;            // fp32 [64][136] log gate, then G; later T scratch
constexpr size_t kInQ = kInG + C * kF32Pitch * 4;            // bf16 [64][136] q; later bf16 beta exp(G) ⊙ k
constexpr size_t kInLt = kInQ + C * kBfPitch * 2;            // fp32 [64][68]  L, then T = (I + L)^-1 in place
constexpr size_t kInA = kInLt + C * kLtPitch * 4;            // bf16 [64][72]  A_qk; later T in bf16
constexpr size_t kInBeta = kInA + C * kSqPitch * 2;          // fp32 [64]
constexpr size_t kIntraSmemBytes = kInBeta + C * 4;          // 113,920: two blocks per SM
static_assert(kIntraSmemBytes <= 113 * 1024, "two intra blocks must fit on one SM");

__global__ void __launch_bounds__(kThreads, 2) kda_tc_intra_kernel(KdaPrefillArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* sK = reinterpret_cast<float*>(smem + kInK);
  float* sG = reinterpret_cast<float*>(smem + kInG);
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem + kInQ);
  float* sLT = reinterpret_cast<float*>(smem + kInLt);
  uint16_t* sA = reinterpret_cast<uint16_t*>(smem + kInA);
  float* sBeta = reinterpret_cast<float*>(smem + kInBeta);
  uint16_t* sBk = sQ;                                // beta exp(G) ⊙ k, once q is no longer read
  uint16_t* sBv = reinterpret_cast<uint16_t*>(sK);  // beta v, once k is no longer read
  float* sM = sG;                                    // [3][16][16] partial products of T, once G is no longer read
  uint16_t* sTb = sA;                                // T in bf16, once A_qk is stored

  const KdaTokenArgs& in = a.in;
  const int H = a.H;
  const int64_t ci = blockIdx.x;
  const int h = blockIdx.y;
  const KdaPrefillPlan::Chunk ch = a.chunks[ci];
  const int n = ch.n;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;  // mma fragment coordinates: row g (+8), columns 2t, 2t+1 (+8)
  unsigned char* ws = reinterpret_cast<unsigned char*>(a.ws) + (ci * H + h) * static_cast<int64_t>(kTcChunkHeadBytes);
  uint16_t* ws_w = reinterpret_cast<uint16_t*>(ws + kTcW);
  uint16_t* ws_qg = reinterpret_cast<uint16_t*>(ws + kTcQg);
  uint16_t* ws_kd = reinterpret_cast<uint16_t*>(ws + kTcKd);
  uint16_t* ws_a = reinterpret_cast<uint16_t*>(ws + kTcA);
  float* ws_u = reinterpret_cast<float*>(ws + kTcU);
  float* ws_decay = reinterpret_cast<float*>(ws + kTcDecay);

  // L and A are written only below the diagonal (A: on it too); the rest must read as zero.
  for (int i = tid; i < C * kLtPitch; i += kThreads) sLT[i] = 0.0f;
  for (int i = tid; i < C * kSqPitch / 2; i += kThreads) reinterpret_cast<uint32_t*>(sA)[i] = 0u;

  // Log gates and beta, one warp per row, four channels per lane; zeros past the chunk's end. Unrolled so that all
  // of a warp's row loads are in flight together (the two blocks of an SM alternate loading and computing).
#pragma unroll
  for (int r = warp; r < C; r += kWarps) {
    float4 g4 = make_float4(0, 0, 0, 0);
    float beta = 0.0f;
    if (r < n) {
      const int64_t row = (ch.t0 + r) * H + h;
      const float4 x4 = ld4(in.gate + row * D + lane * 4);
      g4 = make_float4(kda_log_gate(in, h, lane * 4, x4.x), kda_log_gate(in, h, lane * 4 + 1, x4.y),
                       kda_log_gate(in, h, lane * 4 + 2, x4.z), kda_log_gate(in, h, lane * 4 + 3, x4.w));
      beta = kda_beta(in, in.beta[row]);
    }
    st4(sG + r * kF32Pitch + lane * 4, g4);
    if (lane == 0) sBeta[r] = beta;
  }
  __syncthreads();

  // Chunk-local inclusive cumulative sum in token order, as the CPU reference; padded rows repeat G_{n-1}.
  if (tid < D) {
    float acc = 0.0f;
#pragma unroll 8
    for (int r = 0; r < C; ++r) {
      acc += sG[r * kF32Pitch + tid];
      sG[r * kF32Pitch + tid] = acc;
    }
  }
  __syncthreads();
  const float* Gend = sG + (C - 1) * kF32Pitch;
  if (tid < D / 4) st4(ws_decay + tid * 4, exp4(ld4(Gend + tid * 4)));

  // q and k rows (normalised when asked): the decayed rows the state pass reads, straight from fp32; k kept in
  // fp32 and q in bf16 for L and A.
#pragma unroll 4
  for (int r = warp; r < C; r += kWarps) {
    float4 q4 = make_float4(0, 0, 0, 0), k4 = q4;
    if (r < n) {
      const int64_t row = (ch.t0 + r) * H + h;
      q4 = ld4(in.q + row * D + lane * 4);
      k4 = ld4(in.k + row * D + lane * 4);
      if (in.normalize_qk) {
        q4 = mul4(1.0f / sqrtf(warp_sum(dot4(q4, q4)) + 1e-6f), q4);
        k4 = mul4(1.0f / sqrtf(warp_sum(dot4(k4, k4)) + 1e-6f), k4);
      }
    }
    const float4 G4 = ld4(sG + r * kF32Pitch + lane * 4);
    st_bf16x4(ws_qg + r * D + lane * 4, mul4(in.scale, mul4(q4, exp4(G4))));
    st_bf16x4(ws_kd + r * D + lane * 4, mul4(k4, exp4(sub4(ld4(Gend + lane * 4), G4))));
    st4(sK + r * kF32Pitch + lane * 4, k4);
    st_bf16x4(sQ + r * kBfPitch + lane * 4, q4);
  }
  __syncthreads();

  // L and A inside warp w's 8x8 diagonal block: lanes 0..27 one pair s < r each (lane = ri (ri - 1) / 2 + si),
  // lanes 28..31 the diagonal of A (whose decay is exp(0) = 1), two rows each.
  {
    const int base = 8 * warp;
    if (lane < 28) {
      int ri = 1, si = lane;
      while (si >= ri) {
        si -= ri;
        ++ri;
      }
      const int r = base + ri, s = base + si;
      float acc_l = 0.0f, acc_a = 0.0f;
#pragma unroll 4
      for (int d = 0; d < D; d += 4) {
        const float4 e = exp4(sub4(ld4(sG + r * kF32Pitch + d), ld4(sG + s * kF32Pitch + d)));
        const float4 ks = mul4(ld4(sK + s * kF32Pitch + d), e);
        acc_l += dot4(ld4(sK + r * kF32Pitch + d), ks);
        acc_a += dot4(ld_bf16x4(sQ + r * kBfPitch + d), ks);
      }
      sLT[r * kLtPitch + s] = sBeta[r] * acc_l;
      sA[r * kSqPitch + s] = to_bf16(in.scale * acc_a);
    } else {
      for (int rr = 0; rr < 2; ++rr) {
        const int r = base + 2 * (lane - 28) + rr;
        float acc = 0.0f;
#pragma unroll 4
        for (int d = 0; d < D; d += 4) acc += dot4(ld_bf16x4(sQ + r * kBfPitch + d), ld4(sK + r * kF32Pitch + d));
        sA[r * kSqPitch + r] = to_bf16(in.scale * acc);
      }
    }
  }

  // L and A for warp w's rows r = 8w + g against every earlier row s < rho = 8w, split at rho. The warp's rows
  // are the mma's 8 columns (B: k_r exp(G_r - G_rho), q_r exp(G_r - G_rho)); the earlier rows its 16-row tiles
  // (A: k_s exp(G_rho - G_s), zero for s >= rho). The accumulators hold L^T and A^T.
  if (warp > 0) {
    const int rho = 8 * warp;
    const float* Grho = sG + rho * kF32Pitch;
    uint32_t kl[8][2], ql[8][2];
    {
      const int r = rho + g;
#pragma unroll
      for (int ks = 0; ks < 8; ++ks)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int d = 16 * ks + 8 * half + 2 * t;
          const float2 gr = ld2(sG + r * kF32Pitch + d), g0 = ld2(Grho + d);
          const float e0 = expf(gr.x - g0.x), e1 = expf(gr.y - g0.y);
          const float2 kr = ld2(sK + r * kF32Pitch + d), qr = ld_bf16x2(sQ + r * kBfPitch + d);
          kl[ks][half] = pack_bf16(kr.x * e0, kr.y * e1);
          ql[ks][half] = pack_bf16(qr.x * e0, qr.y * e1);
        }
    }
    const int m_tiles = (warp + 1) / 2;  // 16-row tiles covering s < rho
    for (int mt = 0; mt < m_tiles; ++mt) {
      float cl[4] = {0, 0, 0, 0}, ca[4] = {0, 0, 0, 0};
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        uint32_t af[4];  // af[i]: row s = 16 mt + g + 8 (i & 1), columns d = 16 ks + 2t + 8 (i >> 1), +1
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int s = 16 * mt + g + 8 * (i & 1);
          const int d = 16 * ks + 2 * t + 8 * (i >> 1);
          af[i] = 0u;
          if (s < rho) {
            const float2 gs = ld2(sG + s * kF32Pitch + d), g0 = ld2(Grho + d);
            const float2 k2 = ld2(sK + s * kF32Pitch + d);
            af[i] = pack_bf16(k2.x * expf(g0.x - gs.x), k2.y * expf(g0.y - gs.y));
          }
        }
        mma_bf16(cl, af, kl[ks][0], kl[ks][1]);
        mma_bf16(ca, af, ql[ks][0], ql[ks][1]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // accumulator i: s = 16 mt + g + 8 (i >> 1), r = rho + 2t + (i & 1)
        const int s = 16 * mt + g + 8 * (i >> 1);
        const int r = rho + 2 * t + (i & 1);
        if (s < rho) {
          sLT[r * kLtPitch + s] = sBeta[r] * cl[i];
          sA[r * kSqPitch + s] = to_bf16(in.scale * ca[i]);
        }
      }
    }
  }
  __syncthreads();

  // A_qk out; the right-hand side beta exp(G) ⊙ k of W in bf16 over q.
  for (int i = tid; i < C * C / 8; i += kThreads) {
    const int r = i >> 3, c = (i & 7) * 8;
    *reinterpret_cast<uint4*>(ws_a + r * C + c) = *reinterpret_cast<const uint4*>(sA + r * kSqPitch + c);
  }
  for (int i = tid; i < C * D / 4; i += kThreads) {
    const int r = i / (D / 4), d = (i % (D / 4)) * 4;
    const float4 kg = mul4(ld4(sK + r * kF32Pitch + d), exp4(ld4(sG + r * kF32Pitch + d)));
    st_bf16x4(sBk + r * kBfPitch + d, mul4(sBeta[r], kg));
  }
  __syncthreads();

  // Warps 0..3: the 16x16 diagonal blocks of T by forward substitution, lane c < 16 owning column c (t[x] = 0
  // above the diagonal, so every row sums over all earlier rows), written over L once the warp has read it.
  // Warps 4..7 meanwhile: the right-hand side beta v of U in bf16 over k.
  if (warp < 4) {
    if (lane < 16) {
      const int base = 16 * warp, c = lane;
      float tc[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        float acc = 0.0f;
#pragma unroll
        for (int x = 0; x < r; ++x) acc += sLT[(base + r) * kLtPitch + base + x] * tc[x];
        tc[r] = r < c ? 0.0f : (r == c ? 1.0f : -acc);
      }
      __syncwarp(0x0000FFFFu);
#pragma unroll
      for (int r = 0; r < 16; ++r) sLT[(base + r) * kLtPitch + base + c] = tc[r];
    }
  } else {
    for (int i = tid - 128; i < C * D / 4; i += 128) {
      const int r = i / (D / 4), d = (i % (D / 4)) * 4;
      const float4 v = r < n ? ld4(in.v + ((ch.t0 + r) * H + h) * D + d) : make_float4(0, 0, 0, 0);
      st_bf16x4(sBv + r * kBfPitch + d, mul4(sBeta[r], v));
    }
  }
  __syncthreads();

  // Off-diagonal blocks of T, one row block i at a time: T_ij = -T_ii sum_{16j <= x < 16i} L_ix T_xj (rows of
  // earlier blocks are final; row block i still holds L until all of its partial products are formed).
  {
    const int rl = tid >> 4, cl = tid & 15;
    for (int i = 1; i < C / 16; ++i) {
      const int r = 16 * i + rl;
      for (int j = 0; j < i; ++j) {
        float acc = 0.0f;
        for (int x = 16 * j; x < 16 * i; ++x) acc += sLT[r * kLtPitch + x] * sLT[x * kLtPitch + 16 * j + cl];
        sM[(j * 16 + rl) * 16 + cl] = acc;
      }
      __syncthreads();
      for (int j = 0; j < i; ++j) {
        float acc = 0.0f;
#pragma unroll
        for (int y = 0; y < 16; ++y) acc += sLT[r * kLtPitch + 16 * i + y] * sM[(j * 16 + y) * 16 + cl];
        sLT[r * kLtPitch + 16 * j + cl] = -acc;
      }
      __syncthreads();
    }
  }
  for (int i = tid; i < C * C / 4; i += kThreads) {
    const int r = i / (C / 4), c = (i % (C / 4)) * 4;
    st_bf16x4(sTb + r * kSqPitch + c, ld4(sLT + r * kLtPitch + c));
  }
  __syncthreads();

  // W = T (beta exp(G) ⊙ K) (warps 0..3) and U = T (beta V) (warps 4..7), 32 columns per warp; T is lower
  // triangular, so row tile mt only needs k-steps 0..mt.
  {
    const bool is_w = warp < 4;
    const uint16_t* sB = is_w ? sBk : sBv;
    const int n0 = 32 * (warp & 3);
    for (int mt = 0; mt < C / 16; ++mt) {
      float acc[4][4] = {};
      for (int ks = 0; ks <= mt; ++ks) {
        uint32_t af[4];
        ldmatrix_x4(af, sTb + (16 * mt + (lane & 15)) * kSqPitch + 16 * ks + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bf[4];
          ldmatrix_x4_trans(bf, sB + (16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8) * kBfPitch + n0 + 16 * np +
                                    (lane >> 4) * 8);
          mma_bf16(acc[2 * np], af, bf[0], bf[1]);
          mma_bf16(acc[2 * np + 1], af, bf[2], bf[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = 16 * mt + g + 8 * hr, col = n0 + 8 * nt + 2 * t;
          if (is_w) {
            *reinterpret_cast<uint32_t*>(ws_w + r * D + col) = pack_bf16(acc[nt][2 * hr], acc[nt][2 * hr + 1]);
          } else {
            *reinterpret_cast<float2*>(ws_u + r * D + col) = make_float2(acc[nt][2 * hr], acc[nt][2 * hr + 1]);
          }
        }
    }
  }
}

// ------------------------------------------------------------------------------------------------ state pass

constexpr int kTileV = 32;             // value columns per block
constexpr int kTiles = D / kTileV;
constexpr int kVPitch = kTileV + 8;    // bf16 per row of the S and V' tiles (80 bytes: ldmatrix rows conflict-free)
constexpr int kUPitch = kTileV + 8;    // floats per row of the U tile

// One stage of a chunk's operands in shared memory (byte offsets); two stages alternate.
constexpr size_t kStW = 0;                             // bf16 [64][136]; W, Qg, Kd consecutive as in the workspace
constexpr size_t kStQg = kStW + C * kBfPitch * 2;
constexpr size_t kStKd = kStQg + C * kBfPitch * 2;
constexpr size_t kStA = kStKd + C * kBfPitch * 2;      // bf16 [64][72]
constexpr size_t kStU = kStA + C * kSqPitch * 2;       // fp32 [64][40], this block's columns
constexpr size_t kStDecay = kStU + C * kUPitch * 4;    // fp32 [128]
constexpr size_t kStageBytes = kStDecay + D * 4;
constexpr size_t kStS = 2 * kStageBytes;               // bf16 [128][40] the state tile at the start of the chunk
constexpr size_t kStVp = kStS + D * kVPitch * 2;       // bf16 [64][40]  V'
constexpr size_t kStateSmemBytes = kStVp + C * kVPitch * 2;
static_assert(kStageBytes % 16 == 0 && kStS % 16 == 0 && kStVp % 16 == 0, "16-byte aligned regions");

// Issues the cp.async copies of one chunk's operands (this block's 32 columns of U) into a stage.
__device__ __forceinline__ void load_chunk(unsigned char* stage, const unsigned char* src, int tile, int tid) {
  for (int i = tid; i < 3 * C * (D / 8); i += kThreads) {  // W, Qg, Kd: 16 pieces of 16 bytes per row
    const int m = i / (C * (D / 8)), r = (i / (D / 8)) % C, p = i % (D / 8);
    cp_async_16(stage + kStW + (static_cast<size_t>(m) * C + r) * kBfPitch * 2 + p * 16,
                src + kTcW + (static_cast<size_t>(m) * C + r) * D * 2 + p * 16, 16);
  }
  for (int i = tid; i < C * (C / 8); i += kThreads) {
    const int r = i / (C / 8), p = i % (C / 8);
    cp_async_16(stage + kStA + r * kSqPitch * 2 + p * 16, src + kTcA + r * C * 2 + p * 16, 16);
  }
  for (int i = tid; i < C * (kTileV / 4); i += kThreads) {
    const int r = i / (kTileV / 4), p = i % (kTileV / 4);
    cp_async_16(stage + kStU + r * kUPitch * 4 + p * 16, src + kTcU + (r * D + tile * kTileV) * 4 + p * 16, 16);
  }
  if (tid < D / 4) cp_async_16(stage + kStDecay + tid * 16, src + kTcDecay + tid * 16, 16);
}

// The bf16 copy of a warp's state rows d0, d0 + 8 (accumulator layout: s[nt] = columns 8 nt + 2t, +1).
__device__ __forceinline__ void store_state_bf16(uint16_t* sS, const float (&s)[4][4], int d0, int t) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    *reinterpret_cast<uint32_t*>(sS + d0 * kVPitch + 8 * nt + 2 * t) = pack_bf16(s[nt][0], s[nt][1]);
    *reinterpret_cast<uint32_t*>(sS + (d0 + 8) * kVPitch + 8 * nt + 2 * t) = pack_bf16(s[nt][2], s[nt][3]);
  }
}

__device__ __forceinline__ void store_state_f32(float* dst, const float (&s)[4][4], int d0, int t) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    *reinterpret_cast<float2*>(dst + d0 * D + 8 * nt + 2 * t) = make_float2(s[nt][0], s[nt][1]);
    *reinterpret_cast<float2*>(dst + (d0 + 8) * D + 8 * nt + 2 * t) = make_float2(s[nt][2], s[nt][3]);
  }
}

__global__ void __launch_bounds__(kThreads, 1) kda_tc_state_kernel(KdaPrefillArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* sS = reinterpret_cast<uint16_t*>(smem + kStS);
  uint16_t* sVp = reinterpret_cast<uint16_t*>(smem + kStVp);

  const int H = a.H;
  const int tile = blockIdx.x % kTiles;
  const int seq_head = blockIdx.x / kTiles;
  const int h = seq_head % H;
  const int b = seq_head / H;
  const KdaPrefillPlan::Seq seq = a.seqs[b];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int j0 = tile * kTileV;
  const int mt = warp & 3;           // the chunk's rows 16 mt .. +15 for W S / Qg S and the output
  const int d0 = 16 * warp + g;      // the state rows d0 and d0 + 8 this lane holds
  const unsigned char* ws = reinterpret_cast<const unsigned char*>(a.ws);
  auto chunk_ws = [&](int64_t ci) { return ws + (ci * H + h) * static_cast<int64_t>(kTcChunkHeadBytes); };

  if (seq.num_chunks > 0) {
    load_chunk(smem, chunk_ws(seq.first_chunk), tile, tid);
    cp_async_commit();
  }

  const int64_t state_size = static_cast<int64_t>(H) * D * D;
  const int64_t head_offset = static_cast<int64_t>(h) * D * D + j0;
  float* S_slot = a.state_pool + static_cast<int64_t>(a.slots[b]) * a.in.state_stride + head_offset;
  float s[4][4];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const float2 lo = ld2(S_slot + d0 * D + 8 * nt + 2 * t), hi = ld2(S_slot + (d0 + 8) * D + 8 * nt + 2 * t);
    s[nt][0] = lo.x;
    s[nt][1] = lo.y;
    s[nt][2] = hi.x;
    s[nt][3] = hi.y;
  }
  store_state_bf16(sS, s, d0, t);

  for (int64_t c = 0; c < seq.num_chunks; ++c) {
    const int64_t ci = seq.first_chunk + c;
    const KdaPrefillPlan::Chunk ch = a.chunks[ci];
    const unsigned char* stage = smem + (c & 1) * kStageBytes;
    cp_async_wait<0>();  // this chunk's copies (the only group in flight)
    __syncthreads();     // ... from every thread; every warp is done with the previous chunk and its stage
    if (c + 1 < seq.num_chunks) {
      load_chunk(smem + ((c + 1) & 1) * kStageBytes, chunk_ws(ci + 1), tile, tid);
      cp_async_commit();
    }
    const uint16_t* sKd = reinterpret_cast<const uint16_t*>(stage + kStKd);
    const uint16_t* sA = reinterpret_cast<const uint16_t*>(stage + kStA);
    const float* sU = reinterpret_cast<const float*>(stage + kStU);
    const float* sDecay = reinterpret_cast<const float*>(stage + kStDecay);

    // Warps 0..3: W S; warps 4..7: Qg S; both against the state at the start of the chunk.
    float acc[4][4] = {};
    {
      const uint16_t* sX = reinterpret_cast<const uint16_t*>(stage + (warp < 4 ? kStW : kStQg));
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t af[4];
        ldmatrix_x4(af, sX + (16 * mt + (lane & 15)) * kBfPitch + 16 * ks + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bf[4];
          ldmatrix_x4_trans(bf, sS + (16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8) * kVPitch + 16 * np +
                                    (lane >> 4) * 8);
          mma_bf16(acc[2 * np], af, bf[0], bf[1]);
          mma_bf16(acc[2 * np + 1], af, bf[2], bf[3]);
        }
      }
    }
    if (warp < 4) {  // V' = U - W S, rounded once to bf16 as the input of A V' and Kd^T V'
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = 16 * mt + g + 8 * hr, col = 8 * nt + 2 * t;
          const float2 u = ld2(sU + r * kUPitch + col);
          *reinterpret_cast<uint32_t*>(sVp + r * kVPitch + col) =
              pack_bf16(u.x - acc[nt][2 * hr], u.y - acc[nt][2 * hr + 1]);
        }
    }
    __syncthreads();

    if (warp >= 4) {  // O = Qg S + A V' (A is lower triangular: row tile mt needs k-steps 0..mt)
      for (int ks = 0; ks <= mt; ++ks) {
        uint32_t af[4];
        ldmatrix_x4(af, sA + (16 * mt + (lane & 15)) * kSqPitch + 16 * ks + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bf[4];
          ldmatrix_x4_trans(bf, sVp + (16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8) * kVPitch + 16 * np +
                                    (lane >> 4) * 8);
          mma_bf16(acc[2 * np], af, bf[0], bf[1]);
          mma_bf16(acc[2 * np + 1], af, bf[2], bf[3]);
        }
      }
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = 16 * mt + g + 8 * hr;
        if (r < ch.n) {
          float* orow = a.o + ((ch.t0 + r) * H + h) * D + j0;
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
            *reinterpret_cast<float2*>(orow + 8 * nt + 2 * t) = make_float2(acc[nt][2 * hr], acc[nt][2 * hr + 1]);
        }
      }
    }

    // S = diag(exp(G_end)) S + Kd^T V' for the state rows 16 warp .. +15: Kd^T is read transposed from Kd [s][d].
    const float dec0 = sDecay[d0], dec1 = sDecay[d0 + 8];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      s[nt][0] *= dec0;
      s[nt][1] *= dec0;
      s[nt][2] *= dec1;
      s[nt][3] *= dec1;
    }
#pragma unroll
    for (int ks = 0; ks < C / 16; ++ks) {
      uint32_t af[4];
      ldmatrix_x4_trans(af, sKd + (16 * ks + (lane & 7) + ((lane >> 4) << 3)) * kBfPitch + 16 * warp +
                                ((lane >> 3) & 1) * 8);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, sVp + (16 * ks + (lane & 7) + ((lane >> 3) & 1) * 8) * kVPitch + 16 * np +
                                  (lane >> 4) * 8);
        mma_bf16(s[2 * np], af, bf[0], bf[1]);
        mma_bf16(s[2 * np + 1], af, bf[2], bf[3]);
      }
    }
    store_state_bf16(sS, s, d0, t);  // every read of the previous copy happened before the barrier above
    if (ch.checkpoint >= 0) store_state_f32(a.checkpoints + ch.checkpoint * state_size + head_offset, s, d0, t);
  }
  store_state_f32(S_slot, s, d0, t);
}

}  // namespace

cudaError_t launch_kda_prefill_tc(const KdaPrefillArgs& args, cudaStream_t stream) {
  cudaError_t status = cudaFuncSetAttribute(kda_tc_intra_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(kIntraSmemBytes));
  if (status != cudaSuccess) return status;
  // Two intra blocks per SM need the largest shared-memory carveout.
  status = cudaFuncSetAttribute(kda_tc_intra_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                cudaSharedmemCarveoutMaxShared);
  if (status != cudaSuccess) return status;
  status = cudaFuncSetAttribute(kda_tc_state_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(kStateSmemBytes));
  if (status != cudaSuccess) return status;
  if (args.num_chunks > 0) {
    kda_tc_intra_kernel<<<dim3(static_cast<unsigned>(args.num_chunks), static_cast<unsigned>(args.H)), kThreads,
                          kIntraSmemBytes, stream>>>(args);
    status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  if (args.num_seqs > 0) {
    const int64_t blocks = static_cast<int64_t>(args.num_seqs) * args.H * kTiles;
    kda_tc_state_kernel<<<static_cast<unsigned>(blocks), kThreads, kStateSmemBytes, stream>>>(args);
    status = cudaGetLastError();
  }
  return status;
}

}  // namespace kestrel::cuda::detail
