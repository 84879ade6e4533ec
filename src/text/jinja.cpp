#include "text/jinja.h"

#include <chrono>
#include <cmath>
#include <unordered_map>

#include <fmt/format.h>

#include "core/error.h"
#include "text/jinja_builtins.h"
#include "text/utf8.h"

namespace kestrel::text::jinja {

namespace {

// How deeply a template's source may nest blocks ({% if %} in {% for %} ...) and, separately, expressions
// (parentheses, operators, `a.b[c]`, filter chains): parsing, evaluating and destroying the syntax tree recurse
// once per level. Published chat templates nest blocks under ten deep and expressions under twenty; 128 leaves a
// wide margin while keeping a render, even through recursive macros, far inside an 8 MB stack.
constexpr int kMaxTemplateNesting = 128;

// Each call of a recursive macro stacks another render of its body, up to kMaxTemplateNesting blocks and
// expression levels deep: about 55 KB of stack per call at full nesting (Release, x86-64). 64 calls stay under
// 4 MB; recursive macros in chat templates follow a tool schema's nesting, a few levels.
constexpr int kMaxMacroRecursion = 64;

// The most items a list built by `+` or `*` may hold (a doubling loop of `l + l` would otherwise reach gigabytes
// within the step budget).
constexpr size_t kMaxListItems = 1'000'000;

// ---------------------------------------------------------------------------------------------------------------
// Lexer

enum class T { text, var_begin, var_end, block_begin, block_end, name, string, integer, floating, op, eof };

struct Token {
  T type;
  std::string value;
  int line;
};

[[noreturn]] void syntax_error(int line, const std::string& msg) { fail("template syntax error, line {}: {}", line, msg); }

bool is_space_at(std::string_view s, size_t i, size_t* len) {
  const size_t n = utf8_valid_length(s, i);
  if (n == 0) return false;
  *len = n;
  return py_isspace(utf8_decode_at(s, i, n));
}

std::string rstrip_ws(std::string_view s) {
  // Walk forward, remembering where the trailing run of whitespace started.
  size_t i = 0, keep = 0, len = 0;
  while (i < s.size()) {
    if (is_space_at(s, i, &len)) {
      i += len;
    } else {
      i += std::max<size_t>(1, utf8_valid_length(s, i));
      keep = i;
    }
  }
  return std::string(s.substr(0, keep));
}

size_t lstrip_ws_len(std::string_view s) {
  size_t i = 0, len = 0;
  while (i < s.size() && is_space_at(s, i, &len)) i += len;
  return i;
}

// jinja2 reads the source through str.splitlines() and joins with "\n", which normalises every line break and
// drops one trailing newline unless keep_trailing_newline is set.
std::string normalize_newlines(std::string_view src, bool keep_trailing_newline) {
  std::vector<std::string> lines = py_splitlines(src);
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) out += (i ? "\n" : "") + lines[i];
  if (keep_trailing_newline && !src.empty() && !lines.empty()) {
    const std::u32string u = to_u32(src);
    const char32_t c = u.back();
    if (c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E || c == 0x85 ||
        c == 0x2028 || c == 0x2029)
      out += "\n";
  }
  return out;
}

class Lexer {
 public:
  Lexer(std::string src, Options o) : s_(std::move(src)), o_(o) {}

  std::vector<Token> run() {
    bool line_starting = true, strip_next = false;
    while (pos_ < s_.size()) {
      size_t open = std::string::npos;
      char kind = 0;
      for (size_t p = s_.find('{', pos_); p != std::string::npos; p = s_.find('{', p + 1)) {
        if (p + 1 < s_.size() && (s_[p + 1] == '{' || s_[p + 1] == '%' || s_[p + 1] == '#')) {
          open = p;
          kind = s_[p + 1];
          break;
        }
      }
      std::string text = s_.substr(pos_, (open == std::string::npos ? s_.size() : open) - pos_);
      if (strip_next) {
        text.erase(0, lstrip_ws_len(text));
        strip_next = false;
      }
      if (open == std::string::npos) {
        emit_text(text);
        count_lines(s_.size());
        break;
      }
      const char mod = open + 2 < s_.size() ? s_[open + 2] : 0;
      if (mod == '-') {
        text = rstrip_ws(text);
      } else if (mod != '+' && o_.lstrip_blocks && kind != '{') {
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size() && lstrip_ws_len(text.substr(l_pos)) == text.size() - l_pos)
          text.erase(l_pos);
      }
      emit_text(text);
      count_lines(open);
      pos_ = open + 2 + ((mod == '-' || mod == '+') ? 1 : 0);
      bool closer_strip = false, closer_plus = false;
      if (kind == '#') {
        const size_t close = s_.find("#}", pos_);
        if (close == std::string::npos) syntax_error(line_, "unclosed comment");
        closer_strip = close > pos_ && s_[close - 1] == '-';
        closer_plus = close > pos_ && s_[close - 1] == '+';
        count_lines(close + 2);
        pos_ = close + 2;
      } else {
        const bool block = kind == '%';
        const int begin_line = line_;
        toks_.push_back({block ? T::block_begin : T::var_begin, "", line_});
        const size_t first = toks_.size();
        lex_tag(block ? '%' : '}', closer_strip, closer_plus, begin_line);
        toks_.push_back({block ? T::block_end : T::var_end, "", line_});
        if (block && toks_.size() == first + 2 && toks_[first].type == T::name && toks_[first].value == "raw") {
          toks_.resize(first - 1);
          lex_raw(closer_strip, closer_plus, line_starting);
          continue;
        }
        if (!block) {
          line_starting = false;
          strip_next = closer_strip;
          continue;
        }
      }
      // After a block or comment tag: `-` strips all following whitespace, trim_blocks removes one newline.
      line_starting = false;
      if (closer_strip) {
        const size_t n = lstrip_ws_len(std::string_view(s_).substr(pos_));
        line_starting = n > 0 && s_[pos_ + n - 1] == '\n';
        count_lines(pos_ + n);
        pos_ += n;
      } else if (!closer_plus && o_.trim_blocks && pos_ < s_.size() && s_[pos_] == '\n') {
        count_lines(pos_ + 1);
        ++pos_;
        line_starting = true;
      }
    }
    toks_.push_back({T::eof, "", line_});
    return std::move(toks_);
  }

 private:
  void emit_text(const std::string& t) {
    if (!t.empty()) toks_.push_back({T::text, t, line_});
  }
  void count_lines(size_t upto) {
    for (size_t i = counted_; i < upto && i < s_.size(); ++i)
      if (s_[i] == '\n') ++line_;
    counted_ = std::max(counted_, upto);
  }

