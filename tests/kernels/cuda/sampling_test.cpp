// GPU sampling (cuda::sample_rows) against the CPU sampler's arithmetic.
//
// The reference is kestrel::sample_token (src/engine/sampler.cpp), with the penalty list a sequence's Sampler
// hands it (Sampler::penalty_tokens). This test links only the kernel libraries, not the engine, so
// reference_sample and penalty_list below are line-for-line copies of those two functions (the uniform is an
// argument of sample_token, so uniforms at 0, next to 1 and on cumulative boundaries can be tested), recording the
// intermediate values the checks need. They must follow sampler.cpp: a change there is a change here.
#include "kernels/cuda/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::cuda {
namespace {

constexpr double kEps = 0x1p-53;  // half an ulp of 1 in double
constexpr double kAlmostOne = 1.0 - 0x1p-53;

// A sequence's penalty state as Sampler keeps it: its prompt and how often it generated each token.
struct PenaltyState {
  std::vector<int32_t> prompt;
  std::map<int32_t, int> generated;
};

bool penalised(const SampleRowParams& p) {
  return p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f || p.repetition_penalty != 1.0f;
}

// Sampler::penalty_tokens (sampler.cpp) for a Sampler built with p and st.prompt that generated st.generated:
// nothing without a penalty; the prompt's tokens only with a repetition penalty (the constructor keeps them only
// then), each once; then the generated tokens not in the prompt.
std::vector<SamplePenaltyToken> penalty_list(const SampleRowParams& p, const PenaltyState& st) {
  std::vector<SamplePenaltyToken> out;
  if (!penalised(p)) return out;
  std::unordered_set<int32_t> prompt_tokens;
  if (p.repetition_penalty != 1.0f) prompt_tokens.insert(st.prompt.begin(), st.prompt.end());
  for (int32_t t : prompt_tokens) {
    const auto g = st.generated.find(t);
    out.push_back({t, g == st.generated.end() ? 0 : g->second});
  }
  for (const auto& [t, count] : st.generated)
    if (!prompt_tokens.count(t)) out.push_back({t, count});
  return out;
}

struct Reference {
  int32_t token = 0;
  bool greedy = true;
  int64_t n = 0;                // candidates after the top-k cut
  int64_t keep = 0;             // after the top-p and min-p cuts
  std::vector<int32_t> order;   // the first n candidates
  std::vector<double> prob;     // [n]
  std::vector<double> cum;      // the sampling loop's cumulative sums, [keep]
  double mass = 0.0, u = 0.0;
  bool cut_near = false;        // top_p or the min-p floor within the GPU's rounding of a cumulative sum / p_i
  double lse = 0.0;
  std::vector<std::pair<int32_t, float>> top;
};

// The bound sampling.h states for the cumulative sums of n candidates (relative to their total).
double sum_bound(int64_t n) { return 2.0 * static_cast<double>(n + (n + 1023) / 1024 + 1030) * kEps; }

// sample_token's penalties (sampler.cpp): the logits it samples from.
std::vector<float> reference_penalise(const float* raw, int64_t vocab, const SampleRowParams& p_,
                                      const std::vector<SamplePenaltyToken>& penalties) {
  std::vector<float> penalised_logits(raw, raw + vocab);
  const float r = p_.repetition_penalty;
  if (r != 1.0f)
    for (const SamplePenaltyToken& t : penalties) {
      float& l = penalised_logits[t.token];
      l = l > 0.0f ? l / r : l * r;
    }
  for (const SamplePenaltyToken& t : penalties)
    if (t.generated > 0)
      penalised_logits[t.token] -= p_.frequency_penalty * static_cast<float>(t.generated) + p_.presence_penalty;
  return penalised_logits;
}

// sample_token (sampler.cpp). n_top: the number of alternatives (the CPU's p_.logprobs), -1 for none.
// mask: the row's token mask (sample_token's `allowed`), empty for none.
Reference reference_sample(const float* raw, int64_t vocab, const SampleRowParams& p,
                           const std::vector<SamplePenaltyToken>& penalties, double u01, int n_top,
                           const std::vector<uint32_t>& mask = {}) {
  Reference ref;
  std::vector<float> penalised_logits, masked;
  const float* logits = raw;
  if (!mask.empty()) {
    masked.assign(raw, raw + vocab);
    for (int64_t t = 0; t < vocab; ++t)
      if (!(mask[t >> 5] >> (t & 31) & 1)) masked[t] = -std::numeric_limits<float>::infinity();
    logits = masked.data();
  }
  if (penalised(p)) {
    penalised_logits = reference_penalise(logits, vocab, p, penalties);
    logits = penalised_logits.data();
  }

  if (p.temperature == 0.0f) {
    ref.token = static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  } else {
    ref.greedy = false;
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    auto better = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    int64_t keep = vocab;
    if (p.top_k > 0 && p.top_k < vocab) {
      keep = p.top_k;
      std::partial_sort(order.begin(), order.begin() + keep, order.end(), better);
    } else {
      std::sort(order.begin(), order.end(), better);
    }
    ref.n = keep;
    const double top = logits[order[0]];
    std::vector<double> prob(keep);
    double kept = 0.0;
    for (int64_t i = 0; i < keep; ++i) kept += prob[i] = std::exp((logits[order[i]] - top) / p.temperature);
    if (p.top_p < 1.0f) {
      double cum = 0.0;
      const double near = sum_bound(ref.n);
      for (int64_t i = 0; i < keep; ++i) {
        cum += prob[i] / kept;
        if (std::abs(cum - p.top_p) <= near) ref.cut_near = true;
        if (cum >= p.top_p) {
          keep = i + 1;
          break;
        }
      }
    }
    if (p.min_p > 0.0f) {
      const double floor = p.min_p * prob[0];
      for (int64_t j = 1; j < keep; ++j)
        if (std::abs(prob[j] - floor) <= 4 * kEps * floor) ref.cut_near = true;
      int64_t i = 1;
      while (i < keep && prob[i] >= floor) ++i;
      keep = i;
    }
    if (!mask.empty())
      while (keep > 1 && prob[keep - 1] == 0.0) --keep;
    double mass = 0.0;
    for (int64_t i = 0; i < keep; ++i) mass += prob[i];
    const double u = u01 * mass;
    double cum = 0.0;
    int32_t token = order[keep - 1];
    bool found = false;
    for (int64_t i = 0; i < keep; ++i) {
      cum += prob[i];
      ref.cum.push_back(cum);
      if (!found && u < cum) {
        token = order[i];
        found = true;
      }
    }
    ref.token = token;
    ref.keep = keep;
    ref.order.assign(order.begin(), order.begin() + ref.n);
    ref.prob = std::move(prob);
    ref.mass = mass;
    ref.u = u;
  }

  if (n_top >= 0) {
    const float mx = *std::max_element(raw, raw + vocab);
    double total = 0.0;
    for (int64_t i = 0; i < vocab; ++i) total += std::exp(static_cast<double>(raw[i]) - mx);
    ref.lse = mx + std::log(total);
    std::vector<int32_t> ids(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + n_top, ids.end(),
                      [&](int32_t a, int32_t b) { return raw[a] > raw[b] || (raw[a] == raw[b] && a < b); });
    for (int i = 0; i < n_top; ++i) ref.top.emplace_back(ids[i], static_cast<float>(raw[ids[i]] - ref.lse));
  }
  return ref;
}

// ---------------------------------------------------------------- running the GPU

struct Batch {
  int64_t vocab = 0;
  int64_t logit_rows = 0;
  std::vector<float> logits;          // [logit_rows, vocab]
  std::vector<int32_t> source_rows;   // empty: identity
  std::vector<SampleRowParams> params;
  std::vector<PenaltyState> states;   // [rows]
  std::vector<std::vector<uint32_t>> masks;  // [rows] or empty; an empty row: no mask
  int max_top = 0;

