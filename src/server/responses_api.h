// OpenAI's Responses API (POST /v1/responses) on top of the chat pipeline: a request is translated into a chat
// request (instructions, input items, flat function tools, text.format), generated as chat is, and its output
// given back as Responses items (reasoning, message, function_call), whole or as the Responses stream of events.
// Stateless: `previous_response_id` is refused (nothing is stored), `store` is answered false.
#pragma once
#include <string>
#include <vector>

#include "server/output_parser.h"
#include "server/protocol.h"

namespace kestrel::server {

// The chat-completions body for a Responses body, and the fields the response object repeats. ApiError 400 for
// what the translation cannot carry (non-function tools, previous_response_id, n).
struct ResponsesRequest {
  Json chat;     // a body for parse_chat_request
  Json echoed;   // instructions, tools, tool_choice, temperature, top_p, max_output_tokens, parallel_tool_calls, text
};
ResponsesRequest translate_responses_request(const Json& body);

// The usage and status of a finished response.
struct ResponseEnd {
  int64_t input_tokens = 0, cached_tokens = 0, output_tokens = 0;
  std::string finish_reason;  // stop, length, tool_calls, abort
};

// The response object: `output` items as given, status from `end` (completed, or incomplete after length/abort).
Json response_object(const std::string& id, int64_t created, const std::string& model, const Json& echoed,
                     const Json& output, const ResponseEnd* end);
// The output items of a whole (non-streamed) completion: reasoning, then the message, then the function calls.
Json response_items(const std::string& id, const OutputDelta& total);

// The event stream of one response: deltas in, Responses events (JSON texts) out.
class ResponsesStream {
 public:
  ResponsesStream(std::string id, int64_t created, std::string model, Json echoed);
  std::vector<std::string> begin();                     // response.created, response.in_progress
  std::vector<std::string> delta(const OutputDelta& d);  // item added / text deltas / item done
  std::vector<std::string> finish(const ResponseEnd& end);  // closes the open item, response.completed

 private:
  enum class Kind { none, reasoning, message, call };
  void emit(Json ev);
  std::vector<std::string> take();
  void open(Kind k, const ToolCallDelta* call = nullptr);
  void close();
  std::string id_, model_;
  int64_t created_;
  Json echoed_;
  std::vector<std::string> out_;
  int64_t seq_ = 0;
  Kind kind_ = Kind::none;
  int output_index_ = -1, call_index_ = -1;
  std::string item_id_, text_, call_id_, call_name_;
  Json items_ = Json::array();
};

}  // namespace kestrel::server
