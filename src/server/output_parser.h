// The reasoning and tool-call parsers as one streaming state machine over a completion's text:
//   start -> reasoning (<think> ... </think>) -> content -> tool-call section -> calls -> content.
// Text arrives in arbitrary pieces (as the detokenizer releases it); each piece yields a delta of reasoning, content
// and tool-call fragments. Text that may be the start of a marker is held back until it is decided, so the deltas
// of any split of the text concatenate to the same result as one piece: streaming and non-streaming agree.
//
// Formats:
//  kimi_k3       <think>…</think> then <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
//                <|tool_call_argument_begin|>{json}<|tool_call_end|>…<|tool_calls_section_end|> (arguments stream
//                as they are generated; the call id is "functions.NAME:IDX").
//  deepseek_v32  <think>…</think> then DSML: <｜DSML｜function_calls> <｜DSML｜invoke name="NAME">
//                <｜DSML｜parameter name="P" string="true|false">VALUE</｜DSML｜parameter>… </｜DSML｜invoke>…
//                </｜DSML｜function_calls> (a call's arguments, a JSON object built from its parameters, come
//                when its invoke closes).
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::server {

enum class ParserFormat { kimi_k3, deepseek_v32 };
// "kimi_k3" or "deepseek_v32"; Error for anything else.
ParserFormat parser_format(const std::string& name);

struct ToolCallDelta {
  int index = 0;
  std::string id, name;   // set on the first delta of a call only
  std::string arguments;  // a fragment of the arguments' JSON text
};

struct OutputDelta {
  std::string reasoning, content;
  std::vector<ToolCallDelta> tool_calls;

  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
  // Appends `d`: text concatenated, fragments of one call merged (what a client assembling a stream does).
  void merge(const OutputDelta& d);
};

struct ParserOptions {
  std::optional<ParserFormat> reasoning;  // none: <think> markup is content
  std::optional<ParserFormat> tools;      // none: tool-call markup is content
  bool start_in_reasoning = false;        // the prompt already opened the reasoning (ends with <think>)
  std::string call_id_prefix = "call_";   // ids of DSML calls: prefix + index
};
// The markers that open and close reasoning in `f` (a prompt ending with the first starts the completion inside
// reasoning; one ending with the second has closed it).
const char* reasoning_begin_marker(ParserFormat f);
const char* reasoning_end_marker(ParserFormat f);

class OutputParser {
 public:
  explicit OutputParser(const ParserOptions& opts);

  void feed(std::string_view text, OutputDelta& out);
  // End of the text: held-back text is released where it stands (an unterminated call keeps what it has).
  void finish(OutputDelta& out);
  int num_tool_calls() const { return calls_; }

 private:
  enum class State { start, reasoning, content, section, call_header, call_body };
  // Emits buf_ up to the held-back tail of possible `markers` prefixes (all of it when final).
  void emit_until_markers(std::string& to, std::initializer_list<std::string_view> markers, bool final);
  void begin_call(const std::string& id, const std::string& name, OutputDelta& out);
  void process(OutputDelta& out, bool final);
  bool step_kimi_tools(OutputDelta& out, bool final);
  bool step_dsml_tools(OutputDelta& out, bool final);

  ParserOptions opts_;
  State state_;
  std::string buf_;
  int calls_ = 0;
};

}  // namespace kestrel::server
