// Token sampling on the GPU: kestrel::sample_token (src/engine/sampler.h, sampler.cpp; what Sampler::sample does
// with a sequence's state) for many rows at once, so that a step returns token ids (and log-probabilities) instead
// of its logits.
//
// Division of work. The host keeps each sequence's state (its Sampler: random stream, prompt tokens, counts of
// generated tokens). Per sampled row it passes
//   - the uniform Sampler::draw_uniform() returns: (next_random() >> 11) * 2^-53, the value sample_token
//     multiplies by the mass (0, with the stream not advanced, for a greedy row);
//   - the sampling parameters (SampleRowParams, from SamplingParams validated by SamplingParams::validate);
//   - Sampler::penalty_tokens() as a CSR list of distinct (token, generated count) pairs (SamplePenaltyToken).
// After the call the host counts the sampled token (Sampler::accept).
//
// The transformations are sample_token's, in its order:
//   0. a row with a token mask: the tokens outside it are -inf (then penalised, which keeps them -inf);
//   1. penalties (only when presence or frequency != 0 or repetition != 1): repetition first, for every listed
//      token (l > 0 ? l / r : l * r) when r != 1, then l -= frequency * count + presence for every listed token
//      with count >= 1; fp32 operations in that order, rounded one by one (no contraction into FMAs);
//   2. temperature 0: the first maximum of the penalised row (ties: the lower id);
//   3. otherwise candidates by decreasing penalised logit, ties by increasing id (-0 equals +0), cut to the top_k
//      best when 0 < top_k < vocab; p_i = exp((double(l_i) - top) / double(temperature)) in double, top the best
//      logit; top_p < 1: the shortest head whose sum of fl(p_i / kept) reaches top_p (kept: the sum of the p_i);
//      min_p > 0: the head before the first p_i < double(min_p) * p_0; then u * mass (mass: the sum of the kept
//      p_i) and the first candidate whose cumulative sum exceeds it (none: the last kept candidate).
//   Log-probabilities (a row with logprobs >= 0) are the raw row's, as the CPU's: float(double(raw[t]) - lse) with
//   lse = max + log(sum exp(double(raw_i) - max)), and the logprobs best raw tokens (ties: lower id), best first.
//
// Where the result is the CPU's exactly and where it cannot be:
//   - penalties, the greedy token, the candidate order (top-k set and ties included), every p_i's arithmetic, the
//     min-p cut and u * mass are the CPU's operations; the greedy token is always the CPU's.
//   - exp and log are CUDA's (at most 1 ulp from the exact value), the host's are glibc's (correctly rounded
//     except in rare cases): a p_i may differ from the CPU's in its last bit.
//   - sums. The CPU sums sequentially in candidate order. Here each of 1024 threads sums a contiguous chunk of
//     ceil(n / 1024) candidates sequentially from 0, thread 0 adds the chunk sums one after the other, and the
//     cumulative sum at candidate i is fl(sum of the chunks before + the chunk's sum up to i). With n <= 1024
//     candidates (top_k <= 1024, or a small vocabulary) a chunk is one candidate and this is the CPU's very
//     sequence of roundings; above, the order differs. Either way the cumulative sums are nondecreasing and a
//     candidate with p_i = 0 never adds to them, so a zero-probability token is never drawn (u < 1 gives
//     u * mass < mass).
//   So the sampled token equals the CPU's unless the scaled uniform u * mass lies within
//   B = 2 (n + ceil(n / 1024) + 1030) * 2^-53 * mass of the cumulative sum at a candidate boundary (n: the
//   candidates after the top-k cut; the CPU's recursive sum is within (n - 1) 2^-53 mass of the exact sum, this
//   one within (ceil(n / 1024) + 1025) 2^-53 mass, a p_i within 1.5 ulp of the CPU's, and u * mass follows the
//   mass), or top_p lies within B / mass of the top-p head's cumulative sum, or a p_i within 2 ulp of the min-p
//   floor. There the token may be a neighbour in candidate order. The uniform lands there with probability about
//   2 B / mass per row.
//   - log-probabilities: the lse sum runs in another order than the CPU's and log is CUDA's, so lse differs from
//     the CPU's by at most (vocab + vocab / 1024 + 48 + 8 (|lse| + |max logit|)) 2^-53; a log-probability is within
//     that plus one fp32 ulp of the CPU's (for most rows it is equal). The alternatives' ids and order are exact.
// NaN logits: the CPU's sort is undefined for them; here a NaN sorts last and the row's token is unspecified (no
// fault).
//
// Cost and the head path. With full_sort every non-greedy row is fully sorted (one CUB segmented radix sort over
// 32-bit keys, one block per row), then at most five passes over its candidates. Without (the default) a row's
// head -- the first H of its sorted candidates, found from a histogram of its log-probabilities, holding every
// candidate its top-k, top-p or min-p cut can keep -- is sorted alone (H <= 2048) and the same arithmetic runs on
// it (sampling.cu, head_kernel), so the token is the full sort's:
//   - bit for bit whenever the top-k cut leaves at most the head (top_k <= 2048 without ties across the head's
//     end), or top_p = 1 (min-p rows);
//   - otherwise (top_p < 1 without top-k) the top-p divisor `kept`, the sum of every p_i, is the head's sum (its
//     p_i exact, in another order) plus the rest of the row's p_i from fp32 exp: within about 1e-10 relative of
//     the full sort's for ordinary rows (the rest's fp32 errors are independent roundings of about 1e-7 each and
//     its share of the mass is at most 1 - top_p; about 1e-7 relative at worst), and the token differs only where
//     top_p lies that close to a cumulative sum at the cut (the uniform and everything else are the full sort's).
// Rows whose head is too large (top_p = 1 and min_p = 0 without a short top-k; flat rows), or whose best logit is
// not finite, take the full sort. Greedy rows only have their argmax. A row asking for logprobs alternatives costs
// one pass over the vocabulary per alternative.
//
// All pointers are device pointers; the call is asynchronous on its stream, allocates nothing, reads no device
// data on the host and is deterministic (CUDA-graph capturable). Argument errors throw kestrel::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kestrel::cuda {

