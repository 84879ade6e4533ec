// EBNF grammars in the syntax xgrammar and llama.cpp's GBNF share (vLLM's structured_outputs "grammar"):
//   rule ::= alternatives          one rule per definition; the root rule is `root` unless named otherwise
//   "text"  [a-z\u00e9]  [^"\\]    literals and code-point classes (escapes \n \t \r \\ \" \xHH \uHHHH \UHHHHHHHH ...)
//   a b  a | b  (a b)  a* a+ a?    sequence, alternation, grouping, repetition
//   a{2} a{2,} a{2,5}              bounded repetition
//   .                              any character (GBNF)
//   # comment                      to the end of the line
//   rule ::= body (= lookahead)    a lookahead assertion (xgrammar's): parsed; it does not change the language
// Errors name the line and column.
#pragma once
#include <string>
#include <string_view>

#include "grammar/grammar.h"

namespace kestrel::grammar {

Grammar parse_ebnf(std::string_view text, const std::string& root = "root");

}  // namespace kestrel::grammar
