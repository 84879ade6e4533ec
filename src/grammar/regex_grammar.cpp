#include "grammar/regex_grammar.h"

#include <fmt/format.h>

#include "core/error.h"
#include "grammar/escapes.h"

namespace kestrel::grammar {
namespace {

constexpr int kMaxNesting = 1000;

const std::vector<CodeRange> kDigit = {{'0', '9'}};
const std::vector<CodeRange> kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
// \s is ECMAScript's WhiteSpace and LineTerminator, as in xgrammar (and JavaScript): TAB, LF, VT, FF, CR, space,
// NBSP, every Space_Separator (U+1680, U+2000-U+200A, U+202F, U+205F, U+3000), LS, PS and ZWNBSP (U+FEFF). \d and
// \w are ASCII only.
const std::vector<CodeRange> kSpace = {{'\t', '\r'}, {' ', ' '}, {0xA0, 0xA0}, {0x1680, 0x1680}, {0x2000, 0x200A},
                                       {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000},
                                       {0xFEFF, 0xFEFF}};

class RegexParser {
 public:
  RegexParser(Grammar& g, std::string_view p, const RegexOptions& o) : g_(g), p_(p), opts_(o) {}

  ExprId parse() {
    const ExprId e = alternatives(0);
    if (pos_ < p_.size()) error("unmatched ')'");
    return e;
  }

 private:
  template <typename... Args>
  [[noreturn]] void error(fmt::format_string<Args...> f, Args&&... args) const {
    fail("regex '{}', at character {}: {}", std::string(p_), pos_ + 1, fmt::format(f, std::forward<Args>(args)...));
  }

  ExprId chars(std::vector<CodeRange> ranges, bool negated) {
    std::vector<CodeRange> r = normalize_ranges(std::move(ranges), negated, kMaxCodePoint);
    if (opts_.json_string_body) r = subtract(r, {{0, 0x1F}, {'"', '"'}, {'\\', '\\'}});
    if (r.empty()) error("a character class that matches nothing");
    return g_.chars(std::move(r));
  }
  static std::vector<CodeRange> subtract(const std::vector<CodeRange>& a, const std::vector<CodeRange>& b) {
    std::vector<CodeRange> keep = normalize_ranges(b, true, kMaxCodePoint), out;
    for (const CodeRange& x : a)
      for (const CodeRange& y : keep) {
        const uint32_t lo = std::max(x.lo, y.lo), hi = std::min(x.hi, y.hi);
        if (lo <= hi) out.push_back({lo, hi});
      }
    return out;
  }

  ExprId alternatives(int depth) {
    if (depth > kMaxNesting) error("groups nest deeper than {} levels", kMaxNesting);
    std::vector<ExprId> alts = {sequence(depth)};
    while (pos_ < p_.size() && p_[pos_] == '|') {
      ++pos_;
      alts.push_back(sequence(depth));
    }
    return g_.alt(std::move(alts));
  }

  ExprId sequence(int depth) {
    std::vector<ExprId> items;
    while (pos_ < p_.size() && p_[pos_] != '|' && p_[pos_] != ')') {
      const char c = p_[pos_];
      if (c == '^' || c == '$') {  // anchors: the pattern always matches the whole text
        ++pos_;
        continue;
      }
      if (c == '*' || c == '+' || c == '?' || c == '{')
        error("'{}' has nothing to repeat", c);
      items.push_back(quantified(atom(depth)));
    }
    return g_.seq(std::move(items));
  }

  bool digits(int64_t& v) {
    const size_t start = pos_;
    v = 0;
    while (pos_ < p_.size() && p_[pos_] >= '0' && p_[pos_] <= '9') {
      if (v > 1'000'000) error("a repetition count above 1000000");
      v = v * 10 + (p_[pos_++] - '0');
    }
    return pos_ > start;
  }

