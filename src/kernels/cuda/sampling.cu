// sample_rows: three launches on the caller's stream.
//   1. prepare_kernel, one block per row: the row's sort keys (penalised logits), its argmax when greedy, the
//      sort's segment, and for logprobs rows the raw row's lse and best alternatives;
//   2. CUB's segmented radix sort of (key, id) for the non-greedy rows (greedy rows have empty segments);
//   3. choose_kernel, one block per non-greedy row: probabilities, cuts and the draw; the sampled token's
//      log-probability for every logprobs row.
// Workspace (each part 256-byte aligned): two regions of rows * vocab (uint32 key, int32 id) pairs, the sort's
// double buffer; the segment offsets; the rows' lse; the sort's own scratch in what is left. Once sorted, the
// region the sort does not end in holds the rows' probabilities (rows * vocab doubles, the same bytes).
#include <cub/device/device_segmented_radix_sort.cuh>

#include <cstdint>

#include "kernels/cuda/sampling.h"

namespace kestrel::cuda {

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr size_t kAlign = 256;

// Sort key of a logit: ascending keys are descending logits, -0 and +0 share a key (the CPU compares them equal),
// every NaN gets the largest key (last). Bijective on the other values, so a key gives its logit back.
__device__ __forceinline__ uint32_t logit_key(float v) {
  if (isnan(v)) return 0xFFFFFFFFu;
  const uint32_t bits = __float_as_uint(v == 0.0f ? 0.0f : v);
  const uint32_t ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return ~ordered;
}

__device__ __forceinline__ float key_logit(uint32_t key) {
  const uint32_t ordered = ~key;
  return __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7FFFFFFFu) : ~ordered);
}

// sample_token applies penalties only when one is on.
__device__ __forceinline__ bool penalised(const SampleRowParams& p) {
  return p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f || p.repetition_penalty != 1.0f;
}

// sample_token's penalties for one listed token, each fp32 operation rounded on its own as on the host (built with
// -ffp-contract=off): nvcc would otherwise fuse the product and the sum.
__device__ __forceinline__ float penalise(float l, const SamplePenaltyToken& t, const SampleRowParams& p) {
  const float r = p.repetition_penalty;
  if (r != 1.0f) l = l > 0.0f ? __fdiv_rn(l, r) : __fmul_rn(l, r);
  if (t.generated > 0)
    l = __fsub_rn(l, __fadd_rn(__fmul_rn(p.frequency_penalty, static_cast<float>(t.generated)), p.presence_penalty));
  return l;
}

// A candidate of a block-wide "first": the smaller key, on equal keys the lower id; id < 0: none.
struct KeyId {
  uint32_t key;
  int32_t id;
};

__device__ __forceinline__ KeyId first_of(KeyId a, KeyId b) {
  if (b.id < 0) return a;
  if (a.id < 0) return b;
  return (b.key < a.key || (b.key == a.key && b.id < a.id)) ? b : a;
}

// The first of every thread's candidate, returned to every thread. first_of is commutative and associative, so
// the result does not depend on the order.
__device__ KeyId block_first(KeyId v, KeyId* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = first_of(v, KeyId{__shfl_xor_sync(0xffffffffu, v.key, offset), __shfl_xor_sync(0xffffffffu, v.id, offset)});
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  KeyId total = scratch[0];
  for (int w = 1; w < kWarps; ++w) total = first_of(total, scratch[w]);
  __syncthreads();
  return total;
}

// The sum of every thread's value in a fixed order (a butterfly within each warp, then the warps in order),
// returned to every thread.
__device__ double block_sum(double v, double* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  double total = scratch[0];
  for (int w = 1; w < kWarps; ++w) total = __dadd_rn(total, scratch[w]);
  __syncthreads();
  return total;
}

__device__ int64_t block_min(int64_t v, int64_t* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v = min(v, static_cast<int64_t>(__shfl_xor_sync(0xffffffffu, v, offset)));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  int64_t total = scratch[0];
  for (int w = 1; w < kWarps; ++w) total = min(total, scratch[w]);
  __syncthreads();
  return total;
}

// The row a sampled row reads; -1 when out of range (the row is skipped and gets token -1).
__device__ __forceinline__ int64_t source_row(const SampleRowsArgs& a, int64_t r) {
  const int64_t src = a.source_rows ? a.source_rows[r] : r;
  return src >= 0 && src < a.logit_rows ? src : -1;
}

// Row r's token mask, or null.
__device__ __forceinline__ const uint32_t* row_mask(const SampleRowsArgs& a, int64_t r) {
  if (a.token_masks == nullptr) return nullptr;
  const int64_t m = a.mask_index ? a.mask_index[r] : r;
  return m < 0 ? nullptr : a.token_masks + m * a.mask_words;
}