  const std::vector<uint32_t>& mask(int64_t r) const {
    static const std::vector<uint32_t> none;
    return masks.empty() ? none : masks[r];
  }
  int64_t rows() const { return static_cast<int64_t>(params.size()); }
  const float* row(int64_t r) const { return logits.data() + (source_rows.empty() ? r : source_rows[r]) * vocab; }
};

struct GpuResult {
  std::vector<int32_t> tokens;
  std::vector<float> token_logprobs;
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
  std::vector<int32_t> head_drawn;  // SampleRowsArgs::head_drawn
};

// All bits set: token -1 and NaN log-probabilities where the kernels fail to write.
template <typename T>
void poison(DeviceBuffer<T>& d) {
  if (d.size() > 0) KESTREL_CUDA_CHECK(cudaMemset(d.get(), 0xff, d.bytes()));
}

// The batch's inputs on the device, its outputs and a workspace; launch() can run directly or under capture.
class GpuBatch {
 public:
  explicit GpuBatch(const Batch& b, bool full_sort = false, bool greedy_only = false)
      : logits_(to_device(b.logits)),
        params_(to_device(b.params)),
        tokens_(static_cast<size_t>(b.rows())),
        token_logprobs_(static_cast<size_t>(b.rows())),
        top_ids_(static_cast<size_t>(b.rows() * std::max(b.max_top, 1))),
        top_logprobs_(static_cast<size_t>(b.rows() * std::max(b.max_top, 1))),
        head_drawn_(static_cast<size_t>(b.rows())),
        workspace_(sample_rows_workspace_bytes(b.rows(), b.vocab)) {
    // The CSR penalty lists, as the engine hands each sequence's Sampler::penalty_tokens() on.
    std::vector<int32_t> offsets{0};
    std::vector<SamplePenaltyToken> entries;
    for (int64_t r = 0; r < b.rows(); ++r) {
      const std::vector<SamplePenaltyToken> row = penalty_list(b.params[r], b.states[r]);
      entries.insert(entries.end(), row.begin(), row.end());
      offsets.push_back(static_cast<int32_t>(entries.size()));
    }
    offsets_ = to_device(offsets);
    if (!entries.empty()) entries_ = to_device(entries);
    if (!b.source_rows.empty()) source_rows_ = to_device(b.source_rows);
    // Token masks as the engine hands them: one per masked row, rows without one at mask index -1.
    std::vector<uint32_t> words;
    std::vector<int32_t> index;
    const int64_t mask_words = (b.vocab + 31) / 32;
    for (int64_t r = 0; r < b.rows(); ++r) {
      if (b.mask(r).empty()) {
        index.push_back(-1);
        continue;
      }
      index.push_back(static_cast<int32_t>(words.size() / mask_words));
      words.insert(words.end(), b.mask(r).begin(), b.mask(r).end());
    }
    if (!words.empty()) {
      masks_ = to_device(words);
      mask_index_ = to_device(index);
      args_.token_masks = masks_.get();
      args_.mask_index = mask_index_.get();
      args_.mask_words = mask_words;
    }
    args_.logits = logits_.get();
    args_.logit_rows = b.logit_rows;
    args_.vocab = b.vocab;
    args_.rows = b.rows();
    args_.source_rows = b.source_rows.empty() ? nullptr : source_rows_.get();
    args_.params = params_.get();
    if (!entries.empty()) {
      args_.penalty_offsets = offsets_.get();
      args_.penalty_tokens = entries_.get();
    }
    args_.tokens = tokens_.get();
    args_.token_logprobs = token_logprobs_.get();
    args_.max_top_logprobs = b.max_top;
    if (b.max_top > 0) {
      args_.top_ids = top_ids_.get();
      args_.top_logprobs = top_logprobs_.get();
    }
    poison(tokens_);
    poison(token_logprobs_);
    poison(top_ids_);
    poison(top_logprobs_);
    poison(head_drawn_);
    args_.full_sort = full_sort;
    args_.greedy_only = greedy_only;
    args_.head_drawn = head_drawn_.get();
  }

  void launch(cudaStream_t s) { sample_rows(args_, workspace_.get(), workspace_.bytes(), s); }

  GpuResult result() const {
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
    return GpuResult{to_host(tokens_), to_host(token_logprobs_), to_host(top_ids_), to_host(top_logprobs_),
                     to_host(head_drawn_)};
  }

