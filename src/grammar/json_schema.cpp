#include "grammar/json_schema.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "core/error.h"
#include "grammar/number_range.h"
#include "grammar/regex_grammar.h"

namespace kestrel::grammar {
namespace {

using Json = nlohmann::ordered_json;

// Keywords that only annotate: ignored wherever they appear.
const std::set<std::string> kAnnotations = {"title",    "description", "default",  "examples", "$comment", "deprecated",
                                            "readOnly", "writeOnly",   "$schema",  "$id",      "$anchor",  "$defs",
                                            "definitions", "contentMediaType", "contentEncoding", "discriminator",
                                            "nullable", "strict"};
// Keywords that assert what this converter cannot enforce: refused by name.
const std::set<std::string> kUnsupported = {
    "multipleOf",        "uniqueItems", "contains",         "minContains",     "maxContains",  "patternProperties",
    "propertyNames",     "minProperties", "maxProperties",  "dependentRequired", "dependentSchemas",
    "dependencies",      "if",          "then",             "else",            "not",          "unevaluatedItems",
    "$dynamicRef",       "$recursiveRef", "contentSchema"};

const std::set<std::string> kObjectKeys = {"properties", "required", "additionalProperties", "unevaluatedProperties"};
const std::set<std::string> kArrayKeys = {"items", "prefixItems", "minItems", "maxItems"};
const std::set<std::string> kStringKeys = {"minLength", "maxLength", "pattern", "format"};
const std::set<std::string> kNumberKeys = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"};

// RFC 3339 / JSON Schema formats as regexes over the string's body.
const std::map<std::string, std::string> kFormats = {
    {"date", R"(\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]))"},
    {"time", R"(([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d))"},
    {"date-time",
     R"(\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])[Tt]([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d))"},
    {"duration",
     R"(P((\d+Y(\d+M)?(\d+D)?|\d+M(\d+D)?|\d+D)(T(\d+H(\d+M)?(\d+S)?|\d+M(\d+S)?|\d+S))?|T(\d+H(\d+M)?(\d+S)?|\d+M(\d+S)?|\d+S)|\d+W))"},
    {"uuid", R"([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})"},
    {"ipv4", R"(((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d))"},
    {"email",
     R"([A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*)"},
    {"hostname", R"([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*)"},
};
// The formats JSON Schema defines (draft-07 to 2020-12) that Kestrel has no regex for: refused, as a user asks for
// them expecting them enforced. Any other format is not JSON Schema's (a vendor's name, "AWS::EC2::VPC.Id", "json",
// "int64", ...): an annotation, ignored as JSON Schema says of unknown formats (and as xgrammar and jsonschema do).
const std::set<std::string> kStandardFormatsRefused = {
    "idn-email", "idn-hostname", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uri-template",
    "json-pointer", "relative-json-pointer", "regex"};

// A JSON number as its shortest round-trip decimal text (integral values without a fraction, as xgrammar writes
// them).
std::string number_text(const Json& v) {
  if (v.is_number_integer()) return v.dump();
  const double d = v.get<double>();
  if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 1e17) return fmt::format("{:.0f}", d);
  return v.dump();
}

std::string compact(const Json& v) {
  if (v.is_number()) return number_text(v);
  if (v.is_array()) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + compact(v[i]);
    return s + "]";
  }
  if (v.is_object()) {
    std::string s = "{";
    bool first = true;
    for (const auto& [k, x] : v.items()) {
      s += (first ? "" : ",") + Json(k).dump(-1, ' ', false, Json::error_handler_t::replace) + ":" + compact(x);
      first = false;
    }
    return s + "}";
  }
  return v.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// JSON Pointer tokens of a "#/..." reference (with ~0 ~1 and %XX decoded).
std::vector<std::string> pointer_tokens(const std::string& ref) {
  std::vector<std::string> out;
  std::string cur;
  std::string decoded;
  for (size_t i = 1; i < ref.size(); ++i) {
    if (ref[i] == '%' && i + 2 < ref.size() && std::isxdigit(static_cast<unsigned char>(ref[i + 1])) &&
        std::isxdigit(static_cast<unsigned char>(ref[i + 2]))) {
      decoded += static_cast<char>(std::stoi(ref.substr(i + 1, 2), nullptr, 16));
      i += 2;
    } else {
      decoded += ref[i];
    }
  }
  if (decoded.empty()) return out;
  size_t i = 1;  // after the leading '/'
  while (i <= decoded.size()) {
    const size_t slash = decoded.find('/', i);
    std::string tok = decoded.substr(i, slash == std::string::npos ? std::string::npos : slash - i);
    std::string un;
    for (size_t k = 0; k < tok.size(); ++k) {
      if (tok[k] == '~' && k + 1 < tok.size() && tok[k + 1] == '0') un += '~', ++k;
      else if (tok[k] == '~' && k + 1 < tok.size() && tok[k + 1] == '1') un += '/', ++k;
      else un += tok[k];
    }
    out.push_back(un);
    if (slash == std::string::npos) break;
    i = slash + 1;
  }
  return out;
}

class SchemaConverter {
 public:
  SchemaConverter(Grammar& g, const Json& root, std::string prefix, const JsonSchemaOptions& o)
      : g_(g), root_(root), prefix_(std::move(prefix)), opts_(o) {}