__device__ __forceinline__ bool wants_logprobs(const SampleRowsArgs& a, const SampleRowParams& p) {
  return p.logprobs >= 0 && a.token_logprobs != nullptr;
}

struct Prepared {
  uint32_t* keys;      // [rows * vocab] the sort's input
  int32_t* ids;        // [rows * vocab]
  int32_t* seg_begin;  // [rows]
  int32_t* seg_end;    // [rows]
  double* lse;         // [rows]
};

__global__ void __launch_bounds__(kThreads) prepare_kernel(SampleRowsArgs a, Prepared w) {
  __shared__ KeyId key_scratch[kWarps];
  __shared__ double sum_scratch[kWarps];
  const int64_t r = blockIdx.x;
  const int64_t V = a.vocab;
  const int64_t base = r * V;
  const int64_t src = source_row(a, r);
  const SampleRowParams p = a.params[r];
  const bool greedy = p.temperature == 0.0f;
  if (src < 0) {
    if (threadIdx.x == 0) {
      a.tokens[r] = -1;
      w.seg_begin[r] = w.seg_end[r] = static_cast<int32_t>(base);
    }
    return;
  }
  const float* raw = a.logits + src * V;
  uint32_t* key = w.keys + base;
  const bool logprobs = wants_logprobs(a, p);

  KeyId raw_best{0u, -1};
  for (int64_t i = threadIdx.x; i < V; i += kThreads) {
    const uint32_t k = logit_key(raw[i]);
    key[i] = k;
    if (!greedy) w.ids[base + i] = static_cast<int32_t>(i);
    if (raw_best.id < 0 || k < raw_best.key) raw_best = KeyId{k, static_cast<int32_t>(i)};
  }
  if (penalised(p) && a.penalty_offsets != nullptr) {
    __syncthreads();  // a penalised token's key was written by another thread
    const int32_t end = a.penalty_offsets[r + 1];
    for (int32_t j = a.penalty_offsets[r] + threadIdx.x; j < end; j += kThreads) {
      const SamplePenaltyToken t = a.penalty_tokens[j];
      if (t.token >= 0 && t.token < V) key[t.token] = logit_key(penalise(raw[t.token], t, p));
    }
  }
  if (const uint32_t* mask = row_mask(a, r)) {
    __syncthreads();  // a penalised key may have been written by another thread
    const uint32_t masked = logit_key(-INFINITY);
    for (int64_t i = threadIdx.x; i < V; i += kThreads)
      if (!(mask[i >> 5] >> (i & 31) & 1u)) key[i] = masked;
  }
  __syncthreads();

  if (greedy) {
    KeyId best{0u, -1};
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
      const uint32_t k = key[i];
      if (best.id < 0 || k < best.key) best = KeyId{k, static_cast<int32_t>(i)};
    }
    best = block_first(best, key_scratch);
    if (threadIdx.x == 0) a.tokens[r] = best.id;
  }
  if (threadIdx.x == 0) {
    w.seg_begin[r] = static_cast<int32_t>(base);
    w.seg_end[r] = static_cast<int32_t>(greedy ? base : base + V);
  }
  if (!logprobs) return;

  // sample_token's log-probabilities: mx the raw maximum (fp32), exp in double, lse = mx + log(total).
  const double mx = key_logit(block_first(raw_best, key_scratch).key);
  double part = 0.0;
  for (int64_t i = threadIdx.x; i < V; i += kThreads) part = __dadd_rn(part, exp(__dsub_rn(raw[i], mx)));
  const double lse = __dadd_rn(mx, log(block_sum(part, sum_scratch)));
  if (threadIdx.x == 0) w.lse[r] = lse;

  // The best raw tokens, best first (ties: lower id): each round takes the first key after the previous one.
  const int n_top = static_cast<int>(min(static_cast<int64_t>(min(p.logprobs, a.max_top_logprobs)), V));
  KeyId prev{0u, -1};
  for (int j = 0; j < n_top; ++j) {
    KeyId best{0u, -1};
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
      const uint32_t k = logit_key(raw[i]);
      const bool after = prev.id < 0 || k > prev.key || (k == prev.key && i > prev.id);
      if (after && (best.id < 0 || k < best.key)) best = KeyId{k, static_cast<int32_t>(i)};
    }
    best = block_first(best, key_scratch);
    if (best.id < 0) break;
    if (threadIdx.x == 0) {
      a.top_ids[r * a.max_top_logprobs + j] = best.id;
      a.top_logprobs[r * a.max_top_logprobs + j] = static_cast<float>(__dsub_rn(raw[best.id], lse));
    }
    prev = best;
  }
}

