// Exact top-k of the decode indexer scores with cpu::topk_indices' rule, several CTAs per query row.
//
// Each score maps to an order-preserving 32-bit key: larger score, larger key; -0 and +0 share one key; -inf and
// NaN map to 0, which no selectable score has (the smallest, -FLT_MAX, maps to 0x00800000), and key-0 candidates
// are never counted. The k-th largest key T is found by a radix select (digits of 11, 11 and 10 bits); then every
// candidate with key > T is selected, and of those with key == T the ones with the lowest positions, as many as
// are still needed: exactly the set of the first k of cpu::topk_indices' order. When a row has at most k
// selectable candidates all of them are taken.
//
// A row is cut into `chunks` contiguous chunks, one CTA each; the CTAs of a row meet at barriers (a counter in
// the workspace), which is safe because the kernel is launched cooperatively: every CTA of the grid is resident.
// Per row:
//   1. each CTA reads its chunk once into shared memory (as keys) and adds its histogram of the top digit to the
//      row's histogram in the workspace;                                                        barrier
//   2. every CTA finds the top digit of T from that histogram (the same answer everywhere), then histograms
//      the next digit of its keys that share the top digit;                                    barrier
//   3. the same for the last digit;                                                            barrier
//   4. every CTA counts its keys > T and == T (per warp, by ballots) and publishes its chunk's totals; barrier
//   5. every CTA writes its selected positions at their final ranks (the totals of the chunks before it, of the
//      warps before it, and of the lanes before it by popcount), ascending; then -1 padding.
// Steps 2-3 are skipped for rows that take all their candidates. A row's histograms are zeroed by its chunk-0 CTA
// after the barrier that follows their last read, and the chunk totals and the counters by the last CTA to
// finish, so the workspace is all zeros again when the kernel ends. When there are more rows than fit on the
// device at once, the rows are taken in rounds by `slots` groups of CTAs.
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "kernels/cuda/dsa_common.cuh"

namespace kestrel::cuda::dsa {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxChunk = 16384;    // keys of one CTA, held in shared memory
constexpr int kSmallChunk = 4096;   // with few rows, chunks are cut down to this to spread a row over more CTAs
constexpr int kHist1 = 0, kHist2 = 2048, kHist3 = 4096;  // workspace words of a slot: the three histograms,
constexpr int kBarrier = 5120, kExit = 5121;              // the barrier and exit counters,
constexpr int kTotals = 5128;                             // then the chunk totals (gt[chunks], tie[chunks])

struct TopkParams {
  const float* scores;
  int64_t stride;
  int n_q;
  const int32_t* ctx_lens;
  int max_ctx;
  int k;
  int32_t* out;
  uint32_t* ws;
  int rows;
  int chunks;  // CTAs per row
  int chunk;   // positions per chunk
  int items;   // keys per thread in shared memory: chunk <= items * kThreads
  int slots;   // rows handled at once
  int slot_words;
};

__device__ __forceinline__ uint32_t order_key(float s) {
  if (isnan(s) || s == -INFINITY) return 0;
  const uint32_t u = s == 0.0f ? 0u : __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}


// All CTAs of a slot arrive; returns when `target` arrivals have been counted. The fences make each CTA's earlier
// global writes and atomics visible to the others before they pass.
__device__ void slot_barrier(uint32_t* counter, uint32_t target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    while (*reinterpret_cast<volatile uint32_t*>(counter) < target) __nanosleep(32);
    __threadfence();
  }
  __syncthreads();
}

struct Digit {
  uint32_t total;   // keys counted in the histogram
  uint32_t digit;   // bin holding the need-th largest key (when need <= total)
  uint32_t before;  // keys in the bins above it
};

struct TopkShared {
  cub::BlockScan<uint32_t, kThreads>::TempStorage scan;
  uint32_t hist[2048];
  uint32_t digit, before;
  uint32_t warp_gt[kWarps], warp_tie[kWarps];
  uint32_t chunk_gt, chunk_tie;
};

