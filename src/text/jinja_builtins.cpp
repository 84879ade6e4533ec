#include "text/jinja_builtins.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <unordered_map>

#include <fmt/format.h>

#include "core/error.h"
#include "text/utf8.h"

namespace kestrel::text::jinja {

std::optional<int64_t> parse_int64(std::string_view digits) {
  int64_t v = 0;
  const auto r = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (r.ec != std::errc() || r.ptr != digits.data() + digits.size()) return std::nullopt;
  return v;
}

bool py_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

std::u32string to_u32(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const size_t n = utf8_valid_length(s, i);
    if (n == 0) fail("template string is not valid UTF-8");
    out += utf8_decode_at(s, i, n);
    i += n;
  }
  return out;
}

std::string from_u32(std::u32string_view s) {
  std::string out;
  for (char32_t c : s) utf8_append(out, c);
  return out;
}

std::vector<std::string> py_splitlines(std::string_view s) {
  const std::u32string u = to_u32(s);
  std::vector<std::string> out;
  size_t start = 0, i = 0;
  while (i < u.size()) {
    const char32_t c = u[i];
    const bool br = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
                    c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!br) {
      ++i;
      continue;
    }
    out.push_back(from_u32(std::u32string_view(u).substr(start, i - start)));
    i += (c == '\r' && i + 1 < u.size() && u[i + 1] == '\n') ? 2 : 1;
    start = i;
  }
  if (start < u.size()) out.push_back(from_u32(std::u32string_view(u).substr(start)));
  return out;
}

namespace {

bool is_ascii(std::string_view s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  return true;
}

std::string ascii_lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

std::string ascii_upper(std::string s) {
  for (char& c : s)
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  return s;
}

bool is_alpha(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

std::string title_case(const std::string& s) {
  std::string out = s;
  bool prev_cased = false;
  for (char& c : out) {
    if (is_alpha(static_cast<unsigned char>(c))) {
      c = prev_cased ? static_cast<char>(std::tolower(static_cast<unsigned char>(c)))
                     : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      prev_cased = true;
    } else {
      prev_cased = false;
    }
  }
  return out;
}

std::string capitalize(const std::string& s) {
  std::string out = ascii_lower(s);
  if (!out.empty() && out[0] >= 'a' && out[0] <= 'z') out[0] = static_cast<char>(out[0] - 'a' + 'A');
  return out;
}

// str.strip / lstrip / rstrip with optional chars (None: whitespace).
std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  const std::u32string u = to_u32(s);
  std::u32string set;
  const bool ws = chars.is_none() || chars.is_undefined();
  if (!ws) {
    if (!chars.is_string()) fail("strip arg must be None or str");
    set = to_u32(chars.str());
  }
  auto strip_char = [&](char32_t c) { return ws ? py_isspace(c) : set.find(c) != std::u32string::npos; };
  size_t b = 0, e = u.size();
  if (left)
    while (b < e && strip_char(u[b])) ++b;
  if (right)
    while (e > b && strip_char(u[e - 1])) --e;
  return from_u32(std::u32string_view(u).substr(b, e - b));
}

std::vector<Value> py_split(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right) {
  std::vector<Value> out;
  if (sep.is_none() || sep.is_undefined()) {
    const std::u32string u = to_u32(s);
    std::vector<std::pair<size_t, size_t>> words;
    size_t i = 0;
    while (i < u.size()) {
      while (i < u.size() && py_isspace(u[i])) ++i;
      if (i >= u.size()) break;
      size_t j = i;
      while (j < u.size() && !py_isspace(u[j])) ++j;
      words.emplace_back(i, j);
      i = j;
    }
    if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit + 1) {
      // The unsplit remainder keeps its inner whitespace, trimmed on the split side only.
      if (!from_right) {
        for (int64_t k = 0; k < maxsplit; ++k) out.emplace_back(from_u32(u.substr(words[k].first, words[k].second - words[k].first)));
        out.emplace_back(from_u32(u.substr(words[maxsplit].first, words.back().second - words[maxsplit].first)));
      } else {
        const size_t keep = words.size() - static_cast<size_t>(maxsplit);
        out.emplace_back(from_u32(u.substr(words[0].first, words[keep - 1].second - words[0].first)));
        for (size_t k = keep; k < words.size(); ++k) out.emplace_back(from_u32(u.substr(words[k].first, words[k].second - words[k].first)));
      }
      return out;
    }
    for (const auto& [b, e] : words) out.emplace_back(from_u32(u.substr(b, e - b)));
    return out;
  }
  if (!sep.is_string()) fail("split: separator must be a string");
  const std::string& d = sep.str();
  if (d.empty()) fail("split: empty separator");
  std::vector<std::string> parts;
  if (!from_right) {
    size_t pos = 0;
    int64_t n = 0;
    for (;;) {
      const size_t f = s.find(d, pos);
      if (f == std::string::npos || (maxsplit >= 0 && n >= maxsplit)) break;
      parts.push_back(s.substr(pos, f - pos));
      pos = f + d.size();
      ++n;
    }
    parts.push_back(s.substr(pos));
  } else {
    size_t end = s.size();
    int64_t n = 0;
    for (;;) {
      if (end < d.size()) break;
      const size_t f = s.rfind(d, end - d.size());
      if (f == std::string::npos || (maxsplit >= 0 && n >= maxsplit)) break;
      parts.insert(parts.begin(), s.substr(f + d.size(), end - f - d.size()));
      end = f;
      ++n;
    }
    parts.insert(parts.begin(), s.substr(0, end));
  }
  for (auto& p : parts) out.emplace_back(std::move(p));
  return out;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count) {
  std::string out;
  if (old.empty()) {
    // Python inserts `repl` between characters (and at both ends).
    const std::u32string u = to_u32(s);
    int64_t n = 0;
    for (size_t i = 0; i <= u.size(); ++i) {
      if (count < 0 || n < count) {
        out += repl;
        ++n;
        check_string_size(out.size());
      }
      if (i < u.size()) utf8_append(out, u[i]);
    }
    return out;
  }
  size_t pos = 0;
  int64_t n = 0;
  for (;;) {
    const size_t f = s.find(old, pos);
    if (f == std::string::npos || (count >= 0 && n >= count)) break;
    out.append(s, pos, f - pos);
    out += repl;
    check_string_size(out.size());
    pos = f + old.size();
    ++n;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

int64_t py_count(const std::string& s, const std::string& sub) {
  if (sub.empty()) return static_cast<int64_t>(to_u32(s).size()) + 1;
  int64_t n = 0;
  for (size_t pos = s.find(sub); pos != std::string::npos; pos = s.find(sub, pos + sub.size())) ++n;
  return n;
}

// Byte offset -> code point index.
int64_t cp_index(const std::string& s, size_t byte_pos) { return static_cast<int64_t>(to_u32(s.substr(0, byte_pos)).size()); }

bool prefix_test(const std::string& s, const Value& what, bool suffix) {
  auto one = [&](const Value& p) {
    if (!p.is_string()) fail("{}with first arg must be str or a tuple of str", suffix ? "ends" : "starts");
    const std::string& x = p.str();
    if (x.size() > s.size()) return false;
    return suffix ? s.compare(s.size() - x.size(), x.size(), x) == 0 : s.compare(0, x.size(), x) == 0;
  };
  if (what.is_list()) {
    for (const Value& p : what.items())
      if (one(p)) return true;
    return false;
  }
  return one(what);
}

template <typename Pred>
bool all_chars(const std::string& s, Pred pred) {
  const std::u32string u = to_u32(s);
  if (u.empty()) return false;
  return std::all_of(u.begin(), u.end(), pred);
}

std::string py_format(const std::string& fmt_str, const CallArgs& a) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < fmt_str.size(); ++i) {
    const char c = fmt_str[i];
    if (c == '{' && i + 1 < fmt_str.size() && fmt_str[i + 1] == '{') {
      out += '{';
      ++i;
    } else if (c == '}' && i + 1 < fmt_str.size() && fmt_str[i + 1] == '}') {
      out += '}';
      ++i;
    } else if (c == '{') {
      const size_t close = fmt_str.find('}', i);
      if (close == std::string::npos) fail("format: single '{{' in format string");
      const std::string field = fmt_str.substr(i + 1, close - i - 1);
      if (field.find_first_of(":!") != std::string::npos) fail("format: format specs are not supported");
      Value v;
      if (field.empty()) {
        if (auto_index >= a.args.size()) fail("format: not enough arguments");
        v = a.args[auto_index++];
      } else if (const auto k = parse_int64(field)) {
        if (*k < 0 || static_cast<size_t>(*k) >= a.args.size()) fail("format: index {} out of range", *k);
        v = a.args[static_cast<size_t>(*k)];
      } else {
        v = a.get(SIZE_MAX, field);
        if (v.is_undefined()) fail("format: no argument named '{}'", field);
      }
      out += v.to_str();
      i = close;
    } else {
      out += c;
    }
  }
  return out;
}

