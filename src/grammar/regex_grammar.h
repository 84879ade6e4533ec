// Regular expressions (the JSON Schema `pattern` dialect and vLLM's structured_outputs "regex") as grammar
// expressions over code points, with xgrammar's reading of them: ^ and $ are ignored (a pattern matches the whole
// text), `.` is any character, \d \w are ASCII digits and word characters, \s is ECMAScript's white space and line
// terminators (TAB-CR, space, U+00A0, U+1680, U+2000-U+200A, U+2028, U+2029, U+202F, U+205F, U+3000, U+FEFF); greedy and lazy
// quantifiers match the same strings. Back-references, lookaround, word boundaries, \p{...} classes and inline flags
// are refused with an Error naming them.
#pragma once
#include <string_view>

#include "grammar/grammar.h"

namespace kestrel::grammar {

struct RegexOptions {
  // Every character class loses the characters a JSON string must escape (control characters, '"', '\\'): the
  // pattern then describes the body of a JSON string literal written without escapes (xgrammar's json_string).
  bool json_string_body = false;
};

// Adds the expression of `pattern` to g.
ExprId regex_expr(Grammar& g, std::string_view pattern, const RegexOptions& opts = {});
// A grammar whose root matches `pattern`.
Grammar regex_grammar(std::string_view pattern, const RegexOptions& opts = {});

}  // namespace kestrel::grammar