  // Tokens of one {{ }} or {% %} up to its closer ('}' for "}}", '%' for "%}").
  void lex_tag(char closer, bool& strip, bool& plus, int begin_line) {
    for (;;) {
      while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
        if (s_[pos_] == '\n') ++line_;
        ++pos_;
      }
      counted_ = pos_;
      if (pos_ >= s_.size()) syntax_error(begin_line, closer == '%' ? "unclosed block tag" : "unclosed variable tag");
      auto at = [&](std::string_view w) { return s_.compare(pos_, w.size(), w) == 0; };
      const std::string end = std::string(1, closer) + "}";
      if (at(end)) {
        pos_ += 2;
        return;
      }
      if ((s_[pos_] == '-' || (closer == '%' && s_[pos_] == '+')) && s_.compare(pos_ + 1, 2, end) == 0) {
        (s_[pos_] == '-' ? strip : plus) = true;
        pos_ += 3;
        return;
      }
      const char c = s_[pos_];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos_;
        while (e < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[e])) || s_[e] == '_')) ++e;
        toks_.push_back({T::name, s_.substr(pos_, e - pos_), line_});
        pos_ = e;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        lex_number();
      } else if (c == '\'' || c == '"') {
        lex_string(c);
      } else {
        static const char* ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">",
                                    "=", "(", ")", "[", "]", "{", "}", ",", ".", ":", "|", ";"};
        bool found = false;
        for (const char* op : ops) {
          if (at(op)) {
            toks_.push_back({T::op, op, line_});
            pos_ += std::string_view(op).size();
            found = true;
            break;
          }
        }
        if (!found) syntax_error(line_, fmt::format("unexpected character '{}'", c));
      }
    }
  }

  void lex_number() {
    size_t e = pos_;
    auto digits = [&] {
      while (e < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[e])) || (s_[e] == '_' && e + 1 < s_.size() && std::isdigit(static_cast<unsigned char>(s_[e + 1]))))) ++e;
    };
    digits();
    bool is_float = false;
    if (e + 1 < s_.size() && s_[e] == '.' && std::isdigit(static_cast<unsigned char>(s_[e + 1]))) {
      ++e;
      digits();
      is_float = true;
    }
    if (e < s_.size() && (s_[e] == 'e' || s_[e] == 'E')) {
      size_t k = e + 1;
      if (k < s_.size() && (s_[k] == '+' || s_[k] == '-')) ++k;
      if (k < s_.size() && std::isdigit(static_cast<unsigned char>(s_[k]))) {
        e = k;
        digits();
        is_float = true;
      }
    }
    std::string v;
    for (size_t i = pos_; i < e; ++i)
      if (s_[i] != '_') v += s_[i];
    toks_.push_back({is_float ? T::floating : T::integer, v, line_});
    pos_ = e;
  }

  // Python string literal with the escapes of the unicode-escape codec (unknown escapes stay as written).
  void lex_string(char q) {
    const int start_line = line_;
    std::string v;
    size_t i = pos_ + 1;
    for (;;) {
      if (i >= s_.size()) syntax_error(start_line, "unterminated string");
      const char c = s_[i];
      if (c == q) break;
      if (c == '\n') ++line_;
      if (c != '\\') {
        v += c;
        ++i;
        continue;
      }
      if (i + 1 >= s_.size()) syntax_error(start_line, "unterminated string");
      const char e = s_[i + 1];
      i += 2;
      auto hex = [&](int n) {
        if (i + static_cast<size_t>(n) > s_.size()) syntax_error(line_, "truncated \\x/\\u escape");
        uint32_t cp = 0;
        for (int k = 0; k < n; ++k) {
          const char h = s_[i + static_cast<size_t>(k)];
          if (!std::isxdigit(static_cast<unsigned char>(h))) syntax_error(line_, "truncated \\x/\\u escape");
          cp = cp * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
        }
        i += static_cast<size_t>(n);
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) syntax_error(line_, "escape is not a valid code point");
        utf8_append(v, cp);
      };
      switch (e) {
        case 'n': v += '\n'; break;
        case 't': v += '\t'; break;
        case 'r': v += '\r'; break;
        case '\\': v += '\\'; break;
        case '\'': v += '\''; break;
        case '"': v += '"'; break;
        case 'a': v += '\a'; break;
        case 'b': v += '\b'; break;
        case 'f': v += '\f'; break;
        case 'v': v += '\v'; break;
        case '\n': ++line_; break;
        case 'x': hex(2); break;
        case 'u': hex(4); break;
        case 'U': hex(8); break;
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && i < s_.size() && s_[i] >= '0' && s_[i] <= '7'; ++k) cp = cp * 8 + static_cast<uint32_t>(s_[i++] - '0');
            utf8_append(v, cp);
          } else {
            v += '\\';
            v += e;
          }
      }
    }
    toks_.push_back({T::string, v, start_line});
    pos_ = i + 1;
  }

  // {% raw %}...{% endraw %}: the text in between is literal.
  void lex_raw(bool strip_after_raw, bool plus_after_raw, bool& line_starting) {
    size_t search = pos_;
    for (;;) {
      const size_t open = s_.find("{%", search);
      if (open == std::string::npos) syntax_error(line_, "missing endraw");
      size_t k = open + 2;
      const char mod = k < s_.size() ? s_[k] : 0;
      if (mod == '-' || mod == '+') ++k;
      while (k < s_.size() && (s_[k] == ' ' || s_[k] == '\t' || s_[k] == '\n')) ++k;
      if (s_.compare(k, 6, "endraw") != 0) {
        search = open + 2;
        continue;
      }
      k += 6;
      while (k < s_.size() && (s_[k] == ' ' || s_[k] == '\t' || s_[k] == '\n')) ++k;
      bool end_strip = false, end_plus = false;
      if (k < s_.size() && (s_[k] == '-' || s_[k] == '+')) {
        (s_[k] == '-' ? end_strip : end_plus) = true;
        ++k;
      }
      if (s_.compare(k, 2, "%}") != 0) syntax_error(line_, "malformed endraw");
      std::string body = s_.substr(pos_, open - pos_);
      if (strip_after_raw) body.erase(0, lstrip_ws_len(body));
      else if (!plus_after_raw && o_.trim_blocks && !body.empty() && body[0] == '\n') body.erase(0, 1);
      if (mod == '-') body = rstrip_ws(body);
      emit_text(body);
      count_lines(k + 2);
      pos_ = k + 2;
      line_starting = false;
      if (end_strip) {
        const size_t n = lstrip_ws_len(std::string_view(s_).substr(pos_));
        count_lines(pos_ + n);
        pos_ += n;
      } else if (!end_plus && o_.trim_blocks && pos_ < s_.size() && s_[pos_] == '\n') {
        count_lines(pos_ + 1);
        ++pos_;
        line_starting = true;
      }
      return;
    }
  }

  std::string s_;
  Options o_;
  size_t pos_ = 0, counted_ = 0;
  int line_ = 1;
  std::vector<Token> toks_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Syntax tree and evaluation

namespace {

struct Frame {
  std::unordered_map<std::string, Value> vars;
  Frame* parent = nullptr;
};

struct Ctx {
  Frame* frame = nullptr;
  Frame* root = nullptr;
  int macro_depth = 0;
  int64_t steps = 0;
  size_t total_bytes = 0;
  Limits limits;
  size_t output_limit = limits.max_output_bytes;
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();