// The bin of the need-th largest key in a global histogram of `bins` bins (read through L2: other CTAs wrote it).
__device__ Digit find_digit(TopkShared& sh, const uint32_t* hist, int bins, uint32_t need) {
  const int per = bins / kThreads;  // 4 or 2 bins per thread, taken from the top down
  const int top = bins - 1 - per * static_cast<int>(threadIdx.x);
  uint32_t c[4] = {0, 0, 0, 0}, sum = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (j < per) {
      c[j] = __ldcg(hist + top - j);
      sum += c[j];
    }
  uint32_t before, total;
  cub::BlockScan<uint32_t, kThreads>(sh.scan).ExclusiveSum(sum, before, total);
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (j < per) {
      if (before < need && need <= before + c[j]) {
        sh.digit = static_cast<uint32_t>(top - j);
        sh.before = before;
      }
      before += c[j];
    }
  __syncthreads();
  const Digit d{total, sh.digit, sh.before};
  __syncthreads();
  return d;
}

__device__ void clear_hist(TopkShared& sh) {
  for (int b = threadIdx.x; b < 2048; b += kThreads) sh.hist[b] = 0;
  __syncthreads();
}

// Adds the CTA's histogram to the row's; empty bins are skipped.
__device__ void flush_hist(TopkShared& sh, uint32_t* global, int bins) {
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += kThreads) {
    const uint32_t v = sh.hist[b];
    if (v) atomicAdd(global + b, v);
  }
}

__device__ void zero_words(uint32_t* global, int n) {
  for (int b = threadIdx.x; b < n; b += kThreads) global[b] = 0;
}