  RuleId convert_root() {
    const RuleId r = g_.declare(g_.fresh_name(prefix_));
    refs_.emplace("#", r);
    g_.define(r, convert(root_, "#", 0));
    return r;
  }

  RuleId convert_at(const std::string& pointer) {
    ref(pointer, pointer);
    return refs_.at(pointer);
  }

  // Any JSON value (a recursive rule shared by every use).
  ExprId any_value() {
    if (any_ < 0) {
      any_ = g_.declare(g_.fresh_name(prefix_ + "_any"));
      const RuleId arr = g_.declare(g_.fresh_name(prefix_ + "_any_array"));
      const RuleId obj = g_.declare(g_.fresh_name(prefix_ + "_any_object"));
      g_.define(any_, g_.alt({number(), string(), boolean(), g_.bytes("null"), g_.ref(arr), g_.ref(obj)}));
      const ExprId v = g_.ref(any_);
      g_.define(arr, g_.alt({g_.seq({g_.bytes("["), ws(), v, g_.star(g_.seq({comma(), g_.ref(any_)})), ws(), g_.bytes("]")}),
                             g_.seq({g_.bytes("["), ws(), g_.bytes("]")})}));
      g_.define(obj, g_.alt({g_.seq({g_.bytes("{"), ws(), string(), colon(), g_.ref(any_),
                                     g_.star(g_.seq({comma(), string(), colon(), g_.ref(any_)})), ws(), g_.bytes("}")}),
                             g_.seq({g_.bytes("{"), ws(), g_.bytes("}")})}));
    }
    return g_.ref(any_);
  }
  ExprId any_object() {
    any_value();
    return g_.ref(g_.find(g_.rule(any_).name + "_object"));
  }
  ExprId any_array() {
    any_value();
    return g_.ref(g_.find(g_.rule(any_).name + "_array"));
  }

 private:
  template <typename... Args>
  [[noreturn]] static void error(const std::string& path, fmt::format_string<Args...> f, Args&&... args) {
    fail("JSON schema at '{}': {}", path, fmt::format(f, std::forward<Args>(args)...));
  }

  ExprId ws() { return opts_.any_whitespace ? g_.star(g_.chars({{' ', ' '}, {'\n', '\n'}, {'\r', '\r'}, {'\t', '\t'}})) : g_.empty(); }
  ExprId comma() { return opts_.any_whitespace ? g_.seq({ws(), g_.bytes(","), ws()}) : g_.bytes(", "); }
  ExprId colon() { return opts_.any_whitespace ? g_.seq({ws(), g_.bytes(":"), ws()}) : g_.bytes(": "); }

  // One character of a JSON string body: anything but control characters, '"' and '\\', or an escape.
  ExprId string_char() {
    const ExprId plain = g_.chars({{0, 0x1F}, {'"', '"'}, {'\\', '\\'}}, true);
    const ExprId hex = g_.chars({{'0', '9'}, {'A', 'F'}, {'a', 'f'}});
    const ExprId escape = g_.seq({g_.bytes("\\"), g_.alt({g_.chars({{'"', '"'}, {'\\', '\\'}, {'/', '/'}, {'b', 'b'},
                                                                    {'f', 'f'}, {'n', 'n'}, {'r', 'r'}, {'t', 't'}}),
                                                          g_.seq({g_.bytes("u"), hex, hex, hex, hex})})});
    return g_.alt({plain, escape});
  }
  ExprId string() { return g_.seq({g_.bytes("\""), g_.star(string_char()), g_.bytes("\"")}); }
  ExprId number() {
    const ExprId digits = g_.plus(g_.chars({{'0', '9'}}));
    return g_.seq({g_.optional(g_.bytes("-")), g_.alt({g_.bytes("0"), g_.seq({g_.chars({{'1', '9'}}), g_.star(g_.chars({{'0', '9'}}))})}),
                   g_.optional(g_.seq({g_.bytes("."), digits})),
                   g_.optional(g_.seq({g_.chars({{'e', 'e'}, {'E', 'E'}}), g_.optional(g_.chars({{'+', '+'}, {'-', '-'}})),
                                       g_.plus(g_.chars({{'0', '9'}}))}))});
  }
  ExprId boolean() { return g_.alt({g_.bytes("true"), g_.bytes("false")}); }