  Value lookup(const std::string& name) const {
    for (Frame* f = frame; f; f = f->parent) {
      const auto it = f->vars.find(name);
      if (it != f->vars.end()) return it->second;
    }
    return Value::undefined(name);
  }
  void tick(int64_t n = 1) {
    const int64_t before = steps;
    steps += n;
    if (steps > limits.max_steps)
      fail("template render exceeded its budget of {} steps (runaway loop or recursion?)", limits.max_steps);
    // The flag and the clock every 256 steps: cheap, and a step is bounded work (a string built is capped).
    if ((before >> 8) != (steps >> 8)) {
      if (limits.cancel && limits.cancel->load(std::memory_order_relaxed)) fail("template render cancelled");
      if (std::chrono::steady_clock::now() > deadline)
        fail("template render exceeded its time budget of {} s", limits.max_seconds);
    }
  }
  void charge(size_t bytes) {
    if (bytes > limits.max_string_bytes)
      fail("template render built a string of {} bytes (the limit is {})", bytes, limits.max_string_bytes);
    total_bytes += bytes;
    if (total_bytes > limits.max_total_bytes)
      fail("template render built more than {} bytes of strings in all", limits.max_total_bytes);
    tick(1 + static_cast<int64_t>(bytes >> 12));  // building a string is work too: one step per 4 KiB
  }
  void charge(const Value& v) {
    if (v.is_string()) charge(v.str().size());
    else if (v.is_list()) tick(1 + static_cast<int64_t>(v.items().size() >> 4));
  }
};

thread_local Ctx* g_render = nullptr;  // the render running on this thread, for the builtins' charges


enum class Flow { normal, brk, cont };

}  // namespace

struct Expr {
  int line = 0;
  int height = 1;  // levels of the expression tree under and including this node
  virtual ~Expr() = default;
  virtual Value eval(Ctx& c) const = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct Node {
  int line = 0;
  virtual ~Node() = default;
  virtual Flow exec(Ctx& c, std::string& out) const = 0;
};
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

namespace {

Flow exec_body(const Body& body, Ctx& c, std::string& out) {
  for (const NodePtr& n : body) {
    c.tick();
    const Flow f = n->exec(c, out);
    if (f != Flow::normal) return f;
  }
  return Flow::normal;
}

// Adds the template line to errors raised while evaluating a node (once, at the innermost node).
template <typename F>
auto at_line(int line, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (msg.rfind("template ", 0) == 0) throw;
    fail("template error, line {}: {}", line, msg);
  }
}

struct Literal : Expr {
  Value v;
  Value eval(Ctx&) const override { return v; }
};

struct Name : Expr {
  std::string name;
  Value eval(Ctx& c) const override { return c.lookup(name); }
};

struct ListExpr : Expr {
  std::vector<ExprPtr> items;
  bool tuple = false;
  Value eval(Ctx& c) const override {
    std::vector<Value> v;
    for (const auto& e : items) v.push_back(e->eval(c));
    return Value::list(std::move(v), tuple);
  }
};

struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  Value eval(Ctx& c) const override {
    DictData d;
    for (const auto& [k, v] : items) {
      const Value key = k->eval(c);
      if (!key.is_string()) fail("dict keys must be strings here, got {}", key.type_name());
      d.set(key.str(), v->eval(c));
    }
    return Value::dict(std::move(d));
  }
};

struct GetAttr : Expr {
  ExprPtr obj;
  std::string name;
  Value eval(Ctx& c) const override { return get_attr(obj->eval(c), name); }
};

struct GetItem : Expr {
  ExprPtr obj, key;
  Value eval(Ctx& c) const override { return get_item(obj->eval(c), key->eval(c)); }
};

struct SliceExpr : Expr {
  ExprPtr obj, start, stop, step;
  Value eval(Ctx& c) const override {
    auto opt = [&](const ExprPtr& e) -> std::optional<int64_t> {
      if (!e) return std::nullopt;
      const Value v = e->eval(c);
      if (v.is_none()) return std::nullopt;
      if (!v.is_int() && !v.is_bool()) fail("slice indices must be integers or None, got {}", v.type_name());
      return v.as_int();
    };
    const Value o = obj->eval(c);
    return get_slice(o, opt(start), opt(stop), opt(step));
  }
};

struct Args {
  std::vector<ExprPtr> pos;
  std::vector<std::pair<std::string, ExprPtr>> kw;
  CallArgs eval(Ctx& c) const {
    CallArgs a;
    for (const auto& e : pos) a.args.push_back(e->eval(c));
    for (const auto& [k, e] : kw) a.kwargs.emplace_back(k, e->eval(c));
    return a;
  }
};

struct Call : Expr {
  ExprPtr callee;
  Args args;
  Value eval(Ctx& c) const override {
    const Value f = callee->eval(c);
    CallArgs a = args.eval(c);
    if (f.is_callable()) {
      c.tick();
      Value v = f.callable().fn(a);
      c.charge(v);
      return v;
    }
    if (f.is_undefined()) fail("'{}' is undefined", f.undefined_name());
    fail("'{}' object is not callable", f.type_name());
  }
};

struct FilterExpr : Expr {
  ExprPtr input;
  std::string name;
  const Filter* filter = nullptr;
  Args args;
  Value eval(Ctx& c) const override {
    const Value v = input->eval(c);
    CallArgs a = args.eval(c);
    c.tick();
    Value r = (*filter)(v, a);
    c.charge(r);
    return r;
  }
};

struct TestExpr : Expr {
  ExprPtr input;
  std::string name;
  const Test* test = nullptr;
  Args args;
  bool negate = false;
  Value eval(Ctx& c) const override {
    const Value v = input->eval(c);
    CallArgs a = args.eval(c);
    return Value((*test)(v, a) != negate);
  }
};

struct Unary : Expr {
  char op;  // '-', '+', '!'
  ExprPtr e;
  Value eval(Ctx& c) const override {
    const Value v = e->eval(c);
    if (op == '!') return Value(!v.truthy());
    if (v.is_float()) return Value(op == '-' ? -v.as_double() : v.as_double());
    if (v.is_int() || v.is_bool()) return Value(op == '-' ? -v.as_int() : v.as_int());
    fail("bad operand type for unary {}: '{}'", op, v.type_name());
  }
};

int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

// `seq * n`: the size is known before anything is built, so an empty sequence times 2^62 costs nothing and a large
// result is refused before it is allocated.
Value repeat(Ctx& c, const Value& seq, int64_t n) {
  const size_t unit = seq.is_string() ? seq.str().size() : seq.items().size();
  if (n <= 0 || unit == 0) return seq.is_string() ? Value(std::string()) : Value::list(std::vector<Value>{});
  const uint64_t limit = seq.is_string() ? c.limits.max_string_bytes : kMaxListItems;
  if (static_cast<uint64_t>(n) > limit / unit)
    fail("template render: repetition of {} {} {} times is over the limit of {}", unit,
         seq.is_string() ? "bytes" : "items", n, limit);
  const size_t total = unit * static_cast<size_t>(n);
  if (seq.is_string()) {
    c.charge(total);
    std::string out;
    out.reserve(total);
    for (int64_t i = 0; i < n; ++i) out += seq.str();
    return Value(out);
  }
  c.tick(1 + static_cast<int64_t>(total >> 4));
  std::vector<Value> out;
  out.reserve(total);
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), seq.items().begin(), seq.items().end());
  return Value::list(std::move(out));
}