constexpr int64_t kMaxSampleVocab = 262144;
// Alternatives per row the GPU returns; a request asking for more keeps its sampling on the host.
constexpr int kMaxSampleTopLogprobs = 20;

// One sampled row's parameters, as kestrel::SamplingParams (validated there).
struct SampleRowParams {
  double uniform = 0.0;  // Sampler::draw_uniform(), in [0, 1)
  float temperature = 0.0f;  // 0: greedy
  float top_p = 1.0f;
  float min_p = 0.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;
  int32_t top_k = 0;     // 0: all
  int32_t logprobs = -1;  // >= 0: the sampled token's log-probability and min(logprobs, max_top_logprobs) best
};

// A token of a row's penalty list (kestrel::PenaltyToken without its in_prompt flag, which sample_token does not
// read): in the prompt, or generated `generated` >= 1 times, or both. Tokens of one row are distinct.
struct SamplePenaltyToken {
  int32_t token = 0;
  int32_t generated = 0;
};

struct SampleRowsArgs {
  const float* logits = nullptr;  // [logit_rows, vocab] fp32, the model's raw logits
  int64_t logit_rows = 0;
  int64_t vocab = 0;
  int64_t rows = 0;                       // rows to sample
  const int32_t* source_rows = nullptr;   // [rows]: the logits row of each sampled row (the n completions of a
                                          // prompt sample its last row); null: row r samples logits row r
  const SampleRowParams* params = nullptr;  // [rows]
  // Penalty lists in CSR form: row r's tokens are penalty_tokens[penalty_offsets[r] .. penalty_offsets[r + 1]).
  // Both null: every list is empty. Ids outside the vocabulary are skipped.
  const int32_t* penalty_offsets = nullptr;  // [rows + 1]
  const SamplePenaltyToken* penalty_tokens = nullptr;
  // Structured output (optional): the tokens a row may choose, bit t of word t / 32 of its mask; a token outside it
  // is -inf before penalties, temperature, top-k, top-p and min-p (sample_token's `allowed`), and a masked row's
  // draw never falls back to a candidate of probability 0. Row r's mask is token_masks + mask_index[r] *
  // mask_words (mask_index[r] < 0: none), or token_masks + r * mask_words when mask_index is null. Every mask
  // must allow at least one token.
  const uint32_t* token_masks = nullptr;
  const int32_t* mask_index = nullptr;  // [rows]
  int64_t mask_words = 0;               // >= ceil(vocab / 32) when token_masks is set
  int32_t* tokens = nullptr;  // [rows] out: the sampled tokens
  // Optional outputs, written for rows with logprobs >= 0 only: the sampled token's log-probability, and the first
  // min(logprobs, max_top_logprobs) entries of the row's alternatives (the rest of the row is not written).
  float* token_logprobs = nullptr;  // [rows]
  int32_t* top_ids = nullptr;       // [rows, max_top_logprobs]
  float* top_logprobs = nullptr;    // [rows, max_top_logprobs]
  int max_top_logprobs = 0;         // 0..kMaxSampleTopLogprobs; > 0 needs top_ids and top_logprobs
  // true: every non-greedy row sorts its whole vocabulary (the reference for the head path; see "Cost" above).
  bool full_sort = false;
  // The caller's promise that every row is greedy (temperature 0; the host built the params): then no row can
  // need the full sort, and without full_sort the call is one launch instead of the sort's and the draw's too.
  // A non-greedy row under it gets no token.
  bool greedy_only = false;
  // Optional [rows] out (tests, benchmarks): 1 where the head path drew the row (greedy rows included), 0 where
  // the full sort did (every row with full_sort; skipped rows: 1).
  int32_t* head_drawn = nullptr;
};

// Device scratch sample_rows needs for `rows` rows of `vocab` logits on the current device: about 16 bytes per
// logit plus the sort's own scratch. rows * vocab must stay below 2^31.
size_t sample_rows_workspace_bytes(int64_t rows, int64_t vocab);

// Samples every row as described above. workspace: at least sample_rows_workspace_bytes(args.rows, args.vocab)
// bytes, 256-byte aligned; one call at a time may use it.
void sample_rows(const SampleRowsArgs& args, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// The kernels and the sort behind sample_rows (sampling.cu), called once the arguments are checked
// (sampling.cpp).
namespace detail {
cudaError_t sample_rows_workspace_bytes(int64_t rows, int64_t vocab, size_t* bytes);
cudaError_t launch_sample_rows(const SampleRowsArgs& args, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream);
}  // namespace detail

}  // namespace kestrel::cuda
