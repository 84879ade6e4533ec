// Exact top-k of the decode indexer scores with cpu::topk_indices' rule.
//
// Each score maps to an order-preserving 32-bit key: larger score, larger key; -0 and +0 share one key; -inf and
// NaN map to 0, which no selectable score has (the smallest, -FLT_MAX, maps to 0x00800000), and key-0 candidates
// are never counted. The k-th largest key T is found by a radix select over the row (digits of 11, 11 and 10
// bits, one histogram pass each; the histogram of the first pass also counts the selectable candidates, and when
// there are at most k of them all are taken). Then every candidate with key > T is selected, and of those with
// key == T the ones with the lowest positions, as many as are still needed: exactly the set of the first k of
// cpu::topk_indices' order. A last pass writes the selected positions in ascending order (a block-wide prefix sum
// per 1024 candidates) and pads with -1.
//
// One CTA of 1024 threads per query row; the row is read four times (it is L2-resident at decode lengths).
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "kernels/cuda/dsa_common.cuh"

namespace kestrel::cuda::dsa {
namespace {

constexpr int kThreads = 1024;
constexpr int kMaxBins = 2048;

__device__ __forceinline__ uint32_t order_key(float s) {
  if (isnan(s) || s == -INFINITY) return 0;
  const uint32_t u = s == 0.0f ? 0u : __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Adds one to hist[bin] for every lane that has a bin (bin >= 0), one atomic per distinct bin in the warp: the
// scores of a row often share their leading bits, and per-lane atomics on one bin would serialise.
__device__ __forceinline__ void warp_histogram_add(uint32_t* hist, int bin) {
  const uint32_t active = __ballot_sync(0xFFFFFFFFu, bin >= 0);
  if (bin < 0) return;
  const uint32_t same = __match_any_sync(active, bin);
  if ((threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
}

__global__ void __launch_bounds__(kThreads) topk_kernel(const float* __restrict__ scores, int64_t stride, int n_q,
                                                        const int32_t* __restrict__ ctx_lens, int max_ctx, int k,
                                                        int32_t* __restrict__ out) {
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ uint32_t hist[kMaxBins];
  __shared__ uint32_t found_digit, found_before;

  const int tid = threadIdx.x;
  const int row = blockIdx.x;
  const int req = row / n_q, i = row % n_q;
  const int n = max(0, min(ctx_lens[req] - n_q + i + 1, max_ctx));
  const float* s = scores + int64_t{row} * stride;
  int32_t* o = out + int64_t{row} * k;

  // Radix select of the k-th largest key: after the passes, threshold holds its bits, greater counts the keys
  // above it and need_ties how many keys equal to it are taken.
  uint32_t threshold = 0, greater = 0, need_ties = static_cast<uint32_t>(k);
  bool take_all = false;
#pragma unroll 1
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
    const int bins = pass == 2 ? 1024 : 2048;
    const int prefix_shift = shift + (pass == 2 ? 10 : 11);
    for (int b = tid; b < kMaxBins; b += kThreads) hist[b] = 0;
    __syncthreads();
    for (int base = 0; base < n; base += kThreads) {
      const int j = base + tid;
      int bin = -1;
      if (j < n) {
        const uint32_t key = order_key(s[j]);
        if (key != 0 && (pass == 0 || (key >> prefix_shift) == threshold))
          bin = static_cast<int>((key >> shift) & static_cast<uint32_t>(bins - 1));
      }
      warp_histogram_add(hist, bin);
    }
    __syncthreads();
    // Thread t holds bins bins-1-2t and bins-2-2t; the exclusive sum counts the keys in all higher bins.
    uint32_t c_hi = 0, c_lo = 0;
    if (2 * tid < bins) {
      c_hi = hist[bins - 1 - 2 * tid];
      c_lo = hist[bins - 2 - 2 * tid];
    }
    uint32_t before, total;
    Scan(scan_tmp).ExclusiveSum(c_hi + c_lo, before, total);
    if (pass == 0 && total <= static_cast<uint32_t>(k)) {
      take_all = true;
      greater = total;
      break;
    }
    if (2 * tid < bins) {
      if (before < need_ties && need_ties <= before + c_hi) {
        found_digit = bins - 1 - 2 * tid;
        found_before = before;
      } else if (before + c_hi < need_ties && need_ties <= before + c_hi + c_lo) {
        found_digit = bins - 2 - 2 * tid;
        found_before = before + c_hi;
      }
    }
    __syncthreads();
    threshold = (pass == 0 ? 0u : threshold << (pass == 2 ? 10 : 11)) | found_digit;
    greater += found_before;
    need_ties -= found_before;
    __syncthreads();
  }
  if (take_all) {
    threshold = 0;  // every key > 0
    need_ties = 0;
  }

  // Selected positions in ascending order; ties are taken in position order.
  uint32_t run_gt = 0, run_tie = 0;
  for (int base = 0; base < n; base += kThreads) {
    const int j = base + tid;
    const uint32_t key = j < n ? order_key(s[j]) : 0u;
    const bool gt = key > threshold;
    const bool tie = need_ties > 0 && key == threshold;
    // Both counts fit in 16 bits per 1024 candidates, so one scan carries both.
    uint32_t before, total;
    __syncthreads();
    Scan(scan_tmp).ExclusiveSum(static_cast<uint32_t>(gt) | static_cast<uint32_t>(tie) << 16, before, total);
    const uint32_t gt_before = run_gt + (before & 0xFFFFu), tie_before = run_tie + (before >> 16);
    if (gt || (tie && tie_before < need_ties)) o[gt_before + min(tie_before, need_ties)] = j;
    run_gt += total & 0xFFFFu;
    run_tie += total >> 16;
    if (run_gt == greater && run_tie >= need_ties) break;
  }
  for (int j = static_cast<int>(greater + need_ties) + tid; j < k; j += kThreads) o[j] = -1;
}

}  // namespace
}  // namespace kestrel::cuda::dsa

namespace kestrel::cuda {

void topk_decode(const float* scores, int64_t score_stride, int batch, int n_q, const int32_t* ctx_lens,
                 int max_ctx_len, int k, int32_t* out, cudaStream_t stream) {
  using dsa::require;
  require(batch >= 0 && n_q >= 1 && k >= 1,
          "topk_decode: need batch >= 0, n_q >= 1 and k >= 1, got batch " + std::to_string(batch) + ", n_q " +
              std::to_string(n_q) + ", k " + std::to_string(k));
  require(max_ctx_len >= 0 && score_stride >= max_ctx_len,
          "topk_decode: score stride " + std::to_string(score_stride) + " is smaller than max_ctx_len " +
              std::to_string(max_ctx_len));
  if (batch == 0) return;
  require(scores && ctx_lens && out, "topk_decode: a device pointer is missing");
  const int rows = batch * n_q;
  dsa::topk_kernel<<<rows, dsa::kThreads, 0, stream>>>(scores, score_stride, n_q, ctx_lens, max_ctx_len, k, out);
  check(cudaGetLastError(), "topk_decode kernel launch");
}

}  // namespace kestrel::cuda