Value binary(Ctx& c, const std::string& op, const Value& a, const Value& b) {
  auto type_error = [&]() -> Value {
    fail("unsupported operand type(s) for {}: '{}' and '{}'", op, a.type_name(), b.type_name());
  };
  // Strings and lists built here are charged before they are allocated.
  if (op == "~") {
    std::string l = a.to_str(), r = b.to_str();
    c.charge(l.size() + r.size());
    return Value(l + r);
  }
  const bool nums = a.is_number() && b.is_number();
  const bool floats = nums && (a.is_float() || b.is_float());
  if (op == "+") {
    if (nums) return floats ? Value(a.as_double() + b.as_double()) : Value(a.as_int() + b.as_int());
    if (a.is_string() && b.is_string()) {
      c.charge(a.str().size() + b.str().size());
      return Value(a.str() + b.str());
    }
    if (a.is_list() && b.is_list()) {
      const size_t items = a.items().size() + b.items().size();
      if (items > kMaxListItems) fail("template render built a list of {} items (the limit is {})", items, kMaxListItems);
      c.tick(1 + static_cast<int64_t>(items >> 4));
      std::vector<Value> v = a.items();
      v.insert(v.end(), b.items().begin(), b.items().end());
      return Value::list(std::move(v), a.is_tuple());
    }
    return type_error();
  }
  if (op == "-") {
    if (nums) return floats ? Value(a.as_double() - b.as_double()) : Value(a.as_int() - b.as_int());
    return type_error();
  }
  if (op == "*") {
    if (nums) return floats ? Value(a.as_double() * b.as_double()) : Value(a.as_int() * b.as_int());
    if ((a.is_string() || a.is_list()) && (b.is_int() || b.is_bool())) return repeat(c, a, b.as_int());
    if ((b.is_string() || b.is_list()) && (a.is_int() || a.is_bool())) return repeat(c, b, a.as_int());
    return type_error();
  }
  if (op == "/") {
    if (!nums) return type_error();
    if (b.as_double() == 0) fail("division by zero");
    return Value(a.as_double() / b.as_double());
  }
  if (op == "//") {
    if (!nums) return type_error();
    if (b.as_double() == 0) fail("integer division or modulo by zero");
    if (floats) return Value(std::floor(a.as_double() / b.as_double()));
    return Value(floor_div(a.as_int(), b.as_int()));
  }
  if (op == "%") {
    if (!nums) {
      if (a.is_string()) fail("'%' string formatting is not supported; use the format filter");
      return type_error();
    }
    if (b.as_double() == 0) fail("integer division or modulo by zero");
    if (floats) {
      const double x = a.as_double(), y = b.as_double();
      double r = std::fmod(x, y);
      if (r != 0 && ((r < 0) != (y < 0))) r += y;
      return Value(r);
    }
    return Value(a.as_int() - floor_div(a.as_int(), b.as_int()) * b.as_int());
  }
  if (op == "**") {
    if (!nums) return type_error();
    if (!floats && b.as_int() >= 0) {
      int64_t r = 1;
      for (int64_t i = 0; i < b.as_int(); ++i) {
        r *= a.as_int();
        if (i > 64 && (r == 0 || r == 1)) break;
      }
      return Value(r);
    }
    return Value(std::pow(a.as_double(), b.as_double()));
  }
  fail("unknown operator {}", op);
}

struct Binary : Expr {
  std::string op;
  ExprPtr l, r;
  Value eval(Ctx& c) const override { return binary(c, op, l->eval(c), r->eval(c)); }
};

struct Compare : Expr {
  ExprPtr first;
  std::vector<std::pair<std::string, ExprPtr>> rest;
  Value eval(Ctx& c) const override {
    Value left = first->eval(c);
    for (const auto& [op, e] : rest) {
      const Value right = e->eval(c);
      bool ok = false;
      if (op == "==") ok = equals(left, right);
      else if (op == "!=") ok = !equals(left, right);
      else if (op == "<") ok = compare(left, right) < 0;
      else if (op == ">") ok = compare(left, right) > 0;
      else if (op == "<=") ok = compare(left, right) <= 0;
      else if (op == ">=") ok = compare(left, right) >= 0;
      else if (op == "in") ok = contains(right, left);
      else if (op == "notin") ok = !contains(right, left);
      if (!ok) return Value(false);
      left = right;
    }
    return Value(true);
  }
};

struct Logic : Expr {
  bool is_and;
  ExprPtr l, r;
  Value eval(Ctx& c) const override {
    Value a = l->eval(c);
    if (is_and ? !a.truthy() : a.truthy()) return a;
    return r->eval(c);
  }
};

struct CondExpr : Expr {
  ExprPtr cond, yes, no;
  Value eval(Ctx& c) const override {
    if (cond->eval(c).truthy()) return yes->eval(c);
    return no ? no->eval(c) : Value::undefined();
  }
};

// ----- statements

struct TextNode : Node {
  std::string text;
  Flow exec(Ctx& c, std::string& out) const override;
};

void check_output(const Ctx& c, const std::string& out) {
  if (out.size() > c.output_limit) fail("template render: output exceeds {} bytes", c.output_limit);
}

Flow TextNode::exec(Ctx& c, std::string& out) const {
  out += text;
  check_output(c, out);
  return Flow::normal;
}

struct OutputNode : Node {
  ExprPtr e;
  Flow exec(Ctx& c, std::string& out) const override {
    at_line(line, [&] { out += e->eval(c).to_str(); });
    check_output(c, out);
    return Flow::normal;
  }
};

struct IfNode : Node {
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body else_body;
  Flow exec(Ctx& c, std::string& out) const override {
    for (const auto& branch : branches) {  // no structured binding: clang 14 (the fuzz build) cannot capture one
      const Expr& cond = *branch.first;
      const bool t = at_line(cond.line, [&] { return cond.eval(c).truthy(); });
      if (t) return exec_body(branch.second, c, out);
    }
    return exec_body(else_body, c, out);
  }
};

// Assignment target: a name, or names to unpack.
struct Target {
  std::vector<std::string> names;
  bool unpack = false;
};

void bind(Frame& f, const Target& t, const Value& v) {
  if (!t.unpack) {
    f.vars[t.names[0]] = v;
    return;
  }
  const std::vector<Value> items = iterate(v);
  if (items.size() != t.names.size())
    fail("cannot unpack {} values into {} names", items.size(), t.names.size());
  for (size_t i = 0; i < items.size(); ++i) f.vars[t.names[i]] = items[i];
}