 private:
  DeviceBuffer<float> logits_;
  DeviceBuffer<SampleRowParams> params_;
  DeviceBuffer<int32_t> offsets_, source_rows_, mask_index_;
  DeviceBuffer<uint32_t> masks_;
  DeviceBuffer<SamplePenaltyToken> entries_;
  DeviceBuffer<int32_t> tokens_;
  DeviceBuffer<float> token_logprobs_;
  DeviceBuffer<int32_t> top_ids_;
  DeviceBuffer<float> top_logprobs_;
  DeviceBuffer<int32_t> head_drawn_;
  DeviceBuffer<uint8_t> workspace_;  // cudaMalloc: 256-byte aligned
  SampleRowsArgs args_;
};

GpuResult run_gpu(const Batch& b, bool full_sort = false, bool greedy_only = false) {
  GpuBatch g(b, full_sort, greedy_only);
  g.launch(nullptr);
  return g.result();
}

// ---------------------------------------------------------------- checks

struct Tally {
  int rows = 0, equal = 0, boundary = 0, relaxed = 0;
};

// The GPU's token against the reference. Greedy rows and rows marked exact (every cumulative sum exact in
// double on both sides) must match. Otherwise a different token is accepted only where sampling.h says it may
// be: the scaled uniform within the sum bound B of the GPU token's cumulative interval in the CPU's order, or
// (cut_near) a top-p/min-p cut within rounding, where any candidate of positive probability is accepted.
void check_token(const Reference& ref, int32_t gpu, bool exact, Tally& tally, int64_t row) {
  SCOPED_TRACE(::testing::Message() << "row " << row);
  ++tally.rows;
  if (gpu == ref.token) {
    ++tally.equal;
    return;
  }
  ASSERT_FALSE(ref.greedy || exact) << "GPU token " << gpu << ", CPU token " << ref.token;
  const auto it = std::find(ref.order.begin(), ref.order.end(), gpu);
  ASSERT_TRUE(it != ref.order.end()) << "GPU token " << gpu << " is not among the top-k candidates";
  const int64_t pos = it - ref.order.begin();
  ASSERT_GT(ref.prob[pos], 0.0) << "GPU drew token " << gpu << " of probability 0";
  if (ref.cut_near) {
    ++tally.relaxed;
    return;
  }
  ASSERT_LT(pos, ref.keep) << "GPU token " << gpu << " is past the CPU's top-p/min-p cut";
  const double band = sum_bound(ref.n) * ref.mass;
  const double lower = pos > 0 ? ref.cum[pos - 1] : 0.0;
  EXPECT_TRUE(ref.u >= lower - band && ref.u < ref.cum[pos] + band)
      << "GPU token " << gpu << " (candidate " << pos << ", cumulative [" << lower << ", " << ref.cum[pos]
      << ")), CPU token " << ref.token << ", u * mass = " << ref.u << ", band " << band;
  ++tally.boundary;
}

// The bound sampling.h states for a log-probability: one fp32 ulp of either value plus the lse difference,
// (vocab + vocab / 1024 + 48 + 8 (|lse| + |max logit|)) 2^-53.
void check_logprob(float gpu, float ref, double lse, double mx, int64_t vocab, const char* what) {
  const double bound = 0x1p-23 * std::max(std::abs(gpu), std::abs(ref)) +
                       (static_cast<double>(vocab + vocab / 1024 + 48) + 8 * (std::abs(lse) + std::abs(mx))) * kEps;
  EXPECT_LE(std::abs(static_cast<double>(gpu) - ref), bound) << what << ": GPU " << gpu << ", CPU " << ref;
}

void check_batch(const Batch& b, const std::vector<double>& uniforms, const std::vector<bool>& exact,
                 const GpuResult& g, const char* name) {
  SCOPED_TRACE(name);
  Tally tally;
  for (int64_t r = 0; r < b.rows(); ++r) {
    const SampleRowParams& p = b.params[r];
    const int n_top = p.logprobs >= 0 ? std::min(p.logprobs, b.max_top) : -1;
    const float* raw = b.row(r);
    const Reference ref =
        reference_sample(raw, b.vocab, p, penalty_list(p, b.states[r]), uniforms[r], n_top, b.mask(r));
    check_token(ref, g.tokens[r], exact[r], tally, r);
    if (!b.mask(r).empty()) {
      const int32_t t = g.tokens[r];
      ASSERT_TRUE(t >= 0 && t < b.vocab && (b.mask(r)[t >> 5] >> (t & 31) & 1))
          << "row " << r << ": GPU token " << t << " is outside the row's mask";
    }
    if (n_top < 0) continue;
    const int32_t t = g.tokens[r];
    ASSERT_TRUE(t >= 0 && t < b.vocab);
    const double mx = *std::max_element(raw, raw + b.vocab);
    check_logprob(g.token_logprobs[r], static_cast<float>(raw[t] - ref.lse), ref.lse, mx, b.vocab, "token logprob");
    for (int j = 0; j < n_top; ++j) {
      EXPECT_EQ(g.top_ids[r * b.max_top + j], ref.top[j].first) << "row " << r << " alternative " << j;
      check_logprob(g.top_logprobs[r * b.max_top + j], ref.top[j].second, ref.lse, mx, b.vocab, "alternative");
    }
  }
  std::printf("[%s] %d rows: %d equal, %d different within the boundary band, %d at a near cut\n", name, tally.rows,
              tally.equal, tally.boundary, tally.relaxed);
}

// ---------------------------------------------------------------- inputs

double draw_uniform(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1p-53; }

// LLM-like rows: normal logits, some with a few tokens far above the rest (peaked), some flat.
std::vector<float> random_logits(int64_t rows, int64_t V, std::mt19937_64& rng) {
  std::vector<float> x(static_cast<size_t>(rows * V));
  std::normal_distribution<float> normal(0.0f, 2.5f);
  std::uniform_int_distribution<int64_t> pick(0, V - 1);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x.data() + r * V;
    for (int64_t i = 0; i < V; ++i) row[i] = normal(rng);
    if (r % 3 == 1)
      for (int k = 0; k < 8; ++k) row[pick(rng)] += 12.0f + static_cast<float>(k);
  }
  return x;
}

PenaltyState random_state(int64_t V, std::mt19937_64& rng) {
  PenaltyState st;
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(std::min<int64_t>(V, 512) - 1));
  std::uniform_int_distribution<int> count(1, 4);
  for (int i = 0; i < 40; ++i) st.prompt.push_back(tok(rng));  // repeats on purpose
  for (int i = 0; i < 25; ++i) st.generated[tok(rng)] += count(rng);
  return st;
}

SampleRowParams sampled(float temperature, int top_k = 0, float top_p = 1.0f, float min_p = 0.0f) {
  SampleRowParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  return p;
}