// printf-style "%s" formatting of the `format` filter.
std::string percent_format(const std::string& f, const std::vector<Value>& args) {
  std::string out;
  size_t k = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] != '%') {
      out += f[i];
      continue;
    }
    if (i + 1 >= f.size()) fail("format: incomplete format");
    const char spec = f[++i];
    if (spec == '%') {
      out += '%';
      continue;
    }
    if (k >= args.size()) fail("format: not enough arguments for format string");
    const Value& v = args[k++];
    switch (spec) {
      case 's': out += v.to_str(); break;
      case 'r': out += v.repr(); break;
      case 'd':
      case 'i': out += std::to_string(v.is_float() ? static_cast<int64_t>(v.as_double()) : v.as_int()); break;
      case 'f': out += fmt::format("{:.6f}", v.as_double()); break;
      default: fail("format: unsupported conversion '%{}'", spec);
    }
  }
  if (k != args.size()) fail("format: not all arguments converted during string formatting");
  return out;
}

Value method(const Value& self, const std::string& name, std::function<Value(const Value&, CallArgs&)> fn) {
  return Value::function(name, [self, fn = std::move(fn)](CallArgs& a) { return fn(self, a); });
}

int64_t int_arg(const Value& v, std::string_view what) {
  if (!v.is_int() && !v.is_bool()) fail("{} must be an integer, got {}", what, v.type_name());
  return v.as_int();
}