  static void check_keywords(const Json& s, const std::string& path) {
    for (const auto& [k, v] : s.items()) {
      if (!kUnsupported.count(k)) continue;
      // The values that assert nothing (real-world schemas write `"uniqueItems": false`) are ignored.
      if ((k == "uniqueItems" && v.is_boolean() && !v.get<bool>()) ||
          ((k == "minProperties" || k == "minContains") && v.is_number_integer() && v.get<int64_t>() == 0))
        continue;
      error(path, "'{}' is not supported (this engine cannot enforce it)", k);
    }
  }

  ExprId ref(const std::string& uri, const std::string& path) {
    if (const auto it = refs_.find(uri); it != refs_.end()) return g_.ref(it->second);
    if (uri.empty() || uri[0] != '#' || (uri.size() > 1 && uri[1] != '/'))
      error(path, "$ref '{}' is not supported: only references into this document (#, #/$defs/NAME, #/...) are", uri);
    const Json* target = &root_;
    for (const std::string& tok : pointer_tokens(uri)) {
      if (target->is_object() && target->contains(tok)) {
        target = &(*target)[tok];
      } else if (target->is_array() && !tok.empty() && std::all_of(tok.begin(), tok.end(), ::isdigit) &&
                 std::stoull(tok) < target->size()) {
        target = &(*target)[std::stoull(tok)];
      } else {
        error(path, "$ref '{}' does not resolve in the schema", uri);
      }
    }
    std::string name = prefix_;
    for (const std::string& tok : pointer_tokens(uri)) {
      name += "_";
      for (char c : tok) name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
    }
    const RuleId r = g_.declare(g_.fresh_name(name));
    refs_.emplace(uri, r);
    g_.define(r, convert(*target, uri, 0));
    return g_.ref(r);
  }

  // Whether `v` is of one of the schema's listed types (any value when it lists none, or 'type' is malformed).
  static bool has_schema_type(const Json& s, const Json& v) {
    const auto it = s.find("type");
    if (it == s.end()) return true;
    auto is = [&](const Json& t) {
      if (!t.is_string()) return true;
      const std::string& n = t.get_ref<const std::string&>();
      if (n == "null") return v.is_null();
      if (n == "boolean") return v.is_boolean();
      if (n == "string") return v.is_string();
      if (n == "array") return v.is_array();
      if (n == "object") return v.is_object();
      if (n == "number") return v.is_number();
      if (n == "integer")
        return v.is_number_integer() || (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>());
      return true;
    };
    if (!it->is_array()) return is(*it);
    if (it->empty()) return true;
    return std::any_of(it->begin(), it->end(), is);
  }

