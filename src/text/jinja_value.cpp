#include "text/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include <fmt/format.h>

#include "core/error.h"
#include "text/utf8.h"

namespace kestrel::text::jinja {

namespace {

// `depth` counts the lists/dicts enclosing the one about to be entered.
void check_depth(int depth, std::string_view what) {
  if (depth >= kMaxValueDepth) fail("{}: lists/dicts nesting deeper than {}", what, kMaxValueDepth);
}

}  // namespace

ListData::ListData(std::vector<Value> list_items, bool is_tuple) : items(std::move(list_items)), tuple(is_tuple) {}

ListData::~ListData() { Value::release(items); }

DictData::~DictData() {
  std::vector<Value> pending;
  for (auto& kv : items)
    if (kv.second.is_list() || kv.second.is_dict()) pending.push_back(std::move(kv.second));
  Value::release(pending);
}

void Value::release(std::vector<Value>& pending) {
  while (!pending.empty()) {
    Value v = std::move(pending.back());
    pending.pop_back();
    // Only a sole owner may empty a container; a shared one is released by its last owner, the same way.
    if (v.list_ && v.list_.use_count() == 1) {
      for (Value& e : v.list_->items)
        if (e.list_ || e.dict_) pending.push_back(std::move(e));
      v.list_->items.clear();
    }
    if (v.dict_ && v.dict_.use_count() == 1) {
      for (auto& kv : v.dict_->items)
        if (kv.second.list_ || kv.second.dict_) pending.push_back(std::move(kv.second));
      v.dict_->items.clear();
    }
  }
}

const Value* DictData::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

Value* DictData::find(std::string_view key) {
  for (auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void DictData::set(const std::string& key, Value v) {
  if (Value* e = find(key)) *e = std::move(v);
  else items.emplace_back(key, std::move(v));
}

Value Value::undefined(std::string name) {
  Value v;
  v.s_ = std::make_shared<std::string>(std::move(name));
  return v;
}

Value Value::none() {
  Value v;
  v.kind_ = Kind::none;
  return v;
}

Value::Value(bool b) : kind_(Kind::boolean), b_(b) {}
Value::Value(int64_t i) : kind_(Kind::integer), i_(i) {}
Value::Value(double d) : kind_(Kind::floating), d_(d) {}
Value::Value(std::string s) : kind_(Kind::string), s_(std::make_shared<std::string>(std::move(s))) {}

Value Value::list(std::vector<Value> items, bool tuple) {
  Value v;
  v.kind_ = Kind::list;
  v.list_ = std::make_shared<ListData>(std::move(items), tuple);
  return v;
}

Value Value::dict(DictData d) {
  Value v;
  v.kind_ = Kind::dict;
  v.dict_ = std::make_shared<DictData>(std::move(d));
  return v;
}

Value Value::function(std::string name, Function fn) {
  Value v;
  v.kind_ = Kind::callable;
  v.fn_ = std::make_shared<Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& j) { return from_json_at(j, 0); }

Value Value::from_json_at(const nlohmann::ordered_json& j, int depth) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return none();
    case nlohmann::ordered_json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<double>(u));
      return Value(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      check_depth(depth, "template data");
      std::vector<Value> items;
      for (const auto& e : j) items.push_back(from_json_at(e, depth + 1));
      return list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      check_depth(depth, "template data");
      DictData d;
      for (const auto& [k, e] : j.items()) d.items.emplace_back(k, from_json_at(e, depth + 1));
      return dict(std::move(d));
    }
    default: fail("template data: unsupported JSON value of type {}", j.type_name());
  }
}

int64_t Value::as_int() const {
  if (kind_ == Kind::boolean) return b_ ? 1 : 0;
  if (kind_ == Kind::integer) return i_;
  fail("expected an integer, got {}", type_name());
}

double Value::as_double() const {
  if (kind_ == Kind::floating) return d_;
  return static_cast<double>(as_int());
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::undefined:
    case Kind::none: return false;
    case Kind::boolean: return b_;
    case Kind::integer: return i_ != 0;
    case Kind::floating: return d_ != 0.0;
    case Kind::string: return !s_->empty();
    case Kind::list: return !list_->items.empty();
    case Kind::dict: return !dict_->items.empty();
    case Kind::callable: return true;
  }
  return false;
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::undefined: return "Undefined";
    case Kind::none: return "NoneType";
    case Kind::boolean: return "bool";
    case Kind::integer: return "int";
    case Kind::floating: return "float";
    case Kind::string: return "str";
    case Kind::list: return list_->tuple ? "tuple" : "list";
    case Kind::dict: return dict_->is_namespace ? "Namespace" : "dict";
    case Kind::callable: return "function";
  }
  return "?";
}

