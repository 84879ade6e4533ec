// Values of the Jinja interpreter, with Python semantics where chat templates observe them: truthiness,
// equality and ordering, str() and repr() formatting (floats as Python prints them), and json.dumps output as
// the `tojson` filter of Hugging Face chat templates produces it.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace kestrel::text::jinja {

class Value;
struct CallArgs;
using Function = std::function<Value(CallArgs&)>;

// How deeply lists and dicts may nest where a value is converted from JSON, printed, serialised or compared:
// those walks recurse once per level, and request data (tools schemas, message content) must not be able to
// exhaust the stack. Real tool schemas nest a few tens of levels at most; 256 levels cost well under 1 MB of
// stack. Deeper values are a kestrel::Error ("nesting deeper than 256").
inline constexpr int kMaxValueDepth = 256;

// Lists and dicts release the containers they solely own iteratively: a template loop can build a chain of
// lists far deeper than kMaxValueDepth, and destroying it by recursion would overflow the stack.
struct ListData {
  std::vector<Value> items;
  bool tuple = false;
  ListData() = default;
  ListData(std::vector<Value> list_items, bool is_tuple);
  ListData(const ListData&) = default;
  ListData(ListData&&) noexcept = default;
  ListData& operator=(const ListData&) = default;
  ListData& operator=(ListData&&) noexcept = default;
  ~ListData();
};

// Insertion-ordered, string keys (chat-template data comes from JSON).
struct DictData {
  std::vector<std::pair<std::string, Value>> items;
  bool is_namespace = false;  // `namespace(...)`: attributes may be assigned with {% set ns.x = ... %}
  DictData() = default;
  DictData(const DictData&) = default;
  DictData(DictData&&) noexcept = default;
  DictData& operator=(const DictData&) = default;
  DictData& operator=(DictData&&) noexcept = default;
  ~DictData();
  const Value* find(std::string_view key) const;
  Value* find(std::string_view key);
  void set(const std::string& key, Value v);
};

struct Callable {
  std::string name;
  Function fn;
};

class Value {
 public:
  enum class Kind { undefined, none, boolean, integer, floating, string, list, dict, callable };

  Value() = default;  // undefined
  static Value undefined(std::string name = {});
  static Value none();
  Value(bool b);
  Value(int64_t i);
  Value(int i) : Value(static_cast<int64_t>(i)) {}
  Value(double d);
  Value(std::string s);
  Value(const char* s) : Value(std::string(s)) {}
  static Value list(std::vector<Value> items = {}, bool tuple = false);
  static Value dict(DictData d = {});
  static Value function(std::string name, Function fn);
  // Throws kestrel::Error for arrays/objects nested deeper than kMaxValueDepth.
  static Value from_json(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::undefined; }
  bool is_none() const { return kind_ == Kind::none; }
  bool is_bool() const { return kind_ == Kind::boolean; }
  bool is_int() const { return kind_ == Kind::integer; }
  bool is_float() const { return kind_ == Kind::floating; }
  bool is_number() const { return is_int() || is_float() || is_bool(); }
  bool is_string() const { return kind_ == Kind::string; }
  bool is_list() const { return kind_ == Kind::list; }
  bool is_dict() const { return kind_ == Kind::dict; }
  bool is_callable() const { return kind_ == Kind::callable; }

  bool as_bool() const { return b_; }
  int64_t as_int() const;      // bool, int (throws for others)
  double as_double() const;    // bool, int, float
  const std::string& str() const { return *s_; }
  const std::vector<Value>& items() const { return list_->items; }
  bool is_tuple() const { return list_->tuple; }
  const DictData& dict_data() const { return *dict_; }
  DictData& dict_data_mut() const { return *dict_; }
  const Callable& callable() const { return *fn_; }
  const std::string& undefined_name() const { return *s_; }

  bool truthy() const;
  // Python str(): what {{ x }} prints ("" for undefined).
  std::string to_str() const;
  // Python repr().
  std::string repr() const;
  // Python's type name, for error messages.
  std::string type_name() const;

  // Destroys `pending` without recursing into the lists and dicts only it owns (see ListData).
  static void release(std::vector<Value>& pending);

 private:
  static Value from_json_at(const nlohmann::ordered_json& j, int depth);
  std::string repr_at(int depth) const;

  Kind kind_ = Kind::undefined;
  bool b_ = false;
  int64_t i_ = 0;
  double d_ = 0;
  std::shared_ptr<std::string> s_;
  std::shared_ptr<ListData> list_;
  std::shared_ptr<DictData> dict_;
  std::shared_ptr<Callable> fn_;
};

// Arguments of a call: positional, then keyword.
struct CallArgs {
  std::vector<Value> args;
  std::vector<std::pair<std::string, Value>> kwargs;
  // The argument by position or keyword, or `fallback` when not given.
  Value get(size_t pos, std::string_view name, Value fallback = Value()) const;
  // Throws kestrel::Error when more positional arguments than `max_pos` were passed, or an unknown keyword.
  void check(std::string_view fn, size_t max_pos, std::initializer_list<std::string_view> names) const;
};

// Both throw kestrel::Error for lists/dicts nested deeper than kMaxValueDepth.
bool equals(const Value& a, const Value& b);
// Python ordering for numbers, strings and lists; throws kestrel::Error for other types.
int compare(const Value& a, const Value& b);

std::string python_float_repr(double d);
std::string python_string_repr(const std::string& s);

struct JsonOptions {
  bool ensure_ascii = false;
  int indent = -1;  // -1: none
  std::string item_separator, key_separator;  // empty: Python's defaults for the indent mode
  bool sort_keys = false;
};
// Python json.dumps; throws kestrel::Error for lists/dicts nested deeper than kMaxValueDepth.
std::string to_json(const Value& v, const JsonOptions& opts);

}  // namespace kestrel::text::jinja
