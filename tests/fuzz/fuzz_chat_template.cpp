// libFuzzer harness: a chat template (the input up to its first NUL byte) rendered with messages (a JSON list after
// that byte, or a fixed conversation) under small budgets. kestrel::Error is the expected failure; anything else
// escaping, or a budget not holding, is a bug.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using nlohmann::ordered_json;
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const size_t nul = in.find('\0');
  const std::string_view source = in.substr(0, nul);
  ordered_json messages = ordered_json::parse(R"([{"role": "system", "content": "You are helpful."},
      {"role": "user", "content": "Hi <b>there</b>"}, {"role": "assistant", "content": "Hello!",
       "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
      {"role": "tool", "content": "42"}, {"role": "user", "content": "Thanks"}])");
  if (nul != std::string_view::npos) {
    ordered_json j = ordered_json::parse(in.substr(nul + 1), nullptr, false);
    if (!j.is_discarded() && j.is_array()) messages = std::move(j);
  }
  const ordered_json tools = ordered_json::parse(
      R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "properties": {"x": {"type": "integer"}}}}}])");
  kestrel::text::jinja::Limits limits;
  limits.max_steps = 200'000;
  limits.max_output_bytes = 1 << 20;
  limits.max_string_bytes = 1 << 20;
  limits.max_total_bytes = 16 << 20;
  limits.max_seconds = 0.5;
  try {
    const kestrel::text::ChatTemplate t(source, ordered_json{{"bos_token", "<s>"}, {"eos_token", "</s>"}});
    t.render(messages, tools, true, ordered_json{{"thinking", true}}, limits);
  } catch (const kestrel::Error&) {
  }
  return 0;
}