  ExprId convert(const Json& s, const std::string& path, int depth) {
    if (depth > opts_.max_depth) error(path, "the schema nests deeper than {} levels", opts_.max_depth);
    if (s.is_boolean()) {
      if (s.get<bool>()) return any_value();
      error(path, "the schema 'false' matches nothing");
    }
    if (!s.is_object()) error(path, "a schema must be an object or a boolean");
    check_keywords(s, path);
    if (const auto it = s.find("$ref"); it != s.end()) {
      if (!it->is_string()) error(path, "'$ref' must be a string");
      for (const auto& [k, v] : s.items())
        if (k != "$ref" && !kAnnotations.count(k))
          error(path, "'{}' beside '$ref' is not supported (put it in the referenced schema)", k);
      return ref(it->get<std::string>(), path + "/$ref");
    }
    if (const auto it = s.find("const"); it != s.end()) {
      if (!has_schema_type(s, *it)) error(path, "the 'const' value is not of the schema's 'type'");
      return g_.bytes(compact(*it));
    }
    if (const auto it = s.find("enum"); it != s.end()) {
      if (!it->is_array() || it->empty()) error(path, "'enum' must be a non-empty array");
      // Values of another type than the schema's 'type' are left out (xgrammar keeps them): no value is written
      // that the schema rejects.
      std::vector<ExprId> alts;
      for (const Json& v : *it)
        if (has_schema_type(s, v)) alts.push_back(g_.bytes(compact(v)));
      if (alts.empty()) error(path, "no 'enum' value is of the schema's 'type'");
      return g_.alt(std::move(alts));
    }
    for (const char* key : {"anyOf", "oneOf"})
      if (const auto it = s.find(key); it != s.end()) {
        if (!it->is_array() || it->empty()) error(path, "'{}' must be a non-empty array", key);
        for (const auto& [k, v] : s.items())
          if (k != key && !kAnnotations.count(k))
            error(path, "'{}' beside '{}' is not supported (move it into each alternative)", k, key);
        std::vector<ExprId> alts;
        for (size_t i = 0; i < it->size(); ++i)
          alts.push_back(convert((*it)[i], fmt::format("{}/{}/{}", path, key, i), depth + 1));
        return g_.alt(std::move(alts));
      }
    if (const auto it = s.find("allOf"); it != s.end()) {
      if (!it->is_array() || it->size() != 1)
        error(path, "'allOf' of {} schemas is not supported (only one: merge them into one schema)",
              it->is_array() ? it->size() : 0);
      for (const auto& [k, v] : s.items())
        if (k != "allOf" && !kAnnotations.count(k)) error(path, "'{}' beside 'allOf' is not supported", k);
      return convert((*it)[0], path + "/allOf/0", depth + 1);
    }
    std::vector<std::string> types;
    if (const auto it = s.find("type"); it != s.end()) {
      if (it->is_string()) {
        types.push_back(it->get<std::string>());
      } else if (it->is_array() && !it->empty()) {
        for (const Json& t : *it) {
          if (!t.is_string()) error(path, "'type' must be a string or an array of strings");
          types.push_back(t.get<std::string>());
        }
      } else {
        error(path, "'type' must be a string or a non-empty array of strings");
      }
    } else {
      auto has_any = [&](const std::set<std::string>& keys) {
        return std::any_of(keys.begin(), keys.end(), [&](const std::string& k) { return s.contains(k); });
      };
      if (has_any(kObjectKeys)) types.push_back("object");
      else if (has_any(kArrayKeys)) types.push_back("array");
      else if (has_any(kStringKeys)) types.push_back("string");
      else if (has_any(kNumberKeys)) types.push_back("number");
      else return any_value();
    }
    std::vector<ExprId> alts;
    for (const std::string& t : types) {
      if (t == "null") alts.push_back(g_.bytes("null"));
      else if (t == "boolean") alts.push_back(boolean());
      else if (t == "integer") alts.push_back(integer_schema(s, path));
      else if (t == "number") alts.push_back(number_schema(s, path));
      else if (t == "string") alts.push_back(string_schema(s, path));
      else if (t == "array") alts.push_back(array_schema(s, path, depth));
      else if (t == "object") alts.push_back(object_schema(s, path, depth));
      else error(path, "unknown type '{}'", t);
    }
    return g_.alt(std::move(alts));
  }

  std::optional<Bound> bound(const Json& s, const char* key, const std::string& path, bool exclusive) {
    const auto it = s.find(key);
    if (it == s.end()) return std::nullopt;
    if (!it->is_number()) error(path, "'{}' must be a number", key);
    if (it->is_number_float() && !std::isfinite(it->get<double>())) error(path, "'{}' must be finite", key);
    return Bound{number_text(*it), exclusive};
  }
  // The tighter of the inclusive and exclusive bound on one side.
  std::optional<Bound> side(const Json& s, const char* inclusive, const char* exclusive, const std::string& path,
                            bool lower) {
    const auto a = bound(s, inclusive, path, false), b = bound(s, exclusive, path, true);
    if (!a || !b) return a ? a : b;
    const int c = compare_decimal(a->value, b->value);
    if (c == 0) return b;
    return (c > 0) == lower ? a : b;
  }

  ExprId integer_schema(const Json& s, const std::string& path) {
    const auto lo = side(s, "minimum", "exclusiveMinimum", path, true);
    const auto hi = side(s, "maximum", "exclusiveMaximum", path, false);
    if (!lo && !hi) {
      return g_.alt({g_.bytes("0"), g_.seq({g_.optional(g_.bytes("-")), g_.chars({{'1', '9'}}), g_.star(g_.chars({{'0', '9'}}))})});
    }
    const ExprId e = integer_range(g_, lo, hi);
    if (e < 0) error(path, "no integer lies within the bounds");
    return e;
  }

  ExprId number_schema(const Json& s, const std::string& path) {
    const auto lo = side(s, "minimum", "exclusiveMinimum", path, true);
    const auto hi = side(s, "maximum", "exclusiveMaximum", path, false);
    if (!lo && !hi) return number();
    const ExprId e = decimal_range(g_, lo, hi, 6);
    if (e < 0) error(path, "no number lies within the bounds");
    return e;
  }

