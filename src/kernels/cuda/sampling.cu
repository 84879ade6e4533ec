// sample_rows: three launches on the caller's stream.
//   1. prepare_kernel (full_sort), one block per row: the row's sort keys (penalised logits), its argmax when
//      greedy, the sort's segment, and for logprobs rows the raw row's lse and best alternatives. Without
//      full_sort head_kernel (below) instead: most rows are drawn there from a sorted head of their candidates,
//      the others are left to 2 and 3 as prepare_kernel leaves them;
//   2. CUB's segmented radix sort of (key, id) for the non-greedy rows (greedy rows have empty segments);
//   3. choose_kernel, one block per non-greedy row: probabilities, cuts and the draw; the sampled token's
//      log-probability for every logprobs row.
// Workspace (each part 256-byte aligned): two regions of rows * vocab (uint32 key, int32 id) pairs, the sort's
// double buffer; the segment offsets; the rows' lse; the rows head_kernel finished; the sort's own scratch in
// what is left. Once sorted, the region the sort does not end in holds the rows' probabilities (rows * vocab
// doubles, the same bytes).
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

// sample_token's log-probabilities of a row (a logprobs row only; the whole block calls it): mx the raw maximum
// (fp32), exp in double, lse = mx + log(total), written to lse_out[r] and returned to every thread; then the
// logprobs best raw tokens (ties: lower id), best first.
__device__ double row_logprobs(const SampleRowsArgs& a, const SampleRowParams& p, int64_t r, const float* raw,
                               int64_t V, KeyId raw_best, double* lse_out, KeyId* key_scratch, double* sum_scratch) {
  // sample_token's log-probabilities: mx the raw maximum (fp32), exp in double, lse = mx + log(total).
  const double mx = key_logit(block_first(raw_best, key_scratch).key);
  double part = 0.0;
  for (int64_t i = threadIdx.x; i < V; i += kThreads) part = __dadd_rn(part, exp(__dsub_rn(raw[i], mx)));
  const double lse = __dadd_rn(mx, log(block_sum(part, sum_scratch)));
  if (threadIdx.x == 0) lse_out[r] = lse;

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
  return lse;
}