enum class Stop { none, reach, exceed_scaled };

struct ScanResult {
  double total;
  int64_t first;  // the first candidate whose cumulative sum stops the scan; -1: none
};

__device__ __forceinline__ bool stops(Stop stop, double cum, double threshold) {
  return stop == Stop::reach ? cum >= threshold : threshold < cum;
}

__device__ __forceinline__ double term(const double* prob, int64_t i, bool divide, double divisor) {
  return divide ? __ddiv_rn(prob[i], divisor) : prob[i];
}

// Cumulative sums of term(i) over i < n (n >= 1): thread t sums its chunk [t c, t c + c), c = ceil(n / kThreads),
// sequentially from 0; thread 0 adds the chunk sums one after the other (prefix_t before chunk t; the total
// after the last); the cumulative sum at i in chunk t is fl(prefix_t + the chunk's sum up to i). The sum at a
// chunk's end is then exactly prefix_{t+1}, so the sums never decrease and a zero term never raises them; with
// n <= kThreads every chunk is one term and this is the plain sequential sum. Stop::reach: the first i whose
// sum is >= threshold; Stop::exceed_scaled: the first i whose sum exceeds threshold * total. The first such
// chunk is found from the prefixes, then walked by thread 0. Called by the whole block; all threads get the result.
__device__ ScanResult chunked_scan(const double* prob, int64_t n, bool divide, double divisor, Stop stop,
                                   double threshold, double* totals, ScanResult* result) {
  const int64_t chunk = (n + kThreads - 1) / kThreads;
  {
    const int64_t b = min(n, int64_t{threadIdx.x} * chunk), e = min(n, b + chunk);
    double local = 0.0;
    for (int64_t i = b; i < e; ++i) local = __dadd_rn(local, term(prob, i, divide, divisor));
    totals[threadIdx.x] = local;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double running = 0.0;
    for (int t = 0; t < kThreads; ++t) {
      const double s = totals[t];
      totals[t] = running;
      running = __dadd_rn(running, s);
    }
    const double total = running;
    const double limit = stop == Stop::exceed_scaled ? __dmul_rn(threshold, total) : threshold;
    int64_t first = -1;
    if (stop != Stop::none) {
      for (int t = 0; t < kThreads && first < 0; ++t) {
        if (!stops(stop, t + 1 < kThreads ? totals[t + 1] : total, limit)) continue;
        const int64_t b = min(n, int64_t{t} * chunk), e = min(n, b + chunk);
        double local = 0.0;
        for (int64_t i = b; i < e; ++i) {
          local = __dadd_rn(local, term(prob, i, divide, divisor));
          if (stops(stop, __dadd_rn(totals[t], local), limit)) {
            first = i;
            break;
          }
        }
      }
    }
    *result = ScanResult{total, first};
  }
  __syncthreads();
  return *result;
}

struct Sorted {
  const uint32_t* keys;  // [rows * vocab], each non-greedy row's segment sorted
  const int32_t* ids;
  double* prob;          // [rows * vocab]
  const double* lse;     // [rows]
};

__global__ void __launch_bounds__(kThreads) choose_kernel(SampleRowsArgs a, Sorted s) {
  __shared__ double totals[kThreads];
  __shared__ ScanResult scan_result;
  __shared__ int64_t min_scratch[kWarps];
  const int64_t r = blockIdx.x;
  const int64_t src = source_row(a, r);
  if (src < 0) return;
  const SampleRowParams p = a.params[r];
  const int64_t V = a.vocab;
  int32_t token = 0;
  if (p.temperature != 0.0f) {
    const uint32_t* key = s.keys + r * V;
    double* prob = s.prob + r * V;
    const int64_t n = p.top_k > 0 && p.top_k < V ? p.top_k : V;
    const double top = key_logit(key[0]);
    const double temperature = p.temperature;
    for (int64_t i = threadIdx.x; i < n; i += kThreads)
      prob[i] = exp(__ddiv_rn(__dsub_rn(key_logit(key[i]), top), temperature));
    __syncthreads();
    int64_t keep = n;
    if (p.top_p < 1.0f) {
      const double kept = chunked_scan(prob, n, false, 0.0, Stop::none, 0.0, totals, &scan_result).total;
      const int64_t cut = chunked_scan(prob, n, true, kept, Stop::reach, p.top_p, totals, &scan_result).first;
      if (cut >= 0) keep = cut + 1;
    }
    if (p.min_p > 0.0f) {
      const double floor = __dmul_rn(p.min_p, prob[0]);
      int64_t first = keep;
      for (int64_t i = 1 + threadIdx.x; i < keep; i += kThreads)
        if (!(prob[i] >= floor)) {
          first = i;
          break;
        }
      keep = block_min(first, min_scratch);
    }
    if (row_mask(a, r) != nullptr) {
      // As sample_token with a mask: the kept candidates end at the last one of nonzero probability.
      int64_t last = 0;
      for (int64_t i = threadIdx.x; i < keep; i += kThreads)
        if (!(prob[i] == 0.0)) last = max(last, i);
      keep = 1 - block_min(-last, min_scratch);
    }
    const int64_t pick =
        chunked_scan(prob, keep, false, 0.0, Stop::exceed_scaled, p.uniform, totals, &scan_result).first;
    token = s.ids[r * V + (pick >= 0 ? pick : keep - 1)];
    if (threadIdx.x == 0) a.tokens[r] = token;
  } else if (threadIdx.x == 0) {
    token = a.tokens[r];
  }
  if (threadIdx.x == 0 && wants_logprobs(a, p))
    a.token_logprobs[r] = static_cast<float>(__dsub_rn(a.logits[src * V + token], s.lse[r]));
}

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Layout {
  size_t region[2];  // each: rows * vocab keys, then as many ids; later rows * vocab doubles
  size_t seg_begin, seg_end, lse, sort;
};