std::string python_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  const std::string sci(buf, r.ptr);  // shortest round-trip digits, "-d.ddde+XX"
  const size_t e = sci.find('e');
  const int exp = std::stoi(sci.substr(e + 1));
  std::string mant = sci.substr(0, e);
  const bool neg = mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  std::string out = neg ? "-" : "";
  if (exp >= -5 + 1 && exp < 16) {
    // Python repr switches to exponent notation below 1e-4 and from 1e16.
    if (exp >= 0) {
      if (digits.size() <= static_cast<size_t>(exp) + 1) {
        out += digits + std::string(static_cast<size_t>(exp) + 1 - digits.size(), '0') + ".0";
      } else {
        out += digits.substr(0, static_cast<size_t>(exp) + 1) + "." + digits.substr(static_cast<size_t>(exp) + 1);
      }
    } else {
      out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  out += fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
  return out;
}

namespace {

// str.isprintable() for the non-ASCII characters it rejects that text plausibly holds: C1 controls, the space
// separators other than ' ', line/paragraph separators and the common format characters.
bool python_printable(char32_t cp) {
  if (cp < 0xA0 || cp == 0xAD || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200F) || (cp >= 0x2028 && cp <= 0x202F) ||
      (cp >= 0x205F && cp <= 0x206F) || cp == 0x3000 || cp == 0xFEFF || (cp >= 0xFFF9 && cp <= 0xFFFB) ||
      (cp >= 0x600 && cp <= 0x605) || cp == 0x61C || cp == 0x6DD || cp == 0x70F || cp == 0x180E ||
      (cp >= 0xE0000 && cp <= 0xE007F) || (cp >= 0xD800 && cp <= 0xDFFF) || (cp >= 0xE000 && cp <= 0xF8FF))
    return false;
  return true;
}

}  // namespace

std::string python_string_repr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const size_t n = utf8_valid_length(s, i);
      const char32_t cp = n ? utf8_decode_at(s, i, n) : c;
      if (!python_printable(cp)) {
        if (cp <= 0xFF) out += fmt::format("\\x{:02x}", static_cast<unsigned>(cp));
        else if (cp <= 0xFFFF) out += fmt::format("\\u{:04x}", static_cast<unsigned>(cp));
        else out += fmt::format("\\U{:08x}", static_cast<unsigned>(cp));
      } else {
        out.append(s, i, n);
      }
      i += n ? n : 1;
      continue;
    }
    if (c == static_cast<unsigned char>(q) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7F) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += static_cast<char>(c);
    }
    ++i;
  }
  return out + q;
}

std::string Value::repr() const { return repr_at(0); }

std::string Value::repr_at(int depth) const {
  switch (kind_) {
    case Kind::string: return python_string_repr(*s_);
    case Kind::list: {
      check_depth(depth, "printing a value");
      std::string out = list_->tuple ? "(" : "[";
      for (size_t i = 0; i < list_->items.size(); ++i) out += (i ? ", " : "") + list_->items[i].repr_at(depth + 1);
      if (list_->tuple && list_->items.size() == 1) out += ",";
      return out + (list_->tuple ? ")" : "]");
    }
    case Kind::dict: {
      if (dict_->is_namespace) return "<Namespace>";
      check_depth(depth, "printing a value");
      std::string out = "{";
      for (size_t i = 0; i < dict_->items.size(); ++i)
        out += (i ? ", " : "") + python_string_repr(dict_->items[i].first) + ": " +
               dict_->items[i].second.repr_at(depth + 1);
      return out + "}";
    }
    default: return to_str();
  }
}

std::string Value::to_str() const {
  switch (kind_) {
    case Kind::undefined: return "";
    case Kind::none: return "None";
    case Kind::boolean: return b_ ? "True" : "False";
    case Kind::integer: return std::to_string(i_);
    case Kind::floating: return python_float_repr(d_);
    case Kind::string: return *s_;
    case Kind::callable: return "<function " + fn_->name + ">";
    default: return repr();
  }
}

namespace {

bool equals_at(const Value& a, const Value& b, int depth) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::undefined:
    case Value::Kind::none: return true;
    case Value::Kind::string: return a.str() == b.str();
    case Value::Kind::list: {
      if (a.is_tuple() != b.is_tuple() || a.items().size() != b.items().size()) return false;
      check_depth(depth, "comparing values");
      for (size_t i = 0; i < a.items().size(); ++i)
        if (!equals_at(a.items()[i], b.items()[i], depth + 1)) return false;
      return true;
    }
    case Value::Kind::dict: {
      const DictData &x = a.dict_data(), &y = b.dict_data();
      if (x.is_namespace || y.is_namespace) return &x == &y;
      if (x.items.size() != y.items.size()) return false;
      check_depth(depth, "comparing values");
      for (const auto& [k, v] : x.items) {
        const Value* w = y.find(k);
        if (!w || !equals_at(v, *w, depth + 1)) return false;
      }
      return true;
    }
    case Value::Kind::callable: return &a.callable() == &b.callable();
    default: return false;
  }
}