struct ForNode : Node {
  Target target;
  ExprPtr iter, filter;
  Body body, else_body;
  Flow exec(Ctx& c, std::string& out) const override {
    const Value seq = at_line(line, [&] {
      const Value v = iter->eval(c);
      if (v.is_none()) fail("'NoneType' object is not iterable");
      return v;
    });
    std::vector<Value> items = at_line(line, [&] { return iterate(seq); });
    Frame frame;
    frame.parent = c.frame;
    Frame* saved = c.frame;
    c.frame = &frame;
    if (filter) {
      std::vector<Value> kept;
      for (const Value& v : items) {
        at_line(line, [&] { bind(frame, target, v); });
        if (at_line(line, [&] { return filter->eval(c).truthy(); })) kept.push_back(v);
      }
      items = std::move(kept);
    }
    const int64_t n = static_cast<int64_t>(items.size());
    const int64_t depth = [&] {
      const Value outer = c.lookup("loop");
      if (outer.is_dict())
        if (const Value* d = outer.dict_data().find("depth")) return d->as_int() + 1;
      return int64_t{1};
    }();
    Flow result = Flow::normal;
    for (int64_t i = 0; i < n; ++i) {
      c.tick();
      at_line(line, [&] { bind(frame, target, items[static_cast<size_t>(i)]); });
      DictData loop;
      loop.set("index", Value(i + 1));
      loop.set("index0", Value(i));
      loop.set("revindex", Value(n - i));
      loop.set("revindex0", Value(n - i - 1));
      loop.set("first", Value(i == 0));
      loop.set("last", Value(i == n - 1));
      loop.set("length", Value(n));
      loop.set("depth", Value(depth));
      loop.set("depth0", Value(depth - 1));
      loop.set("previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : Value::undefined("previtem"));
      loop.set("nextitem", i + 1 < n ? items[static_cast<size_t>(i + 1)] : Value::undefined("nextitem"));
      loop.set("cycle", Value::function("cycle", [i](CallArgs& a) {
                 if (a.args.empty()) fail("loop.cycle needs at least one argument");
                 return a.args[static_cast<size_t>(i) % a.args.size()];
               }));
      frame.vars["loop"] = Value::dict(std::move(loop));
      const Flow f = exec_body(body, c, out);
      if (f == Flow::brk) break;
    }
    c.frame = saved;
    if (n == 0) result = exec_body(else_body, c, out);
    return result;
  }
};

struct SetNode : Node {
  Target target;
  std::string ns_attr;  // {% set ns.attr = ... %} when non-empty (target.names[0] is the namespace)
  ExprPtr value;
  Body block;  // {% set x %}...{% endset %}
  std::vector<std::unique_ptr<FilterExpr>> block_filters;
  Flow exec(Ctx& c, std::string&) const override {
    at_line(line, [&] {
      Value v;
      if (value) {
        v = value->eval(c);
      } else {
        std::string s;
        exec_body(block, c, s);
        v = Value(s);
        for (const auto& f : block_filters) {
          CallArgs a = f->args.eval(c);
          v = (*f->filter)(v, a);
        }
      }
      if (!ns_attr.empty()) {
        const Value ns = c.lookup(target.names[0]);
        if (!ns.is_dict() || !ns.dict_data().is_namespace)
          fail("cannot assign attribute '{}' on '{}', which is not a namespace", ns_attr, target.names[0]);
        ns.dict_data_mut().set(ns_attr, v);
      } else {
        bind(*c.frame, target, v);
      }
    });
    return Flow::normal;
  }
};

struct MacroNode : Node {
  std::string name;
  std::vector<std::pair<std::string, ExprPtr>> params;
  Body body;
  Flow exec(Ctx& c, std::string&) const override {
    Ctx* ctx = &c;
    const MacroNode* self = this;
    c.frame->vars[name] = Value::function(name, [ctx, self](CallArgs& a) { return self->call(*ctx, a); });
    return Flow::normal;
  }
  Value call(Ctx& c, CallArgs& a) const {
    c.tick();
    if (++c.macro_depth > kMaxMacroRecursion) fail("macro recursion deeper than {}", kMaxMacroRecursion);
    Frame frame;
    frame.parent = c.root;
    Frame* saved = c.frame;
    c.frame = &frame;
    std::vector<Value> varargs;
    for (size_t i = 0; i < a.args.size(); ++i) {
      if (i < params.size()) frame.vars[params[i].first] = a.args[i];
      else varargs.push_back(a.args[i]);
    }
    DictData extra;
    for (const auto& [k, v] : a.kwargs) {
      bool known = false;
      for (const auto& p : params) known |= p.first == k;
      if (known) frame.vars[k] = v;
      else extra.set(k, v);
    }
    for (size_t i = 0; i < params.size(); ++i) {
      if (frame.vars.count(params[i].first)) continue;
      frame.vars[params[i].first] = params[i].second ? params[i].second->eval(c) : Value::undefined(params[i].first);
    }
    frame.vars["varargs"] = Value::list(std::move(varargs));
    frame.vars["kwargs"] = Value::dict(std::move(extra));
    std::string out;
    try {
      exec_body(body, c, out);
    } catch (...) {
      c.frame = saved;
      --c.macro_depth;
      throw;
    }
    c.frame = saved;
    --c.macro_depth;
    return Value(out);
  }
};

struct FilterBlockNode : Node {
  std::vector<std::unique_ptr<FilterExpr>> filters;
  Body body;
  Flow exec(Ctx& c, std::string& out) const override {
    std::string s;
    const Flow f = exec_body(body, c, s);
    at_line(line, [&] {
      Value v(s);
      for (const auto& fl : filters) {
        CallArgs a = fl->args.eval(c);
        v = (*fl->filter)(v, a);
      }
      out += v.to_str();
    });
    return f;
  }
};

struct WithNode : Node {
  std::vector<std::pair<std::string, ExprPtr>> assigns;
  Body body;
  Flow exec(Ctx& c, std::string& out) const override {
    Frame frame;
    frame.parent = c.frame;
    for (const auto& assign : assigns) {
      const Expr& e = *assign.second;
      frame.vars[assign.first] = at_line(line, [&] { return e.eval(c); });
    }
    Frame* saved = c.frame;
    c.frame = &frame;
    Flow f = Flow::normal;
    try {
      f = exec_body(body, c, out);
    } catch (...) {
      c.frame = saved;
      throw;
    }
    c.frame = saved;
    return f;
  }
};

struct BodyNode : Node {  // {% generation %}: renders its body
  Body body;
  Flow exec(Ctx& c, std::string& out) const override { return exec_body(body, c, out); }
};

struct LoopControl : Node {
  bool is_break;
  Flow exec(Ctx&, std::string&) const override { return is_break ? Flow::brk : Flow::cont; }
};

// ---------------------------------------------------------------------------------------------------------------
// Parser

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  Body parse_template() {
    std::string end;
    Body b = parse_body({}, end);
    return b;
  }