  ExprId quantified(ExprId e) {
    bool repeated = false;
    while (pos_ < p_.size()) {
      const char c = p_[pos_];
      int64_t lo = 0, hi = 0;
      if (c == '*') lo = 0, hi = -1, ++pos_;
      else if (c == '+') lo = 1, hi = -1, ++pos_;
      else if (c == '?') lo = 0, hi = 1, ++pos_;
      else if (c == '{') {
        const size_t at = pos_++;
        if (!digits(lo)) {
          pos_ = at;
          error("'{{' must start a repetition {{n}}, {{n,}} or {{n,m}} (write \\{{ for the character)");
        }
        hi = lo;
        if (pos_ < p_.size() && p_[pos_] == ',') {
          ++pos_;
          if (!digits(hi)) hi = -1;
        }
        if (pos_ >= p_.size() || p_[pos_] != '}') error("an unterminated repetition");
        ++pos_;
        if (hi != -1 && hi < lo) error("repetition {{{},{}}}: the lower bound is larger", lo, hi);
      } else {
        break;
      }
      if (repeated) error("two repetition operators in a row");
      repeated = true;
      if (pos_ < p_.size() && p_[pos_] == '?') ++pos_;  // lazy: the same strings
      else if (pos_ < p_.size() && p_[pos_] == '+') error("possessive quantifiers are not supported");
      e = g_.repeat(e, lo, hi);
    }
    return e;
  }

  // A class escape (\d \w \s and negations) at pos_ (the backslash), or false.
  bool class_escape(std::vector<CodeRange>& into, bool& negated_class) {
    if (pos_ + 1 >= p_.size()) return false;
    const char c = p_[pos_ + 1];
    const std::vector<CodeRange>* set = nullptr;
    if (c == 'd' || c == 'D') set = &kDigit;
    else if (c == 'w' || c == 'W') set = &kWord;
    else if (c == 's' || c == 'S') set = &kSpace;
    if (!set) return false;
    pos_ += 2;
    if (c >= 'a') {
      into.insert(into.end(), set->begin(), set->end());
    } else {
      const auto neg = normalize_ranges(*set, true, kMaxCodePoint);
      into.insert(into.end(), neg.begin(), neg.end());
    }
    negated_class = false;
    return true;
  }

  uint32_t escaped_char(bool in_class) {
    if (pos_ + 1 >= p_.size()) error("a backslash at the end of the pattern");
    const char c = p_[pos_ + 1];
    if (c >= '1' && c <= '9') error("back-references (\\{}) are not supported", c);
    if (c == 'k') error("named back-references (\\k) are not supported");
    if (c == 'b' && !in_class) error("word boundaries (\\b) are not supported");
    if (c == 'B') error("word boundaries (\\B) are not supported");
    if (c == 'p' || c == 'P') error("Unicode property classes (\\{}{{...}}) are not supported", c);
    if (c == 'b') {  // in a class: backspace
      pos_ += 2;
      return 8;
    }
    if (c == 'u' && pos_ + 2 < p_.size() && p_[pos_ + 2] == '{') {
      size_t j = pos_ + 3;
      uint32_t v = 0;
      while (j < p_.size() && std::isxdigit(static_cast<unsigned char>(p_[j])) && j - pos_ - 3 < 6)
        v = v * 16 + static_cast<uint32_t>(std::stoi(std::string(1, p_[j++]), nullptr, 16));
      if (j == pos_ + 3 || j >= p_.size() || p_[j] != '}' || v > kMaxCodePoint) error("a malformed \\u{{...}} escape");
      pos_ = j + 1;
      return v;
    }
    if (c == 'c') {
      if (pos_ + 2 >= p_.size() || !std::isalpha(static_cast<unsigned char>(p_[pos_ + 2])))
        error("\\c must be followed by a letter");
      const uint32_t v = static_cast<unsigned char>(p_[pos_ + 2]) % 32;
      pos_ += 3;
      return v;
    }
    if (c == 'x' && pos_ + 3 < p_.size() && std::isxdigit(static_cast<unsigned char>(p_[pos_ + 2])) &&
        std::isxdigit(static_cast<unsigned char>(p_[pos_ + 3]))) {
      const uint32_t v = static_cast<uint32_t>(std::stoi(std::string(p_.substr(pos_ + 2, 2)), nullptr, 16));
      pos_ += 4;
      return v;
    }
    std::string why;
    size_t i = pos_;
    if (const auto cp = parse_escape(p_, i, in_class, why)) {
      pos_ = i;
      return *cp;
    }
    // Any other escaped punctuation stands for itself (\. \* \( \{ \| \$ ...).
    if (std::ispunct(static_cast<unsigned char>(c)) || c == ' ') {
      pos_ += 2;
      return static_cast<unsigned char>(c);
    }
    error("unknown escape '\\{}'", c);
  }

