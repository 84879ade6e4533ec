// Token-sharded prefill of whole tiny models over W simulated ranks against the unsharded prefill (PARALLEL.md
// "Token-sharded prefill"): the same logits bit for bit, the same cache bytes on every rank, and per request the
// causal work each rank's attention core ran balanced within one piece of the 2W-piece split.
#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "model/make_model.h"
#include "cpu/cpu_backend.h"
#include "model/model.h"
#include "model/weights.h"
#include "parallel/local_world.h"
#include "parallel/token_sharded_prefill.h"

namespace kestrel::parallel {
namespace {

namespace fs = std::filesystem;

// Single-threaded OpenMP on the main thread (the unsharded runs) and, below, on every rank's thread: CI runs several
// test binaries at once on two cores, where OpenMP threads busy-waiting against each other make a step many times
// slower. Results do not depend on the thread count.
const bool kSingleThreaded = [] {
  omp_set_num_threads(1);
  return true;
}();

// The checkpoints this process made, removed when it exits.
struct TempDirs {
  std::vector<std::string> dirs;
  ~TempDirs() {
    for (const std::string& d : dirs) fs::remove_all(d);
  }
};

std::string tiny_dir(Arch arch) {
  static TempDirs made;
  const std::string dir = fs::temp_directory_path() / ("kestrel_parallel_test_" + std::string(arch_name(arch)) +
                                                       "_" + std::to_string(::getpid()));
  if (!fs::exists(dir + "/config.json")) {
    make_model(find_preset(arch, "tiny"), dir, 7);
    made.dirs.push_back(dir);
  }
  return dir;
}

const Model& tiny_model(Arch arch, const ModelOptions& opts = {}) {
  static std::map<std::tuple<Arch, int, int>, std::unique_ptr<Model>> models;
  auto& m = models[{arch, static_cast<int>(opts.latent_cache), static_cast<int>(opts.index_keys)}];
  if (!m) m = load_cpu_model(tiny_dir(arch), opts);
  return *m;
}

std::vector<int32_t> random_ids(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(n);
  for (auto& t : ids) t = static_cast<int32_t>(rng() % 4096);
  return ids;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Request {
  int64_t cached = 0;  // positions prefilled before the step
  int64_t tokens = 0;  // the step's new tokens
};

// The requests of one step in a pool of the model's cache plan (B = 16): request i holds its state rows, then the
// token rows of its blocks. Their cached prefixes are prefilled once, unsharded; each run of the step starts from
// a copy of that pool. The last request wants logits for its last half only.
class Step {
 public:
  Step(const Model& m, std::vector<Request> reqs, uint32_t seed) : reqs_(std::move(reqs)) {
    plan_ = plan_cache(m.cache_specs(), {.block_size = 16});
    const int64_t B = plan_.block_size, S = plan_.state_rows_per_request;
    const size_t n = reqs_.size();
    ids_.resize(n);
    tables_.resize(n);
    state_rows_.resize(n);
    prefix_slots_.resize(n);
    slots_.resize(n);
    int32_t row = 0;
    for (size_t i = 0; i < n; ++i) {
      const Request& r = reqs_[i];
      ids_[i] = random_ids(r.cached + r.tokens, seed + static_cast<uint32_t>(i));
      for (int64_t s = 0; s < S; ++s) state_rows_[i].push_back(row++);
      for (int64_t j = 0; j < plan_.token_rows_for(r.cached + r.tokens); ++j) tables_[i].push_back(row++);
      for (int64_t p = 0; p < r.cached + r.tokens; ++p)
        (p < r.cached ? prefix_slots_[i] : slots_[i]).push_back(int64_t{tables_[i][p / B]} * B + p % B);
    }
    pool_.assign(static_cast<size_t>(row) * plan_.row_bytes, 0);
    std::vector<SequenceStep> prefix;
    for (size_t i = 0; i < n; ++i) {
      const Request& r = reqs_[i];
      if (r.cached > 0)
        prefix.push_back({std::span(ids_[i]).first(r.cached), 0, true, tables_[i], prefix_slots_[i], state_rows_[i],
                          {}, r.cached});
      const int64_t logits_from = i + 1 == n ? r.tokens / 2 : 0;
      steps_.push_back({std::span(ids_[i]).subspan(r.cached), r.cached, true, tables_[i], slots_[i], state_rows_[i],
                        {}, logits_from});
      wanted_ += r.tokens - logits_from;
    }
    if (!prefix.empty()) m.forward(StepBatch{pool_.data(), &plan_, prefix}, nullptr);
  }

  const std::vector<Request>& requests() const { return reqs_; }
  int64_t wanted_logits() const { return wanted_; }
  std::vector<uint8_t> prefilled_pool() const { return pool_; }
  StepBatch batch(std::vector<uint8_t>& pool) const { return {pool.data(), &plan_, steps_}; }

 private:
  std::vector<Request> reqs_;
  CachePlan plan_;
  std::vector<std::vector<int32_t>> ids_, tables_, state_rows_;
  std::vector<std::vector<int64_t>> prefix_slots_, slots_;
  std::vector<SequenceStep> steps_;
  std::vector<uint8_t> pool_;
  int64_t wanted_ = 0;
};

struct Run {
  std::vector<float> logits;
  std::vector<uint8_t> pool;
  std::vector<TokenShardWork> work;  // per MLA layer (sharded runs)
};

Run run_unsharded(const Model& m, const Step& step) {
  Run r{std::vector<float>(step.wanted_logits() * m.config().vocab_size), step.prefilled_pool(), {}};
  m.forward(step.batch(r.pool), r.logits.data());
  return r;
}

std::vector<Run> run_sharded(const Model& m, const Step& step, int W) {
  std::vector<Run> runs(W);
  LocalWorld(W).run([&](Communicator& comm) {
    omp_set_num_threads(1);
    Run& r = runs[comm.rank()];
    r.pool = step.prefilled_pool();
    r.logits.resize(step.wanted_logits() * m.config().vocab_size);
    r.work = token_sharded_forward(comm, m, step.batch(r.pool), r.logits.data());
  });
  return runs;
}

// Per MLA layer and request: the ranks' attention cores together ran every token once, and no two ranks' causal
// work (the sum over their queries of position + 1, the keys each one scores) differs by more than the causal work
// of the request's largest piece of the 2W-piece split, nor by more than its last token's work.
void expect_balanced_work(const Model& m, const Step& step, int W, const std::vector<Run>& runs) {
  const int mla_layers = m.config().num_layers_of(LayerKind::mla);
  for (int r = 0; r < W; ++r) ASSERT_EQ(static_cast<int>(runs[r].work.size()), mla_layers);
  const auto& reqs = step.requests();
  for (int l = 0; l < mla_layers; ++l)
    for (size_t q = 0; q < reqs.size(); ++q) {
      const int64_t start = reqs[q].cached, n = reqs[q].tokens;
      int64_t tokens = 0, total = 0, lo = INT64_MAX, hi = 0;
      for (int r = 0; r < W; ++r) {
        const int64_t work = runs[r].work[l].causal_work[q];
        tokens += runs[r].work[l].query_tokens[q];
        total += work;
        lo = std::min(lo, work);
        hi = std::max(hi, work);
      }
      EXPECT_EQ(tokens, n);
      EXPECT_EQ(total, n * (2 * start + n + 1) / 2);  // positions start .. start + n - 1, each + 1
      int64_t largest_piece = 0, position = start;
      for (int64_t size : causal_piece_sizes(n, W)) {
        largest_piece = std::max(largest_piece, size * (2 * position + size + 1) / 2);
        position += size;
      }
      EXPECT_LE(hi - lo, largest_piece) << "W=" << W << " layer " << l << " request " << q;
      EXPECT_LE(hi - lo, start + n) << "W=" << W << " layer " << l << " request " << q;
    }
}

void expect_sharded_equals_unsharded(const Model& m, const Step& step, int W) {
  const Run ref = run_unsharded(m, step);
  const std::vector<Run> runs = run_sharded(m, step, W);
  for (int r = 0; r < W; ++r) {
    EXPECT_TRUE(same_bits(runs[r].logits, ref.logits)) << "W=" << W << ": logits of rank " << r;
    EXPECT_TRUE(runs[r].pool == ref.pool) << "W=" << W << ": cache of rank " << r;
  }
  expect_balanced_work(m, step, W, runs);
}

// Lengths not divisible by 2W; longer than index_topk (16), so the indexer selects; a request appended to a
// cached prefix; requests shorter than 2W (empty pieces); and a step of fewer tokens than ranks (ranks that own
// no token at all).
const std::vector<std::vector<Request>> kSteps = {
    {{0, 37}},
    {{0, 29}, {21, 19}, {0, 3}, {50, 1}},
    {{10, 2}},
};

TEST(TokenShardedPrefill, TinyKimiK3EqualsUnshardedBitForBit) {
  const Model& m = tiny_model(Arch::kimi_k3);
  ASSERT_EQ(m.config().num_attention_heads, 4);  // W = 3 splits the heads 1, 1, 2
  ASSERT_LT(m.config().index_topk, 37);
  for (size_t s = 0; s < kSteps.size(); ++s) {
    const Step step(m, kSteps[s], 100 + static_cast<uint32_t>(s));
    for (int W : {2, 3, 4}) {
      SCOPED_TRACE("step " + std::to_string(s) + ", W=" + std::to_string(W));
      expect_sharded_equals_unsharded(m, step, W);
    }
  }
}

// Each rank writes the step's entries into its copy of the cache in the layer's own format, so the quantized
// formats stay exact too.
TEST(TokenShardedPrefill, TinyKimiK3QuantizedCacheFormats) {
  for (auto [latent, keys] : {std::pair{LatentCacheDtype::fp8, IndexKeyDtype::mxfp4},
                              std::pair{LatentCacheDtype::nvfp4, IndexKeyDtype::fp8}}) {
    ModelOptions opts;
    opts.latent_cache = latent;
    opts.index_keys = keys;
    const Model& m = tiny_model(Arch::kimi_k3, opts);
    const Step step(m, kSteps[1], 200);
    expect_sharded_equals_unsharded(m, step, 3);
  }
}

// kimi_linear: dense MLA (no indexer) with q_proj and no query latent; deepseek_v32: RoPE on the head-sharded
// queries and keys at each token's position.
TEST(TokenShardedPrefill, OtherArchitectures) {
  for (Arch arch : {Arch::kimi_linear, Arch::deepseek_v32}) {
    const Model& m = tiny_model(arch);
    const Step step(m, kSteps[1], 300);
    for (int W : {3, 4}) {
      SCOPED_TRACE(std::string(arch_name(arch)) + ", W=" + std::to_string(W));
      expect_sharded_equals_unsharded(m, step, W);
    }
  }
}

TEST(TokenShardedPrefill, RejectsAStepThatIsNotThePlans) {
  const Model& m = tiny_model(Arch::kimi_k3);
  int first_mla = 0;
  while (m.config().layer_kinds[first_mla] != LayerKind::mla) ++first_mla;
  const std::vector<PrefillRequest> planned = {{0, 5}};
  const TokenShardPlan plan(planned, 2);
  LocalWorld(2).run([&](Communicator& comm) {
    TokenShardedMla runner(comm, plan);
    const std::vector<MlaStepRequest> reqs = {{TokenPages{}, 6}};
    const ModelConfig& c = m.config();
    std::vector<float> x(6 * c.hidden_size), qr(6 * c.q_lora_rank), q(6 * c.num_attention_heads * c.qk_head_dim()),
        kv(6 * (c.kv_lora_rank + c.qk_rope_head_dim)), o(6 * c.num_attention_heads * c.v_head_dim);
    const MlaCore& core = dynamic_cast<const CpuBackend&>(m.backend()).mla(m.layers()[first_mla].mla->attn);
    EXPECT_THROW(runner.run(core, x.data(), qr.data(), q.data(), kv.data(), reqs, o.data()), Error);
  });
}

}  // namespace
}  // namespace kestrel::parallel