std::optional<Value> string_method(const Value& s, const std::string& name) {
  using F = std::function<Value(const Value&, CallArgs&)>;
  static const std::unordered_map<std::string, F> methods = {
      {"strip", [](const Value& v, CallArgs& a) { return Value(py_strip(v.str(), a.get(0, "chars", Value::none()), true, true)); }},
      {"lstrip", [](const Value& v, CallArgs& a) { return Value(py_strip(v.str(), a.get(0, "chars", Value::none()), true, false)); }},
      {"rstrip", [](const Value& v, CallArgs& a) { return Value(py_strip(v.str(), a.get(0, "chars", Value::none()), false, true)); }},
      {"split", [](const Value& v, CallArgs& a) {
         const Value m = a.get(1, "maxsplit", Value(int64_t{-1}));
         return Value::list(py_split(v.str(), a.get(0, "sep", Value::none()), int_arg(m, "maxsplit"), false));
       }},
      {"rsplit", [](const Value& v, CallArgs& a) {
         const Value m = a.get(1, "maxsplit", Value(int64_t{-1}));
         return Value::list(py_split(v.str(), a.get(0, "sep", Value::none()), int_arg(m, "maxsplit"), true));
       }},
      {"startswith", [](const Value& v, CallArgs& a) { return Value(prefix_test(v.str(), a.get(0, "prefix"), false)); }},
      {"endswith", [](const Value& v, CallArgs& a) { return Value(prefix_test(v.str(), a.get(0, "suffix"), true)); }},
      {"upper", [](const Value& v, CallArgs&) { return Value(ascii_upper(v.str())); }},
      {"lower", [](const Value& v, CallArgs&) { return Value(ascii_lower(v.str())); }},
      {"title", [](const Value& v, CallArgs&) { return Value(title_case(v.str())); }},
      {"capitalize", [](const Value& v, CallArgs&) { return Value(capitalize(v.str())); }},
      {"replace", [](const Value& v, CallArgs& a) {
         const Value o = a.get(0, "old"), n = a.get(1, "new");
         if (!o.is_string() || !n.is_string()) fail("replace() arguments must be str");
         return Value(py_replace(v.str(), o.str(), n.str(), int_arg(a.get(2, "count", Value(int64_t{-1})), "count")));
       }},
      {"find", [](const Value& v, CallArgs& a) {
         const Value sub = a.get(0, "sub");
         if (!sub.is_string()) fail("find() argument must be str");
         const size_t f = v.str().find(sub.str());
         return Value(f == std::string::npos ? int64_t{-1} : cp_index(v.str(), f));
       }},
      {"rfind", [](const Value& v, CallArgs& a) {
         const Value sub = a.get(0, "sub");
         if (!sub.is_string()) fail("rfind() argument must be str");
         const size_t f = v.str().rfind(sub.str());
         return Value(f == std::string::npos ? int64_t{-1} : cp_index(v.str(), f));
       }},
      {"count", [](const Value& v, CallArgs& a) {
         const Value sub = a.get(0, "sub");
         if (!sub.is_string()) fail("count() argument must be str");
         return Value(py_count(v.str(), sub.str()));
       }},
      {"join", [](const Value& v, CallArgs& a) {
         std::string out;
         bool first = true;
         for (const Value& e : iterate(a.get(0, "iterable"))) {
           if (!e.is_string()) fail("join: sequence item must be str, got {}", e.type_name());
           if (!first) out += v.str();
           out += e.str();
           check_string_size(out.size());
           first = false;
         }
         return Value(out);
       }},
      {"format", [](const Value& v, CallArgs& a) { return Value(py_format(v.str(), a)); }},
      {"isdigit", [](const Value& v, CallArgs&) { return Value(all_chars(v.str(), [](char32_t c) { return c >= '0' && c <= '9'; })); }},
      {"isalpha", [](const Value& v, CallArgs&) { return Value(is_ascii(v.str()) && all_chars(v.str(), [](char32_t c) { return is_alpha(c); })); }},
      {"isalnum", [](const Value& v, CallArgs&) { return Value(is_ascii(v.str()) && all_chars(v.str(), [](char32_t c) { return is_alpha(c) || (c >= '0' && c <= '9'); })); }},
      {"isspace", [](const Value& v, CallArgs&) { return Value(all_chars(v.str(), py_isspace)); }},
      {"islower", [](const Value& v, CallArgs&) { return Value(v.str() == ascii_lower(v.str()) && v.str() != ascii_upper(v.str())); }},
      {"isupper", [](const Value& v, CallArgs&) { return Value(v.str() == ascii_upper(v.str()) && v.str() != ascii_lower(v.str())); }},
      {"splitlines", [](const Value& v, CallArgs&) {
         std::vector<Value> out;
         for (auto& l : py_splitlines(v.str())) out.emplace_back(std::move(l));
         return Value::list(std::move(out));
       }},
  };
  const auto it = methods.find(name);
  if (it == methods.end()) return std::nullopt;
  return method(s, name, it->second);
}

std::optional<Value> dict_method(const Value& d, const std::string& name) {
  if (name == "items")
    return method(d, name, [](const Value& v, CallArgs&) {
      std::vector<Value> out;
      for (const auto& [k, e] : v.dict_data().items) out.push_back(Value::list({Value(k), e}, true));
      return Value::list(std::move(out));
    });
  if (name == "keys")
    return method(d, name, [](const Value& v, CallArgs&) {
      std::vector<Value> out;
      for (const auto& [k, e] : v.dict_data().items) out.emplace_back(k);
      return Value::list(std::move(out));
    });
  if (name == "values")
    return method(d, name, [](const Value& v, CallArgs&) {
      std::vector<Value> out;
      for (const auto& [k, e] : v.dict_data().items) out.push_back(e);
      return Value::list(std::move(out));
    });
  if (name == "get")
    return method(d, name, [](const Value& v, CallArgs& a) {
      const Value key = a.get(0, "key");
      if (key.is_string())
        if (const Value* e = v.dict_data().find(key.str())) return *e;
      return a.get(1, "default", Value::none());
    });
  return std::nullopt;
}

std::optional<Value> list_method(const Value& l, const std::string& name) {
  if (name == "index")
    return method(l, name, [](const Value& v, CallArgs& a) {
      const Value x = a.get(0, "value");
      for (size_t i = 0; i < v.items().size(); ++i)
        if (equals(v.items()[i], x)) return Value(static_cast<int64_t>(i));
      fail("{} is not in list", x.repr());
    });
  if (name == "count")
    return method(l, name, [](const Value& v, CallArgs& a) {
      const Value x = a.get(0, "value");
      int64_t n = 0;
      for (const Value& e : v.items()) n += equals(e, x);
      return Value(n);
    });
  return std::nullopt;
}

