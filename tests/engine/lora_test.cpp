// LoRA on the CPU backend (issue #20): PEFT-format adapters read and checked (model/lora.h), applied per request
// as y = W x + scale * B (A x) on every attention projection, the dense and shared-expert MLPs and the routed
// experts, on tiny models of each architecture:
//  - a model through an adapter equals the plain model whose weights the test merged (W + scale * B A) within an
//    fp32 bound;
//  - several adapters (and none) in one batch equal each request alone, bit for bit, prefixes never shared across
//    adapters;
//  - a rollout-then-score loop whose adapter is reloaded with new weights every step: the scored log-probs equal
//    the rollout's bit for bit (KL 0.0);
//  - bad adapter files are Errors naming the file and tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/lora.h"
#include "model/safetensors.h"
#include "tiny_models.h"

namespace kestrel {
namespace {

using test::random_prompt;
using test::run_checked;
using test::tiny_dir;

namespace fs = std::filesystem;

using Modules = std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>>;

CpuBackend& cpu(const Model& m) { return dynamic_cast<CpuBackend&>(m.backend()); }

std::string temp_dir(const std::string& name) {
  static test::TempDirs made;
  const std::string d = fs::temp_directory_path() / ("kestrel_lora_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  made.dirs.push_back(d);
  return d;
}

// A random adapter over every module the model lets LoRA adapt.
LoraAdapter random_adapter(const Model& m, const std::string& name, uint64_t seed, int rank = 8, float alpha = 16.0f) {
  const std::string dir = temp_dir(name);
  write_lora_adapter(dir, rank, alpha, cpu(m).lora_modules(), seed);
  return load_lora_adapter(dir);
}

std::vector<float> prompt_logits(const Model& m, const std::vector<int32_t>& prompt, int32_t lora) {
  const int64_t V = m.config().vocab_size;
  std::vector<float> logits(prompt.size() * V);
  SequenceState s = m.new_sequence();
  m.forward(s, prompt.data(), static_cast<int64_t>(prompt.size()), logits.data(), false, lora);
  return logits;
}

class Lora : public ::testing::TestWithParam<Arch> {};

// The adapter's output against the merged weights' (built here, in the CPU backend's fp32 weights). The two differ
// only by fp32 rounding (W x + s B (A x) against (W + s B A) x), which the layers carry on: the bound is 1e-3 of
// the logits' range, while the adapter itself moves the logits by far more (checked).
TEST_P(Lora, EqualsMergedWeights) {
  const std::string dir = tiny_dir(GetParam());
  const auto adapted = load_cpu_model(dir), merged = load_cpu_model(dir);
  const Modules modules = cpu(*adapted).lora_modules();
  // Every kind of layer is covered: attention projections, dense / shared MLPs and routed experts.
  bool attn = false, mlp = false, experts = false;
  for (const auto& [name, shape] : modules) {
    attn |= name.find("self_attn.") != std::string::npos;
    mlp |= name.find(".mlp.gate_proj") != std::string::npos || name.find("shared_experts.") != std::string::npos;
    experts |= name.find(".experts.") != std::string::npos && name.find("shared_experts") == std::string::npos;
  }
  EXPECT_TRUE(attn && mlp && experts) << modules.size() << " modules";
  const LoraAdapter a = random_adapter(*adapted, "merged", 11);
  ASSERT_EQ(a.modules.size(), modules.size());
  EXPECT_EQ(a.scale, 2.0f);
  adapted->load_lora(1, a);
  for (const auto& [module, m] : a.modules) {
    int64_t out = 0, in = 0;
    float* w = cpu(*merged).module_weight(module, &out, &in);
    ASSERT_EQ(out, m.out);
    ASSERT_EQ(in, m.in);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        float d = 0.0f;
        for (int j = 0; j < a.rank; ++j) d += m.b[o * a.rank + j] * m.a[j * in + i];
        w[o * in + i] += a.scale * d;
      }
  }
  const std::vector<int32_t> prompt = random_prompt(37, 5);
  const std::vector<float> base = prompt_logits(*adapted, prompt, 0), with = prompt_logits(*adapted, prompt, 1),
                           want = prompt_logits(*merged, prompt, 0);
  float range = 0, diff = 0, moved = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    range = std::max(range, std::abs(want[i]));
    diff = std::max(diff, std::abs(with[i] - want[i]));
    moved = std::max(moved, std::abs(base[i] - want[i]));
  }
  std::printf("[lora] %s: %zu modules, max |adapter - merged| %.3g, max |logit| %.3g, the adapter moves logits by "
              "up to %.3g\n",
              arch_name(GetParam()), modules.size(), diff, range, moved);
  EXPECT_LE(diff, 1e-3f * range);
  EXPECT_GT(moved, 100 * diff);
  EXPECT_GT(moved, 0.01f * range);
  // Unloaded, the model is the base model again, bit for bit.
  adapted->unload_lora(1);
  EXPECT_FALSE(adapted->has_lora(1));
  EXPECT_TRUE(test::same_bits(prompt_logits(*adapted, prompt, 0), base));
  EXPECT_THROW(prompt_logits(*adapted, prompt, 1), Error);
}

// Requests of four adapters and of none in one engine, sharing prompts (and so, without per-adapter keys, prefixes):
// each equals its request alone in a fresh engine, tokens, log-probs and logits bit for bit.
TEST_P(Lora, SeveralAdaptersInOneBatchEqualEachAlone) {
  const auto m = load_cpu_model(tiny_dir(GetParam()));
  for (int id = 1; id <= 4; ++id) m->load_lora(id, random_adapter(*m, "batch" + std::to_string(id), 100 + id));
  EngineConfig cfg;
  cfg.num_rows = 160;
  cfg.max_model_len = 160;
  cfg.max_num_batched_tokens = 64;  // prompts cut over steps (the KDA chunk is the least), mixed with decodes
  auto sampling = [](int32_t lora, int i) {
    SamplingParams p;
    p.max_tokens = 6;
    p.temperature = i % 2 ? 1.0f : 0.0f;
    p.seed = 7 + i;
    p.logprobs = 2;
    p.ignore_eos = true;
    p.lora_id = lora;
    return p;
  };
  std::vector<std::pair<std::vector<int32_t>, SamplingParams>> reqs;
  // Three prompts longer than a block (64 with KDA) under five adapter ids (0: none): requests i and i + 15 repeat.
  for (int i = 0; i < 20; ++i) reqs.push_back({random_prompt(70 + (i % 3) * 20, 900 + i % 3), sampling(i % 5, i)});
  Engine batch(*m, cfg);
  for (const auto& [prompt, p] : reqs) batch.add_request(prompt, p, 0, true);
  const std::vector<RequestOutput> together = run_checked(batch);
  ASSERT_EQ(together.size(), reqs.size());
  std::set<std::vector<int32_t>> distinct;
  for (size_t i = 0; i < reqs.size(); ++i) {
    Engine alone(*m, cfg);
    alone.add_request(reqs[i].first, reqs[i].second, 0, true);
    const std::vector<RequestOutput> one = run_checked(alone);
    const Completion &a = together[i].completions.at(0), &b = one.at(0).completions.at(0);
    EXPECT_EQ(a.token_ids, b.token_ids) << "request " << i;
    ASSERT_EQ(a.logprobs.size(), b.logprobs.size());
    for (size_t t = 0; t < a.logprobs.size(); ++t)
      EXPECT_EQ(std::memcmp(&a.logprobs[t].logprob, &b.logprobs[t].logprob, sizeof(float)), 0) << i << " " << t;
    // The logits of the positions both computed (a prefix hit skips some), bit for bit.
    const int64_t V = m->config().vocab_size, from = std::max(a.logits_first, b.logits_first);
    const int64_t n = static_cast<int64_t>(a.logits.size()) / V + a.logits_first - from;
    ASSERT_GT(n, 0);
    EXPECT_EQ(std::memcmp(a.logits.data() + (from - a.logits_first) * V, b.logits.data() + (from - b.logits_first) * V,
                          n * V * sizeof(float)),
              0)
        << "request " << i;
    if (reqs[i].second.temperature == 0.0f) distinct.insert(a.token_ids);
  }
  EXPECT_GT(batch.stats().prefix.hit_tokens, 0);  // requests of the same adapter and prompt did share
  EXPECT_GT(distinct.size(), 2u);                 // the adapters change what is generated
  // An id never loaded is refused when the request is added.
  SamplingParams bad = sampling(9, 0);
  EXPECT_THROW(batch.add_request(reqs[0].first, bad), Error);
}

struct Rollout {
  std::vector<int32_t> prompt, tokens;
  std::vector<float> logprobs;
  int32_t lora = 0;
};

// The RL loop of rl_loop_test.cpp with a LoRA policy: at every step the adapter is reloaded with new weights (the
// trainer's update), alternating between two ids, so that the previous step's rollouts are scored through the
// weights that sampled them while the new rollouts run in the same batches. Prefixes cached under an id's old
// weights are never reused under its new ones (the key changes with every load).
TEST_P(Lora, RolloutThenScoreWithUpdatedAdapterBitForBit) {
  ModelOptions o;
  o.kda_chunked_prefill = false;  // --batch-invariant
  const auto m = load_cpu_model(tiny_dir(GetParam()), o);
  const char* arch = arch_name(GetParam());
  const Modules modules = cpu(*m).lora_modules();
  std::mt19937 rng(77);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<std::unique_ptr<Engine>> engines;
  for (int64_t budget : {7, 19, 64}) {
    EngineConfig cfg;
    cfg.num_rows = 48;
    cfg.max_model_len = 128;
    cfg.max_num_batched_tokens = budget;
    engines.push_back(std::make_unique<Engine>(*m, cfg));
  }
  std::vector<std::vector<int32_t>> prompts;
  for (uint32_t i = 0; i < 6; ++i) prompts.push_back(random_prompt(uniform(2, 28), 700 + i));
  const std::string dir = temp_dir("rl");
  constexpr int kSteps = 100;
  int64_t total = 0;
  std::vector<Rollout> previous;
  for (int step = 0; step < kSteps; ++step) {
    // The trainer's update: new weights for this step's id (the other id keeps the previous step's).
    const int32_t lora = 1 + step % 2;
    write_lora_adapter(dir, 4 + step % 3, 8.0f, modules, 5000 + step);
    m->load_lora(lora, load_lora_adapter(dir));
    Engine& roll = *engines[uniform(0, 2)];
    std::vector<RequestId> ids;
    for (int g = uniform(1, 3); g > 0; --g) {
      SamplingParams p;
      p.n = uniform(1, 3);
      p.max_tokens = uniform(1, 8);
      p.temperature = 1.0f;
      p.seed = rng();
      p.logprobs = 0;
      p.ignore_eos = true;
      p.lora_id = lora;
      ids.push_back(roll.add_request(prompts[uniform(0, 5)], p));
    }
    std::map<RequestId, RequestOutput> done, scored;
    for (int k = uniform(0, 3); k > 0 && roll.has_unfinished(); --k)
      for (RequestOutput& out : roll.step().finished) done.emplace(out.id, std::move(out));
    Engine& score = uniform(0, 1) ? roll : *engines[uniform(0, 2)];
    std::vector<RequestId> score_ids;
    for (const Rollout& r : previous) {
      std::vector<int32_t> seq = r.prompt;
      seq.insert(seq.end(), r.tokens.begin(), r.tokens.end());
      SamplingParams p;
      p.max_tokens = 0;
      p.prompt_logprobs = 0;
      p.prompt_logprobs_start = static_cast<int64_t>(r.prompt.size());
      p.lora_id = r.lora;
      score_ids.push_back(score.add_request(seq, p));
    }
    for (RequestOutput& out : run_checked(roll))
      (&roll == &score && out.completions.empty() ? scored : done).emplace(out.id, std::move(out));
    if (&score != &roll)
      for (RequestOutput& out : run_checked(score)) scored.emplace(out.id, std::move(out));
    int64_t tokens = 0;
    double kl = 0;
    for (size_t i = 0; i < previous.size(); ++i) {
      const Rollout& r = previous[i];
      const std::vector<TokenLogprob>& lps = scored.at(score_ids[i]).prompt_logprobs;
      ASSERT_EQ(lps.size(), r.tokens.size()) << arch << " step " << step;
      for (size_t t = 0; t < lps.size(); ++t) {
        ASSERT_EQ(lps[t].token, r.tokens[t]);
        EXPECT_EQ(std::memcmp(&lps[t].logprob, &r.logprobs[t], sizeof(float)), 0)
            << arch << " step " << step << " sequence " << i << " token " << t << ": rollout " << r.logprobs[t]
            << ", scored " << lps[t].logprob;
        kl += static_cast<double>(r.logprobs[t]) - lps[t].logprob;
        ++tokens;
      }
    }
    if (tokens) kl /= static_cast<double>(tokens);
    EXPECT_EQ(kl, 0.0);
    if (step > 0)
      std::printf("[lora-rl] %s step %2d: adapter %d reloaded, %2zu sequences, %3lld tokens scored, KL %.1f\n", arch,
                  step, lora, previous.size(), static_cast<long long>(tokens), kl);
    total += tokens;
    previous.clear();
    for (RequestId id : ids)
      for (const Completion& c : done.at(id).completions) {
        Rollout r{done.at(id).prompt, c.token_ids, {}, lora};
        for (const TokenLogprob& lp : c.logprobs) r.logprobs.push_back(lp.logprob);
        previous.push_back(std::move(r));
      }
  }
  int64_t hits = 0;
  for (const auto& e : engines) {
    hits += e->stats().prefix.hit_tokens;
    EXPECT_EQ(e->cache().pool().num_referenced(), 0);
  }
  std::printf("[lora-rl] %s: %d steps, %lld tokens scored equal to the rollout bit for bit, %lld prefix-hit tokens\n",
              arch, kSteps, static_cast<long long>(total), static_cast<long long>(hits));
  EXPECT_GT(total, 1000);
  EXPECT_GT(hits, 0);
}

INSTANTIATE_TEST_SUITE_P(Tiny, Lora, ::testing::Values(Arch::kimi_k3, Arch::kimi_linear, Arch::deepseek_v32),
                         [](const auto& info) { return std::string(arch_name(info.param)); });

// ---------------------------------------------------------------- bad adapter files

// The message of the Error `f` throws ("" when it does not).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void write_config(const std::string& dir, const nlohmann::json& j) { std::ofstream(dir + "/adapter_config.json") << j.dump(); }

TEST(LoraFiles, BadAdaptersAreClearErrors) {
  const auto m = load_cpu_model(tiny_dir(Arch::kimi_linear));
  const Modules all = cpu(*m).lora_modules();
  Modules some;
  for (const auto& mod : all)
    if (mod.first.find("layers.0.") != std::string::npos) some.push_back(mod);
  ASSERT_FALSE(some.empty());
  const std::string o_proj = "model.layers.0.self_attn.o_proj";
  const std::pair<int64_t, int64_t> o_shape = [&] {
    for (const auto& mod : all)
      if (mod.first == o_proj) return mod.second;
    return std::pair<int64_t, int64_t>{0, 0};
  }();
  ASSERT_GT(o_shape.first, 0);
  auto expect_error = [](const std::string& msg, std::initializer_list<const char*> parts) {
    ASSERT_FALSE(msg.empty()) << "no error";
    for (const char* p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  };
  const std::string good = temp_dir("good");
  write_lora_adapter(good, 4, 8.0f, some, 1, 0.05f, "BF16");
  const LoraAdapter a = load_lora_adapter(good);
  EXPECT_EQ(a.rank, 4);
  EXPECT_EQ(a.scale, 2.0f);
  EXPECT_EQ(a.modules.size(), some.size());

  // No such directory / files.
  expect_error(error_of([&] { load_lora_adapter(good + "_missing"); }), {"adapter_config.json", "does not exist"});
  // The config's rank against the tensors'.
  {
    const std::string d = temp_dir("rank");
    write_lora_adapter(d, 4, 8.0f, some, 1);
    write_config(d, {{"r", 8}, {"lora_alpha", 16}, {"target_modules", lora_target_names()}});
    expect_error(error_of([&] { load_lora_adapter(d); }), {"adapter_model.safetensors", "lora_A.weight", "rank 4",
                                                           "r is 8"});
  }
  // A rank beyond --max-lora-rank.
  {
    const std::string d = temp_dir("big");
    write_lora_adapter(d, 65, 65.0f, {{o_proj, o_shape}}, 1);
    expect_error(error_of([&] { load_lora_adapter(d); }), {"adapter_config.json", "r = 65", "[1, 64]"});
    expect_error(error_of([&] { load_lora_adapter(d, 32); }), {"r = 65", "[1, 32]"});
  }
  // An unknown target module.
  {
    const std::string d = temp_dir("unknown");
    write_lora_adapter(d, 4, 8.0f, {{o_proj, o_shape}}, 1);
    write_config(d, {{"r", 4}, {"lora_alpha", 8}, {"target_modules", {"o_proj", "embed_tokens"}}});
    expect_error(error_of([&] { load_lora_adapter(d); }), {"adapter_config.json", "unknown target module 'embed_tokens'"});
  }
  // A tensor of a module that target_modules does not name.
  {
    const std::string d = temp_dir("untargeted");
    write_lora_adapter(d, 4, 8.0f, some, 1);
    write_config(d, {{"r", 4}, {"lora_alpha", 8}, {"target_modules", {"o_proj"}}});
    expect_error(error_of([&] { load_lora_adapter(d); }), {"adapter_model.safetensors", "not in target_modules"});
  }
  // Wrong shapes: the layer's input width, then its output width.
  for (const auto& [shape, what] : {std::pair{std::pair{o_shape.first, o_shape.second + 1}, "lora_A.weight"},
                                    std::pair{std::pair{o_shape.first + 2, o_shape.second}, "lora_B.weight"}}) {
    const std::string d = temp_dir(std::string("shape_") + what);
    write_lora_adapter(d, 4, 8.0f, {{o_proj, shape}}, 1);
    const LoraAdapter bad = load_lora_adapter(d);
    expect_error(error_of([&] { m->load_lora(3, bad); }),
                 {"adapter_model.safetensors", what, "model.layers.0.self_attn.o_proj"});
    EXPECT_FALSE(m->has_lora(3));
  }
  // A module the model does not have (a layer beyond its depth).
  {
    const std::string d = temp_dir("nolayer");
    write_lora_adapter(d, 4, 8.0f, {{"model.layers.99.self_attn.o_proj", o_shape}}, 1);
    const LoraAdapter bad = load_lora_adapter(d);
    expect_error(error_of([&] { m->load_lora(3, bad); }),
                 {"adapter_model.safetensors", "model.layers.99.self_attn.o_proj", "not a linear layer"});
  }
  // A tensor that is not a LoRA weight, and a module with A but no B.
  {
    const std::string d = temp_dir("stray");
    fs::create_directories(d);
    std::map<std::string, TensorData> t;
    t["base_model.model." + o_proj + ".lora_A.weight"] = TensorData{DType::F32, {4, o_shape.second},
                                                                    std::vector<uint8_t>(16 * o_shape.second)};
    write_safetensors(d + "/adapter_model.safetensors", t);
    write_config(d, {{"r", 4}, {"lora_alpha", 8}, {"target_modules", {"o_proj"}}});
    expect_error(error_of([&] { load_lora_adapter(d); }), {"adapter_model.safetensors", "lora_B.weight", "but no"});
    t["base_model.model." + o_proj + ".lora_magnitude_vector"] = TensorData{DType::F32, {1}, std::vector<uint8_t>(4)};
    write_safetensors(d + "/adapter_model.safetensors", t);
    expect_error(error_of([&] { load_lora_adapter(d); }), {"lora_magnitude_vector", "is not a LoRA weight"});
  }
  // A malformed config.
  {
    const std::string d = temp_dir("json");
    write_lora_adapter(d, 4, 8.0f, {{o_proj, o_shape}}, 1);
    std::ofstream(d + "/adapter_config.json") << "{\"r\": 4,";
    expect_error(error_of([&] { load_lora_adapter(d); }), {"adapter_config.json", "not valid JSON"});
    write_config(d, {{"r", 4}, {"target_modules", {"o_proj"}}});
    expect_error(error_of([&] { load_lora_adapter(d); }), {"adapter_config.json", "lora_alpha"});
  }
  // After all of that the model still runs, and a good adapter loads.
  m->load_lora(3, a);
  EXPECT_TRUE(m->has_lora(3));
  EXPECT_FALSE(prompt_logits(*m, random_prompt(5, 1), 3).empty());
  EXPECT_THROW(m->load_lora(0, a), Error);
}

}  // namespace
}  // namespace kestrel