// Row configurations cycled over a batch: every option alone, penalties alone and together, everything at once.
std::vector<SampleRowParams> configurations() {
  std::vector<SampleRowParams> c;
  c.push_back(sampled(0.0f));
  c.push_back(sampled(1.0f));
  c.push_back(sampled(0.7f));
  c.push_back(sampled(1.6f));
  c.push_back(sampled(1.0f, 1));
  c.push_back(sampled(1.0f, 50));
  c.push_back(sampled(0.9f, 1024));
  c.push_back(sampled(0.9f, 1025));
  c.push_back(sampled(1.2f, 5000));
  c.push_back(sampled(1.0f, 0, 0.9f));
  c.push_back(sampled(1.0f, 0, 0.5f));
  c.push_back(sampled(0.8f, 0, 0.999f));
  c.push_back(sampled(1.0f, 0, 1.0f, 0.05f));
  c.push_back(sampled(1.0f, 0, 1.0f, 0.5f));
  c.push_back(sampled(2.0f, 200, 0.8f));
  c.push_back(sampled(1.0f, 100, 0.95f, 0.02f));
  SampleRowParams pres = sampled(1.0f);
  pres.presence_penalty = 1.5f;
  c.push_back(pres);
  SampleRowParams freq = sampled(0.8f, 40);
  freq.frequency_penalty = 0.7f;
  c.push_back(freq);
  SampleRowParams rep = sampled(1.0f, 0, 0.9f);
  rep.repetition_penalty = 1.3f;
  c.push_back(rep);
  SampleRowParams rep_low = sampled(1.0f);
  rep_low.repetition_penalty = 0.8f;
  c.push_back(rep_low);
  SampleRowParams negative = sampled(1.0f);
  negative.presence_penalty = -0.5f;
  negative.frequency_penalty = -0.25f;
  c.push_back(negative);
  SampleRowParams greedy_pen = sampled(0.0f);
  greedy_pen.presence_penalty = 0.4f;
  greedy_pen.frequency_penalty = 0.3f;
  greedy_pen.repetition_penalty = 1.2f;
  c.push_back(greedy_pen);
  SampleRowParams all = sampled(0.9f, 300, 0.92f, 0.01f);
  all.presence_penalty = 0.2f;
  all.frequency_penalty = 0.1f;
  all.repetition_penalty = 1.1f;
  all.logprobs = 5;
  c.push_back(all);
  SampleRowParams lp = sampled(1.0f);
  lp.logprobs = 0;
  c.push_back(lp);
  SampleRowParams lp_greedy = sampled(0.0f);
  lp_greedy.logprobs = kMaxSampleTopLogprobs;
  c.push_back(lp_greedy);
  return c;
}

// A batch of `rows` rows cycling through configurations(), with penalty states, random uniforms except that rows
// 5 and 6 of every 7 take 0 and the largest uniform below 1.
void run_mixed(int64_t rows, int64_t V, uint64_t seed, const char* name) {
  std::mt19937_64 rng(seed);
  Batch b;
  b.vocab = V;
  b.logit_rows = rows;
  b.logits = random_logits(rows, V, rng);
  b.max_top = kMaxSampleTopLogprobs;
  const auto configs = configurations();
  std::vector<double> uniforms;
  std::vector<bool> exact;
  for (int64_t r = 0; r < rows; ++r) {
    SampleRowParams p = configs[(r + seed) % configs.size()];
    const double u = r % 7 == 5 ? 0.0 : r % 7 == 6 ? kAlmostOne : draw_uniform(rng);
    p.uniform = u;
    b.params.push_back(p);
    b.states.push_back(random_state(V, rng));
    uniforms.push_back(u);
    exact.push_back(u == 0.0);  // u * mass = 0 < p_0 = 1: the first candidate, whatever the sums
  }
  check_batch(b, uniforms, exact, run_gpu(b), name);
}

// Every configuration under token masks of several shapes (structured output): none, half the vocabulary, a few
// tokens, one token, only tokens far below the row's best (the draw's tail of zero probabilities), and the mask a
// grammar gives inside a JSON string (everything but a few ids).
void run_masked(int64_t rows, int64_t V, uint64_t seed, const char* name) {
  std::mt19937_64 rng(seed);
  Batch b;
  b.vocab = V;
  b.logit_rows = rows;
  b.logits = random_logits(rows, V, rng);
  b.max_top = kMaxSampleTopLogprobs;
  const auto configs = configurations();
  const int64_t W = (V + 31) / 32;
  std::uniform_int_distribution<int64_t> pick(0, V - 1);
  std::vector<double> uniforms;
  std::vector<bool> exact;
  for (int64_t r = 0; r < rows; ++r) {
    SampleRowParams p = configs[(r + seed) % configs.size()];
    const double u = r % 7 == 5 ? 0.0 : r % 7 == 6 ? kAlmostOne : draw_uniform(rng);
    p.uniform = u;
    b.params.push_back(p);
    b.states.push_back(random_state(V, rng));
    uniforms.push_back(u);
    exact.push_back(u == 0.0);
    std::vector<uint32_t> m(static_cast<size_t>(W), 0);
    auto allow = [&](int64_t t) { m[t >> 5] |= 1u << (t & 31); };
    const float* row = b.logits.data() + r * V;
    switch (r % 6) {
      case 0: m.clear(); break;
      case 1:
        for (int64_t t = 0; t < V; ++t)
          if (rng() & 1) allow(t);
        allow(pick(rng));
        break;
      case 2:
        for (int k = 0; k < 7; ++k) allow(pick(rng));
        break;
      case 3: allow(pick(rng)); break;
      case 4: {
        // The 20 lowest logits only: most have probability 0 next to the row's best once exp underflows.
        std::vector<int32_t> ids(V);
        std::iota(ids.begin(), ids.end(), 0);
        std::partial_sort(ids.begin(), ids.begin() + 20, ids.end(), [&](int32_t x, int32_t y) { return row[x] < row[y]; });
        for (int k = 0; k < 20; ++k) allow(ids[k]);
        break;
      }
      default:
        for (int64_t t = 0; t < V; ++t) allow(t);
        for (int k = 0; k < 9; ++k) {
          const int64_t t = pick(rng);
          m[t >> 5] &= ~(1u << (t & 31));
        }
        break;
    }
    b.masks.push_back(std::move(m));
  }
  check_batch(b, uniforms, exact, run_gpu(b), name);
}

bool have_gpu() { return device_count() > 0; }

// ---------------------------------------------------------------- tests

TEST(SampleRows, MixedOptionsSmallVocab) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  run_mixed(64, 4096, 1, "V=4096 rows=64");
  for (uint64_t seed = 2; seed < 8; ++seed) run_mixed(1, 4096, seed, "V=4096 rows=1");
}

