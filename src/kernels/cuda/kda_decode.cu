// KDA recurrent decode: one token per sequence, state updated in place in its slot.
//
// One block per (sequence, head, tile of 32 value columns); 4 tiles per head, so even N = 1 spreads over 128
// blocks. Thread t owns a 8 (key rows) x 4 (value columns) piece of the tile in registers: columns
// 4 (t % 8) .. +3, key rows 8 (t / 8) .. +7. Eight consecutive threads read one 128-byte row segment with
// 16-byte loads, and all eight state loads of a thread are issued before any of them is used.
//
// The step is one pass over the state: with S_d = diag(alpha) S,
//   S_d^T k and S_d^T (scale q) are reduced together; delta = beta (v - S_d^T k);
//   o = S_d^T (scale q) + delta (k . scale q)    (= (S_d + k delta^T)^T (scale q), the updated state read)
//   S = S_d + k delta^T.
// Fused in: the gate (softplus or lower-bound form) from the gate projection, the L2 norm of q and k, sigmoid
// of the beta logit (each optional, see KdaInputs).
#include "kernels/cuda/kda_device.cuh"

namespace kestrel::cuda::detail {
namespace {

constexpr int kTileV = 32;
constexpr int kTiles = kKdaDim / kTileV;
constexpr int kThreads = 128;  // = kKdaDim: thread t also preprocesses key channel t
constexpr int kRows = 8;       // key rows per thread
constexpr int kWarps = kThreads / 32;

__global__ void __launch_bounds__(kThreads) kda_decode_kernel(KdaTokenArgs in, int H, float* __restrict__ state_pool,
                                                               const int32_t* __restrict__ slots,
                                                               float* __restrict__ o) {
  const int tile = blockIdx.x % kTiles;
  const int seq_head = blockIdx.x / kTiles;
  const int h = seq_head % H;
  const int i = seq_head / H;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int c4 = t & 7;       // column group within the tile
  const int slice = t >> 3;   // key rows slice * kRows ..

  float* S = state_pool + static_cast<int64_t>(slots[i]) * in.state_stride +
             (static_cast<int64_t>(h) * kKdaDim + slice * kRows) * kKdaDim + tile * kTileV + c4 * 4;
  float4 s[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) s[r] = *reinterpret_cast<const float4*>(S + r * kKdaDim);

  __shared__ float s_q[kKdaDim], s_k[kKdaDim], s_alpha[kKdaDim];
  __shared__ float s_sums[kWarps][3];
  __shared__ float s_part[kWarps][8][8];  // [warp][column group][S^T k (4) | S^T q (4)]
  __shared__ __align__(16) float s_delta[kTileV];

  const int64_t row = static_cast<int64_t>(i) * H + h;  // (token, head) row of q, k, v, o
  float qd = in.q[row * kKdaDim + t];
  float kd = in.k[row * kKdaDim + t];
  s_alpha[t] = expf(kda_log_gate(in, h, t, in.gate[row * kKdaDim + t]));
  float qq = warp_sum(qd * qd), kk = warp_sum(kd * kd), kq = warp_sum(kd * qd);
  if (lane == 0) {
    s_sums[warp][0] = qq;
    s_sums[warp][1] = kk;
    s_sums[warp][2] = kq;
  }
  __syncthreads();
  qq = kk = kq = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    qq += s_sums[w][0];
    kk += s_sums[w][1];
    kq += s_sums[w][2];
  }
  float kq_scaled = in.scale * kq;  // k . (scale q), after normalisation
  if (in.normalize_qk) {
    const float inv_q = 1.0f / sqrtf(qq + 1e-6f), inv_k = 1.0f / sqrtf(kk + 1e-6f);
    qd *= inv_q;
    kd *= inv_k;
    kq_scaled *= inv_q * inv_k;
  }
  s_q[t] = in.scale * qd;
  s_k[t] = kd;
  const float beta = kda_beta(in, in.beta[row]);
  __syncthreads();

  float sk[4] = {0, 0, 0, 0}, sq[4] = {0, 0, 0, 0};
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int d = slice * kRows + r;
    const float a = s_alpha[d], kv = s_k[d], qv = s_q[d];
    s[r].x *= a;
    s[r].y *= a;
    s[r].z *= a;
    s[r].w *= a;
    sk[0] += s[r].x * kv;
    sk[1] += s[r].y * kv;
    sk[2] += s[r].z * kv;
    sk[3] += s[r].w * kv;
    sq[0] += s[r].x * qv;
    sq[1] += s[r].y * qv;
    sq[2] += s[r].z * qv;
    sq[3] += s[r].w * qv;
  }
  // Sum over the 4 row slices inside the warp (lanes 8 and 16 apart), then over the warps.
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int off = 8; off < 32; off <<= 1) {
      sk[c] += __shfl_xor_sync(0xffffffffu, sk[c], off);
      sq[c] += __shfl_xor_sync(0xffffffffu, sq[c], off);
    }
  if (lane < 8) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      s_part[warp][lane][c] = sk[c];
      s_part[warp][lane][4 + c] = sq[c];
    }
  }
  __syncthreads();
  if (t < kTileV) {
    const int group = t >> 2, c = t & 3;
    float stk = 0.0f, stq = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      stk += s_part[w][group][c];
      stq += s_part[w][group][4 + c];
    }
    const int64_t col = row * kKdaDim + tile * kTileV + t;
    const float delta = beta * (in.v[col] - stk);
    o[col] = stq + delta * kq_scaled;
    s_delta[t] = delta;
  }
  __syncthreads();

  const float4 delta = *reinterpret_cast<const float4*>(&s_delta[c4 * 4]);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float kv = s_k[slice * kRows + r];
    s[r].x += kv * delta.x;
    s[r].y += kv * delta.y;
    s[r].z += kv * delta.z;
    s[r].w += kv * delta.w;
    *reinterpret_cast<float4*>(S + r * kKdaDim) = s[r];
  }
}

}  // namespace

cudaError_t launch_kda_decode(const KdaTokenArgs& in, int N, int H, float* state_pool, const int32_t* slots, float* o,
                              cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  const int64_t blocks = static_cast<int64_t>(N) * H * kTiles;
  kda_decode_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(in, H, state_pool, slots, o);
  return cudaGetLastError();
}

}  // namespace kestrel::cuda::detail
