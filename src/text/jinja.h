// A Jinja2 interpreter covering what published chat templates use: {{ }}, {% if/elif/else %}, {% for %} (with
// `if`, `else`, loop variables, tuple unpacking, break/continue), {% set %} (names, namespace attributes,
// blocks), {% macro %}, {% filter %}, {% with %}, {% raw %}, {% generation %}, comments, whitespace control
// (-, +, trim_blocks, lstrip_blocks), Python-like expressions (arithmetic, comparisons, `in`, `is` tests,
// conditional expressions, slices, method calls on str/dict/list) and the common built-in filters.
// Output equals Python jinja2's for the same template and data; anything outside this subset is a
// kestrel::Error at parse time (unknown tag, filter or test) or at render time (type errors, undefined calls).
#pragma once
#include <atomic>
#include <cstdint>
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

// What one render may spend. Every limit is enforced inside the interpreter, so a hostile template or context (a
// chat template from a checkpoint, or chat_template_kwargs from a request) cannot run unbounded: exceeding one is
// a kestrel::Error starting "template render".
struct Limits {
  int64_t max_steps = 10'000'000;  // nodes executed, loop iterations, calls (macros, filters, functions), items built
  size_t max_output_bytes = size_t{64} << 20;  // the rendered text, and any block or macro output
  size_t max_string_bytes = size_t{64} << 20;  // one string built by ~, +, *, a filter or method
  size_t max_total_bytes = size_t{1} << 30;    // all strings built during the render together
  double max_seconds = 30;                     // wall time; 0: none
  const std::atomic<bool>* cancel = nullptr;   // set from another thread to stop the render
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
  std::string render(const DictData& context, const Limits& limits = {}) const;

 private:
  std::unique_ptr<Node> root_;
};

}  // namespace kestrel::text::jinja