__global__ void __launch_bounds__(kThreads, 3) topk_kernel(TopkParams p) {
  extern __shared__ uint32_t keys[];  // the chunk's keys, p.items * kThreads (0 past the row)
  __shared__ TopkShared sh;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c = static_cast<int>(blockIdx.x) % p.chunks, slot = static_cast<int>(blockIdx.x) / p.chunks;
  uint32_t* ws = p.ws + static_cast<int64_t>(slot) * p.slot_words;
  uint32_t* total_gt = ws + kTotals;
  uint32_t* total_tie = total_gt + p.chunks;
  const int span = p.items * kThreads;
  const uint32_t lanes_below = (1u << lane) - 1u;
  uint32_t barriers = 0;
  auto barrier = [&] { slot_barrier(ws + kBarrier, ++barriers * static_cast<uint32_t>(p.chunks)); };

  for (int row = slot; row < p.rows; row += p.slots) {
    const int req = row / p.n_q, i = row % p.n_q;
    const int n = max(0, min(p.ctx_lens[req] - p.n_q + i + 1, p.max_ctx));
    const int base = c * p.chunk;
    const int len = max(0, min(p.chunk, n - base));
    const float* s = p.scores + static_cast<int64_t>(row) * p.stride + base;
    const uint32_t k = static_cast<uint32_t>(p.k);

    // 1. Keys into shared memory, histogram of bits 31..21.
    clear_hist(sh);
#pragma unroll 8
    for (int e = tid; e < span; e += kThreads) keys[e] = e < len ? order_key(s[e]) : 0u;
#pragma unroll 4
    for (int e = tid; e < span; e += kThreads) {  // each thread reads back its own keys: no barrier needed
      const uint32_t key = keys[e];
      if (key) atomicAdd(&sh.hist[key >> 21], 1u);
    }
    flush_hist(sh, ws + kHist1, 2048);
    barrier();

    // 2. Top digit; histogram of bits 20..10 of the keys that share it.
    const Digit d1 = find_digit(sh, ws + kHist1, 2048, k);
    const bool take_all = d1.total <= k;
    uint32_t threshold = 0, greater = d1.total, need = 0;
    if (!take_all) {
      greater = d1.before;
      need = k - d1.before;
      clear_hist(sh);
#pragma unroll 4
      for (int e = tid; e < span; e += kThreads) {
        const uint32_t key = keys[e];
        if (key && (key >> 21) == d1.digit) atomicAdd(&sh.hist[(key >> 10) & 2047u], 1u);
      }
      flush_hist(sh, ws + kHist2, 2048);
    }
    barrier();
    if (c == 0) zero_words(ws + kHist1, 2048);

    // 3. Middle digit; histogram of bits 9..0; the last digit gives T.
    if (!take_all) {
      const Digit d2 = find_digit(sh, ws + kHist2, 2048, need);
      greater += d2.before;
      need -= d2.before;
      const uint32_t prefix = d1.digit << 11 | d2.digit;
      clear_hist(sh);
#pragma unroll 4
      for (int e = tid; e < span; e += kThreads) {
        const uint32_t key = keys[e];
        if (key && (key >> 10) == prefix) atomicAdd(&sh.hist[key & 1023u], 1u);
      }
      flush_hist(sh, ws + kHist3, 1024);
      barrier();
      if (c == 0) zero_words(ws + kHist2, 2048);
      const Digit d3 = find_digit(sh, ws + kHist3, 1024, need);
      greater += d3.before;
      need -= d3.before;
      threshold = prefix << 10 | d3.digit;
    }
    // Now: `greater` keys > threshold are taken, and the `need` lowest-position keys == threshold.

    // 4. Per-warp counts over the warp's consecutive segment of the chunk; the chunk's totals to the workspace.
    const int seg = warp * 32 * p.items;
    uint32_t wgt = 0, wtie = 0;
    for (int it = 0; it < p.items; ++it) {
      const uint32_t key = keys[seg + it * 32 + lane];
      wgt += __popc(__ballot_sync(0xFFFFFFFFu, key > threshold));
      wtie += __popc(__ballot_sync(0xFFFFFFFFu, need > 0 && key == threshold));
    }
    if (lane == 0) {
      sh.warp_gt[warp] = wgt;
      sh.warp_tie[warp] = wtie;
    }
    __syncthreads();
    if (tid == 0) {
      uint32_t g = 0, t = 0;
      for (int w = 0; w < kWarps; ++w) {
        g += sh.warp_gt[w];
        t += sh.warp_tie[w];
      }
      total_gt[c] = g;
      total_tie[c] = t;
    }
    barrier();
    if (c == 0 && !take_all) zero_words(ws + kHist3, 1024);

    // 5. Ranks: chunks before this one (warp 0 sums them), warps before this one, lanes before this one.
    if (warp == 0) {
      uint32_t g = 0, t = 0;
      for (int j = lane; j < c; j += 32) {
        g += __ldcg(total_gt + j);
        t += __ldcg(total_tie + j);
      }
#pragma unroll
      for (int off = 16; off > 0; off /= 2) {
        g += __shfl_xor_sync(0xFFFFFFFFu, g, off);
        t += __shfl_xor_sync(0xFFFFFFFFu, t, off);
      }
      if (lane == 0) {
        sh.chunk_gt = g;
        sh.chunk_tie = t;
      }
    }
    __syncthreads();
    uint32_t run_gt = sh.chunk_gt, run_tie = sh.chunk_tie;
    for (int w = 0; w < warp; ++w) {
      run_gt += sh.warp_gt[w];
      run_tie += sh.warp_tie[w];
    }
    int32_t* o = p.out + static_cast<int64_t>(row) * p.k;
    for (int it = 0; it < p.items; ++it) {
      const int e = seg + it * 32 + lane;
      const uint32_t key = keys[e];
      const bool gt = key > threshold, tie = need > 0 && key == threshold;
      const uint32_t b_gt = __ballot_sync(0xFFFFFFFFu, gt), b_tie = __ballot_sync(0xFFFFFFFFu, tie);
      const uint32_t gt_rank = run_gt + __popc(b_gt & lanes_below);
      const uint32_t tie_rank = run_tie + __popc(b_tie & lanes_below);
      if (gt || (tie && tie_rank < need)) o[gt_rank + min(tie_rank, need)] = base + e;
      run_gt += __popc(b_gt);
      run_tie += __popc(b_tie);
    }
    for (int j = static_cast<int>(greater + need) + c * kThreads + tid; j < p.k; j += p.chunks * kThreads) o[j] = -1;
    __syncthreads();  // the keys and sh are rewritten by the next row
  }

  // Every CTA of the slot has read the chunk totals and passed its last barrier once it gets here; the last one
  // zeroes the totals and the counters.
  __syncthreads();
  if (tid == 0 && atomicAdd(ws + kExit, 1u) == static_cast<uint32_t>(p.chunks) - 1u) {
    uint32_t* totals = p.ws + static_cast<int64_t>(slot) * p.slot_words + kTotals;
    for (int j = 0; j < 2 * p.chunks; ++j) totals[j] = 0;
    atomicExch(ws + kBarrier, 0u);
    atomicExch(ws + kExit, 0u);
  }
}

struct TopkPlan {
  int chunks, chunk, items, slots, slot_words;
  size_t smem;
};

size_t keys_bytes(int items) { return static_cast<size_t>(items) * kThreads * sizeof(uint32_t); }