Value undefined_access(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) {
    const std::string& n = obj.undefined_name();
    fail("'{}' is undefined (accessing '{}')", n.empty() ? "value" : n, name);
  }
  return Value::undefined(name);
}

}  // namespace

Value get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind()) {
    case Value::Kind::undefined: return undefined_access(obj, name);
    case Value::Kind::string:
      if (auto m = string_method(obj, name)) return *m;
      break;
    case Value::Kind::dict: {
      if (!obj.dict_data().is_namespace)
        if (auto m = dict_method(obj, name)) return *m;
      if (const Value* e = obj.dict_data().find(name)) return *e;
      break;
    }
    case Value::Kind::list:
      if (auto m = list_method(obj, name)) return *m;
      break;
    default: break;
  }
  return Value::undefined(name);
}

namespace {

int64_t normalize_index(int64_t i, int64_t n) { return i < 0 ? i + n : i; }

}  // namespace

Value get_item(const Value& obj, const Value& key) {
  switch (obj.kind()) {
    case Value::Kind::undefined: return undefined_access(obj, key.to_str());
    case Value::Kind::dict:
      if (key.is_string()) {
        if (const Value* e = obj.dict_data().find(key.str())) return *e;
        if (!obj.dict_data().is_namespace)
          if (auto m = dict_method(obj, key.str())) return *m;
      }
      return Value::undefined(key.to_str());
    case Value::Kind::list:
      if (key.is_int() || key.is_bool()) {
        const int64_t n = static_cast<int64_t>(obj.items().size());
        const int64_t i = normalize_index(key.as_int(), n);
        if (i < 0 || i >= n) return Value::undefined(key.to_str());
        return obj.items()[static_cast<size_t>(i)];
      }
      if (key.is_string())
        if (auto m = list_method(obj, key.str())) return *m;
      return Value::undefined(key.to_str());
    case Value::Kind::string:
      if (key.is_int() || key.is_bool()) {
        const std::u32string u = to_u32(obj.str());
        const int64_t n = static_cast<int64_t>(u.size());
        const int64_t i = normalize_index(key.as_int(), n);
        if (i < 0 || i >= n) return Value::undefined(key.to_str());
        return Value(from_u32(u.substr(static_cast<size_t>(i), 1)));
      }
      if (key.is_string())
        if (auto m = string_method(obj, key.str())) return *m;
      return Value::undefined(key.to_str());
    default: return Value::undefined(key.to_str());
  }
}

Value get_slice(const Value& obj, const std::optional<int64_t>& start, const std::optional<int64_t>& stop,
                const std::optional<int64_t>& step_opt) {
  const int64_t step = step_opt.value_or(1);
  if (step == 0) fail("slice step cannot be zero");
  auto indices = [&](int64_t n) {
    std::vector<int64_t> idx;
    auto clamp = [&](std::optional<int64_t> v, int64_t dflt, bool is_start) {
      if (!v) return dflt;
      int64_t x = *v < 0 ? *v + n : *v;
      if (step > 0) return std::clamp<int64_t>(x, 0, n);
      (void)is_start;
      return std::clamp<int64_t>(x, -1, n - 1);
    };
    const int64_t b = clamp(start, step > 0 ? 0 : n - 1, true);
    const int64_t e = clamp(stop, step > 0 ? n : -1, false);
    if (step > 0)
      for (int64_t i = b; i < e; i += step) idx.push_back(i);
    else
      for (int64_t i = b; i > e; i += step) idx.push_back(i);
    return idx;
  };
  if (obj.is_string()) {
    const std::u32string u = to_u32(obj.str());
    std::u32string out;
    for (int64_t i : indices(static_cast<int64_t>(u.size()))) out += u[static_cast<size_t>(i)];
    return Value(from_u32(out));
  }
  if (obj.is_list()) {
    std::vector<Value> out;
    for (int64_t i : indices(static_cast<int64_t>(obj.items().size()))) out.push_back(obj.items()[static_cast<size_t>(i)]);
    return Value::list(std::move(out), obj.is_tuple());
  }
  if (obj.is_undefined()) return undefined_access(obj, "[:]");
  fail("'{}' object is not subscriptable", obj.type_name());
}

std::vector<Value> iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::undefined: return {};
    case Value::Kind::list: return v.items();
    case Value::Kind::dict: {
      std::vector<Value> out;
      for (const auto& [k, e] : v.dict_data().items) out.emplace_back(k);
      return out;
    }
    case Value::Kind::string: {
      std::vector<Value> out;
      for (char32_t c : to_u32(v.str())) out.emplace_back(from_u32(std::u32string(1, c)));
      return out;
    }
    default: fail("'{}' object is not iterable", v.type_name());
  }
}

int64_t py_len(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::undefined: return 0;
    case Value::Kind::string: return static_cast<int64_t>(to_u32(v.str()).size());
    case Value::Kind::list: return static_cast<int64_t>(v.items().size());
    case Value::Kind::dict: return static_cast<int64_t>(v.dict_data().items.size());
    default: fail("object of type '{}' has no len()", v.type_name());
  }
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Value::Kind::string:
      if (!item.is_string()) fail("'in <string>' requires string as left operand, not {}", item.type_name());
      return container.str().find(item.str()) != std::string::npos;
    case Value::Kind::list:
      for (const Value& e : container.items())
        if (equals(e, item)) return true;
      return false;
    case Value::Kind::dict: return item.is_string() && container.dict_data().find(item.str()) != nullptr;
    case Value::Kind::undefined: fail("argument of type 'Undefined' is not iterable");
    default: fail("argument of type '{}' is not iterable", container.type_name());
  }
}