  uint32_t literal_char() {
    const size_t at = pos_;
    const auto cp = decode_utf8(p_, pos_);
    if (!cp) {
      pos_ = at;
      error("invalid UTF-8");
    }
    return *cp;
  }

  ExprId char_class() {
    ++pos_;  // [
    bool negated = false;
    if (pos_ < p_.size() && p_[pos_] == '^') negated = true, ++pos_;
    std::vector<CodeRange> ranges;
    bool first = true;
    while (true) {
      if (pos_ >= p_.size()) error("an unterminated character class");
      if (p_[pos_] == ']' && !first) {
        ++pos_;
        break;
      }
      if (p_[pos_] == ']' && first) error("an empty character class");
      first = false;
      bool unused = false;
      if (p_[pos_] == '\\' && class_escape(ranges, unused)) continue;
      if (p_[pos_] == '[' && pos_ + 1 < p_.size() && p_[pos_ + 1] == ':') error("POSIX classes ([:name:]) are not supported");
      const uint32_t lo = p_[pos_] == '\\' ? escaped_char(true) : literal_char();
      uint32_t hi = lo;
      if (pos_ + 1 < p_.size() && p_[pos_] == '-' && p_[pos_ + 1] != ']') {
        ++pos_;
        if (p_[pos_] == '\\' && pos_ + 1 < p_.size() && std::string_view("dDwWsS").find(p_[pos_ + 1]) != std::string_view::npos)
          error("a range cannot end in a class escape");
        hi = p_[pos_] == '\\' ? escaped_char(true) : literal_char();
        if (hi < lo) error("class range {:#x}-{:#x} is reversed", lo, hi);
      }
      ranges.push_back({lo, hi});
    }
    return chars(std::move(ranges), negated);
  }

  ExprId atom(int depth) {
    const char c = p_[pos_];
    if (c == '(') {
      ++pos_;
      if (pos_ < p_.size() && p_[pos_] == '?') {
        ++pos_;
        if (pos_ < p_.size() && p_[pos_] == ':') {
          ++pos_;
        } else if (pos_ < p_.size() && (p_[pos_] == '=' || p_[pos_] == '!')) {
          error("lookahead groups are not supported");
        } else if (pos_ + 1 < p_.size() && p_[pos_] == '<' && (p_[pos_ + 1] == '=' || p_[pos_ + 1] == '!')) {
          error("lookbehind groups are not supported");
        } else if (pos_ < p_.size() && (p_[pos_] == '<' || p_[pos_] == 'P')) {
          if (p_[pos_] == 'P') ++pos_;
          if (pos_ >= p_.size() || p_[pos_] != '<') error("a malformed named group");
          ++pos_;
          while (pos_ < p_.size() && (std::isalnum(static_cast<unsigned char>(p_[pos_])) || p_[pos_] == '_')) ++pos_;
          if (pos_ >= p_.size() || p_[pos_] != '>') error("a malformed named group");
          ++pos_;
        } else {
          error("inline flags and other group modifiers ((?...)) are not supported");
        }
      }
      const ExprId e = alternatives(depth + 1);
      if (pos_ >= p_.size() || p_[pos_] != ')') error("an unclosed group");
      ++pos_;
      return e;
    }
    if (c == '[') return char_class();
    if (c == '.') {
      ++pos_;
      return chars({{0, kMaxCodePoint}}, false);
    }
    if (c == '\\') {
      std::vector<CodeRange> ranges;
      bool unused = false;
      if (class_escape(ranges, unused)) return chars(std::move(ranges), false);
      return literal(escaped_char(false));
    }
    return literal(literal_char());
  }

  ExprId literal(uint32_t cp) {
    if (opts_.json_string_body) return chars({{cp, cp}}, false);
    std::string s;
    append_utf8(s, cp);
    return g_.bytes(std::move(s));
  }

  Grammar& g_;
  std::string_view p_;
  RegexOptions opts_;
  size_t pos_ = 0;
};

}  // namespace

ExprId regex_expr(Grammar& g, std::string_view pattern, const RegexOptions& opts) {
  return RegexParser(g, pattern, opts).parse();
}

Grammar regex_grammar(std::string_view pattern, const RegexOptions& opts) {
  Grammar g;
  g.set_root(g.add_rule("root", regex_expr(g, pattern, opts)));
  return g;
}

}  // namespace kestrel::grammar