TEST(SampleRows, MixedOptionsLargeVocab) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  run_mixed(64, 163840, 11, "V=163840 rows=64");
  run_mixed(1, 163840, 12, "V=163840 rows=1");
  run_mixed(3, kMaxSampleVocab, 13, "V=262144 rows=3");
}

TEST(SampleRows, TokenMasksMatchTheCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  run_masked(64, 4096, 21, "masked V=4096 rows=64");
  run_masked(64, 163840, 22, "masked V=163840 rows=64");
  run_masked(5, 163840, 23, "masked V=163840 rows=5");
}

// Greedy rows whose maximum occurs many times (values from a few levels; one row with +0 and -0 maxima; one
// all-equal row): the lowest id wins, with and without penalties.
TEST(SampleRows, GreedyTies) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const int64_t V : {int64_t{4096}, int64_t{163840}}) {
    for (const int64_t rows : {int64_t{1}, int64_t{64}}) {
      std::mt19937_64 rng(static_cast<uint64_t>(V + rows));
      std::uniform_int_distribution<int> level(0, 7);
      Batch b;
      b.vocab = V;
      b.logit_rows = rows;
      b.logits.resize(static_cast<size_t>(rows * V));
      for (float& x : b.logits) x = static_cast<float>(level(rng)) * 0.5f;
      if (rows > 1) {
        float* zeros = b.logits.data() + V;
        for (int64_t i = 0; i < V; ++i) zeros[i] = i % 5 == 0 ? (i % 2 ? 0.0f : -0.0f) : -1.0f - static_cast<float>(i % 3);
        std::fill(b.logits.begin() + 2 * V, b.logits.begin() + 3 * V, 0.75f);
      }
      for (int64_t r = 0; r < rows; ++r) {
        SampleRowParams p = sampled(0.0f);
        if (r % 2 == 1 && r > 2) {  // rows 1 and 2 are the checked tie rows below
          p.presence_penalty = 0.25f;
          p.repetition_penalty = 1.5f;
        }
        b.params.push_back(p);
        b.states.push_back(random_state(V, rng));
      }
      const GpuResult g = run_gpu(b);
      for (int64_t r = 0; r < rows; ++r) {
        const Reference ref = reference_sample(b.row(r), V, b.params[r], penalty_list(b.params[r], b.states[r]), 0.0, -1);
        EXPECT_EQ(g.tokens[r], ref.token) << "V " << V << " row " << r;
      }
      if (rows > 1) {
        EXPECT_EQ(g.tokens[1], 0) << "+0 and -0 tie: the lowest id";
        EXPECT_EQ(g.tokens[2], 0) << "all-equal row";
      }
    }
  }
}

// The penalised logits to the last bit: in each row a penalised token A and an unpenalised token B set to the
// CPU's penalised value of A are the row's maximum, so the lower of their ids must win. A value of A one ulp too
// high makes A win where B has the lower id, one ulp too low makes B win where A has it; the rows alternate.
TEST(SampleRows, PenaltyArithmeticIsTheCpusToTheBit) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t rows = 64, V = 4096;
  std::mt19937_64 rng(41);
  std::uniform_real_distribution<float> logit(-8.0f, 8.0f), penalty(-1.0f, 1.0f), repetition(0.5f, 2.0f);
  std::uniform_int_distribution<int> count(0, 5), id(0, static_cast<int>(V) - 1);
  Batch b;
  b.vocab = V;
  b.logit_rows = rows;
  b.logits.assign(static_cast<size_t>(rows * V), -100.0f);
  std::vector<int32_t> want;
  for (int64_t r = 0; r < rows; ++r) {
    int32_t a = id(rng), o = id(rng);
    while (o == a) o = id(rng);
    if ((a < o) != (r % 2 == 0)) std::swap(a, o);  // even rows: A has the lower id
    SampleRowParams p = sampled(0.0f);
    p.presence_penalty = penalty(rng);
    p.frequency_penalty = penalty(rng);
    p.repetition_penalty = r % 4 < 2 ? repetition(rng) : 1.0f;
    PenaltyState st;
    const int generated = count(rng);
    if (generated > 0) st.generated[a] = generated;
    if (generated == 0 || r % 3 == 0) st.prompt.push_back(a);
    float* row = b.logits.data() + r * V;
    row[a] = logit(rng);
    row[o] = reference_penalise(row, V, p, penalty_list(p, st))[a];
    b.params.push_back(p);
    b.states.push_back(st);
    want.push_back(std::min(a, o));
  }
  const GpuResult g = run_gpu(b);
  for (int64_t r = 0; r < rows; ++r) EXPECT_EQ(g.tokens[r], want[r]) << "row " << r;
}

// Rows whose probabilities are exactly 0 or 1 in double (m tokens at one value, the rest -inf; or all tokens
// equal), so that every cumulative sum is an exact integer on both sides, and the top-p terms p_i / kept exact
// fractions (top-p only with a power-of-two count of candidates of probability 1): the GPU must give the CPU's token exactly, even for uniforms placed on the cumulative boundaries, and
// never a token of probability 0.
TEST(SampleRows, ExactSumsGiveTheCpuTokenAtEveryBoundary) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const float inf = std::numeric_limits<float>::infinity();
  for (const int64_t V : {int64_t{4096}, int64_t{163840}}) {
    std::mt19937_64 rng(static_cast<uint64_t>(V));
    std::uniform_int_distribution<int64_t> pick(0, V - 1);
    // Row 0: 64 tokens at 3.0, the rest -inf. Row 1: all tokens equal.
    std::vector<float> logits(static_cast<size_t>(2 * V), -inf);
    int placed = 0;
    while (placed < 64) {
      float& x = logits[static_cast<size_t>(pick(rng))];
      if (x == -inf) {
        x = 3.0f;
        ++placed;
      }
    }
    std::fill(logits.begin() + V, logits.end(), 1.25f);

    Batch b;
    b.vocab = V;
    b.logit_rows = 2;
    b.logits = logits;
    std::vector<double> uniforms;
    const std::vector<SampleRowParams> options = {sampled(1.0f), sampled(0.5f, 2048, 0.5f),
                                                  sampled(1.0f, 0, 1.0f, 0.5f), sampled(1.0f, 1000),
                                                  sampled(1.0f, 1024, 0.25f), sampled(1.0f, 0, 1.0f, 1.0f)};
    for (int src = 0; src < 2; ++src) {
      const double m = src == 0 ? 64.0 : static_cast<double>(V);
      std::vector<double> us = {0.0, kAlmostOne, 0.5, 1.0 / m, 1.0 - 1.0 / m};
      for (int j = 0; j < 6; ++j) {
        const double at = std::floor(draw_uniform(rng) * m) / m;  // a boundary j / m
        us.push_back(at);
        us.push_back(std::nextafter(at, 0.0));
        us.push_back(std::nextafter(at, 1.0));
      }
      for (const SampleRowParams& o : options)
        for (const double u : us) {
          SampleRowParams p = o;
          p.uniform = u;
          b.params.push_back(p);
          b.source_rows.push_back(src);
          b.states.emplace_back();
          uniforms.push_back(u);
        }
    }
    const GpuResult g = run_gpu(b);
    check_batch(b, uniforms, std::vector<bool>(uniforms.size(), true), g, V == 4096 ? "exact V=4096" : "exact V=163840");
  }
}