namespace {

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// Resolves "a.b.0" attribute paths the way jinja2's make_attrgetter does.
Value attr_path(const Value& v, const std::string& path) {
  Value cur = v;
  size_t pos = 0;
  while (pos <= path.size()) {
    const size_t dot = path.find('.', pos);
    const std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    const auto index = digits ? parse_int64(part) : std::nullopt;
    cur = index ? get_item(cur, Value(*index)) : get_item(cur, Value(part));
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  return cur;
}

Value sort_key(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value(ascii_lower(v.str()));
  return v;
}

Value call_filter(const std::string& name, const Value& input, std::vector<Value> args) {
  const Filter* f = find_filter(name);
  if (!f) fail("no filter named '{}'", name);
  CallArgs a;
  a.args = std::move(args);
  return (*f)(input, a);
}

bool call_test(const std::string& name, const Value& input, std::vector<Value> args) {
  const Test* t = find_test(name);
  if (!t) fail("no test named '{}'", name);
  CallArgs a;
  a.args = std::move(args);
  return (*t)(input, a);
}

// select/reject/selectattr/rejectattr.
Value select_items(const Value& seq, CallArgs& a, bool by_attr, bool keep_if) {
  std::vector<Value> out;
  size_t first_arg = 0;
  std::string attr;
  if (by_attr) {
    const Value at = a.get(0, "attribute");
    if (!at.is_string()) fail("selectattr/rejectattr need an attribute name");
    attr = at.str();
    first_arg = 1;
  }
  std::string test;
  std::vector<Value> test_args;
  if (a.args.size() > first_arg) {
    test = a.args[first_arg].to_str();
    test_args.assign(a.args.begin() + static_cast<long>(first_arg) + 1, a.args.end());
  }
  for (const Value& item : iterate(seq)) {
    const Value probe = by_attr ? attr_path(item, attr) : item;
    const bool r = test.empty() ? probe.truthy() : call_test(test, probe, test_args);
    if (r == keep_if) out.push_back(item);
  }
  return Value::list(std::move(out));
}

Value to_list(const Value& v) { return Value::list(iterate(v)); }

std::vector<Value> sorted(std::vector<Value> items, bool reverse, bool case_sensitive, const std::string& attribute) {
  auto key = [&](const Value& v) { return sort_key(attribute.empty() ? v : attr_path(v, attribute), case_sensitive); };
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    return reverse ? compare(key(y), key(x)) < 0 : compare(key(x), key(y)) < 0;
  });
  return items;
}

