// A context-free grammar over bytes and special tokens: what every structured-output format (JSON Schema, free JSON,
// regex, EBNF/GBNF, choice, tool calls) is translated into before it is compiled into an automaton
// (grammar/automaton.h). A grammar is a list of named rules; a rule's body is an expression tree of literals,
// Unicode character classes (matched as UTF-8), special tokens, sequences, alternations, bounded or unbounded
// repetitions and references to rules.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kestrel::grammar {

// A closed range of Unicode code points (surrogates included, as in xgrammar: a class is a set of code points and
// each is matched by its UTF-8 bytes).
struct CodeRange {
  uint32_t lo = 0, hi = 0;
};
constexpr uint32_t kMaxCodePoint = 0x10FFFF;

using ExprId = int32_t;
using RuleId = int32_t;

struct Expr {
  enum class Kind {
    empty,     // matches ""
    bytes,     // the bytes of `text`
    chars,     // one code point in `ranges` (sorted, disjoint)
    byte_set,  // one byte in `ranges` (values 0..255): regex classes of raw bytes
    special,   // one special token: those named in `tokens`, or (negated) any special token not named there
    seq,       // children in order
    alt,       // one of the children
    repeat,    // children[0] between min and max times (max -1: unbounded)
    rule,      // the rule `rule`
  };
  Kind kind = Kind::empty;
  std::string text;
  std::vector<CodeRange> ranges;
  std::vector<std::string> tokens;  // special tokens by their text
  bool negated = false;
  std::vector<ExprId> children;
  int64_t min = 0, max = 0;
  RuleId rule = -1;
};

struct Rule {
  std::string name;
  ExprId body = -1;
};

class Grammar {
 public:
  // Expressions; each returns the id of the new node.
  ExprId empty();
  ExprId bytes(std::string text);
  // A class of code points; `negated` takes the complement in [0, kMaxCodePoint]. Ranges may overlap, any order.
  ExprId chars(std::vector<CodeRange> ranges, bool negated = false);
  ExprId byte_set(std::vector<CodeRange> ranges, bool negated = false);
  ExprId special(std::vector<std::string> tokens, bool negated = false);
  ExprId seq(std::vector<ExprId> children);
  ExprId alt(std::vector<ExprId> children);
  ExprId repeat(ExprId child, int64_t min, int64_t max);
  ExprId star(ExprId child) { return repeat(child, 0, -1); }
  ExprId plus(ExprId child) { return repeat(child, 1, -1); }
  ExprId optional(ExprId child) { return repeat(child, 0, 1); }
  ExprId ref(RuleId rule);

  // Rules: declared first (so that bodies may refer to rules defined later), defined once.
  RuleId declare(const std::string& name);
  void define(RuleId rule, ExprId body);
  RuleId add_rule(const std::string& name, ExprId body);
  // The rule of that name, or -1.
  RuleId find(const std::string& name) const;
  // A name not used yet, built from `base`.
  std::string fresh_name(const std::string& base) const;

  void set_root(RuleId r) { root_ = r; }
  RuleId root() const { return root_; }

  const Expr& expr(ExprId e) const { return exprs_[static_cast<size_t>(e)]; }
  const Rule& rule(RuleId r) const { return rules_[static_cast<size_t>(r)]; }
  size_t num_rules() const { return rules_.size(); }
  size_t num_exprs() const { return exprs_.size(); }

  // Throws kestrel::Error naming the first rule that is declared but not defined, or a missing root.
  void check_complete() const;
  // EBNF text of the grammar (for error messages and tests).
  std::string to_string() const;

 private:
  ExprId add(Expr e);
  std::vector<Expr> exprs_;
  std::vector<Rule> rules_;
  RuleId root_ = -1;
};

// Sorted, disjoint, merged ranges; the complement in [0, top] when `negated`.
std::vector<CodeRange> normalize_ranges(std::vector<CodeRange> ranges, bool negated, uint32_t top);

}  // namespace kestrel::grammar
