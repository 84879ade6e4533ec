// Structured output on the CPU: per-step token-mask time at batch 1 and 64 and compilation time, on a generated
// vocabulary of about 150K tokens (byte tokens, English-like words with and without a leading space, JSON
// punctuation runs, numbers, whitespace runs, CJK and other multi-byte characters, partial UTF-8 bytes).
//
//   grammar_mask_bench bench/grammar/workloads.json [--vocab-size 150000] [--steps 64] [--seed 1]
//                      [--dump DIR]   (vocab.txt and walks.json for bench/grammar/xgrammar_compare.py)
//
// Per workload: compile (grammar + automaton), precompute (every state's mask cache entry, what xgrammar's compile
// does), then B = 1 and 64 sequences walking random allowed tokens for --steps steps: a step's time is the masks of
// all B rows, one core. Cold: the B = 1 walk on a grammar whose cache fills as states are first reached; the
// headline numbers are warm: the same walks a second time (the first also caches the (state, caller state) pairs
// recursive grammars meet). The rows of a batch walk with different seeds.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "grammar/matcher.h"
#include "grammar/structured_output.h"

using namespace kestrel;
using namespace kestrel::grammar;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

std::shared_ptr<const Vocabulary> make_vocab(int32_t size, uint64_t seed, int32_t* eos) {
  std::mt19937_64 rng(seed);
  std::set<std::string> seen;
  std::vector<std::string> tokens;
  auto add = [&](std::string t) {
    if (t.empty() || static_cast<int32_t>(tokens.size()) >= size - 1 || !seen.insert(t).second) return;
    tokens.push_back(std::move(t));
  };
  for (int b = 0; b < 256; ++b) add(std::string(1, static_cast<char>(b)));
  const std::string punct[] = {"{", "}", "[", "]", "\"", ":", ",", " ", "\n", "\t", ".", "-", "_", "/", "\\", "'"};
  for (const auto& a : punct)
    for (const auto& b : punct) {
      add(a + b);
      for (const auto& c : punct) add(a + b + c);
    }
  for (int n = 0; n < 1000; ++n) add(std::to_string(n));
  for (int n = 1; n <= 64; ++n) add(std::string(static_cast<size_t>(n), ' ')), add("\n" + std::string(static_cast<size_t>(n), ' '));
  const char* onsets[] = {"b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "w",
                          "x", "z", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr", "wh", ""};
  const char* vowels[] = {"a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "io", "oo", "ou", "ie"};
  const char* codas[] = {"", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "rs", "st", "ck", "ll", "ts", "ed", "ing"};
  std::uniform_real_distribution<> u(0, 1);
  while (static_cast<int32_t>(tokens.size()) < size - 1) {
    const double r = u(rng);
    std::string w;
    const int syl = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < syl; ++i)
      w += std::string(onsets[rng() % std::size(onsets)]) + vowels[rng() % std::size(vowels)] + codas[rng() % std::size(codas)];
    if (r < 0.35) add(" " + w);
    else if (r < 0.55) add(w);
    else if (r < 0.62) add(" " + std::string(1, static_cast<char>(std::toupper(w[0]))) + w.substr(1));
    else if (r < 0.68) add("\"" + w + "\"");
    else if (r < 0.72) add(w + "\":");
    else if (r < 0.76) add("\"" + w);
    else if (r < 0.80) add(w + "\",");
    else if (r < 0.86) {  // a CJK or accented run
      std::string s;
      const int n = 1 + static_cast<int>(rng() % 3);
      for (int i = 0; i < n; ++i) {
        const uint32_t cp = r < 0.83 ? 0x4E00 + static_cast<uint32_t>(rng() % 0x5000) : 0xC0 + static_cast<uint32_t>(rng() % 0x140);
        if (cp < 0x800) s += static_cast<char>(0xC0 | (cp >> 6)), s += static_cast<char>(0x80 | (cp & 0x3F));
        else s += static_cast<char>(0xE0 | (cp >> 12)), s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), s += static_cast<char>(0x80 | (cp & 0x3F));
      }
      add(s);
    } else if (r < 0.90) {  // a partial UTF-8 sequence (byte-level BPE has these)
      std::string s = w.substr(0, 2);
      s += static_cast<char>(0xE4 + rng() % 8);
      if (rng() & 1) s += static_cast<char>(0x80 + rng() % 64);
      add(s);
    } else if (r < 0.95) {
      add(" " + std::to_string(rng() % 100000));
    } else {
      add(w + (rng() & 1 ? "." : "()"));
    }
  }
  std::vector<Vocabulary::Kind> kinds(tokens.size(), Vocabulary::Kind::bytes);
  kinds.push_back(Vocabulary::Kind::special);  // the end-of-sequence token
  tokens.push_back("<|eos|>");
  *eos = static_cast<int32_t>(tokens.size() - 1);
  return std::make_shared<const Vocabulary>(kinds, tokens, std::vector<int32_t>{*eos});
}

struct Stats {
  double mean = 0, p50 = 0, p99 = 0, max = 0;
};
Stats stats(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  for (double x : v) s.mean += x;
  s.mean /= static_cast<double>(v.size());
  s.p50 = v[v.size() / 2];
  s.p99 = v[std::min(v.size() - 1, v.size() * 99 / 100)];
  s.max = v.back();
  return s;
}

