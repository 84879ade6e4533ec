// libFuzzer harness: a request body parsed as each route parses it (JSON, then the chat, completions, tokenize,
// detokenize and Responses fields; a Responses body is translated and its chat request parsed too). ApiError (a kestrel::Error) is the expected answer to bad input.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "server/protocol.h"
#include "server/responses_api.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  using namespace kestrel::server;
  Json body;
  try {
    body = parse_body(in);
  } catch (const kestrel::Error&) {
    return 0;
  }
  try {
    parse_chat_request(body);
  } catch (const kestrel::Error&) {
  }
  try {
    parse_completion_request(body);
  } catch (const kestrel::Error&) {
  }
  try {
    parse_tokenize_request(body);
  } catch (const kestrel::Error&) {
  }
  try {
    parse_detokenize_request(body);
  } catch (const kestrel::Error&) {
  }
  try {
    const ResponsesRequest r = translate_responses_request(body);
    parse_chat_request(r.chat);
    response_object("resp_x", 0, "m", r.echoed, Json::array(), nullptr);
  } catch (const kestrel::Error&) {
  }
  return 0;
}