const std::unordered_map<std::string, Filter>& filters() {
  static const std::unordered_map<std::string, Filter> f = [] {
    std::unordered_map<std::string, Filter> m;
    m["tojson"] = [](const Value& v, CallArgs& a) {
      a.check("tojson", 4, {"ensure_ascii", "indent", "separators", "sort_keys"});
      JsonOptions o;
      o.ensure_ascii = a.get(0, "ensure_ascii", Value(false)).truthy();
      const Value indent = a.get(1, "indent", Value::none());
      if (indent.is_int()) o.indent = static_cast<int>(indent.as_int());
      else if (!indent.is_none()) fail("tojson: indent must be an integer or None");
      const Value sep = a.get(2, "separators", Value::none());
      if (sep.is_list()) {
        if (sep.items().size() != 2 || !sep.items()[0].is_string() || !sep.items()[1].is_string())
          fail("tojson: separators must be a pair of strings");
        o.item_separator = sep.items()[0].str();
        o.key_separator = sep.items()[1].str();
        if (o.item_separator.empty() || o.key_separator.empty()) fail("tojson: empty separators are not supported");
      } else if (!sep.is_none()) {
        fail("tojson: separators must be a tuple");
      }
      o.sort_keys = a.get(3, "sort_keys", Value(false)).truthy();
      return Value(to_json(v, o));
    };
    m["trim"] = [](const Value& v, CallArgs& a) { return Value(py_strip(v.to_str(), a.get(0, "chars", Value::none()), true, true)); };
    m["length"] = [](const Value& v, CallArgs&) { return Value(py_len(v)); };
    m["count"] = m["length"];
    m["upper"] = [](const Value& v, CallArgs&) { return Value(ascii_upper(v.to_str())); };
    m["lower"] = [](const Value& v, CallArgs&) { return Value(ascii_lower(v.to_str())); };
    m["title"] = [](const Value& v, CallArgs&) { return Value(title_case(v.to_str())); };
    m["capitalize"] = [](const Value& v, CallArgs&) { return Value(capitalize(v.to_str())); };
    m["string"] = [](const Value& v, CallArgs&) { return Value(v.to_str()); };
    m["safe"] = [](const Value& v, CallArgs&) { return v; };
    m["escape"] = [](const Value& v, CallArgs&) { return Value(html_escape(v.to_str())); };
    m["e"] = m["escape"];
    m["replace"] = [](const Value& v, CallArgs& a) {
      const Value o = a.get(0, "old"), n = a.get(1, "new");
      return Value(py_replace(v.to_str(), o.to_str(), n.to_str(), a.get(2, "count", Value::none()).is_none() ? -1 : int_arg(a.get(2, "count"), "count")));
    };
    m["default"] = [](const Value& v, CallArgs& a) {
      const Value d = a.get(0, "default_value", Value(""));
      const bool boolean = a.get(1, "boolean", Value(false)).truthy();
      if (v.is_undefined() || (boolean && !v.truthy())) return d;
      return v;
    };
    m["d"] = m["default"];
    m["join"] = [](const Value& v, CallArgs& a) {
      const std::string sep = a.get(0, "d", Value("")).to_str();
      const Value attr = a.get(1, "attribute", Value::none());
      std::string out;
      bool first = true;
      for (const Value& e : iterate(v)) {
        if (!first) out += sep;
        out += (attr.is_none() ? e : attr_path(e, attr.to_str())).to_str();
        check_string_size(out.size());
        first = false;
      }
      return Value(out);
    };
    m["first"] = [](const Value& v, CallArgs&) {
      const auto items = iterate(v);
      return items.empty() ? Value::undefined("first") : items.front();
    };
    m["last"] = [](const Value& v, CallArgs&) {
      const auto items = iterate(v);
      return items.empty() ? Value::undefined("last") : items.back();
    };
    m["list"] = [](const Value& v, CallArgs&) { return to_list(v); };
    m["reverse"] = [](const Value& v, CallArgs&) {
      if (v.is_string()) {
        std::u32string u = to_u32(v.str());
        std::reverse(u.begin(), u.end());
        return Value(from_u32(u));
      }
      auto items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::list(std::move(items));
    };
    m["items"] = [](const Value& v, CallArgs&) {
      if (v.is_undefined()) return Value::list();
      if (!v.is_dict()) fail("items: expected a mapping, got {}", v.type_name());
      std::vector<Value> out;
      for (const auto& [k, e] : v.dict_data().items) out.push_back(Value::list({Value(k), e}, true));
      return Value::list(std::move(out));
    };
    m["dictsort"] = [](const Value& v, CallArgs& a) {
      if (!v.is_dict()) fail("dictsort: expected a mapping, got {}", v.type_name());
      const bool cs = a.get(0, "case_sensitive", Value(false)).truthy();
      const std::string by = a.get(1, "by", Value("key")).to_str();
      const bool rev = a.get(2, "reverse", Value(false)).truthy();
      std::vector<Value> out;
      for (const auto& [k, e] : v.dict_data().items) out.push_back(Value::list({Value(k), e}, true));
      const size_t pos = by == "value" ? 1 : 0;
      std::stable_sort(out.begin(), out.end(), [&](const Value& x, const Value& y) {
        const Value kx = sort_key(x.items()[pos], cs), ky = sort_key(y.items()[pos], cs);
        return rev ? compare(ky, kx) < 0 : compare(kx, ky) < 0;
      });
      return Value::list(std::move(out));
    };
    m["sort"] = [](const Value& v, CallArgs& a) {
      const Value attr = a.get(2, "attribute", Value::none());
      return Value::list(sorted(iterate(v), a.get(0, "reverse", Value(false)).truthy(),
                                a.get(1, "case_sensitive", Value(false)).truthy(), attr.is_none() ? "" : attr.to_str()));
    };
    m["unique"] = [](const Value& v, CallArgs& a) {
      const bool cs = a.get(0, "case_sensitive", Value(false)).truthy();
      const Value attr = a.get(1, "attribute", Value::none());
      std::vector<Value> out, seen;
      for (const Value& e : iterate(v)) {
        const Value k = sort_key(attr.is_none() ? e : attr_path(e, attr.to_str()), cs);
        if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, k); })) {
          seen.push_back(k);
          out.push_back(e);
        }
      }
      return Value::list(std::move(out));
    };
    auto minmax = [](bool want_max) {
      return [want_max](const Value& v, CallArgs& a) {
        const bool cs = a.get(0, "case_sensitive", Value(false)).truthy();
        const Value attr = a.get(1, "attribute", Value::none());
        const auto items = iterate(v);
        if (items.empty()) return Value::undefined(want_max ? "max" : "min");
        const Value* best = &items[0];
        for (const Value& e : items) {
          const Value ke = sort_key(attr.is_none() ? e : attr_path(e, attr.to_str()), cs);
          const Value kb = sort_key(attr.is_none() ? *best : attr_path(*best, attr.to_str()), cs);
          if (want_max ? compare(ke, kb) > 0 : compare(ke, kb) < 0) best = &e;
        }
        return *best;
      };
    };
    m["max"] = minmax(true);
    m["min"] = minmax(false);
    m["sum"] = [](const Value& v, CallArgs& a) {
      const Value attr = a.get(0, "attribute", Value::none());
      Value acc = a.get(1, "start", Value(int64_t{0}));
      for (const Value& e : iterate(v)) {
        const Value x = attr.is_none() ? e : attr_path(e, attr.to_str());
        if (!x.is_number() || !acc.is_number()) fail("sum: unsupported operand types {} and {}", acc.type_name(), x.type_name());
        if (acc.is_float() || x.is_float()) acc = Value(acc.as_double() + x.as_double());
        else acc = Value(acc.as_int() + x.as_int());
      }
      return acc;
    };
    m["abs"] = [](const Value& v, CallArgs&) {
      if (v.is_float()) return Value(std::fabs(v.as_double()));
      if (v.is_int() || v.is_bool()) return Value(static_cast<int64_t>(std::llabs(v.as_int())));
      fail("bad operand type for abs(): '{}'", v.type_name());
    };
    m["int"] = [](const Value& v, CallArgs& a) {
      const Value dflt = a.get(0, "default", Value(int64_t{0}));
      if (v.is_int() || v.is_bool()) return Value(v.as_int());
      if (v.is_float()) return Value(static_cast<int64_t>(v.as_double()));
      if (v.is_string()) {
        const std::string s = py_strip(v.str(), Value::none(), true, true);
        try {
          size_t used = 0;
          const long long x = std::stoll(s, &used, 10);
          if (used == s.size()) return Value(static_cast<int64_t>(x));
          const double d = std::stod(s, &used);
          if (used == s.size()) return Value(static_cast<int64_t>(d));
        } catch (const std::exception&) {
        }
      }
      return dflt;
    };
    m["float"] = [](const Value& v, CallArgs& a) {
      const Value dflt = a.get(0, "default", Value(0.0));
      if (v.is_number()) return Value(v.as_double());
      if (v.is_string()) {
        const std::string s = py_strip(v.str(), Value::none(), true, true);
        try {
          size_t used = 0;
          const double d = std::stod(s, &used);
          if (used == s.size()) return Value(d);
        } catch (const std::exception&) {
        }
      }
      return dflt;
    };
    m["round"] = [](const Value& v, CallArgs& a) {
      const int64_t precision = int_arg(a.get(0, "precision", Value(int64_t{0})), "precision");
      if (precision > 100 || precision < -100) fail("round: precision {} is out of range", precision);
      const std::string how = a.get(1, "method", Value("common")).to_str();
      if (how == "common" && precision >= 0) {
        // Python's round(): correctly rounded, ties to even, on the exact binary value; so is %.Nf formatting.
        return Value(std::stod(fmt::format("{:.{}f}", v.as_double(), precision)));
      }
      const double scale = std::pow(10.0, static_cast<double>(precision));
      const double x = v.as_double() * scale;
      double r = 0;
      if (how == "common") r = std::nearbyint(x);
      else if (how == "ceil") r = std::ceil(x);
      else if (how == "floor") r = std::floor(x);
      else fail("round: method must be 'common', 'ceil' or 'floor'");
      return Value(r / scale);
    };
    m["indent"] = [](const Value& v, CallArgs& a) {
      const Value w = a.get(0, "width", Value(int64_t{4}));
      const int64_t width = w.is_string() ? 0 : int_arg(w, "width");
      check_string_size(static_cast<size_t>(std::max<int64_t>(width, 0)));
      const std::string ind = w.is_string() ? w.str() : std::string(static_cast<size_t>(std::max<int64_t>(width, 0)), ' ');
      const bool first = a.get(1, "first", Value(false)).truthy();
      const bool blank = a.get(2, "blank", Value(false)).truthy();
      const auto lines = py_splitlines(v.to_str() + "\n");
      std::string rv;
      for (size_t i = 0; i < lines.size(); ++i) {
        if (i > 0) {
          rv += '\n';
          if (blank || !lines[i].empty()) rv += ind;
        }
        rv += lines[i];
        check_string_size(rv.size());
      }
      return Value(first ? ind + rv : rv);
    };
    m["wordcount"] = [](const Value& v, CallArgs&) {
      int64_t n = 0;
      bool in_word = false;
      for (char32_t c : to_u32(v.to_str())) {
        const bool w = is_alpha(c) || (c >= '0' && c <= '9') || c == '_' || c >= 0x80;
        if (w && !in_word) ++n;
        in_word = w;
      }
      return Value(n);
    };
    m["map"] = [](const Value& v, CallArgs& a) {
      std::vector<Value> out;
      const Value attr = a.get(SIZE_MAX, "attribute");
      if (!attr.is_undefined()) {
        const Value dflt = a.get(SIZE_MAX, "default");
        for (const Value& e : iterate(v)) {
          Value x = attr_path(e, attr.to_str());
          out.push_back(x.is_undefined() && !dflt.is_undefined() ? dflt : x);
        }
        return Value::list(std::move(out));
      }
      if (a.args.empty()) fail("map: needs a filter name or attribute=");
      const std::string name = a.args[0].to_str();
      const std::vector<Value> rest(a.args.begin() + 1, a.args.end());
      for (const Value& e : iterate(v)) out.push_back(call_filter(name, e, rest));
      return Value::list(std::move(out));
    };
    m["select"] = [](const Value& v, CallArgs& a) { return select_items(v, a, false, true); };
    m["reject"] = [](const Value& v, CallArgs& a) { return select_items(v, a, false, false); };
    m["selectattr"] = [](const Value& v, CallArgs& a) { return select_items(v, a, true, true); };
    m["rejectattr"] = [](const Value& v, CallArgs& a) { return select_items(v, a, true, false); };
    m["attr"] = [](const Value& v, CallArgs& a) { return get_attr(v, a.get(0, "name").to_str()); };
    m["batch"] = [](const Value& v, CallArgs& a) {
      const int64_t n = int_arg(a.get(0, "linecount"), "linecount");
      if (n <= 0) fail("batch: linecount must be positive");
      const Value fill = a.get(1, "fill_with", Value::none());
      std::vector<Value> out, cur;
      for (const Value& e : iterate(v)) {
        cur.push_back(e);
        if (static_cast<int64_t>(cur.size()) == n) {
          out.push_back(Value::list(std::move(cur)));
          cur.clear();
        }
      }
      if (!cur.empty()) {
        if (!fill.is_none())
          while (static_cast<int64_t>(cur.size()) < n) cur.push_back(fill);
        out.push_back(Value::list(std::move(cur)));
      }
      return Value::list(std::move(out));
    };
    m["format"] = [](const Value& v, CallArgs& a) { return Value(percent_format(v.to_str(), a.args)); };
    return m;
  }();
  return f;
}