// Uniforms placed on (and one double next to) the CPU's own cumulative boundaries of random rows: the GPU's token
// is the CPU's or, inside the stated band, a neighbour.
TEST(SampleRows, UniformsOnCumulativeBoundaries) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const int64_t V : {int64_t{4096}, int64_t{163840}}) {
    std::mt19937_64 rng(static_cast<uint64_t>(V) + 7);
    Batch b;
    b.vocab = V;
    b.logit_rows = 2;
    b.logits = random_logits(2, V, rng);
    std::vector<double> uniforms;
    const std::vector<SampleRowParams> options = {sampled(1.0f), sampled(1.0f, 600), sampled(0.7f, 0, 0.9f)};
    for (int src = 0; src < 2; ++src)
      for (const SampleRowParams& o : options) {
        const Reference ref = reference_sample(b.logits.data() + src * V, V, o, {}, 0.0, -1);
        for (int j = 0; j < 8; ++j) {
          const int64_t at = std::min<int64_t>(ref.keep - 1, j * j * 3);
          const double boundary = ref.cum[at] / ref.mass;
          for (const double u : {boundary, std::nextafter(boundary, 0.0), std::nextafter(boundary, 1.0)}) {
            if (!(u < 1.0)) continue;
            SampleRowParams p = o;
            p.uniform = u;
            b.params.push_back(p);
            b.source_rows.push_back(src);
            b.states.emplace_back();
            uniforms.push_back(u);
          }
        }
      }
    check_batch(b, uniforms, std::vector<bool>(uniforms.size(), false), run_gpu(b),
                V == 4096 ? "boundaries V=4096" : "boundaries V=163840");
  }
}

// The n completions of one prompt: many sampled rows read one logits row through source_rows, each with its own
// uniform; a source row out of range gives token -1.
TEST(SampleRows, SourceRows) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(21);
  const int64_t V = 4096;
  Batch b;
  b.vocab = V;
  b.logit_rows = 3;
  b.logits = random_logits(3, V, rng);
  std::vector<double> uniforms;
  for (int r = 0; r < 12; ++r) {
    SampleRowParams p = sampled(1.0f, 0, 0.95f);
    p.uniform = draw_uniform(rng);
    b.params.push_back(p);
    b.source_rows.push_back(r % 3);
    b.states.emplace_back();
    uniforms.push_back(p.uniform);
  }
  check_batch(b, uniforms, std::vector<bool>(uniforms.size(), false), run_gpu(b), "source rows");

  b.source_rows[4] = 3;
  b.source_rows[7] = -1;
  const GpuResult g = run_gpu(b);
  EXPECT_EQ(g.tokens[4], -1);
  EXPECT_EQ(g.tokens[7], -1);
  EXPECT_GE(g.tokens[5], 0);
}

// The call captured in a CUDA graph and replayed gives what a direct call gives, bit for bit, every time.
TEST(SampleRows, GraphReplayIsDeterministic) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(31);
  const int64_t rows = 64, V = 32768;
  Batch b;
  b.vocab = V;
  b.logit_rows = rows;
  b.logits = random_logits(rows, V, rng);
  b.max_top = 4;
  const auto configs = configurations();
  for (int64_t r = 0; r < rows; ++r) {
    SampleRowParams p = configs[r % configs.size()];
    p.uniform = draw_uniform(rng);
    b.params.push_back(p);
    b.states.push_back(random_state(V, rng));
  }
  GpuBatch direct(b);
  direct.launch(nullptr);
  const GpuResult want = direct.result();

  GpuBatch captured(b);
  cudaStream_t stream = nullptr;
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  captured.launch(stream);
  KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream));
    const GpuResult got = captured.result();
    EXPECT_EQ(got.tokens, want.tokens) << "replay " << replay;
    for (int64_t r = 0; r < rows; ++r) {
      if (b.params[r].logprobs < 0) continue;
      EXPECT_EQ(std::memcmp(&got.token_logprobs[r], &want.token_logprobs[r], sizeof(float)), 0) << "row " << r;
      const int n = std::min(b.params[r].logprobs, b.max_top);
      for (int j = 0; j < n; ++j) {
        EXPECT_EQ(got.top_ids[r * b.max_top + j], want.top_ids[r * b.max_top + j]);
        EXPECT_EQ(std::memcmp(&got.top_logprobs[r * b.max_top + j], &want.top_logprobs[r * b.max_top + j],
                              sizeof(float)),
                  0);
      }
    }
  }
  KESTREL_CUDA_CHECK(cudaGraphExecDestroy(exec));
  KESTREL_CUDA_CHECK(cudaGraphDestroy(graph));
  KESTREL_CUDA_CHECK(cudaStreamDestroy(stream));
}

// ---------------------------------------------------------------- the head path against the full sort
//
// sample_rows without full_sort draws most rows from a sorted head of their candidates (sampling.h, "Cost and
// the head path"). For the same inputs and uniforms it must give the full sort's token on every row, the same
// log-probabilities bit for bit, and (through check_batch) the CPU's token within sampling.h's bounds.