 private:
  const Token& peek(size_t k = 0) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  const Token& next() { return t_[std::min(i_++, t_.size() - 1)]; }
  bool is_op(const std::string& op, size_t k = 0) const { return peek(k).type == T::op && peek(k).value == op; }
  bool is_name(const std::string& n, size_t k = 0) const { return peek(k).type == T::name && peek(k).value == n; }
  void expect_op(const std::string& op) {
    if (!is_op(op)) syntax_error(peek().line, fmt::format("expected '{}', got {}", op, describe(peek())));
    ++i_;
  }
  void expect(T type, const char* what) {
    if (peek().type != type) syntax_error(peek().line, fmt::format("expected {}, got {}", what, describe(peek())));
    ++i_;
  }
  std::string expect_name() {
    if (peek().type != T::name) syntax_error(peek().line, fmt::format("expected a name, got {}", describe(peek())));
    return next().value;
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case T::eof: return "end of template";
      case T::block_end: return "end of block tag";
      case T::var_end: return "end of variable tag";
      case T::text: return "text";
      default: return "'" + t.value + "'";
    }
  }

  // Parses nodes until a block tag whose name is in `ends`; leaves the position after that name.
  Body parse_body(const std::vector<std::string>& ends, std::string& end_found) {
    Body body;
    for (;;) {
      const Token& tok = peek();
      if (tok.type == T::eof) {
        if (!ends.empty()) syntax_error(tok.line, fmt::format("unexpected end of template, expected '{}'", ends.back()));
        return body;
      }
      if (tok.type == T::text) {
        auto n = std::make_unique<TextNode>();
        n->line = tok.line;
        n->text = tok.value;
        body.push_back(std::move(n));
        ++i_;
      } else if (tok.type == T::var_begin) {
        ++i_;
        auto n = std::make_unique<OutputNode>();
        n->line = tok.line;
        n->e = parse_tuple_expr();
        expect(T::var_end, "'}}'");
        body.push_back(std::move(n));
      } else if (tok.type == T::block_begin) {
        ++i_;
        if (peek().type != T::name) syntax_error(peek().line, "expected a tag name");
        const std::string name = peek().value;
        for (const std::string& e : ends)
          if (name == e) {
            ++i_;
            end_found = name;
            return body;
          }
        body.push_back(parse_statement());
      } else {
        syntax_error(tok.line, fmt::format("unexpected {}", describe(tok)));
      }
    }
  }

  NodePtr parse_statement() {
    if (++block_depth_ > kMaxTemplateNesting)
      syntax_error(peek().line, fmt::format("blocks nesting deeper than {}", kMaxTemplateNesting));
    struct Leave {
      int& d;
      ~Leave() { --d; }
    } leave{block_depth_};
    const Token& tok = next();
    const std::string& tag = tok.value;
    const int line = tok.line;
    NodePtr n;
    if (tag == "if") n = parse_if(line);
    else if (tag == "for") n = parse_for(line);
    else if (tag == "set") n = parse_set(line);
    else if (tag == "macro") n = parse_macro(line);
    else if (tag == "filter") n = parse_filter_block(line);
    else if (tag == "with") n = parse_with(line);
    else if (tag == "generation") {
      expect(T::block_end, "'%}'");
      auto b = std::make_unique<BodyNode>();
      std::string end;
      b->body = parse_body({"endgeneration"}, end);
      expect(T::block_end, "'%}'");
      n = std::move(b);
    } else if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) syntax_error(line, fmt::format("'{}' outside of a loop", tag));
      auto b = std::make_unique<LoopControl>();
      b->is_break = tag == "break";
      expect(T::block_end, "'%}'");
      n = std::move(b);
    } else if (tag == "elif" || tag == "else" || tag.rfind("end", 0) == 0) {
      syntax_error(line, fmt::format("unexpected '{}'", tag));
    } else {
      syntax_error(line, fmt::format("unknown or unsupported tag '{}'", tag));
    }
    n->line = line;
    return n;
  }

  NodePtr parse_if(int line) {
    auto n = std::make_unique<IfNode>();
    ExprPtr cond = parse_expr();
    cond->line = line;
    expect(T::block_end, "'%}'");
    for (;;) {
      std::string end;
      Body b = parse_body({"elif", "else", "endif"}, end);
      n->branches.emplace_back(std::move(cond), std::move(b));
      if (end == "elif") {
        const int l = peek().line;
        cond = parse_expr();
        cond->line = l;
        expect(T::block_end, "'%}'");
        continue;
      }
      if (end == "else") {
        expect(T::block_end, "'%}'");
        std::string e2;
        n->else_body = parse_body({"endif"}, e2);
      }
      expect(T::block_end, "'%}'");
      return n;
    }
  }

  Target parse_target() {
    Target t;
    const bool paren = is_op("(");
    if (paren) ++i_;
    t.names.push_back(expect_name());
    while (is_op(",")) {
      ++i_;
      if (paren && is_op(")")) break;
      t.names.push_back(expect_name());
      t.unpack = true;
    }
    if (paren) {
      expect_op(")");
      t.unpack = true;
    }
    return t;
  }

  NodePtr parse_for(int) {
    auto n = std::make_unique<ForNode>();
    n->target = parse_target();
    if (!is_name("in")) syntax_error(peek().line, "expected 'in' in for loop");
    ++i_;
    n->iter = parse_or();
    if (is_name("if")) {
      ++i_;
      n->filter = parse_expr();
    }
    if (is_name("recursive")) syntax_error(peek().line, "recursive loops are not supported");
    expect(T::block_end, "'%}'");
    ++loop_depth_;
    std::string end;
    n->body = parse_body({"else", "endfor"}, end);
    --loop_depth_;
    if (end == "else") {
      expect(T::block_end, "'%}'");
      n->else_body = parse_body({"endfor"}, end);
    }
    expect(T::block_end, "'%}'");
    return n;
  }

  NodePtr parse_set(int) {
    auto n = std::make_unique<SetNode>();
    if (peek().type == T::name && is_op(".", 1)) {
      n->target.names.push_back(next().value);
      ++i_;
      n->ns_attr = expect_name();
    } else {
      n->target = parse_target();
    }
    if (is_op("=")) {
      ++i_;
      n->value = parse_tuple_expr();
      expect(T::block_end, "'%}'");
      return n;
    }
    if (!n->ns_attr.empty() || n->target.unpack) syntax_error(peek().line, "block set needs a single name");
    while (is_op("|")) {
      ++i_;
      n->block_filters.push_back(parse_filter_call(nullptr));
    }
    expect(T::block_end, "'%}'");
    std::string end;
    n->block = parse_body({"endset"}, end);
    expect(T::block_end, "'%}'");
    return n;
  }

  NodePtr parse_macro(int) {
    auto n = std::make_unique<MacroNode>();
    n->name = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      std::string p = expect_name();
      ExprPtr dflt;
      if (is_op("=")) {
        ++i_;
        dflt = parse_expr();
      }
      n->params.emplace_back(std::move(p), std::move(dflt));
      if (!is_op(",")) break;
      ++i_;
    }
    expect_op(")");
    expect(T::block_end, "'%}'");
    const int saved = loop_depth_;
    loop_depth_ = 0;
    std::string end;
    n->body = parse_body({"endmacro"}, end);
    loop_depth_ = saved;
    if (peek().type == T::name) ++i_;  // {% endmacro name %}
    expect(T::block_end, "'%}'");
    return n;
  }

  NodePtr parse_filter_block(int) {
    auto n = std::make_unique<FilterBlockNode>();
    n->filters.push_back(parse_filter_call(nullptr));
    while (is_op("|")) {
      ++i_;
      n->filters.push_back(parse_filter_call(nullptr));
    }
    expect(T::block_end, "'%}'");
    std::string end;
    n->body = parse_body({"endfilter"}, end);
    expect(T::block_end, "'%}'");
    return n;
  }

  NodePtr parse_with(int) {
    auto n = std::make_unique<WithNode>();
    while (peek().type == T::name) {
      std::string k = next().value;
      expect_op("=");
      n->assigns.emplace_back(std::move(k), parse_expr());
      if (!is_op(",")) break;
      ++i_;
    }
    expect(T::block_end, "'%}'");
    std::string end;
    n->body = parse_body({"endwith"}, end);
    expect(T::block_end, "'%}'");
    return n;
  }

  // ----- expressions

  template <typename N>
  std::unique_ptr<N> make(int line) {
    auto n = std::make_unique<N>();
    n->line = line;
    return n;
  }

  // `a, b` without parentheses makes a tuple (used by {{ }} and {% set %}).
  ExprPtr parse_tuple_expr() {
    const int line = peek().line;
    ExprPtr first = parse_expr();
    if (!is_op(",")) return first;
    auto t = make<ListExpr>(line);
    t->tuple = true;
    t->items.push_back(adopt(*t, std::move(first)));
    while (is_op(",")) {
      ++i_;
      if (peek().type == T::var_end || peek().type == T::block_end) break;
      t->items.push_back(adopt(*t, parse_expr()));
    }
    return t;
  }

  // Guards one level of parser recursion inside an expression.
  struct Nested {
    Parser& p;
    explicit Nested(Parser& parser) : p(parser) {
      if (++p.expr_depth_ > kMaxTemplateNesting)
        syntax_error(p.peek().line, fmt::format("expressions nesting deeper than {}", kMaxTemplateNesting));
    }
    ~Nested() { --p.expr_depth_; }
    Nested(const Nested&) = delete;
    Nested& operator=(const Nested&) = delete;
  };

  // Hangs `child` under `parent`. Loops build chains such as `a.b.c`, `x|f|g` and `a + b + c` without parser
  // recursion, so the tree height is bounded here too: evaluating and destroying it recurse once per level.
  ExprPtr adopt(Expr& parent, ExprPtr child) {
    if (child) {
      parent.height = std::max(parent.height, child->height + 1);
      if (parent.height > kMaxTemplateNesting)
        syntax_error(parent.line, fmt::format("expressions nesting deeper than {}", kMaxTemplateNesting));
    }
    return child;
  }
  Args adopt_args(Expr& parent, Args a) {
    for (ExprPtr& e : a.pos) e = adopt(parent, std::move(e));
    for (auto& kv : a.kw) kv.second = adopt(parent, std::move(kv.second));
    return a;
  }

  ExprPtr parse_expr() {
    const int line = peek().line;
    const Nested nested(*this);
    ExprPtr e = parse_or();
    while (is_name("if")) {
      ++i_;
      auto c = make<CondExpr>(line);
      c->yes = adopt(*c, std::move(e));
      c->cond = adopt(*c, parse_or());
      if (is_name("else")) {
        ++i_;
        c->no = adopt(*c, parse_expr());
      }
      e = std::move(c);
    }
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr l = parse_and();
    while (is_name("or")) {
      const int line = next().line;
      auto n = make<Logic>(line);
      n->is_and = false;
      n->l = adopt(*n, std::move(l));
      n->r = adopt(*n, parse_and());
      l = std::move(n);
    }
    return l;
  }

  ExprPtr parse_and() {
    ExprPtr l = parse_not();
    while (is_name("and")) {
      const int line = next().line;
      auto n = make<Logic>(line);
      n->is_and = true;
      n->l = adopt(*n, std::move(l));
      n->r = adopt(*n, parse_not());
      l = std::move(n);
    }
    return l;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      const Nested nested(*this);
      const int line = next().line;
      auto n = make<Unary>(line);
      n->op = '!';
      n->e = adopt(*n, parse_not());
      return n;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const int line = peek().line;
    ExprPtr first = parse_math1();
    std::vector<std::pair<std::string, ExprPtr>> rest;
    for (;;) {
      std::string op;
      if (peek().type == T::op && (peek().value == "==" || peek().value == "!=" || peek().value == "<" ||
                                   peek().value == ">" || peek().value == "<=" || peek().value == ">=")) {
        op = next().value;
      } else if (is_name("in")) {
        ++i_;
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        i_ += 2;
        op = "notin";
      } else {
        break;
      }
      rest.emplace_back(op, parse_math1());
    }
    if (rest.empty()) return first;
    auto c = make<Compare>(line);
    c->first = adopt(*c, std::move(first));
    for (auto& [op, e] : rest) e = adopt(*c, std::move(e));
    c->rest = std::move(rest);
    return c;
  }

  ExprPtr binary_node(const std::string& op, ExprPtr l, ExprPtr r, int line) {
    auto n = make<Binary>(line);
    n->op = op;
    n->l = adopt(*n, std::move(l));
    n->r = adopt(*n, std::move(r));
    return n;
  }

  ExprPtr parse_math1() {
    ExprPtr l = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& t = next();
      l = binary_node(t.value, std::move(l), parse_concat(), t.line);
    }
    return l;
  }

  ExprPtr parse_concat() {
    ExprPtr l = parse_math2();
    while (is_op("~")) {
      const int line = next().line;
      l = binary_node("~", std::move(l), parse_math2(), line);
    }
    return l;
  }

  ExprPtr parse_math2() {
    ExprPtr l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = next();
      l = binary_node(t.value, std::move(l), parse_pow(), t.line);
    }
    return l;
  }

  ExprPtr parse_pow() {
    ExprPtr l = parse_unary(true);
    while (is_op("**")) {
      const int line = next().line;
      l = binary_node("**", std::move(l), parse_unary(true), line);
    }
    return l;
  }

  ExprPtr parse_unary(bool with_filter) {
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Nested nested(*this);
      const Token& t = next();
      auto u = make<Unary>(t.line);
      u->op = t.value[0];
      u->e = adopt(*u, parse_unary(false));
      e = std::move(u);
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Token& t = peek();
    if (t.type == T::name) {
      ++i_;
      const std::string& v = t.value;
      auto lit = [&](Value x) {
        auto l = make<Literal>(t.line);
        l->v = std::move(x);
        return l;
      };
      if (v == "true" || v == "True") return lit(Value(true));
      if (v == "false" || v == "False") return lit(Value(false));
      if (v == "none" || v == "None") return lit(Value::none());
      auto n = make<Name>(t.line);
      n->name = v;
      return n;
    }
    if (t.type == T::string) {
      std::string s;
      const int line = t.line;
      while (peek().type == T::string) s += next().value;
      auto l = make<Literal>(line);
      l->v = Value(s);
      return l;
    }
    if (t.type == T::integer || t.type == T::floating) {
      ++i_;
      auto l = make<Literal>(t.line);
      if (t.type == T::integer) {
        const auto v = parse_int64(t.value);
        if (!v) syntax_error(t.line, fmt::format("number '{}' is out of range", t.value));
        l->v = Value(*v);
      } else {
        l->v = Value(std::strtod(t.value.c_str(), nullptr));  // overflow gives inf, as Python's float() does
      }
      return l;
    }
    if (is_op("(")) {
      const int line = next().line;
      if (is_op(")")) {
        ++i_;
        auto tup = make<ListExpr>(line);
        tup->tuple = true;
        return tup;
      }
      ExprPtr e = parse_expr();
      if (is_op(",")) {
        auto tup = make<ListExpr>(line);
        tup->tuple = true;
        tup->items.push_back(adopt(*tup, std::move(e)));
        while (is_op(",")) {
          ++i_;
          if (is_op(")")) break;
          tup->items.push_back(adopt(*tup, parse_expr()));
        }
        e = std::move(tup);
      }
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      const int line = next().line;
      auto l = make<ListExpr>(line);
      while (!is_op("]")) {
        l->items.push_back(adopt(*l, parse_expr()));
        if (!is_op(",")) break;
        ++i_;
      }
      expect_op("]");
      return l;
    }
    if (is_op("{")) {
      const int line = next().line;
      auto d = make<DictExpr>(line);
      while (!is_op("}")) {
        ExprPtr k = adopt(*d, parse_expr());
        expect_op(":");
        d->items.emplace_back(std::move(k), adopt(*d, parse_expr()));
        if (!is_op(",")) break;
        ++i_;
      }
      expect_op("}");
      return d;
    }
    syntax_error(t.line, fmt::format("unexpected {}", describe(t)));
  }

  Args parse_call_args() {
    Args a;
    expect_op("(");
    while (!is_op(")")) {
      if (is_op("*") || is_op("**")) syntax_error(peek().line, "*args and **kwargs in calls are not supported");
      if (peek().type == T::name && is_op("=", 1)) {
        std::string k = next().value;
        ++i_;
        a.kw.emplace_back(std::move(k), parse_expr());
      } else {
        if (!a.kw.empty()) syntax_error(peek().line, "positional argument after keyword argument");
        a.pos.push_back(parse_expr());
      }
      if (!is_op(",")) break;
      ++i_;
    }
    expect_op(")");
    return a;
  }

  ExprPtr parse_postfix(ExprPtr e) {
    for (;;) {
      if (is_op(".")) {
        const int line = next().line;
        if (peek().type == T::integer) {
          auto g = make<GetItem>(line);
          g->obj = adopt(*g, std::move(e));
          auto k = make<Literal>(line);
          const Token& num = next();
          const auto index = parse_int64(num.value);
          if (!index) syntax_error(num.line, fmt::format("index '{}' is out of range", num.value));
          k->v = Value(*index);
          g->key = adopt(*g, std::move(k));
          e = std::move(g);
        } else {
          auto g = make<GetAttr>(line);
          g->obj = adopt(*g, std::move(e));
          g->name = expect_name();
          e = std::move(g);
        }
      } else if (is_op("[")) {
        const int line = next().line;
        ExprPtr start, stop, step;
        bool slice = false;
        if (!is_op(":")) start = parse_expr();
        if (is_op(":")) {
          slice = true;
          ++i_;
          if (!is_op("]") && !is_op(":")) stop = parse_expr();
          if (is_op(":")) {
            ++i_;
            if (!is_op("]")) step = parse_expr();
          }
        }
        expect_op("]");
        if (slice) {
          auto s = make<SliceExpr>(line);
          s->obj = adopt(*s, std::move(e));
          s->start = adopt(*s, std::move(start));
          s->stop = adopt(*s, std::move(stop));
          s->step = adopt(*s, std::move(step));
          e = std::move(s);
        } else {
          auto g = make<GetItem>(line);
          g->obj = adopt(*g, std::move(e));
          g->key = adopt(*g, std::move(start));
          e = std::move(g);
        }
      } else if (is_op("(")) {
        const int line = peek().line;
        auto c = make<Call>(line);
        c->callee = adopt(*c, std::move(e));
        c->args = adopt_args(*c, parse_call_args());
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  std::unique_ptr<FilterExpr> parse_filter_call(ExprPtr input) {
    const int line = peek().line;
    std::string name = expect_name();
    while (is_op(".")) {  // dotted filter names
      ++i_;
      name += "." + expect_name();
    }
    auto f = make<FilterExpr>(line);
    f->input = adopt(*f, std::move(input));
    f->name = name;
    f->filter = find_filter(name);
    if (!f->filter) syntax_error(line, fmt::format("no filter named '{}'", name));
    if (is_op("(")) f->args = adopt_args(*f, parse_call_args());
    return f;
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    for (;;) {
      if (is_op("|")) {
        ++i_;
        e = parse_filter_call(std::move(e));
      } else if (is_name("is")) {
        const int line = next().line;
        auto t = make<TestExpr>(line);
        if (is_name("not")) {
          ++i_;
          t->negate = true;
        }
        if (peek().type == T::name) t->name = next().value;
        else if (peek().type == T::op && (peek().value == "==" || peek().value == "!=" || peek().value == "<" ||
                                          peek().value == ">" || peek().value == "<=" || peek().value == ">="))
          t->name = next().value;
        else syntax_error(line, "expected a test name after 'is'");
        t->test = find_test(t->name);
        if (!t->test) syntax_error(line, fmt::format("no test named '{}'", t->name));
        t->input = adopt(*t, std::move(e));
        if (is_op("(")) {
          t->args = adopt_args(*t, parse_call_args());
        } else if (peek().type == T::string || peek().type == T::integer || peek().type == T::floating ||
                   is_op("[") || is_op("{") ||
                   (peek().type == T::name && !is_name("else") && !is_name("or") && !is_name("and") &&
                    !is_name("if") && !is_name("in") && !is_name("not") && !is_name("is"))) {
          t->args.pos.push_back(adopt(*t, parse_primary_with_postfix()));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        const int line = peek().line;
        auto c = make<Call>(line);
        c->callee = adopt(*c, std::move(e));
        c->args = adopt_args(*c, parse_call_args());
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_primary_with_postfix() { return parse_postfix(parse_primary()); }

  std::vector<Token> t_;
  size_t i_ = 0;
  int loop_depth_ = 0;
  int expr_depth_ = 0;
  int block_depth_ = 0;
};

}  // namespace

struct RootNode : Node {
  Body body;
  Flow exec(Ctx& c, std::string& out) const override { return exec_body(body, c, out); }
};

Template::Template(std::string_view source, Options opts) {
  require_utf8(source, "chat template");
  Lexer lx(normalize_newlines(source, opts.keep_trailing_newline), opts);
  Parser p(lx.run());
  auto root = std::make_unique<RootNode>();
  root->body = p.parse_template();
  root_ = std::move(root);
}

Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

std::string Template::render(const DictData& context, const Limits& limits) const {
  Frame globals;
  for (auto& [k, v] : default_globals().items) globals.vars[k] = v;
  for (const auto& [k, v] : context.items) globals.vars[k] = v;
  Frame root;
  root.parent = &globals;
  Ctx c;
  c.frame = &root;
  c.root = &root;
  c.limits = limits;
  c.output_limit = limits.max_output_bytes;
  if (limits.max_seconds > 0)
    c.deadline = std::chrono::steady_clock::now() +
                 std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                     std::chrono::duration<double>(limits.max_seconds));
  if (limits.cancel && limits.cancel->load()) fail("template render cancelled");
  struct Current {  // renders nest when a builtin renders (none does today); restore the outer one
    Ctx* saved;
    explicit Current(Ctx* c) : saved(g_render) { g_render = c; }
    ~Current() { g_render = saved; }
  } current(&c);
  std::string out;
  root_->exec(c, out);
  return out;
}

void charge_steps(int64_t n) {
  if (g_render) g_render->tick(n);
}

void charge_string(size_t bytes) {
  if (g_render) g_render->charge(bytes);
}

void check_string_size(size_t bytes) {
  const size_t limit = g_render ? g_render->limits.max_string_bytes : Limits{}.max_string_bytes;
  if (bytes > limit) fail("template render built a string of more than {} bytes", limit);
}

}  // namespace kestrel::text::jinja