const std::unordered_map<std::string, Test>& tests() {
  static const std::unordered_map<std::string, Test> t = [] {
    std::unordered_map<std::string, Test> m;
    m["defined"] = [](const Value& v, CallArgs&) { return !v.is_undefined(); };
    m["undefined"] = [](const Value& v, CallArgs&) { return v.is_undefined(); };
    m["none"] = [](const Value& v, CallArgs&) { return v.is_none(); };
    m["boolean"] = [](const Value& v, CallArgs&) { return v.is_bool(); };
    m["true"] = [](const Value& v, CallArgs&) { return v.is_bool() && v.as_bool(); };
    m["false"] = [](const Value& v, CallArgs&) { return v.is_bool() && !v.as_bool(); };
    m["integer"] = [](const Value& v, CallArgs&) { return v.is_int(); };
    m["float"] = [](const Value& v, CallArgs&) { return v.is_float(); };
    m["number"] = [](const Value& v, CallArgs&) { return v.is_number(); };
    m["string"] = [](const Value& v, CallArgs&) { return v.is_string(); };
    m["mapping"] = [](const Value& v, CallArgs&) { return v.is_dict() && !v.dict_data().is_namespace; };
    m["sequence"] = [](const Value& v, CallArgs&) { return v.is_string() || v.is_list() || (v.is_dict() && !v.dict_data().is_namespace); };
    m["iterable"] = m["sequence"];
    m["callable"] = [](const Value& v, CallArgs&) { return v.is_callable(); };
    m["odd"] = [](const Value& v, CallArgs&) { return (v.as_int() % 2 + 2) % 2 == 1; };
    m["even"] = [](const Value& v, CallArgs&) { return v.as_int() % 2 == 0; };
    m["divisibleby"] = [](const Value& v, CallArgs& a) {
      const int64_t d = int_arg(a.get(0, "num"), "divisibleby");
      if (d == 0) fail("divisibleby: division by zero");
      return v.as_int() % d == 0;
    };
    m["lower"] = [](const Value& v, CallArgs&) { return v.is_string() && v.str() == ascii_lower(v.str()); };
    m["upper"] = [](const Value& v, CallArgs&) { return v.is_string() && v.str() == ascii_upper(v.str()); };
    m["eq"] = [](const Value& v, CallArgs& a) { return equals(v, a.get(0, "other")); };
    m["equalto"] = m["eq"];
    m["=="] = m["eq"];
    m["ne"] = [](const Value& v, CallArgs& a) { return !equals(v, a.get(0, "other")); };
    m["!="] = m["ne"];
    m["lt"] = [](const Value& v, CallArgs& a) { return compare(v, a.get(0, "other")) < 0; };
    m["lessthan"] = m["lt"];
    m["<"] = m["lt"];
    m["le"] = [](const Value& v, CallArgs& a) { return compare(v, a.get(0, "other")) <= 0; };
    m["<="] = m["le"];
    m["gt"] = [](const Value& v, CallArgs& a) { return compare(v, a.get(0, "other")) > 0; };
    m["greaterthan"] = m["gt"];
    m[">"] = m["gt"];
    m["ge"] = [](const Value& v, CallArgs& a) { return compare(v, a.get(0, "other")) >= 0; };
    m[">="] = m["ge"];
    m["in"] = [](const Value& v, CallArgs& a) { return contains(a.get(0, "seq"), v); };
    m["sameas"] = [](const Value& v, CallArgs& a) {
      const Value o = a.get(0, "other");
      if (v.kind() != o.kind()) return false;
      if (v.is_none() || v.is_bool() || v.is_int() || v.is_undefined()) return equals(v, o);
      if (v.is_list()) return &v.items() == &o.items();
      if (v.is_dict()) return &v.dict_data() == &o.dict_data();
      return false;
    };
    return m;
  }();
  return t;
}

}  // namespace