  int64_t count(const Json& s, const char* key, const std::string& path) {
    const auto it = s.find(key);
    if (it == s.end()) return -1;
    if (!it->is_number_integer() || it->get<int64_t>() < 0) error(path, "'{}' must be a non-negative integer", key);
    return it->get<int64_t>();
  }

  // The lengths in code points of the strings `e` matches: {min, max} (max -1: unbounded), or nullopt where `e`
  // is not made of code points alone (raw bytes, special tokens, rules). A regex over a JSON string's body matches
  // no escapes, so this is the length of the decoded string that JSON Schema's minLength/maxLength count.
  std::optional<std::pair<int64_t, int64_t>> length_range(ExprId id) const {
    const Expr& e = g_.expr(id);
    switch (e.kind) {
      case Expr::Kind::empty: return std::pair<int64_t, int64_t>{0, 0};
      case Expr::Kind::bytes: {
        int64_t n = 0;
        for (unsigned char c : e.text) n += (c & 0xC0) != 0x80;
        return std::pair<int64_t, int64_t>{n, n};
      }
      case Expr::Kind::chars: return std::pair<int64_t, int64_t>{1, 1};
      case Expr::Kind::seq: {
        std::pair<int64_t, int64_t> r{0, 0};
        for (ExprId c : e.children) {
          const auto x = length_range(c);
          if (!x) return std::nullopt;
          r.first += x->first;
          r.second = r.second < 0 || x->second < 0 ? -1 : r.second + x->second;
        }
        return r;
      }
      case Expr::Kind::alt: {
        std::optional<std::pair<int64_t, int64_t>> r;
        for (ExprId c : e.children) {
          const auto x = length_range(c);
          if (!x) return std::nullopt;
          if (!r) r = x;
          else r = std::pair<int64_t, int64_t>{std::min(r->first, x->first),
                                               r->second < 0 || x->second < 0 ? -1 : std::max(r->second, x->second)};
        }
        return r;
      }
      case Expr::Kind::repeat: {
        const auto x = length_range(e.children[0]);
        if (!x) return std::nullopt;
        const int64_t hi = x->second == 0 ? 0 : (e.max < 0 || x->second < 0 ? -1 : e.max * x->second);
        return std::pair<int64_t, int64_t>{e.min * x->first, hi};
      }
      default: return std::nullopt;
    }
  }
  static bool within(const std::pair<int64_t, int64_t>& r, int64_t lo, int64_t hi) {
    return r.first >= lo && (hi < 0 || (r.second >= 0 && r.second <= hi));
  }
  // `e` restricted to the strings of lo..hi code points (hi -1: unbounded), exactly: -1 where none is left,
  // nullopt where the restriction is not one this handles (the caller refuses). Exact cases: the bound is implied;
  // an alternation (restricted alternative by alternative, the empty ones dropped); a sequence of fixed-length parts
  // and one repetition of a fixed-width part, whose count range is narrowed to the lengths allowed.
  std::optional<ExprId> with_length(ExprId id, int64_t lo, int64_t hi) {
    const auto r = length_range(id);
    if (!r) return std::nullopt;
    if (within(*r, lo, hi)) return id;
    if (r->second >= 0 && (r->second < lo || (hi >= 0 && r->first > hi))) return ExprId{-1};
    const Expr e = g_.expr(id);  // a copy: g_ grows below
    if (e.kind == Expr::Kind::alt) {
      std::vector<ExprId> alts;
      for (ExprId c : e.children) {
        const auto x = with_length(c, lo, hi);
        if (!x) return std::nullopt;
        if (*x >= 0) alts.push_back(*x);
      }
      if (alts.empty()) return ExprId{-1};
      return alts.size() == 1 ? alts[0] : g_.alt(std::move(alts));
    }
    std::vector<ExprId> parts;  // the sequence's parts, nested sequences flattened
    std::vector<ExprId> todo = {id};
    while (!todo.empty()) {
      const ExprId x = todo.back();
      todo.pop_back();
      if (g_.expr(x).kind == Expr::Kind::seq) todo.insert(todo.end(), g_.expr(x).children.rbegin(), g_.expr(x).children.rend());
      else parts.push_back(x);
    }
    int64_t fixed = 0, var = -1;
    for (size_t i = 0; i < parts.size(); ++i) {
      const auto x = length_range(parts[i]);
      if (x->first == x->second) {
        fixed += x->first;
        continue;
      }
      if (var >= 0) return std::nullopt;  // two variable parts
      const Expr& p = g_.expr(parts[i]);
      if (p.kind != Expr::Kind::repeat) return std::nullopt;
      const auto w = length_range(p.children[0]);
      if (w->first != w->second || w->first == 0) return std::nullopt;
      var = static_cast<int64_t>(i);
    }
    if (var < 0) return std::nullopt;  // fixed length outside the bound: handled above
    const Expr p = g_.expr(parts[static_cast<size_t>(var)]);
    const int64_t w = length_range(p.children[0])->first;
    // fixed + w*k within [lo, hi], k within [p.min, p.max].
    int64_t kmin = std::max<int64_t>(p.min, lo > fixed ? (lo - fixed + w - 1) / w : 0);
    int64_t kmax = p.max;
    if (hi >= 0) {
      if (hi < fixed) return ExprId{-1};
      const int64_t k = (hi - fixed) / w;
      kmax = kmax < 0 ? k : std::min(kmax, k);
    }
    if (kmax >= 0 && kmax < kmin) return ExprId{-1};
    parts[static_cast<size_t>(var)] = g_.repeat(p.children[0], kmin, kmax);
    return parts.size() == 1 ? parts[0] : g_.seq(std::move(parts));
  }