__global__ void __launch_bounds__(kThreads) prepare_kernel(SampleRowsArgs a, Prepared w) {
  __shared__ KeyId key_scratch[kWarps];
  __shared__ double sum_scratch[kWarps];
  const int64_t r = blockIdx.x;
  const int64_t V = a.vocab;
  const int64_t base = r * V;
  const int64_t src = source_row(a, r);
  const SampleRowParams p = a.params[r];
  const bool greedy = p.temperature == 0.0f;
  if (threadIdx.x == 0 && a.head_drawn != nullptr) a.head_drawn[r] = src < 0 ? 1 : 0;
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
  row_logprobs(a, p, r, raw, V, raw_best, w.lse, key_scratch, sum_scratch);
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

// sample_token's draw from a row's candidates sorted by (key, id): key and ids hold at least the first
// n = min(top_k or vocab, vocab) of them, prob room for n doubles. Returns the token to every thread.
__device__ int32_t choose_sorted(const uint32_t* key, const int32_t* ids, double* prob, int64_t V,
                                 const SampleRowParams& p, bool masked, double* totals, ScanResult* scan_result,
                                 int64_t* min_scratch) {
  const int64_t n = p.top_k > 0 && p.top_k < V ? p.top_k : V;
  const double top = key_logit(key[0]);
  const double temperature = p.temperature;
  for (int64_t i = threadIdx.x; i < n; i += kThreads)
    prob[i] = exp(__ddiv_rn(__dsub_rn(key_logit(key[i]), top), temperature));
  __syncthreads();
  int64_t keep = n;
  if (p.top_p < 1.0f) {
    const double kept = chunked_scan(prob, n, false, 0.0, Stop::none, 0.0, totals, scan_result).total;
    const int64_t cut = chunked_scan(prob, n, true, kept, Stop::reach, p.top_p, totals, scan_result).first;
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
  if (masked) {
    // As sample_token with a mask: the kept candidates end at the last one of nonzero probability.
    int64_t last = 0;
    for (int64_t i = threadIdx.x; i < keep; i += kThreads)
      if (!(prob[i] == 0.0)) last = max(last, i);
    keep = 1 - block_min(-last, min_scratch);
  }
  const int64_t pick = chunked_scan(prob, keep, false, 0.0, Stop::exceed_scaled, p.uniform, totals, scan_result).first;
  return ids[pick >= 0 ? pick : keep - 1];
}

struct Sorted {
  const uint32_t* keys;  // [rows * vocab], each non-greedy row's segment sorted
  const int32_t* ids;
  double* prob;          // [rows * vocab]
  const double* lse;     // [rows]
  const int32_t* done;   // [rows] or null: rows head_kernel finished (skipped here)
};

__global__ void __launch_bounds__(kThreads) choose_kernel(SampleRowsArgs a, Sorted s) {
  __shared__ double totals[kThreads];
  __shared__ ScanResult scan_result;
  __shared__ int64_t min_scratch[kWarps];
  const int64_t r = blockIdx.x;
  const int64_t src = source_row(a, r);
  if (src < 0 || (s.done != nullptr && s.done[r] != 0)) return;
  const SampleRowParams p = a.params[r];
  const int64_t V = a.vocab;
  int32_t token = 0;
  if (p.temperature != 0.0f) {
    token = choose_sorted(s.keys + r * V, s.ids + r * V, s.prob + r * V, V, p, row_mask(a, r) != nullptr, totals,
                          &scan_result, min_scratch);
    if (threadIdx.x == 0) a.tokens[r] = token;
  } else if (threadIdx.x == 0) {
    token = a.tokens[r];
  }
  if (threadIdx.x == 0 && wants_logprobs(a, p))
    a.token_logprobs[r] = static_cast<float>(__dsub_rn(a.logits[src * V + token], s.lse[r]));
}

// ---------------------------------------------------------------- the head path (sample_rows without full_sort)
//
// head_kernel, one block per row, finds the row's head -- a prefix of its candidates in (key, id) order that holds
// every candidate the draw can reach -- without sorting the vocabulary, sorts only the head and runs
// choose_sorted's arithmetic on it:
//   1. keys (penalties and mask as prepare_kernel) and the row's best key; greedy rows end here.
//   2. a histogram of the candidates over kBins bins of x = (top - l) * 64 / temperature (fp32; 64 bins per nat of
//      log-probability below the best, the last bin everything from 2047/64 nats on): monotone in the logit, so
//      "bin <= b" is a prefix of the sorted candidates made of whole tie groups. A bin b < 2047 holds
//      probabilities p = exp((l - top) / temperature) in [exp(-(b+1)/64), exp(-b/64)] up to the fp32 rounding
//      of x (relative 6e-6, bounded here by kBoundSlack).
//   3. the head's last bin: top-k (0 < top_k < vocab): the bin of the top_k-th candidate. Otherwise the lower of
//      the top-p bin (the first whose lower-bound mass reaches top_p (1 + 1e-6) times the row's upper-bound mass)
//      and the min-p bin (the last whose upper-bound probability reaches min_p). Neither: the whole row.
//   4. the head (at most kHeadCap candidates) compacted as 64-bit (key, id) words, bitonic-sorted in shared
//      memory: exactly the first H candidates of the full sort.
//   5. with all n candidates in the head (top-k, or a short row): choose_sorted as is, the full sort's token.
//      Otherwise (no top-k, n = vocab > H): p_i over the head as choose_sorted's; kept (the top-p divisor) is
//      the head's sum plus the rest of the row's p_i from fp32 exp (the full sort sums every p_i in double in its
//      own order: kept may differ from its by about 1e-10 relative, see sampling.h); the top-p cut walks
//      chunked_scan's chunks of ceil(vocab / 1024) candidates, which up to the cut lie in the head; min-p, the
//      mask and the draw are choose_sorted's over the kept candidates, which lie in the head.
// A row whose head is larger than kHeadCap, whose best logit is not finite, or whose top-p cut is not in its head
// (the bounds make this not happen) is left to the full sort: its keys and ids are written and its sort segment
// set, as prepare_kernel does; choose_kernel then draws it. done[r] says which rows head_kernel finished.
constexpr int kHeadCap = 2048;
constexpr int kUnroll = 16;  // logits each thread loads at once in a pass over the row
constexpr int kBins = 2 * kThreads;
constexpr int kLastBin = kBins - 1;
constexpr double kBoundSlack = 1e-4;

__device__ __forceinline__ int logit_bin(uint32_t key, float top, float scale) {
  const float x = __fmul_rn(__fsub_rn(top, key_logit(key)), scale);
  return x < static_cast<float>(kLastBin) ? static_cast<int>(x) : kLastBin;  // NaN: the last bin
}

// Inclusive prefix sums over the block's threads in a fixed order; *total gets the sum of all.
__device__ __forceinline__ int add_of(int a, int b) { return a + b; }
__device__ __forceinline__ double add_of(double a, double b) { return __dadd_rn(a, b); }

template <typename T>
__device__ T block_inclusive_scan(T v, T* scratch, T* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 1; o < 32; o <<= 1) {
    const T up = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v = add_of(up, v);
  }
  if (lane == 31) scratch[warp] = v;
  __syncthreads();
  T before = T(0), all = T(0);
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before = add_of(before, scratch[w]);
    all = add_of(all, scratch[w]);
  }
  __syncthreads();
  *total = all;
  return warp > 0 ? add_of(before, v) : v;
}

