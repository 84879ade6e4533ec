// Chat templates rendered the way Hugging Face transformers' apply_chat_template does: jinja2 with
// trim_blocks and lstrip_blocks, `raise_exception(msg)` and `strftime_now(fmt)` globals, a `tojson` filter with
// json.dumps semantics (ensure_ascii=False by default), and the context `messages`, `tools` (None when absent),
// `documents` (None), `add_generation_prompt`, the special tokens of tokenizer_config.json (bos_token,
// eos_token, ...) and any extra keyword arguments.
#pragma once
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "text/jinja.h"

namespace kestrel::text {

class ChatTemplate {
 public:
  // `tokenizer_config` supplies the special-token variables; it may be null.
  explicit ChatTemplate(std::string_view source, const nlohmann::ordered_json& tokenizer_config = nullptr);

  // The template of a checkpoint: `override_file` when given (--chat-template), else MODEL_DIR/chat_template.jinja,
  // else tokenizer_config.json's `chat_template` (a string, or a list of {name, template} where "default" is used).
  static ChatTemplate from_model_dir(const std::string& model_dir, const std::string& override_file = "");

  // `tools` may be null; `extra` is an object of additional variables (e.g. {"thinking": true}).
  // Throws kestrel::Error when the template raises or fails.
  // `limits`: the render's budgets (steps, bytes, wall time) and a cancellation flag (jinja.h).
  std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                     bool add_generation_prompt, const nlohmann::ordered_json& extra = nullptr,
                     const jinja::Limits& limits = {}) const;

  // Renders with an arbitrary context object (its keys become variables), with the same globals.
  std::string render_context(const nlohmann::ordered_json& context, const jinja::Limits& limits = {}) const;

 private:
  jinja::Template tmpl_;
  jinja::DictData base_;  // globals and special tokens
};

}  // namespace kestrel::text