  ExprId string_schema(const Json& s, const std::string& path) {
    const int64_t min_len = count(s, "minLength", path), max_len = count(s, "maxLength", path);
    const bool lengths = min_len >= 0 || max_len >= 0;
    // A format JSON Schema does not define is an annotation (kStandardFormatsRefused).
    const auto fit = s.find("format");
    if (fit != s.end() && !fit->is_string()) error(path, "'format' must be a string");
    const bool format = fit != s.end() && (kFormats.count(fit->get<std::string>()) ||
                                           kStandardFormatsRefused.count(fit->get<std::string>()));
    if (const auto it = s.find("pattern"); it != s.end()) {
      if (!it->is_string()) error(path, "'pattern' must be a string");
      if (format) error(path, "'pattern' together with 'format' is not supported");
      ExprId body = -1;
      try {
        body = regex_expr(g_, it->get<std::string>(), {.json_string_body = true});
      } catch (const Error& e) {
        error(path + "/pattern", "{}", e.what());
      }
      if (lengths) {
        const int64_t lo = std::max<int64_t>(min_len, 0);
        if (max_len >= 0 && max_len < lo) error(path, "'maxLength' {} is below 'minLength' {}", max_len, lo);
        const auto bounded = with_length(body, lo, max_len);
        if (!bounded)
          error(path, "'pattern' together with 'minLength'/'maxLength' is supported where the bound is implied by "
                "the pattern or falls on one repetition of fixed-width parts (each alternative a sequence of "
                "fixed-length parts and at most one repeated fixed-width part); write the bound into the pattern");
        if (*bounded < 0) error(path, "no string matches 'pattern' within 'minLength'/'maxLength'");
        body = *bounded;
      }
      return g_.seq({g_.bytes("\""), body, g_.bytes("\"")});
    }
    if (format) {
      const auto f = kFormats.find(fit->get<std::string>());
      if (f == kFormats.end())
        error(path, "format '{}' is not supported (supported: date, time, date-time, duration, uuid, ipv4, email, "
              "hostname; formats JSON Schema does not define are ignored)", fit->get<std::string>());
      if (lengths) error(path, "'format' together with 'minLength'/'maxLength' is not supported");
      return g_.seq({g_.bytes("\""), regex_expr(g_, f->second, {.json_string_body = true}), g_.bytes("\"")});
    }
    if (!lengths) return string();
    const int64_t lo = std::max<int64_t>(min_len, 0);
    if (max_len >= 0 && max_len < lo) error(path, "'maxLength' {} is below 'minLength' {}", max_len, lo);
    return g_.seq({g_.bytes("\""), g_.repeat(string_char(), lo, max_len), g_.bytes("\"")});
  }

