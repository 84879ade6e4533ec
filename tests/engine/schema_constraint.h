// A JSON-schema constraint over the tiny kimi_k3 model's vocabulary, shared by the engine tests of structured output
// (constrained_sampling_test) and of structured output with speculative decoding (spec_decode_test).
#pragma once
#include <memory>

#include <nlohmann/json.hpp>

#include "grammar/json_schema.h"
#include "grammar/output_constraint.h"
#include "text/tokenizer.h"
#include "tiny_models.h"

namespace kestrel::test {

inline constexpr int32_t kEos = 258;

inline constexpr const char* kSchema = R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
  "n": {"type": "integer", "minimum": -5, "maximum": 40}, "ok": {"type": "boolean"},
  "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}, "required": ["name", "n", "ok"]})";

inline const text::Tokenizer& tiny_tokenizer() {
  static const text::Tokenizer tok = text::Tokenizer::load(tiny_dir(Arch::kimi_k3));
  return tok;
}

// kSchema compiled over the tiny model's vocabulary (its end: kEos).
inline std::shared_ptr<const grammar::OutputConstraint> schema_constraint(const Model& m, bool any_whitespace) {
  const auto vocab =
      grammar::Vocabulary::from_tokenizer(tiny_tokenizer(), static_cast<int32_t>(m.config().vocab_size), {kEos});
  auto c = std::make_shared<grammar::OutputConstraint>();
  c->grammar = std::make_shared<grammar::CompiledGrammar>(
      grammar::json_schema_grammar(nlohmann::ordered_json::parse(kSchema), {.any_whitespace = any_whitespace}), vocab);
  return c;
}

}  // namespace kestrel::test