Layout layout(int64_t rows, int64_t vocab) {
  const size_t n = static_cast<size_t>(rows * vocab);
  const size_t region = align_up(n * (sizeof(uint32_t) + sizeof(int32_t)));
  const size_t offsets = align_up(static_cast<size_t>(rows) * sizeof(int32_t));
  Layout l{};
  l.region[0] = 0;
  l.region[1] = region;
  l.seg_begin = 2 * region;
  l.seg_end = l.seg_begin + offsets;
  l.lse = l.seg_end + offsets;
  l.sort = l.lse + align_up(static_cast<size_t>(rows) * sizeof(double));
  return l;
}

}  // namespace

namespace detail {

cudaError_t sample_rows_workspace_bytes(int64_t rows, int64_t vocab, size_t* bytes) {
  cub::DoubleBuffer<uint32_t> keys(nullptr, nullptr);
  cub::DoubleBuffer<int32_t> ids(nullptr, nullptr);
  size_t sort_bytes = 0;
  const cudaError_t e = cub::DeviceSegmentedRadixSort::SortPairs(
      nullptr, sort_bytes, keys, ids, static_cast<int>(rows * vocab), static_cast<int>(rows),
      static_cast<const int32_t*>(nullptr), static_cast<const int32_t*>(nullptr), 0, 32);
  *bytes = layout(rows, vocab).sort + align_up(sort_bytes);
  return e;
}

cudaError_t launch_sample_rows(const SampleRowsArgs& args, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream) {
  const Layout l = layout(args.rows, args.vocab);
  char* base = static_cast<char*>(workspace);
  const size_t n = static_cast<size_t>(args.rows * args.vocab);
  uint32_t* keys[2];
  int32_t* ids[2];
  for (int b = 0; b < 2; ++b) {
    keys[b] = reinterpret_cast<uint32_t*>(base + l.region[b]);
    ids[b] = reinterpret_cast<int32_t*>(base + l.region[b] + n * sizeof(uint32_t));
  }
  const Prepared prepared{keys[0], ids[0], reinterpret_cast<int32_t*>(base + l.seg_begin),
                          reinterpret_cast<int32_t*>(base + l.seg_end), reinterpret_cast<double*>(base + l.lse)};
  const unsigned grid = static_cast<unsigned>(args.rows);
  prepare_kernel<<<grid, kThreads, 0, stream>>>(args, prepared);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;

  cub::DoubleBuffer<uint32_t> sort_keys(keys[0], keys[1]);
  cub::DoubleBuffer<int32_t> sort_ids(ids[0], ids[1]);
  size_t sort_bytes = workspace_bytes - l.sort;
  e = cub::DeviceSegmentedRadixSort::SortPairs(base + l.sort, sort_bytes, sort_keys, sort_ids,
                                               static_cast<int>(n), static_cast<int>(args.rows),
                                               static_cast<const int32_t*>(prepared.seg_begin),
                                               static_cast<const int32_t*>(prepared.seg_end), 0, 32, stream);
  if (e != cudaSuccess) return e;

  // The sort chose its final buffer on the host (from its pass count); the other region is free.
  const Sorted sorted{sort_keys.Current(), sort_ids.Current(),
                      reinterpret_cast<double*>(base + l.region[sort_keys.selector ^ 1]), prepared.lse};
  choose_kernel<<<grid, kThreads, 0, stream>>>(args, sorted);
  return cudaGetLastError();
}

}  // namespace detail

}  // namespace kestrel::cuda