  ExprId array_schema(const Json& s, const std::string& path, int depth) {
    std::vector<ExprId> prefix;
    if (const auto it = s.find("prefixItems"); it != s.end()) {
      if (!it->is_array()) error(path, "'prefixItems' must be an array");
      for (size_t i = 0; i < it->size(); ++i)
        prefix.push_back(convert((*it)[i], fmt::format("{}/prefixItems/{}", path, i), depth + 1));
    }
    // Strict: a tuple (prefixItems) without `items` takes no further items, as objects take no other properties.
    bool items_allowed = !(opts_.strict && !prefix.empty() && !s.contains("items"));
    std::optional<ExprId> items;
    if (const auto it = s.find("items"); it != s.end()) {
      if (it->is_boolean() && !it->get<bool>()) items_allowed = false;
      else if (it->is_array()) error(path, "'items' as an array is draft-07 tuple syntax; use 'prefixItems'");
      else items = convert(*it, path + "/items", depth + 1);
    }
    const int64_t k = static_cast<int64_t>(prefix.size());
    const int64_t min_items = std::max<int64_t>(count(s, "minItems", path), 0);
    int64_t max_items = count(s, "maxItems", path);
    if (!items_allowed) max_items = max_items < 0 ? k : std::min(max_items, k);
    if (max_items >= 0 && max_items < min_items)
      error(path, "the array cannot have between {} and {} items", min_items, max_items);
    if (!items && items_allowed && k == 0 && min_items == 0 && max_items < 0) return any_array();
    const ExprId item = items ? *items : any_value();
    // Elements from position i on (a comma before each but the first).
    auto element = [&](int64_t i) { return i < k ? prefix[static_cast<size_t>(i)] : item; };
    std::function<ExprId(int64_t)> from = [&](int64_t i) -> ExprId {
      if (max_items >= 0 && i >= max_items) return g_.empty();
      if (i >= k) {
        // The rest are `item`: at least min_items - i more, at most max_items - i.
        const int64_t need = std::max<int64_t>(min_items - i, 0);
        const int64_t most = max_items < 0 ? -1 : max_items - i;
        if (i == 0) {
          const ExprId some = g_.seq({item, g_.repeat(g_.seq({comma(), item}), std::max<int64_t>(need - 1, 0),
                                                     most < 0 ? -1 : most - 1)});
          return need > 0 ? some : g_.optional(some);
        }
        return g_.repeat(g_.seq({comma(), item}), need, most);
      }
      const ExprId here = g_.seq({i > 0 ? comma() : g_.empty(), element(i), from(i + 1)});
      return i < min_items ? here : g_.optional(here);
    };
    return g_.seq({g_.bytes("["), ws(), from(0), ws(), g_.bytes("]")});
  }

  // A JSON string key that is not exactly one of `names` (compared as written): a trie over the names' code points.
  ExprId key_except(const std::vector<std::string>& names) {
    struct Node {
      std::map<uint32_t, int> next;
      bool end = false;
    };
    std::vector<Node> trie(1);
    for (const std::string& n : names) {
      int at = 0;
      size_t i = 0;
      while (i < n.size()) {
        uint32_t cp = static_cast<unsigned char>(n[i]);
        int len = cp < 0x80 ? 1 : cp < 0xE0 ? 2 : cp < 0xF0 ? 3 : 4;
        if (len > 1) {
          cp &= (0xFF >> (len + 1));
          for (int k = 1; k < len && i + static_cast<size_t>(k) < n.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(n[i + static_cast<size_t>(k)]) & 0x3F);
        }
        i += static_cast<size_t>(len);
        auto it = trie[static_cast<size_t>(at)].next.find(cp);
        if (it == trie[static_cast<size_t>(at)].next.end()) {
          trie.emplace_back();
          it = trie[static_cast<size_t>(at)].next.emplace(cp, static_cast<int>(trie.size() - 1)).first;
        }
        at = it->second;
      }
      trie[static_cast<size_t>(at)].end = true;
    }
    const ExprId rest = g_.seq({g_.star(string_char()), g_.bytes("\"")});
    std::function<ExprId(int)> body = [&](int at) -> ExprId {
      const Node& n = trie[static_cast<size_t>(at)];
      std::vector<ExprId> alts;
      if (!n.end) alts.push_back(g_.bytes("\""));
      std::vector<CodeRange> excluded = {{0, 0x1F}, {'"', '"'}, {'\\', '\\'}};
      for (const auto& [cp, child] : n.next) excluded.push_back({cp, cp});
      alts.push_back(g_.seq({g_.chars(excluded, true), rest}));
      const ExprId hex = g_.chars({{'0', '9'}, {'A', 'F'}, {'a', 'f'}});
      alts.push_back(g_.seq({g_.bytes("\\"),
                             g_.alt({g_.chars({{'"', '"'}, {'\\', '\\'}, {'/', '/'}, {'b', 'b'}, {'f', 'f'}, {'n', 'n'},
                                               {'r', 'r'}, {'t', 't'}}),
                                     g_.seq({g_.bytes("u"), hex, hex, hex, hex})}),
                             rest}));
      for (const auto& [cp, child] : n.next) alts.push_back(g_.seq({g_.chars({{cp, cp}}), body(child)}));
      return g_.alt(std::move(alts));
    };
    return g_.seq({g_.bytes("\""), body(0)});
  }

