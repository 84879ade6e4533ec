#include "grammar/ebnf.h"

#include <map>
#include <set>

#include <fmt/format.h>

#include "core/error.h"
#include "grammar/escapes.h"

namespace kestrel::grammar {
namespace {

constexpr int kMaxNesting = 1000;

class EbnfParser {
 public:
  explicit EbnfParser(std::string_view text) : s_(text) {}

  Grammar parse(const std::string& root) {
    skip_space();
    while (pos_ < s_.size()) {
      const size_t at = pos_;
      const std::string name = identifier();
      if (name.empty()) error(at, "expected a rule name");
      if (attributes_follow())
        error(pos_, "xgrammar's rule attributes ('{}[...] ::=', such as max_chars) are not supported", name);
      skip_space();
      if (!s_.substr(pos_).starts_with("::=")) error(pos_, "expected '::=' after rule name '{}'", name);
      pos_ += 3;
      RuleId r = g_.find(name);
      if (r < 0) r = g_.declare(name);
      if (g_.rule(r).body >= 0) error(at, "rule '{}' is defined twice", name);
      const ExprId body = choices(0);
      g_.define(r, body);
      skip_space();
      if (s_.substr(pos_).starts_with("(=")) {
        pos_ += 2;
        choices(1);  // xgrammar's lookahead assertion: a hint for its mask cache, not part of the language
        expect(')');
      }
      skip_space();
    }
    for (size_t i = 0; i < g_.num_rules(); ++i)
      if (g_.rule(static_cast<RuleId>(i)).body < 0) {
        const std::string& n = g_.rule(static_cast<RuleId>(i)).name;
        error(first_use_.at(n), "rule '{}' is used but not defined", n);
      }
    const RuleId r = g_.find(root);
    KESTREL_CHECK(r >= 0, "the grammar has no rule '{}' (the root rule)", root);
    g_.set_root(r);
    return std::move(g_);
  }

 private:
  template <typename... Args>
  [[noreturn]] void error(size_t at, fmt::format_string<Args...> f, Args&&... args) const {
    int line = 1, col = 1;
    for (size_t i = 0; i < at && i < s_.size(); ++i) {
      if (s_[i] == '\n') ++line, col = 1;
      else ++col;
    }
    fail("EBNF grammar, line {} column {}: {}", line, col, fmt::format(f, std::forward<Args>(args)...));
  }

  static bool name_char(char c, bool first) {
    return c == '_' || c == '-' || c == '.' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (!first && c >= '0' && c <= '9');
  }

  void skip_space() {
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++pos_;
      } else if (c == '#') {
        while (pos_ < s_.size() && s_[pos_] != '\n') ++pos_;
      } else {
        break;
      }
    }
  }

  std::string identifier() {
    const size_t start = pos_;
    while (pos_ < s_.size() && name_char(s_[pos_], pos_ == start)) ++pos_;
    if (pos_ - start == 1 && s_[start] == '.') {  // '.' alone is the any-character element, not a name
      pos_ = start;
      return "";
    }
    return std::string(s_.substr(start, pos_ - start));
  }

  // At pos_ (right after a rule's name): xgrammar's rule attributes, '[...]' then '::=' on the same line.
  bool attributes_follow() const {
    if (pos_ >= s_.size() || s_[pos_] != '[') return false;
    const size_t close = s_.find_first_of("]\n", pos_);
    if (close == std::string_view::npos || s_[close] != ']') return false;
    size_t i = close + 1;
    while (i < s_.size() && (s_[i] == ' ' || s_[i] == '\t')) ++i;
    return s_.substr(i).starts_with("::=");
  }

  // An identifier followed by '::=' (or by xgrammar's rule attributes and '::=') starts the next rule.
  bool at_rule_start() {
    const size_t save = pos_;
    const std::string name = identifier();
    const bool attributes = !name.empty() && attributes_follow();
    skip_space();
    const bool yes = !name.empty() && (attributes || s_.substr(pos_).starts_with("::="));
    pos_ = save;
    return yes;
  }

  void expect(char c) {
    skip_space();
    if (pos_ >= s_.size() || s_[pos_] != c) error(pos_, "expected '{}'", c);
    ++pos_;
  }

  ExprId choices(int depth) {
    if (depth > kMaxNesting) error(pos_, "the grammar nests groups deeper than {} levels", kMaxNesting);
    std::vector<ExprId> alts = {sequence(depth)};
    skip_space();
    while (pos_ < s_.size() && s_[pos_] == '|') {
      ++pos_;
      alts.push_back(sequence(depth));
      skip_space();
    }
    return g_.alt(std::move(alts));
  }

  ExprId sequence(int depth) {
    std::vector<ExprId> items;
    while (true) {
      skip_space();
      if (pos_ >= s_.size()) break;
      const char c = s_[pos_];
      if (c == '|' || c == ')') break;
      if (s_.substr(pos_).starts_with("(=")) break;
      if (name_char(c, true) && at_rule_start()) break;
      items.push_back(quantified(element(depth)));
    }
    if (items.empty()) error(pos_, "expected an element (an empty alternative is written \"\")");
    return g_.seq(std::move(items));
  }

