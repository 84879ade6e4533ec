// The grammar engine driven from Python (tests/python/test_grammar_parity.py): one JSON request per stdin line, one
// JSON answer per stdout line.
//   {"cmd": "vocab"} -> {"tokens": [hex bytes], "kinds": [...], "vocab_size", "stop": [ids]}
//   {"cmd": "grammar", "kind": ..., "spec": ...} -> {"grammar": the grammar's EBNF text}
//   {"cmd": "walk", "kind": "json_schema|json_object|regex|choice|grammar", "spec": ..., "any_whitespace": bool,
//    "tokens": [ids] (replayed) | "seed": n, "steps": n, "stop_prob": p (a random walk over the allowed tokens)}
//     -> {"tokens": [...], "masks": [hex bitmask before each token and after the last], "terminated": bool,
//         "compile_ms": x, "mask_us": mean microseconds per mask} or {"error": message}
// Usage: grammar_probe MODEL_DIR VOCAB_SIZE STOP_ID...
#include <chrono>
#include <iostream>
#include <random>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "grammar/matcher.h"
#include "grammar/structured_output.h"
#include "text/tokenizer.h"

using namespace kestrel;
using namespace kestrel::grammar;

namespace {

std::string hex_of(const std::string& s) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) out += d[c >> 4], out += d[c & 15];
  return out;
}

std::string mask_hex(const std::vector<uint32_t>& words) {
  std::string bytes;
  for (uint32_t w : words)
    for (int k = 0; k < 4; ++k) bytes += static_cast<char>((w >> (8 * k)) & 0xFF);
  return hex_of(bytes);
}

StructuredOutput spec_of(const nlohmann::ordered_json& req) {
  StructuredOutput so;
  const std::string kind = req.at("kind");
  if (kind == "json_schema") so.kind = StructuredOutput::Kind::json_schema, so.text = req.at("spec").dump();
  else if (kind == "json_object") so.kind = StructuredOutput::Kind::json_object;
  else if (kind == "regex") so.kind = StructuredOutput::Kind::regex, so.text = req.at("spec");
  else if (kind == "grammar") so.kind = StructuredOutput::Kind::grammar, so.text = req.at("spec");
  else if (kind == "choice") so.kind = StructuredOutput::Kind::choice, so.choices = req.at("spec").get<std::vector<std::string>>();
  else fail("unknown kind {}", kind);
  so.any_whitespace = req.value("any_whitespace", true);
  return so;
}

nlohmann::json walk(const nlohmann::ordered_json& req, const std::shared_ptr<const Vocabulary>& vocab) {
  const StructuredOutput so = spec_of(req);
  const auto t0 = std::chrono::steady_clock::now();
  auto compiled = std::make_shared<CompiledGrammar>(build_grammar(so), vocab);
  const double compile_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  GrammarMatcher m(compiled);
  std::vector<uint32_t> words(static_cast<size_t>(compiled->mask_words()));
  nlohmann::json masks = nlohmann::json::array(), tokens = nlohmann::json::array();
  double mask_us = 0;
  int masks_made = 0;
  auto make_mask = [&] {
    const auto a = std::chrono::steady_clock::now();
    m.fill_mask(words);
    mask_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count();
    ++masks_made;
    masks.push_back(mask_hex(words));
  };
  if (req.contains("tokens")) {
    for (int32_t t : req.at("tokens")) {
      make_mask();
      if (!m.accept_token(t)) return {{"error", fmt::format("token {} refused after {} tokens", t, tokens.size())}};
      tokens.push_back(t);
    }
    make_mask();
  } else {
    std::mt19937_64 rng(req.value("seed", 0));
    const int steps = req.value("steps", 50);
    const double stop_prob = req.value("stop_prob", 0.3);
    for (int i = 0; i < steps && !m.terminated(); ++i) {
      make_mask();
      std::vector<int32_t> allowed, stops;
      for (int32_t id = 0; id < vocab->size(); ++id)
        if (words[static_cast<size_t>(id) >> 5] >> (id & 31) & 1)
          (vocab->kind(id) == Vocabulary::Kind::stop ? stops : allowed).push_back(id);
      int32_t pick;
      if (!stops.empty() && (allowed.empty() || std::uniform_real_distribution<>(0, 1)(rng) < stop_prob))
        pick = stops[rng() % stops.size()];
      else if (!allowed.empty())
        pick = allowed[rng() % allowed.size()];
      else
        return {{"error", "no token is allowed and the grammar cannot end"}};
      if (!m.accept_token(pick)) return {{"error", fmt::format("allowed token {} refused", pick)}};
      tokens.push_back(pick);
    }
    make_mask();
  }
  return {{"tokens", tokens}, {"masks", masks}, {"terminated", m.terminated()}, {"compile_ms", compile_ms},
          {"mask_us", masks_made ? mask_us / masks_made : 0.0}, {"states", compiled->automaton().num_states()}};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: grammar_probe MODEL_DIR VOCAB_SIZE STOP_ID...\n";
    return 2;
  }
  const text::Tokenizer tok = text::Tokenizer::load(argv[1]);
  std::vector<int32_t> stops;
  for (int i = 3; i < argc; ++i) stops.push_back(std::stoi(argv[i]));
  const auto vocab = Vocabulary::from_tokenizer(tok, std::stoi(argv[2]), stops);
  std::string line;
  while (std::getline(std::cin, line)) {
    nlohmann::json out;
    try {
      const nlohmann::ordered_json req = nlohmann::ordered_json::parse(line);
      if (req.at("cmd") == "vocab") {
        nlohmann::json tokens = nlohmann::json::array(), kinds = nlohmann::json::array();
        for (int32_t id = 0; id < vocab->size(); ++id) {
          tokens.push_back(hex_of(vocab->bytes(id)));
          kinds.push_back(static_cast<int>(vocab->kind(id)));
        }
        out = {{"tokens", tokens}, {"kinds", kinds}, {"vocab_size", vocab->size()}, {"stop", vocab->stop_tokens()}};
      } else if (req.at("cmd") == "grammar") {
        out = {{"grammar", build_grammar(spec_of(req)).to_string()}};
      } else {
        out = walk(req, vocab);
      }
    } catch (const std::exception& e) {
      out = {{"error", e.what()}};
    }
    std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n" << std::flush;
  }
  return 0;
}