  ExprId object_schema(const Json& s, const std::string& path, int depth) {
    std::vector<std::pair<std::string, ExprId>> props;
    std::set<std::string> required;
    if (const auto it = s.find("required"); it != s.end()) {
      if (!it->is_array()) error(path, "'required' must be an array of strings");
      for (const Json& r : *it) {
        if (!r.is_string()) error(path, "'required' must be an array of strings");
        required.insert(r.get<std::string>());
      }
    }
    const auto pit = s.find("properties");
    if (pit != s.end()) {
      if (!pit->is_object()) error(path, "'properties' must be an object");
      for (const auto& [name, sub] : pit->items()) props.emplace_back(name, convert(sub, path + "/properties/" + name, depth + 1));
    }
    for (const std::string& r : required)
      if (std::none_of(props.begin(), props.end(), [&](const auto& p) { return p.first == r; }))
        error(path, "required property '{}' has no schema in 'properties' (add it there)", r);
    // Other keys: additionalProperties, else unevaluatedProperties; absent: none when strict or when properties are
    // listed, any when the schema says nothing about properties at all.
    const Json* extra = nullptr;
    if (const auto it = s.find("additionalProperties"); it != s.end()) extra = &*it;
    else if (const auto it2 = s.find("unevaluatedProperties"); it2 != s.end()) extra = &*it2;
    if (!extra && pit == s.end() && required.empty()) return any_object();
    std::optional<ExprId> extra_value;
    if (extra) {
      if (!(extra->is_boolean() && !extra->get<bool>())) extra_value = convert(*extra, path + "/additionalProperties", depth + 1);
    } else if (!opts_.strict) {
      extra_value = any_value();
    }
    std::vector<std::string> names;
    for (const auto& p : props) names.push_back(p.first);
    const size_t n = props.size();
    auto member = [&](size_t i) {
      return g_.seq({g_.bytes(Json(props[i].first).dump(-1, ' ', false, Json::error_handler_t::replace)), colon(),
                     props[i].second});
    };
    auto additional = [&]() { return g_.seq({key_except(names), colon(), *extra_value}); };
    // The members from property i on; `first`: nothing was written before them (no comma).
    std::map<std::pair<size_t, bool>, ExprId> memo;
    std::function<ExprId(size_t, bool)> from = [&](size_t i, bool first) -> ExprId {
      if (i == n) {
        if (!extra_value) return g_.empty();
        if (first) return g_.optional(g_.seq({additional(), g_.star(g_.seq({comma(), additional()}))}));
        return g_.star(g_.seq({comma(), additional()}));
      }
      const auto key = std::make_pair(i, first);
      if (const auto it = memo.find(key); it != memo.end()) return g_.ref(it->second);
      // Each suffix is a rule of its own, so that the alternatives share it instead of copying it.
      const RuleId r = g_.declare(g_.fresh_name(fmt::format("{}_obj", prefix_)));
      memo.emplace(key, r);
      const ExprId here = g_.seq({first ? g_.empty() : comma(), member(i), from(i + 1, false)});
      const bool req = required.count(props[i].first) > 0;
      g_.define(r, req ? here : g_.alt({here, from(i + 1, first)}));
      return g_.ref(r);
    };
    const ExprId members = from(0, true);
    return g_.seq({g_.bytes("{"), ws(), members, ws(), g_.bytes("}")});
  }

  Grammar& g_;
  const Json& root_;
  std::string prefix_;
  JsonSchemaOptions opts_;
  std::map<std::string, RuleId> refs_;
  RuleId any_ = -1;
};

}  // namespace

RuleId add_json_schema(Grammar& g, const nlohmann::ordered_json& schema, const std::string& prefix,
                       const JsonSchemaOptions& opts, const std::string& pointer) {
  SchemaConverter c(g, schema, prefix, opts);
  return pointer == "#" ? c.convert_root() : c.convert_at(pointer);
}

Grammar json_schema_grammar(const nlohmann::ordered_json& schema, const JsonSchemaOptions& opts) {
  Grammar g;
  g.set_root(add_json_schema(g, schema, "root", opts));
  return g;
}

Grammar json_object_grammar(const JsonSchemaOptions& opts) {
  return json_schema_grammar(Json{{"type", "object"}}, opts);
}

}  // namespace kestrel::grammar