// B rows walking random allowed tokens; per-step times (microseconds, all rows) and each row's tokens.
std::vector<double> walk(const std::shared_ptr<const CompiledGrammar>& g, int batch, int steps, uint64_t seed,
                         std::vector<std::vector<int32_t>>* tokens) {
  std::vector<GrammarMatcher> rows(static_cast<size_t>(batch), GrammarMatcher(g));
  std::vector<std::mt19937_64> rngs;
  for (int b = 0; b < batch; ++b) rngs.emplace_back(seed * 1000 + static_cast<uint64_t>(b));
  std::vector<std::vector<uint32_t>> masks(static_cast<size_t>(batch), std::vector<uint32_t>(static_cast<size_t>(g->mask_words())));
  if (tokens) tokens->assign(static_cast<size_t>(batch), {});
  std::vector<double> times;
  std::vector<int32_t> allowed;
  for (int s = 0; s < steps; ++s) {
    const auto t0 = Clock::now();
    for (int b = 0; b < batch; ++b)
      if (!rows[static_cast<size_t>(b)].terminated()) rows[static_cast<size_t>(b)].fill_mask(masks[static_cast<size_t>(b)]);
    times.push_back(ms_since(t0) * 1000.0);
    for (int b = 0; b < batch; ++b) {
      GrammarMatcher& m = rows[static_cast<size_t>(b)];
      if (m.terminated()) continue;
      allowed.clear();
      bool stop = false;
      const auto& w = masks[static_cast<size_t>(b)];
      for (int32_t id = 0; id < g->vocab_size(); ++id)
        if (w[static_cast<size_t>(id) >> 5] >> (id & 31) & 1) {
          if (g->vocabulary().kind(id) == Vocabulary::Kind::stop) stop = true;
          else allowed.push_back(id);
        }
      // Keep walking (the stop token only when nothing else is allowed): every step measures a live state.
      const int32_t pick = allowed.empty() ? g->vocabulary().stop_tokens()[0]
                                           : allowed[rngs[static_cast<size_t>(b)]() % allowed.size()];
      (void)stop;
      m.accept_token(pick);
      if (tokens) (*tokens)[static_cast<size_t>(b)].push_back(pick);
    }
  }
  return times;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: grammar_mask_bench WORKLOADS.json [--vocab-size N] [--steps N] [--seed N] [--dump DIR]\n");
    return 2;
  }
  int32_t vocab_size = 150000;
  int steps = 64;
  uint64_t seed = 1;
  std::string dump;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--vocab-size") vocab_size = std::stoi(v);
    else if (k == "--steps") steps = std::stoi(v);
    else if (k == "--seed") seed = std::stoull(v);
    else if (k == "--dump") dump = v;
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  std::ifstream in(argv[1]);
  const auto workloads = nlohmann::ordered_json::parse(in);
  int32_t eos = 0;
  auto t0 = Clock::now();
  const auto vocab = make_vocab(vocab_size, seed, &eos);
  std::printf("vocabulary: %d tokens (trie %zu nodes, longest %d bytes), built in %.0f ms\n\n", vocab->size(),
              vocab->trie().size(), vocab->max_token_symbols(), ms_since(t0));
  std::printf("| workload | states (distinct) | compile ms | precompute ms | cache MiB | B=1 step us mean / p50 / p99 "
              "(cold mean) | B=64 step us mean / p50 / p99 (per row mean) |\n|---|---|---|---|---|---|---|\n");
  nlohmann::json walks = nlohmann::json::array();
  for (const auto& w : workloads) {
    StructuredOutput so;
    const std::string kind = w["kind"];
    so.kind = kind == "json_schema" ? StructuredOutput::Kind::json_schema
              : kind == "json_object" ? StructuredOutput::Kind::json_object
                                      : StructuredOutput::Kind::regex;
    so.text = kind == "json_schema" ? w["spec"].dump() : kind == "regex" ? w["spec"].get<std::string>() : "";
    t0 = Clock::now();
    auto g = std::make_shared<const CompiledGrammar>(build_grammar(so), vocab);
    const double compile_ms = ms_since(t0);
    // Cold walk on a lazily filled cache, then the precompute of everything, then warm walks.
    auto lazy = std::make_shared<const CompiledGrammar>(build_grammar(so), vocab);
    const Stats cold = stats(walk(lazy, 1, steps, seed, nullptr));
    t0 = Clock::now();
    g->precompute();
    const double precompute_ms = ms_since(t0);
    // Each walk once untimed, so that the (state, caller) pairs it meets are cached too, then timed.
    std::vector<std::vector<int32_t>> tokens1, tokens64;
    walk(g, 1, steps, seed, nullptr);
    walk(g, 64, steps, seed, nullptr);
    const Stats b1 = stats(walk(g, 1, steps, seed, &tokens1));
    const Stats b64 = stats(walk(g, 64, steps, seed, &tokens64));
    std::printf("| %s | %d (%d) | %.1f | %.1f | %.1f | %.1f / %.1f / %.1f (%.1f) | %.0f / %.0f / %.0f (%.1f) |\n",
                w["name"].get<std::string>().c_str(), g->automaton().num_states(), g->distinct_states(), compile_ms,
                precompute_ms,
                static_cast<double>(g->cache_bytes()) / (1 << 20), b1.mean, b1.p50, b1.p99, cold.mean, b64.mean, b64.p50,
                b64.p99, b64.mean / 64);
    std::fflush(stdout);
    walks.push_back({{"name", w["name"]}, {"tokens", tokens64}});
  }
  if (!dump.empty()) {
    std::ofstream v(dump + "/vocab.txt");
    for (int32_t id = 0; id < vocab->size(); ++id) {
      static const char* d = "0123456789abcdef";
      std::string hex;
      for (unsigned char c : vocab->bytes(id)) hex += d[c >> 4], hex += d[c & 15];
      v << (vocab->kind(id) == Vocabulary::Kind::bytes ? "b " : "s ") << hex << "\n";
    }
    std::ofstream(dump + "/walks.json") << walks.dump();
  }
  return 0;
}