// Rows of several shapes, by r % 7: normal logits of standard deviation 4, 5 and 6 (heads of a few to a few
// thousand candidates at top-p 0.95), the last with a few spikes; logits on a grid of 0.5 (long runs of ties across
// every cut); normal logits with 30% of them -inf; a row with only 5 finite logits; flat normal logits (sd 2.5:
// heads too large at top-p, the full sort's rows).
std::vector<float> shaped_logits(int64_t rows, int64_t V, std::mt19937_64& rng) {
  std::vector<float> x(static_cast<size_t>(rows * V));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int64_t> pick(0, V - 1);
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x.data() + r * V;
    const int kind = static_cast<int>(r % 7);
    const float sd = kind == 0 ? 4.0f : kind == 1 ? 5.0f : kind == 6 ? 2.5f : 6.0f;
    for (int64_t i = 0; i < V; ++i) row[i] = sd * normal(rng);
    if (kind == 2)
      for (int k = 0; k < 4; ++k) row[pick(rng)] += 20.0f + 2.0f * static_cast<float>(k);
    if (kind == 3)
      for (int64_t i = 0; i < V; ++i) row[i] = std::round(row[i] * 2.0f) * 0.5f;
    if (kind == 4)
      for (int64_t i = 0; i < V; ++i)
        if (rng() % 10 < 3) row[i] = -inf;
    if (kind == 5) {
      std::fill(row, row + V, -inf);
      for (int k = 0; k < 5; ++k) row[pick(rng)] = normal(rng);
    }
  }
  return x;
}

// The options the issue asks for, every combination: temperature 0.6 and 1, top-p 0.95, 0.8 and 1, top-k 0, 1,
// 20, 50 and 1000, min-p 0 and 0.05.
std::vector<SampleRowParams> head_configurations() {
  std::vector<SampleRowParams> c;
  for (const float t : {0.6f, 1.0f})
    for (const float top_p : {0.95f, 0.8f, 1.0f})
      for (const int top_k : {0, 1, 20, 50, 1000})
        for (const float min_p : {0.0f, 0.05f}) c.push_back(sampled(t, top_k, top_p, min_p));
  return c;
}

// A batch of `rows` shaped rows, each with a configuration drawn at random (rows of different options side by
// side), a few greedy, penalised, masked and logprobs rows among them; uniforms random except every 11th row at 0
// and every 13th at the largest below 1. Returns how many non-greedy rows the head path drew.
int run_head_vs_full(int64_t rows, int64_t V, uint64_t seed, const char* name) {
  SCOPED_TRACE(name);
  std::mt19937_64 rng(seed);
  Batch b;
  b.vocab = V;
  b.logit_rows = rows;
  b.logits = shaped_logits(rows, V, rng);
  b.max_top = 5;
  const auto configs = head_configurations();
  std::uniform_int_distribution<size_t> which(0, configs.size() - 1);
  const int64_t W = (V + 31) / 32;
  std::vector<double> uniforms;
  std::vector<bool> exact;
  bool any_mask = false;
  for (int64_t r = 0; r < rows; ++r) {
    SampleRowParams p = configs[which(rng)];
    if (r % 17 == 3) p = sampled(0.0f);
    if (r % 19 == 4) {
      p.presence_penalty = 0.5f;
      p.frequency_penalty = 0.25f;
      p.repetition_penalty = 1.2f;
    }
    if (r % 23 == 5) p.logprobs = 3;
    const double u = r % 11 == 7 ? 0.0 : r % 13 == 8 ? kAlmostOne : draw_uniform(rng);
    p.uniform = u;
    b.params.push_back(p);
    b.states.push_back(random_state(V, rng));
    uniforms.push_back(u);
    exact.push_back(u == 0.0);
    std::vector<uint32_t> m;
    // A grammar-like mask: everything but a few ids, or half the vocabulary (not on the shape with 5 finite
    // logits, where it could leave only -inf tokens).
    if (r % 29 == 6 && r % 7 != 5) {
      m.assign(static_cast<size_t>(W), r % 2 ? ~0u : 0u);
      std::uniform_int_distribution<int64_t> pick(0, V - 1);
      if (r % 2) {
        for (int k = 0; k < 9; ++k) {
          const int64_t t = pick(rng);
          m[t >> 5] &= ~(1u << (t & 31));
        }
      } else {
        for (int64_t t = 0; t < V; ++t)
          if (rng() & 1) m[t >> 5] |= 1u << (t & 31);
        const int64_t t = pick(rng);
        m[t >> 5] |= 1u << (t & 31);
      }
      any_mask = true;
    }
    b.masks.push_back(std::move(m));
  }
  if (!any_mask) b.masks.clear();

  const GpuResult head = run_gpu(b, false);
  const GpuResult full = run_gpu(b, true);
  int drawn = 0, sampled_rows = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const SampleRowParams& p = b.params[r];
    SCOPED_TRACE(::testing::Message() << "row " << r << " (shape " << r % 7 << ", temperature " << p.temperature
                                      << ", top_p " << p.top_p << ", top_k " << p.top_k << ", min_p " << p.min_p
                                      << ", head path " << head.head_drawn[r] << ")");
    EXPECT_TRUE(head.head_drawn[r] == 0 || head.head_drawn[r] == 1);
    EXPECT_EQ(full.head_drawn[r], 0);
    EXPECT_EQ(head.tokens[r], full.tokens[r]);
    if (p.temperature != 0.0f) {
      ++sampled_rows;
      drawn += head.head_drawn[r];
    } else {
      EXPECT_EQ(head.head_drawn[r], 1);
    }
    // Top-k of at most 1000 over the plain normal shapes, unmasked: the top-k-th candidate lies well within the
    // histogram's 32 nats and its bin holds a few candidates, so the head is about top_k candidates.
    const int shape = static_cast<int>(r % 7);
    const bool plain = shape == 0 || shape == 1 || shape == 4 || shape == 6;
    // (At the real vocabularies: in a small one, top_k 1000 is a quarter of the row and the head may pass 2048.)
    if (V >= 65536 && p.temperature != 0.0f && p.top_k >= 1 && p.top_k <= 1000 && plain && b.mask(r).empty()) {
      EXPECT_EQ(head.head_drawn[r], 1);
    }
    if (p.logprobs >= 0) {
      EXPECT_EQ(std::memcmp(&head.token_logprobs[r], &full.token_logprobs[r], sizeof(float)), 0);
      for (int j = 0; j < std::min(p.logprobs, b.max_top); ++j) {
        EXPECT_EQ(head.top_ids[r * b.max_top + j], full.top_ids[r * b.max_top + j]);
        EXPECT_EQ(std::memcmp(&head.top_logprobs[r * b.max_top + j], &full.top_logprobs[r * b.max_top + j],
                              sizeof(float)),
                  0);
      }
    }
  }
  check_batch(b, uniforms, exact, head, name);
  std::printf("[%s] head path drew %d of %d sampled rows\n", name, drawn, sampled_rows);
  return drawn;
}