// CTAs of topk_kernel that are resident at once with the largest chunk (smaller chunks fit at least as many).
int resident_ctas() {
  static DeviceCache cache;
  return cache.get([] {
    const size_t smem = keys_bytes(kMaxChunk / kThreads);
    check(cudaFuncSetAttribute(topk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
          "cudaFuncSetAttribute(topk_kernel)");
    check(cudaFuncSetAttribute(topk_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100),
          "cudaFuncSetAttribute(topk_kernel carveout)");
    int per_sm = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, topk_kernel, kThreads, smem),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor(topk_kernel)");
    return per_sm * device_sm_count();
  });
}

// Chunks per row: at least enough for kMaxChunk keys each; with few rows, more (down to kSmallChunk keys) so that
// a row is spread over the device. Rows run in rounds of `slots` when rows * chunks CTAs do not fit at once.
TopkPlan plan_topk(int rows, int max_ctx) {
  const int fit_at_most = resident_ctas();
  const int min_chunks = std::max(1, (max_ctx + kMaxChunk - 1) / kMaxChunk);
  require(min_chunks <= fit_at_most, "topk_decode: max_ctx_len " + std::to_string(max_ctx) +
                                         " needs more CTAs per row than the device holds at once");
  const int spread = std::max(1, (max_ctx + kSmallChunk - 1) / kSmallChunk);
  const int chunks = std::max(min_chunks, std::min(spread, fit_at_most / std::max(rows, 1)));
  TopkPlan plan{};
  plan.chunks = chunks;
  plan.chunk = (max_ctx + chunks - 1) / chunks;
  plan.items = std::max(1, (plan.chunk + kThreads - 1) / kThreads);
  plan.smem = keys_bytes(plan.items);
  plan.slots = std::max(1, std::min(rows, fit_at_most / chunks));
  plan.slot_words = (kTotals + 2 * chunks + 31) / 32 * 32;
  return plan;
}

void check_topk_shapes(int batch, int n_q, int max_ctx_len, int k, const char* fn) {
  require(batch >= 0 && n_q >= 1 && k >= 1 && max_ctx_len >= 0,
          std::string(fn) + ": need batch >= 0, n_q >= 1, k >= 1 and max_ctx_len >= 0, got batch " +
              std::to_string(batch) + ", n_q " + std::to_string(n_q) + ", k " + std::to_string(k) +
              ", max_ctx_len " + std::to_string(max_ctx_len));
}

}  // namespace
}  // namespace kestrel::cuda::dsa

namespace kestrel::cuda {

size_t topk_decode_workspace_bytes(int batch, int n_q, int max_ctx_len, int k) {
  dsa::check_topk_shapes(batch, n_q, max_ctx_len, k, "topk_decode_workspace_bytes");
  if (batch == 0) return 0;
  const dsa::TopkPlan plan = dsa::plan_topk(batch * n_q, max_ctx_len);
  return static_cast<size_t>(plan.slots) * plan.slot_words * sizeof(uint32_t);
}

void topk_decode(const float* scores, int64_t score_stride, int batch, int n_q, const int32_t* ctx_lens,
                 int max_ctx_len, int k, int32_t* out, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream) {
  using dsa::require;
  dsa::check_topk_shapes(batch, n_q, max_ctx_len, k, "topk_decode");
  require(score_stride >= max_ctx_len, "topk_decode: score stride " + std::to_string(score_stride) +
                                           " is smaller than max_ctx_len " + std::to_string(max_ctx_len));
  if (batch == 0) return;
  require(scores && ctx_lens && out, "topk_decode: a device pointer is missing");
  const int rows = batch * n_q;
  const dsa::TopkPlan plan = dsa::plan_topk(rows, max_ctx_len);
  const size_t need = static_cast<size_t>(plan.slots) * plan.slot_words * sizeof(uint32_t);
  require(workspace != nullptr && workspace_bytes >= need,
          "topk_decode: workspace of " + std::to_string(workspace_bytes) + " bytes, need " + std::to_string(need));
  dsa::TopkParams p{scores, score_stride, n_q, ctx_lens, max_ctx_len, k, out, static_cast<uint32_t*>(workspace),
                    rows,   plan.chunks,  plan.chunk, plan.items, plan.slots, plan.slot_words};
  void* args[] = {&p};
  check(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(dsa::topk_kernel),
                                    dim3(static_cast<unsigned>(plan.chunks * plan.slots)), dim3(dsa::kThreads), args,
                                    plan.smem, stream),
        "topk_decode kernel launch");
}

}  // namespace kestrel::cuda