int compare_at(const Value& a, const Value& b, int depth) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      const double x = a.as_double(), y = b.as_double();
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    const int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    const int c = a.str().compare(b.str());  // UTF-8 byte order is code point order
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.is_list() && b.is_list()) {
    check_depth(depth, "comparing values");
    const size_t n = std::min(a.items().size(), b.items().size());
    for (size_t i = 0; i < n; ++i)
      if (const int c = compare_at(a.items()[i], b.items()[i], depth + 1)) return c;
    return a.items().size() < b.items().size() ? -1 : (a.items().size() > b.items().size() ? 1 : 0);
  }
  fail("'<' not supported between instances of '{}' and '{}'", a.type_name(), b.type_name());
}

}  // namespace

bool equals(const Value& a, const Value& b) { return equals_at(a, b, 0); }

int compare(const Value& a, const Value& b) { return compare_at(a, b, 0); }

Value CallArgs::get(size_t pos, std::string_view name, Value fallback) const {
  if (pos < args.size()) return args[pos];
  for (const auto& [k, v] : kwargs)
    if (k == name) return v;
  return fallback;
}

void CallArgs::check(std::string_view fn, size_t max_pos, std::initializer_list<std::string_view> names) const {
  if (args.size() > max_pos) fail("{}() takes at most {} positional arguments ({} given)", fn, max_pos, args.size());
  for (const auto& [k, v] : kwargs)
    if (std::find(names.begin(), names.end(), k) == names.end())
      fail("{}() got an unexpected keyword argument '{}'", fn, k);
}

namespace {

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const size_t n = utf8_valid_length(s, i);
      if (n == 0) fail("tojson: string is not valid UTF-8");
      if (ensure_ascii) {
        const char32_t cp = utf8_decode_at(s, i, n);
        if (cp >= 0x10000) {
          const char32_t v = cp - 0x10000;
          out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
        } else {
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(cp));
        }
      } else {
        out.append(s, i, n);
      }
      i += n;
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) out += fmt::format("\\u{:04x}", c);
        else out += static_cast<char>(c);
    }
    ++i;
  }
  out += '"';
}

void json_value(std::string& out, const Value& v, const JsonOptions& o, int depth) {
  const std::string item_sep = !o.item_separator.empty() ? o.item_separator : (o.indent >= 0 ? "," : ", ");
  const std::string key_sep = !o.key_separator.empty() ? o.key_separator : ": ";
  auto newline = [&](int d) {
    if (o.indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(o.indent * d), ' ');
  };
  switch (v.kind()) {
    case Value::Kind::none: out += "null"; return;
    case Value::Kind::boolean: out += v.as_bool() ? "true" : "false"; return;
    case Value::Kind::integer: out += v.to_str(); return;
    case Value::Kind::floating: {
      const double d = v.as_double();
      if (std::isnan(d)) out += "NaN";
      else if (std::isinf(d)) out += d > 0 ? "Infinity" : "-Infinity";
      else out += python_float_repr(d);
      return;
    }
    case Value::Kind::string: json_string(out, v.str(), o.ensure_ascii); return;
    case Value::Kind::list: {
      check_depth(depth, "tojson");
      if (v.items().empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < v.items().size(); ++i) {
        if (i) out += item_sep;
        newline(depth + 1);
        json_value(out, v.items()[i], o, depth + 1);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::dict: {
      if (v.dict_data().is_namespace) fail("tojson: Object of type Namespace is not JSON serializable");
      check_depth(depth, "tojson");
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.dict_data().items) items.push_back(&kv);
      if (o.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      if (items.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep;
        newline(depth + 1);
        json_string(out, items[i]->first, o.ensure_ascii);
        out += key_sep;
        json_value(out, items[i]->second, o, depth + 1);
      }
      newline(depth);
      out += '}';
      return;
    }
    case Value::Kind::undefined: fail("tojson: Object of type Undefined is not JSON serializable");
    case Value::Kind::callable: fail("tojson: Object of type function is not JSON serializable");
  }
}

}  // namespace

std::string to_json(const Value& v, const JsonOptions& opts) {
  std::string out;
  json_value(out, v, opts, 0);
  return out;
}

}  // namespace kestrel::text::jinja
