// What a request constrains its output to (vLLM's structured_outputs: json, json_object, regex, choice, grammar),
// turned into a grammar.
#pragma once
#include <string>
#include <vector>

#include "grammar/grammar.h"

namespace kestrel::grammar {

struct StructuredOutput {
  enum class Kind { json_schema, json_object, regex, choice, grammar };
  Kind kind = Kind::json_object;
  std::string text;                  // the schema (JSON text), the regex, or the EBNF grammar
  std::vector<std::string> choices;  // Kind::choice
  bool any_whitespace = true;        // JSON: whitespace between tokens ([ \n\r\t]*), else ", " and ": " separators
  bool strict = true;                // JSON Schema: no properties beyond those listed unless additionalProperties

  // A key naming the constraint (for a cache of compiled grammars).
  std::string key() const;
};

// Error (with the reason: malformed schema, unsupported keyword, regex or grammar syntax) when it cannot be built.
Grammar build_grammar(const StructuredOutput& s);

}  // namespace kestrel::grammar