TEST(SampleRows, HeadPathGivesTheFullSortsTokens) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const int64_t V : {int64_t{129280}, int64_t{163840}}) {
    int drawn = 0;
    uint64_t seed = static_cast<uint64_t>(V);
    for (const int64_t rows : {int64_t{1}, int64_t{8}, int64_t{64}, int64_t{256}}) {
      const std::string name = "head V=" + std::to_string(V) + " rows=" + std::to_string(rows);
      drawn += run_head_vs_full(rows, V, ++seed, name.c_str());
    }
    EXPECT_GT(drawn, 100) << "the head path drew too few rows at V=" << V;
  }
  run_head_vs_full(64, 4096, 77, "head V=4096 rows=64");  // short rows: whole rows in the head
  run_head_vs_full(16, 2048, 78, "head V=2048 rows=16");
}

// Top-p rows sampled with many uniforms over one row each (the cut and the draw in every part of the head), at
// both temperatures: the full sort's token for every uniform.
TEST(SampleRows, HeadPathTopPOverManyUniforms) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t V = 163840, rows = 96;
  std::mt19937_64 rng(91);
  std::vector<float> shapes = shaped_logits(7, V, rng);
  Batch b;
  b.vocab = V;
  b.logit_rows = 7;
  b.logits = shapes;
  b.source_rows.resize(rows);
  std::vector<double> uniforms;
  for (int64_t r = 0; r < rows; ++r) {
    b.source_rows[r] = static_cast<int32_t>(r % 6);  // not the flat shape
    // Options independent of the shape: temperature by r / 6, top-p by r / 12, min-p by r / 36.
    const int64_t o = r / 6;
    const float top_p = (o / 2) % 3 == 0 ? 0.95f : (o / 2) % 3 == 1 ? 0.8f : 0.5f;
    SampleRowParams p = sampled(o % 2 ? 0.6f : 1.0f, 0, top_p, (o / 6) % 2 ? 0.05f : 0.0f);
    p.uniform = draw_uniform(rng);
    uniforms.push_back(p.uniform);
    b.params.push_back(p);
    b.states.emplace_back();
  }
  const GpuResult head = run_gpu(b, false), full = run_gpu(b, true);
  int drawn = 0;
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_EQ(head.tokens[r], full.tokens[r]) << "row " << r << " (shape " << r % 6 << ")";
    drawn += head.head_drawn[r];
  }
  std::printf("[top-p uniforms] head path drew %d of %lld rows\n", drawn, static_cast<long long>(rows));
  EXPECT_GT(drawn, rows / 2);
  check_batch(b, uniforms, std::vector<bool>(uniforms.size(), false), head, "top-p uniforms");
}

// A batch of greedy rows only (penalties, masks, logprobs, ties among them) with greedy_only (one launch): the
// full sort's tokens and log-probabilities, bit for bit, and the CPU's tokens.
TEST(SampleRows, GreedyOnlyIsOneLaunchWithTheSameTokens) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t V = 129280, rows = 40;
  std::mt19937_64 rng(55);
  Batch b;
  b.vocab = V;
  b.logit_rows = rows;
  b.logits = shaped_logits(rows, V, rng);
  b.max_top = 4;
  const int64_t W = (V + 31) / 32;
  std::uniform_int_distribution<int64_t> pick(0, V - 1);
  for (int64_t r = 0; r < rows; ++r) {
    SampleRowParams p = sampled(0.0f);
    if (r % 3 == 1) {
      p.presence_penalty = 0.5f;
      p.repetition_penalty = 1.3f;
    }
    if (r % 4 == 2) p.logprobs = 2;
    b.params.push_back(p);
    b.states.push_back(random_state(V, rng));
    std::vector<uint32_t> m;
    if (r % 5 == 3 && r % 7 != 5) {  // not the shape with 5 finite logits: a mask of -inf tokens only
      m.assign(static_cast<size_t>(W), 0u);
      for (int k = 0; k < 50; ++k) {
        const int64_t t = pick(rng);
        m[t >> 5] |= 1u << (t & 31);
      }
    }
    b.masks.push_back(std::move(m));
  }
  const GpuResult one = run_gpu(b, false, true), full = run_gpu(b, true);
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_EQ(one.tokens[r], full.tokens[r]) << "row " << r;
    EXPECT_EQ(one.head_drawn[r], 1) << "row " << r;
    if (b.params[r].logprobs >= 0) {
      EXPECT_EQ(std::memcmp(&one.token_logprobs[r], &full.token_logprobs[r], sizeof(float)), 0) << "row " << r;
      for (int j = 0; j < 2; ++j) EXPECT_EQ(one.top_ids[r * b.max_top + j], full.top_ids[r * b.max_top + j]);
    }
  }
  check_batch(b, std::vector<double>(static_cast<size_t>(rows), 0.0), std::vector<bool>(static_cast<size_t>(rows), true),
              one, "greedy only");
}

TEST(SampleRows, ArgumentErrors) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  EXPECT_THROW(sample_rows_workspace_bytes(4, 0), Error);
  EXPECT_THROW(sample_rows_workspace_bytes(4, kMaxSampleVocab + 1), Error);
  EXPECT_THROW(sample_rows_workspace_bytes(int64_t{1} << 14, kMaxSampleVocab), Error);  // past 2^31 values
  const int64_t rows = 2, V = 1000;
  DeviceBuffer<float> logits(rows * V);
  DeviceBuffer<SampleRowParams> params(rows);
  DeviceBuffer<int32_t> tokens(rows);
  const size_t need = sample_rows_workspace_bytes(rows, V);
  DeviceBuffer<uint8_t> ws(need);
  SampleRowsArgs a;
  a.logits = logits.get();
  a.logit_rows = rows;
  a.vocab = V;
  a.rows = rows;
  a.params = params.get();
  a.tokens = tokens.get();
  EXPECT_THROW(sample_rows(a, ws.get(), need - 1, nullptr), Error);
  EXPECT_THROW(sample_rows(a, ws.get() + 8, need - 8, nullptr), Error);
  SampleRowsArgs too_many = a;
  too_many.max_top_logprobs = kMaxSampleTopLogprobs + 1;
  EXPECT_THROW(sample_rows(too_many, ws.get(), need, nullptr), Error);
  SampleRowsArgs no_top = a;
  no_top.max_top_logprobs = 3;
  EXPECT_THROW(sample_rows(no_top, ws.get(), need, nullptr), Error);
  SampleRowsArgs few_logits = a;
  few_logits.logit_rows = 1;
  EXPECT_THROW(sample_rows(few_logits, ws.get(), need, nullptr), Error);
}

}  // namespace
}  // namespace kestrel::cuda