struct HeadSmem {
  union {
    unsigned int hist[kBins];  // steps 2-3
    int32_t ids[kHeadCap];     // step 5: the sorted head's ids
  } a;
  union {
    unsigned long long pairs[kHeadCap];  // step 4: (key << 32) | id
    double prob[kHeadCap];               // step 5
  } b;
  uint32_t keys[kHeadCap];  // step 5: the sorted head's keys
  double totals[kThreads];
  ScanResult scan_result;
  KeyId key_scratch[kWarps];
  double sum_scratch[kWarps];
  int64_t min_scratch[kWarps];
  int int_scratch[kWarps];
  int head_bin, head_size, fill;
  int64_t cut;
};

__global__ void __launch_bounds__(kThreads) head_kernel(SampleRowsArgs a, Prepared w, int32_t* done) {
  __shared__ HeadSmem sm;
  const int64_t r = blockIdx.x;
  const int64_t V = a.vocab;
  const int64_t base = r * V;
  const int64_t src = source_row(a, r);
  const SampleRowParams p = a.params[r];
  const bool greedy = p.temperature == 0.0f;
  const int tid = threadIdx.x, lane = threadIdx.x % 32;
  if (src < 0) {
    if (tid == 0) {
      a.tokens[r] = -1;
      w.seg_begin[r] = w.seg_end[r] = static_cast<int32_t>(base);
      done[r] = 1;
      if (a.head_drawn != nullptr) a.head_drawn[r] = 1;
    }
    return;
  }
  const float* raw = a.logits + src * V;
  uint32_t* key = w.keys + base;
  const uint32_t* mask = row_mask(a, r);
  const bool pen = penalised(p) && a.penalty_offsets != nullptr;
  const bool overrides = pen || mask != nullptr;  // keys differ from the raw logits': kept in w.keys
  const bool logprobs = wants_logprobs(a, p);
  auto key_at = [&](int64_t i) -> uint32_t { return overrides ? key[i] : logit_key(raw[i]); };

  // 1. Keys, the best raw key (log-probabilities) and the best key.
  // The row is read in tiles of kUnroll * kThreads logits, each thread's kUnroll loads issued together.
  KeyId raw_best{0u, -1};
  const bool vec = V % 4 == 0 && reinterpret_cast<uintptr_t>(raw) % 16 == 0;
  // With aligned rows of a multiple of 4 logits: 16 logits a thread at once, as float4s (the row's first read,
  // from memory). Ties go to the lower id whatever the order (first_of).
  for (int64_t q0 = 0; vec && q0 < V / 4; q0 += 4 * kThreads) {
    float4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t q = q0 + j * kThreads + tid;
      v[j] = q < V / 4 ? reinterpret_cast<const float4*>(raw)[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t q = q0 + j * kThreads + tid;
      if (q >= V / 4) break;
      const uint32_t k[4] = {logit_key(v[j].x), logit_key(v[j].y), logit_key(v[j].z), logit_key(v[j].w)};
      if (overrides) reinterpret_cast<uint4*>(key)[q] = make_uint4(k[0], k[1], k[2], k[3]);
#pragma unroll
      for (int e = 0; e < 4; ++e) raw_best = first_of(raw_best, KeyId{k[e], static_cast<int32_t>(4 * q + e)});
    }
  }
  for (int64_t i0 = 0; !vec && i0 < V; i0 += kUnroll * kThreads) {
    float v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = i0 + j * kThreads + tid;
      v[j] = i < V ? raw[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t i = i0 + j * kThreads + tid;
      if (i >= V) break;
      const uint32_t k = logit_key(v[j]);
      if (overrides) key[i] = k;
      if (raw_best.id < 0 || k < raw_best.key) raw_best = KeyId{k, static_cast<int32_t>(i)};
    }
  }
  KeyId best = raw_best;
  if (overrides) {
    if (pen) {
      __syncthreads();  // a penalised token's key was written by another thread
      const int32_t end = a.penalty_offsets[r + 1];
      for (int32_t j = a.penalty_offsets[r] + tid; j < end; j += kThreads) {
        const SamplePenaltyToken t = a.penalty_tokens[j];
        if (t.token >= 0 && t.token < V) key[t.token] = logit_key(penalise(raw[t.token], t, p));
      }
    }
    if (mask != nullptr) {
      __syncthreads();  // a penalised key may have been written by another thread
      const uint32_t masked = logit_key(-INFINITY);
      for (int64_t i = tid; i < V; i += kThreads)
        if (!(mask[i >> 5] >> (i & 31) & 1u)) key[i] = masked;
    }
    __syncthreads();
    best = KeyId{0u, -1};
    for (int64_t i = tid; i < V; i += kThreads) {
      const uint32_t k = key[i];
      if (best.id < 0 || k < best.key) best = KeyId{k, static_cast<int32_t>(i)};
    }
  }
  best = block_first(best, sm.key_scratch);
  const double lse = logprobs ? row_logprobs(a, p, r, raw, V, raw_best, w.lse, sm.key_scratch, sm.sum_scratch) : 0.0;

  bool finished = false;  // block-uniform
  int32_t token = best.id;
  // No top-k, top-p 1 and no min-p in a row longer than kHeadCap: the head is the whole row, larger than the cap,
  // so the row goes straight to the full sort (no histogram pass that could only end there).
  const bool whole_row = V > kHeadCap && !(p.top_k > 0 && p.top_k < V) && p.top_p >= 1.0f && p.min_p <= 0.0f;
  if (greedy) {
    finished = true;
  } else if (!whole_row && isfinite(key_logit(best.key))) {
    const float top = key_logit(best.key);
    const float scale = __fdiv_rn(64.0f, p.temperature);
    const int64_t n = p.top_k > 0 && p.top_k < V ? p.top_k : V;

    // 2. The histogram; each warp adds its equal bins at once.
    for (int b = tid; b < kBins; b += kThreads) sm.a.hist[b] = 0u;
    __syncthreads();
    for (int64_t i0 = 0; i0 < V; i0 += kUnroll * kThreads) {
      int bin[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t i = i0 + j * kThreads + tid;
        bin[j] = i < V ? logit_bin(key_at(i), top, scale) : -1;
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const unsigned same = __match_any_sync(0xffffffffu, bin[j]);
        if (bin[j] >= 0 && __ffs(same) - 1 == lane) atomicAdd(&sm.a.hist[bin[j]], static_cast<unsigned>(__popc(same)));
      }
    }
    __syncthreads();

    // 3. The head's last bin. Thread t holds bins 2t and 2t + 1.
    const int b0 = 2 * tid, b1 = b0 + 1;
    const int c0 = static_cast<int>(sm.a.hist[b0]), c1 = static_cast<int>(sm.a.hist[b1]);
    int count_total = 0;
    const int count1 = block_inclusive_scan(c0 + c1, sm.int_scratch, &count_total);  // through bin b1
    const int count0 = count1 - c1;                                                  // through bin b0
    constexpr int64_t kNone = kLastBin;
    int64_t head_bin = kNone;
    bool minp_covers = false;
    if (n < V) {
      head_bin = block_min(count0 >= n ? b0 : count1 >= n ? b1 : kNone, sm.min_scratch);
    } else {
      auto upper = [](int b) { return exp(-static_cast<double>(b) * (1.0 / 64)) * (1.0 + kBoundSlack); };
      auto lower = [](int b) {
        return b < kLastBin ? exp(-static_cast<double>(b + 1) * (1.0 / 64)) * (1.0 - kBoundSlack) : 0.0;
      };
      int64_t top_p_bin = kNone, min_p_bin = kNone;
      if (p.top_p < 1.0f) {
        const double lo0 = c0 * lower(b0), lo1 = c1 * lower(b1);
        double hi_total = 0.0, lo_total = 0.0;
        block_inclusive_scan(__dadd_rn(c0 * upper(b0), c1 * upper(b1)), sm.sum_scratch, &hi_total);
        const double lo_through1 = block_inclusive_scan(__dadd_rn(lo0, lo1), sm.sum_scratch, &lo_total);
        const double lo_through0 = __dsub_rn(lo_through1, lo1);  // a lower bound too, up to 1e-16 relative
        const double need = static_cast<double>(p.top_p) * hi_total * (1.0 + 1e-6);
        top_p_bin = block_min(lo_through0 >= need ? b0 : lo_through1 >= need ? b1 : kNone, sm.min_scratch);
      }
      if (p.min_p > 0.0f) {
        const double floor = p.min_p;
        const int64_t last = upper(b1) >= floor ? b1 : upper(b0) >= floor ? b0 : -1;
        min_p_bin = -block_min(-last, sm.min_scratch);
        if (min_p_bin < 0) min_p_bin = 0;
      }
      head_bin = min(top_p_bin, min_p_bin);
      minp_covers = p.min_p > 0.0f && min_p_bin <= head_bin;
    }
    if (tid == 0) sm.fill = 0;
    if (b0 == head_bin) sm.head_size = count0;
    if (b1 == head_bin) sm.head_size = count1;
    __syncthreads();
    const int H = sm.head_size;

    if (H <= kHeadCap) {
      // 4. The head, compacted in any order, then sorted by (key, id); the rest of the row's mass when needed.
      const bool approx = n == V && H < V;
      const bool need_rest = approx && p.top_p < 1.0f;
      // The rest's p_i in fp32: exp((l - top) * (1 / temperature)), 1 / temperature in two fp32 parts (no
      // common rounding of every argument); summed in fp32 over a thread's tile, the tiles in double.
      const double inv_t = __ddiv_rn(1.0, static_cast<double>(p.temperature));
      const float inv_hi = __double2float_rn(inv_t);
      const float inv_lo = __double2float_rn(__dsub_rn(inv_t, static_cast<double>(inv_hi)));
      const double top_d = top;
      double rest = 0.0;
      for (int64_t i0 = 0; i0 < V; i0 += kUnroll * kThreads) {
        uint32_t k[kUnroll];
#pragma unroll
        for (int j = 0; j < kUnroll; ++j) {
          const int64_t i = i0 + j * kThreads + tid;
          k[j] = i < V ? key_at(i) : 0u;
        }
        float tile_rest = 0.0f;
#pragma unroll
        for (int j = 0; j < kUnroll; ++j) {
          const int64_t i = i0 + j * kThreads + tid;
          const bool valid = i < V;
          const bool in = valid && logit_bin(k[j], top, scale) <= head_bin;
          if (valid && !in && need_rest) {
            const float d = __fsub_rn(key_logit(k[j]), top);
            const float arg = __fmaf_rn(d, inv_lo, __fmul_rn(d, inv_hi));
            if (arg > -104.0f) tile_rest = __fadd_rn(tile_rest, expf(arg));  // not -inf nor NaN
          }
          const unsigned ballot = __ballot_sync(0xffffffffu, in);
          if (ballot != 0u) {
            int at = 0;
            if (lane == 0) at = atomicAdd(&sm.fill, __popc(ballot));
            at = __shfl_sync(0xffffffffu, at, 0) + __popc(ballot & ((1u << lane) - 1u));
            if (in && at < kHeadCap)
              sm.b.pairs[at] = (static_cast<unsigned long long>(k[j]) << 32) | static_cast<unsigned long long>(i);
          }
        }
        if (need_rest) rest = __dadd_rn(rest, static_cast<double>(tile_rest));
      }
      if (need_rest) rest = block_sum(rest, sm.sum_scratch);
      __syncthreads();
      int N = 1;
      while (N < H) N <<= 1;
      for (int i = H + tid; i < N; i += kThreads) sm.b.pairs[i] = ~0ull;
      __syncthreads();
      for (int k = 2; k <= N; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
          for (int i = tid; i < N; i += kThreads) {
            const int partner = i ^ j;
            if (partner > i) {
              const unsigned long long x = sm.b.pairs[i], y = sm.b.pairs[partner];
              if ((x > y) == ((i & k) == 0)) {
                sm.b.pairs[i] = y;
                sm.b.pairs[partner] = x;
              }
            }
          }
          __syncthreads();
        }
      uint32_t hk[kHeadCap / kThreads];
      int32_t hid[kHeadCap / kThreads];
#pragma unroll
      for (int j = 0; j < kHeadCap / kThreads; ++j) {
        const int i = tid + j * kThreads;
        const unsigned long long x = i < H ? sm.b.pairs[i] : 0ull;
        hk[j] = static_cast<uint32_t>(x >> 32);
        hid[j] = static_cast<int32_t>(x & 0xffffffffull);
      }
      __syncthreads();  // pairs share their bytes with prob, hist with ids
#pragma unroll
      for (int j = 0; j < kHeadCap / kThreads; ++j) {
        const int i = tid + j * kThreads;
        if (i < H) {
          sm.keys[i] = hk[j];
          sm.a.ids[i] = hid[j];
        }
      }
      __syncthreads();

      // 5. The draw.
      if (!approx) {
        token = choose_sorted(sm.keys, sm.a.ids, sm.b.prob, V, p, mask != nullptr, sm.totals, &sm.scan_result,
                              sm.min_scratch);
        finished = true;
      } else {
        double* prob = sm.b.prob;
        const double temperature = p.temperature;
        for (int i = tid; i < H; i += kThreads)
          prob[i] = exp(__ddiv_rn(__dsub_rn(key_logit(sm.keys[i]), top_d), temperature));
        __syncthreads();
        bool ok = true, have_cut = false;
        int64_t keep = H;
        if (p.top_p < 1.0f) {
          double part = 0.0;
          for (int i = tid; i < H; i += kThreads) part = __dadd_rn(part, prob[i]);
          const double kept = __dadd_rn(block_sum(part, sm.sum_scratch), rest);
          // chunked_scan's cut: chunks of c candidates, thread 0 adding the chunk sums in order. The chunks
          // before the one of the cut lie in the head; the cut's chunk is walked up to the cut.
          const int64_t c = (V + kThreads - 1) / kThreads;
          const int64_t full = H / c;
          const double target = p.top_p;
          for (int64_t t = tid; t < full; t += kThreads) {
            double s = 0.0;
            for (int64_t i = t * c; i < t * c + c; ++i) s = __dadd_rn(s, __ddiv_rn(prob[i], kept));
            sm.totals[t] = s;
          }
          __syncthreads();
          if (tid == 0) {
            double running = 0.0;
            int64_t cut = -1, t = 0;
            for (; t < full; ++t) {
              const double next = __dadd_rn(running, sm.totals[t]);
              if (next >= target) break;
              running = next;
            }
            double local = 0.0;
            for (int64_t i = t * c; i < min(static_cast<int64_t>(H), t * c + c); ++i) {
              local = __dadd_rn(local, __ddiv_rn(prob[i], kept));
              if (__dadd_rn(running, local) >= target) {
                cut = i;
                break;
              }
            }
            sm.cut = cut;
          }
          __syncthreads();
          const int64_t cut = sm.cut;
          if (cut >= 0) {
            keep = cut + 1;
            have_cut = true;
          } else if (!minp_covers) {
            ok = false;
          }
        }
        if (ok) {
          if (p.min_p > 0.0f) {
            // Every candidate past the head is below the floor (min-p bin), so without a cut the first one below
            // it is in the head or the head's end.
            const double floor = __dmul_rn(p.min_p, prob[0]);
            int64_t first = keep;
            for (int64_t i = 1 + tid; i < keep; i += kThreads)
              if (!(prob[i] >= floor)) {
                first = i;
                break;
              }
            keep = block_min(first, sm.min_scratch);
          } else if (!have_cut) {
            ok = false;  // not reached: without min-p and a cut the head is the whole row
          }
        }
        if (ok) {
          if (mask != nullptr) {
            int64_t last = 0;
            for (int64_t i = tid; i < keep; i += kThreads)
              if (!(prob[i] == 0.0)) last = max(last, i);
            keep = 1 - block_min(-last, sm.min_scratch);
          }
          const int64_t pick =
              chunked_scan(prob, keep, false, 0.0, Stop::exceed_scaled, p.uniform, sm.totals, &sm.scan_result).first;
          token = sm.a.ids[pick >= 0 ? pick : keep - 1];
          finished = true;
        }
      }
    }
  }

  if (finished) {
    if (tid == 0) {
      a.tokens[r] = token;
      if (logprobs) a.token_logprobs[r] = static_cast<float>(__dsub_rn(raw[token], lse));
      w.seg_begin[r] = w.seg_end[r] = static_cast<int32_t>(base);
      done[r] = 1;
      if (a.head_drawn != nullptr) a.head_drawn[r] = 1;
    }
    return;
  }
  // Left to the full sort, as prepare_kernel leaves a row.
  for (int64_t i = tid; i < V; i += kThreads) {
    if (!overrides) key[i] = logit_key(raw[i]);
    w.ids[base + i] = static_cast<int32_t>(i);
  }
  if (tid == 0) {
    w.seg_begin[r] = static_cast<int32_t>(base);
    w.seg_end[r] = static_cast<int32_t>(base + V);
    done[r] = 0;
    if (a.head_drawn != nullptr) a.head_drawn[r] = 0;
  }
}

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Layout {
  size_t region[2];  // each: rows * vocab keys, then as many ids; later rows * vocab doubles
  size_t seg_begin, seg_end, lse, done, sort;
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
  l.done = l.lse + align_up(static_cast<size_t>(rows) * sizeof(double));
  l.sort = l.done + offsets;
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
  int32_t* done = args.full_sort ? nullptr : reinterpret_cast<int32_t*>(base + l.done);
  if (args.full_sort)
    prepare_kernel<<<grid, kThreads, 0, stream>>>(args, prepared);
  else
    head_kernel<<<grid, kThreads, 0, stream>>>(args, prepared, done);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || (args.greedy_only && !args.full_sort)) return e;  // greedy rows end in head_kernel

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
                      reinterpret_cast<double*>(base + l.region[sort_keys.selector ^ 1]), prepared.lse, done};
  choose_kernel<<<grid, kThreads, 0, stream>>>(args, sorted);
  return cudaGetLastError();
}

}  // namespace detail

}  // namespace kestrel::cuda
