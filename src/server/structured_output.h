// Structured output in the API: the request fields that constrain a completion (OpenAI's response_format, vLLM's
// structured_outputs and the older guided_json / guided_regex / guided_choice / guided_grammar) and the tool calls
// tool_choice "required" or a named tool forces, each compiled into a grammar over the model's vocabulary, in the
// model's own tool-call syntax, starting after the reasoning section when a reasoning parser is on. Compiled
// grammars are cached by what they were built from. Every malformed or unsupported request is an ApiError(400)
// naming the field and what is wrong.
#pragma once
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "grammar/output_constraint.h"
#include "grammar/structured_output.h"
#include "server/output_parser.h"
#include "server/protocol.h"
#include "text/tokenizer.h"

namespace kestrel::server {

// The structured-output request of a body, from GenerationParams::structured (the fields as given); none when the
// request asks for free text. Throws ApiError(400) for a malformed one or for several at once.
struct OutputRequest {
  grammar::StructuredOutput output;
  std::string param;  // the field it came from
};
std::optional<OutputRequest> parse_output_request(const Json& structured);

// The tool calls a request must make: any of `tools` (tool_choice "required"), or the one named.
struct ToolCallRequest {
  Json tools;                 // the request's tools (validated by protocol.h)
  std::string name;           // empty: any of them
  bool parallel = true;       // several calls allowed (parallel_tool_calls)
};

class StructuredOutputs {
 public:
  // `eos`: the token that ends a completion (the grammar's stop token); `reasoning`: the reasoning parser's format
  // (its markers delimit the reasoning section before a constrained answer).
  StructuredOutputs(const text::Tokenizer& tok, int32_t vocab_size, int32_t eos, std::optional<ParserFormat> reasoning);

  // Where a constrained completion starts: at its first token (no reasoning parser: completions), possibly after
  // a reasoning section it opens, or inside one the prompt opened.
  enum class Start { text, maybe_reasoning, in_reasoning };

  // The constraint of a completion (null when `output` is none).
  std::shared_ptr<const grammar::OutputConstraint> output(const std::optional<OutputRequest>& output, Start start);
  // The constraint of forced tool calls in `format`'s syntax, with each tool's parameters schema.
  std::shared_ptr<const grammar::OutputConstraint> tool_calls(const ToolCallRequest& calls, ParserFormat format,
                                                              Start start);

  // Compiled grammars kept (least recently used beyond this are dropped).
  static constexpr size_t kCacheSize = 256;

 private:
  std::shared_ptr<const grammar::CompiledGrammar> compile(const std::string& key, const std::string& param,
                                                          const std::function<grammar::Grammar()>& build);
  std::shared_ptr<const grammar::OutputConstraint> constrain(std::shared_ptr<const grammar::CompiledGrammar> g,
                                                             Start start);

  std::shared_ptr<const grammar::Vocabulary> vocab_;
  std::optional<ParserFormat> reasoning_;
  std::shared_ptr<const grammar::ReasoningMarkers> markers_;  // built on first use
  std::mutex mu_;
  std::list<std::pair<std::string, std::shared_ptr<const grammar::CompiledGrammar>>> lru_;
  std::unordered_map<std::string, decltype(lru_)::iterator> index_;
};

// The grammar of forced tool calls (exposed for tests): kimi_k3 <|tool_calls_section_begin|> calls
// <|tool_calls_section_end|>, deepseek_v32 DSML <｜DSML｜function_calls> invokes </｜DSML｜function_calls>; markup
// that is a special token of `vocab` is matched as that token, other markup as text.
grammar::Grammar tool_call_grammar(const ToolCallRequest& calls, ParserFormat format, const grammar::Vocabulary& vocab);

}  // namespace kestrel::server
