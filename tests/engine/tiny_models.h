// Helpers shared by the engine tests: the tiny checkpoints (made once per test binary), random prompts, and the
// reference every engine result is compared with: one request alone through the plain forward pass (the whole
// prompt in one call, then one generated token per call), greedy.
#pragma once
#include <omp.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model/make_model.h"
#include "cpu/cpu_backend.h"
#include "model/model.h"

namespace kestrel {
inline void PrintTo(Arch a, std::ostream* os) { *os << arch_name(a); }
}  // namespace kestrel

namespace kestrel::test {

// The engine tests run single-threaded: CI runs several test binaries at once on two cores, where OpenMP threads
// busy-waiting against each other make a step ~25x slower. Results do not depend on the thread count (every
// reduction of the CPU reference has a fixed order).
inline const bool kSingleThreaded = [] {
  omp_set_num_threads(1);
  return true;
}();

// The checkpoints this process made, removed when it exits.
struct TempDirs {
  std::vector<std::string> dirs;
  ~TempDirs() {
    for (const std::string& d : dirs) std::filesystem::remove_all(d);
  }
};

inline std::string tiny_dir(Arch arch) {
  static TempDirs made;
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("kestrel_engine_test_" + std::string(arch_name(arch)) + "_" + std::to_string(::getpid()));
  if (!std::filesystem::exists(dir + "/config.json")) {
    make_model(find_preset(arch, "tiny"), dir, 7);
    made.dirs.push_back(dir);
  }
  return dir;
}

// One loaded model per (architecture, options) per test binary.
inline const Model& tiny_model(Arch arch, const ModelOptions& opts = {}) {
  static std::map<std::tuple<Arch, int, int, bool>, std::unique_ptr<Model>> models;
  const auto key = std::make_tuple(arch, static_cast<int>(opts.latent_cache), static_cast<int>(opts.index_keys),
                                   opts.kda_chunked_prefill);
  auto& m = models[key];
  if (!m) m = load_cpu_model(tiny_dir(arch), opts);
  return *m;
}

inline std::vector<int32_t> random_prompt(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(n);
  for (auto& t : ids) t = static_cast<int32_t>(rng() % 256);  // byte tokens: never the end-of-sequence id
  return ids;
}

struct Generation {
  std::vector<int32_t> tokens;
  std::vector<float> logits;  // [prompt + tokens - 1, vocab]
};

// The request alone through Model::forward: greedy, max_tokens tokens, no stop token.
inline Generation generate_alone(const Model& m, const std::vector<int32_t>& prompt, int max_tokens) {
  const int64_t V = m.config().vocab_size, P = static_cast<int64_t>(prompt.size());
  Generation g;
  SequenceState s = m.new_sequence();
  g.logits.resize(static_cast<size_t>(P * V));
  m.forward(s, prompt.data(), P, g.logits.data());
  for (int i = 0; i < max_tokens; ++i) {
    const float* last = g.logits.data() + g.logits.size() - V;
    const int32_t tok = static_cast<int32_t>(std::max_element(last, last + V) - last);
    g.tokens.push_back(tok);
    if (i + 1 == max_tokens) break;
    const size_t at = g.logits.size();
    g.logits.resize(at + V);
    m.forward(s, &tok, 1, g.logits.data() + at);
  }
  return g;
}

inline SamplingParams greedy(int max_tokens) {
  SamplingParams p;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Runs the engine to the end, checking the row accounting after every step.
inline std::vector<RequestOutput> run_checked(Engine& e, int* steps = nullptr) {
  std::vector<RequestOutput> done;
  int n = 0;
  while (e.has_unfinished()) {
    StepOutput o = e.step();
    ++n;
    e.check_accounting();
    for (RequestOutput& r : o.finished) done.push_back(std::move(r));
  }
  std::sort(done.begin(), done.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  if (steps) *steps = n;
  return done;
}

}  // namespace kestrel::test
