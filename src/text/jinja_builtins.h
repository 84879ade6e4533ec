// Internal to the Jinja interpreter: Python-like operations on values, built-in filters, tests, methods and
// globals.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "text/jinja_value.h"

namespace kestrel::text::jinja {

// The budget of the render running on this thread (jinja.h's Limits): builtins charge work and the strings they
// build; both throw kestrel::Error once a limit is passed. No-ops outside a render.
void charge_steps(int64_t n);
void charge_string(size_t bytes);
// Throws once a string being built passes the per-string limit (64 MiB outside a render).
void check_string_size(size_t bytes);

using Filter = std::function<Value(const Value&, CallArgs&)>;
using Test = std::function<bool(const Value&, CallArgs&)>;

const Filter* find_filter(std::string_view name);
const Test* find_test(std::string_view name);
// range, dict, namespace (jinja2's default globals that templates use).
DictData default_globals();

// `obj.name`: attributes and methods first, then items (jinja2's getattr order).
Value get_attr(const Value& obj, const std::string& name);
// `obj[key]`: items first, then attributes.
Value get_item(const Value& obj, const Value& key);
Value get_slice(const Value& obj, const std::optional<int64_t>& start, const std::optional<int64_t>& stop,
                const std::optional<int64_t>& step);

// What a for loop iterates: list items, dict keys, string characters; nothing for undefined.
std::vector<Value> iterate(const Value& v);
int64_t py_len(const Value& v);
// Python `a in b`.
bool contains(const Value& container, const Value& item);

// A decimal integer that fits int64_t, or nothing.
std::optional<int64_t> parse_int64(std::string_view digits);

bool py_isspace(char32_t c);
// str.splitlines() (without keepends).
std::vector<std::string> py_splitlines(std::string_view s);
std::u32string to_u32(std::string_view s);
std::string from_u32(std::u32string_view s);

}  // namespace kestrel::text::jinja
