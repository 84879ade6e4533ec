// A Jinja2 interpreter covering what published chat templates use: {{ }}, {% if/elif/else %}, {% for %} (with
// `if`, `else`, loop variables, tuple unpacking, break/continue), {% set %} (names, namespace attributes,
// blocks), {% macro %}, {% filter %}, {% with %}, {% raw %}, {% generation %}, comments, whitespace control
// (-, +, trim_blocks, lstrip_blocks), Python-like expressions (arithmetic, comparisons, `in`, `is` tests,
// conditional expressions, slices, method calls on str/dict/list) and the common built-in filters.
// Output equals Python jinja2's for the same template and data; anything outside this subset is a
// kestrel::Error at parse time (unknown tag, filter or test) or at render time (type errors, undefined calls).
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include "text/jinja_value.h"

namespace kestrel::text::jinja {

struct Options {
  bool trim_blocks = false;
  bool lstrip_blocks = false;
  bool keep_trailing_newline = false;
};

struct Node;

class Template {
 public:
  // Throws kestrel::Error naming the line for syntax errors.
  explicit Template(std::string_view source, Options opts = {});
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  // `context` maps names to values (messages, tools, add_generation_prompt, raise_exception, ...).
  std::string render(const DictData& context) const;

 private:
  std::unique_ptr<Node> root_;
};

}  // namespace kestrel::text::jinja