  int64_t integer() {
    skip_space();
    const size_t start = pos_;
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    if (pos_ == start || (pos_ == start + 1 && s_[start] == '-')) error(start, "expected an integer");
    const std::string digits(s_.substr(start, pos_ - start));
    if (digits.size() > 12) error(start, "repetition count {} is too large", digits);
    return std::stoll(digits);
  }

  ExprId quantified(ExprId e) {
    while (true) {
      // As in xgrammar, white space and comments may stand between an element and its quantifier ("a" {2, 3}).
      const size_t before = pos_;
      skip_space();
      if (pos_ >= s_.size() || !(s_[pos_] == '*' || s_[pos_] == '+' || s_[pos_] == '?' || s_[pos_] == '{')) {
        pos_ = before;
        break;
      }
      const char c = s_[pos_];
      if (c == '*') {
        ++pos_;
        e = g_.star(e);
      } else if (c == '+') {
        ++pos_;
        e = g_.plus(e);
      } else if (c == '?') {
        ++pos_;
        e = g_.optional(e);
      } else if (c == '{') {
        const size_t at = pos_++;
        const int64_t lo = integer();
        int64_t hi = lo;
        skip_space();
        if (pos_ < s_.size() && s_[pos_] == ',') {
          ++pos_;
          skip_space();
          if (pos_ < s_.size() && s_[pos_] == '}') hi = -1;  // {n,}
          else hi = integer();                                // {n, -1} is xgrammar's printed form of {n,}
          if (hi < -1) error(at, "a repetition's upper bound cannot be negative");
        }
        expect('}');
        if (lo < 0) error(at, "a repetition's lower bound cannot be negative");
        if (hi != -1 && hi < lo) error(at, "repetition {{{}, {}}}: the lower bound is larger than the upper", lo, hi);
        e = g_.repeat(e, lo, hi);
      } else {
        break;
      }
    }
    return e;
  }

  ExprId element(int depth) {
    skip_space();
    const size_t at = pos_;
    const char c = s_[pos_];
    if (c == '(') {
      ++pos_;
      skip_space();
      if (pos_ < s_.size() && s_[pos_] == ')') {
        ++pos_;
        return g_.empty();
      }
      const ExprId e = choices(depth + 1);
      expect(')');
      return e;
    }
    if (c == '"') return string_literal();
    if (c == '[') return char_class();
    if (c == '.') {
      ++pos_;
      return g_.chars({{0, kMaxCodePoint}});
    }
    const std::string name = identifier();
    if (name.empty()) error(at, "unexpected character '{}'", c);
    // xgrammar's built-in functions (its macros), written NAME( with no space.
    static const std::set<std::string> kMacros = {"Regex", "Substring", "TagDispatch", "Token", "TokenTagDispatch",
                                                  "ExcludeToken"};
    if (pos_ < s_.size() && s_[pos_] == '(' && kMacros.count(name))
      error(at, "xgrammar's built-in '{}(...)' is not supported (write the rule it stands for in EBNF)", name);
    RuleId r = g_.find(name);
    if (r < 0) {
      r = g_.declare(name);
      first_use_.emplace(name, at);
    }
    return g_.ref(r);
  }

  uint32_t escaped(size_t& i, bool in_class) {
    const size_t at = i;
    std::string why;
    const auto cp = parse_escape(s_, i, in_class, why);
    if (!cp) error(at, "{}", why);
    return *cp;
  }

  ExprId string_literal() {
    const size_t at = pos_++;
    std::string out;
    while (true) {
      if (pos_ >= s_.size() || s_[pos_] == '\n') error(at, "unterminated string literal");
      const char c = s_[pos_];
      if (c == '"') {
        ++pos_;
        break;
      }
      if (c == '\\') {
        append_utf8(out, escaped(pos_, false));
      } else {
        out += c;
        ++pos_;
      }
    }
    return g_.bytes(std::move(out));
  }

  // One code point of a class: an escape or the UTF-8 character at pos_.
  uint32_t class_char() {
    if (s_[pos_] == '\\') return escaped(pos_, true);
    const size_t at = pos_;
    const auto cp = decode_utf8(s_, pos_);
    if (!cp) error(at, "invalid UTF-8 in a character class");
    return *cp;
  }

  ExprId char_class() {
    const size_t at = pos_++;
    bool negated = false;
    if (pos_ < s_.size() && s_[pos_] == '^') {
      negated = true;
      ++pos_;
    }
    std::vector<CodeRange> ranges;
    while (true) {
      if (pos_ >= s_.size()) error(at, "unterminated character class");
      if (s_[pos_] == ']') {
        ++pos_;
        break;
      }
      const uint32_t lo = class_char();
      uint32_t hi = lo;
      if (pos_ + 1 < s_.size() && s_[pos_] == '-' && s_[pos_ + 1] != ']') {
        ++pos_;
        hi = class_char();
        if (hi < lo) error(at, "character class range {:#x}-{:#x}: the lower bound is larger", lo, hi);
      }
      if (hi > kMaxCodePoint) error(at, "code point {:#x} is beyond U+10FFFF", hi);
      ranges.push_back({lo, hi});
    }
    return g_.chars(std::move(ranges), negated);
  }

  std::string_view s_;
  size_t pos_ = 0;
  Grammar g_;
  std::map<std::string, size_t> first_use_;
};

}  // namespace

Grammar parse_ebnf(std::string_view text, const std::string& root) { return EbnfParser(text).parse(root); }

}  // namespace kestrel::grammar
