#include "grammar/grammar.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"

namespace kestrel::grammar {

std::vector<CodeRange> normalize_ranges(std::vector<CodeRange> ranges, bool negated, uint32_t top) {
  for (const CodeRange& r : ranges) KESTREL_CHECK(r.lo <= r.hi && r.hi <= top, "bad range {}-{}", r.lo, r.hi);
  std::sort(ranges.begin(), ranges.end(), [](const CodeRange& a, const CodeRange& b) { return a.lo < b.lo; });
  std::vector<CodeRange> merged;
  for (const CodeRange& r : ranges) {
    if (!merged.empty() && r.lo <= merged.back().hi + 1) merged.back().hi = std::max(merged.back().hi, r.hi);
    else merged.push_back(r);
  }
  if (!negated) return merged;
  std::vector<CodeRange> out;
  uint32_t next = 0;
  for (const CodeRange& r : merged) {
    if (r.lo > next) out.push_back({next, r.lo - 1});
    next = r.hi + 1;
  }
  if (merged.empty() || merged.back().hi < top) out.push_back({next, top});
  return out;
}

ExprId Grammar::add(Expr e) {
  exprs_.push_back(std::move(e));
  return static_cast<ExprId>(exprs_.size() - 1);
}

ExprId Grammar::empty() { return add({}); }

ExprId Grammar::bytes(std::string text) {
  if (text.empty()) return empty();
  Expr e;
  e.kind = Expr::Kind::bytes;
  e.text = std::move(text);
  return add(std::move(e));
}

ExprId Grammar::chars(std::vector<CodeRange> ranges, bool negated) {
  Expr e;
  e.kind = Expr::Kind::chars;
  e.ranges = normalize_ranges(std::move(ranges), negated, kMaxCodePoint);
  return add(std::move(e));
}

ExprId Grammar::byte_set(std::vector<CodeRange> ranges, bool negated) {
  Expr e;
  e.kind = Expr::Kind::byte_set;
  e.ranges = normalize_ranges(std::move(ranges), negated, 255);
  return add(std::move(e));
}

ExprId Grammar::special(std::vector<std::string> tokens, bool negated) {
  Expr e;
  e.kind = Expr::Kind::special;
  std::sort(tokens.begin(), tokens.end());
  tokens.erase(std::unique(tokens.begin(), tokens.end()), tokens.end());
  e.tokens = std::move(tokens);
  e.negated = negated;
  return add(std::move(e));
}

ExprId Grammar::seq(std::vector<ExprId> children) {
  if (children.empty()) return empty();
  if (children.size() == 1) return children[0];
  Expr e;
  e.kind = Expr::Kind::seq;
  e.children = std::move(children);
  return add(std::move(e));
}

ExprId Grammar::alt(std::vector<ExprId> children) {
  if (children.size() == 1) return children[0];
  Expr e;
  e.kind = Expr::Kind::alt;
  e.children = std::move(children);
  return add(std::move(e));
}

ExprId Grammar::repeat(ExprId child, int64_t min, int64_t max) {
  KESTREL_CHECK(min >= 0 && (max == -1 || max >= min), "repetition bounds {{{}, {}}} are not a range", min, max);
  if (min == 1 && max == 1) return child;
  Expr e;
  e.kind = Expr::Kind::repeat;
  e.children = {child};
  e.min = min;
  e.max = max;
  return add(std::move(e));
}

ExprId Grammar::ref(RuleId rule) {
  Expr e;
  e.kind = Expr::Kind::rule;
  e.rule = rule;
  return add(std::move(e));
}

RuleId Grammar::declare(const std::string& name) {
  KESTREL_CHECK(find(name) < 0, "rule '{}' is defined twice", name);
  rules_.push_back({name, -1});
  return static_cast<RuleId>(rules_.size() - 1);
}

void Grammar::define(RuleId rule, ExprId body) {
  Rule& r = rules_[static_cast<size_t>(rule)];
  KESTREL_CHECK(r.body < 0, "rule '{}' is defined twice", r.name);
  r.body = body;
}

RuleId Grammar::add_rule(const std::string& name, ExprId body) {
  const RuleId r = declare(name);
  define(r, body);
  return r;
}

RuleId Grammar::find(const std::string& name) const {
  for (size_t i = 0; i < rules_.size(); ++i)
    if (rules_[i].name == name) return static_cast<RuleId>(i);
  return -1;
}

std::string Grammar::fresh_name(const std::string& base) const {
  if (find(base) < 0) return base;
  for (int i = 1;; ++i) {
    std::string n = fmt::format("{}_{}", base, i);
    if (find(n) < 0) return n;
  }
}

void Grammar::check_complete() const {
  KESTREL_CHECK(root_ >= 0, "the grammar has no root rule");
  for (const Rule& r : rules_) KESTREL_CHECK(r.body >= 0, "rule '{}' is used but never defined", r.name);
}

namespace {

std::string escape_char(uint32_t c, bool in_class) {
  switch (c) {
    case '\n': return "\\n";
    case '\r': return "\\r";
    case '\t': return "\\t";
    case '\\': return "\\\\";
    case '"': return in_class ? "\"" : "\\\"";
    case ']': return in_class ? "\\]" : "]";
    case '-': return in_class ? "\\-" : "-";
    case '^': return in_class ? "\\^" : "^";
    default: break;
  }
  if (c < 0x20 || c == 0x7F) return fmt::format("\\x{:02x}", c);
  if (c < 0x80) return std::string(1, static_cast<char>(c));
  return c <= 0xFFFF ? fmt::format("\\u{:04x}", c) : fmt::format("\\U{:08x}", c);
}

}  // namespace

std::string Grammar::to_string() const {
  std::string out;
  auto print = [&](auto&& self, ExprId id) -> std::string {
    const Expr& e = expr(id);
    switch (e.kind) {
      case Expr::Kind::empty: return "\"\"";
      case Expr::Kind::bytes: {
        std::string s = "\"";
        for (unsigned char c : e.text) s += c >= 0x80 ? fmt::format("\\x{:02x}", c) : escape_char(c, false);
        s += '"';
        return s;
      }
      case Expr::Kind::chars:
      case Expr::Kind::byte_set: {
        std::string s = e.kind == Expr::Kind::byte_set ? "bytes[" : "[";
        for (const CodeRange& r : e.ranges) {
          s += escape_char(r.lo, true);
          if (r.hi != r.lo) {
            s += '-';
            s += escape_char(r.hi, true);
          }
        }
        s += ']';
        return s;
      }
      case Expr::Kind::special:
        return fmt::format("<{}{}>", e.negated ? "^" : "", fmt::join(e.tokens, "|"));
      case Expr::Kind::seq:
      case Expr::Kind::alt: {
        std::vector<std::string> parts;
        for (ExprId c : e.children) parts.push_back(self(self, c));
        return fmt::format("({})", fmt::join(parts, e.kind == Expr::Kind::seq ? " " : " | "));
      }
      case Expr::Kind::repeat:
        return fmt::format("{}{{{},{}}}", self(self, e.children[0]), e.min, e.max);
      case Expr::Kind::rule: return rule(e.rule).name;
    }
    return "?";
  };
  for (size_t i = 0; i < rules_.size(); ++i)
    out += fmt::format("{} ::= {}\n", rules_[i].name, rules_[i].body >= 0 ? print(print, rules_[i].body) : "<undefined>");
  return out;
}

}  // namespace kestrel::grammar