const Filter* find_filter(std::string_view name) {
  const auto it = filters().find(std::string(name));
  return it == filters().end() ? nullptr : &it->second;
}

const Test* find_test(std::string_view name) {
  const auto it = tests().find(std::string(name));
  return it == tests().end() ? nullptr : &it->second;
}

DictData default_globals() {
  DictData g;
  g.set("range", Value::function("range", [](CallArgs& a) {
          a.check("range", 3, {});
          if (a.args.empty()) fail("range expected at least 1 argument");
          int64_t start = 0, stop = 0, step = 1;
          if (a.args.size() == 1) {
            stop = int_arg(a.args[0], "range");
          } else {
            start = int_arg(a.args[0], "range");
            stop = int_arg(a.args[1], "range");
            if (a.args.size() == 3) step = int_arg(a.args[2], "range");
          }
          if (step == 0) fail("range() arg 3 must not be zero");
          // In 128 bits: with int64 extremes (range(-2**63, 2**63-1)) the span and the last i + step overflow.
          const __int128 span = step > 0 ? static_cast<__int128>(stop) - start : static_cast<__int128>(start) - stop;
          const __int128 mag = step > 0 ? static_cast<__int128>(step) : -static_cast<__int128>(step);
          const __int128 count = span <= 0 ? 0 : (span + mag - 1) / mag;
          if (count > 10'000'000) fail("range too large ({} items)", static_cast<double>(count));
          charge_steps(1 + static_cast<int64_t>(count));  // each item is work for the loop that takes it
          std::vector<Value> out;
          out.reserve(static_cast<size_t>(count));
          for (int64_t k = 0; k < static_cast<int64_t>(count); ++k)
            out.emplace_back(static_cast<int64_t>(start + static_cast<__int128>(k) * step));
          return Value::list(std::move(out));
        }));
  g.set("dict", Value::function("dict", [](CallArgs& a) {
          if (!a.args.empty()) fail("dict() takes keyword arguments only here");
          DictData d;
          for (const auto& [k, v] : a.kwargs) d.set(k, v);
          return Value::dict(std::move(d));
        }));
  g.set("namespace", Value::function("namespace", [](CallArgs& a) {
          DictData d;
          d.is_namespace = true;
          for (const Value& p : a.args) {
            if (!p.is_dict()) fail("namespace() positional argument must be a mapping");
            for (const auto& [k, v] : p.dict_data().items) d.set(k, v);
          }
          for (const auto& [k, v] : a.kwargs) d.set(k, v);
          return Value::dict(std::move(d));
        }));
  return g;
}

}  // namespace kestrel::text::jinja
