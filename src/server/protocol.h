// The OpenAI request bodies the server accepts, parsed and validated (field types, ranges, combinations) into
// plain structs. Every invalid request throws ApiError(400) naming the field. Unknown top-level fields are ignored
// and reported back (as vLLM does: it logs them); fields this server knows but does not implement are rejected.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/sampler.h"

namespace kestrel::server {

using Json = nlohmann::ordered_json;

// What /v1/completions and /v1/chat/completions share.
struct GenerationParams {
  std::string model;                 // empty: the served model
  SamplingParams sampling;           // max_tokens resolved later (see max_tokens)
  std::optional<int64_t> max_tokens;  // none: what max_model_len leaves after the prompt
  bool seeded = false;               // the request gave a seed (else the server draws one)
  std::vector<std::string> stop;
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;
  bool stream = false;
  bool include_usage = false;        // stream_options.include_usage
  bool continuous_usage_stats = false;
  int top_logprobs = -1;             // >= 0: log-probabilities with this many alternatives
  int prompt_logprobs = -1;          // >= 0: each prompt token's log-probability with this many alternatives
  bool return_tokens_as_token_ids = false;  // logprob tokens as "token_id:N" (vLLM's option)
  int priority = 0;
  // The structured-output fields as given (response_format, structured_outputs, guided_*): parsed and checked by
  // server/structured_output.h. Null when there are none.
  Json structured;
  std::vector<std::string> ignored_fields;
};

using PromptInput = std::variant<std::string, std::vector<int32_t>>;

struct CompletionRequest {
  GenerationParams gen;
  std::vector<PromptInput> prompts;  // one or more; choices are numbered prompt * n + i
  bool echo = false;
};

enum class ToolChoice { none, automatic, required, named };

struct ChatRequest {
  GenerationParams gen;
  Json messages;                 // normalised: content is a string (or null), roles checked
  Json tools;                    // null or the array of tools
  ToolChoice tool_choice = ToolChoice::none;
  std::string tool_name;         // with ToolChoice::named
  bool parallel_tool_calls = true;
  bool add_generation_prompt = true;
  bool continue_final_message = false;
  Json chat_template_kwargs;     // null or an object
};

// POST /v1/score_tokens: teacher-forced log-probabilities of given token sequences (docs/serving.md).
struct ScoreTokensRequest {
  std::string model;
  std::vector<PromptInput> prompts;
  std::vector<PromptInput> responses;  // empty, or one per prompt: then the response tokens are scored
  int64_t start = 1;                   // without responses: the first position scored
  int top_logprobs = 0;
  bool return_tokens_as_token_ids = false;
  int priority = 0;
};

struct TokenizeRequest {
  std::string model;
  std::optional<std::string> prompt;  // either prompt ...
  Json messages;                      // ... or chat messages (rendered with the chat template)
  bool add_special_tokens = true;
  bool add_generation_prompt = true;
  bool return_token_strs = false;
};

struct DetokenizeRequest {
  std::string model;
  std::vector<int32_t> tokens;
};

// The maximum `n`, `logprobs` / `top_logprobs` a request may ask for.
constexpr int kMaxN = 128;
constexpr int kMaxLogprobs = 20;
// Nesting levels a request body may have.
constexpr int kMaxJsonDepth = 64;
constexpr int kMaxJsonObjectKeys = 1024;  // keys of one object (a tool schema's properties, chat_template_kwargs)

CompletionRequest parse_completion_request(const Json& body);
ChatRequest parse_chat_request(const Json& body);
ScoreTokensRequest parse_score_tokens_request(const Json& body);
TokenizeRequest parse_tokenize_request(const Json& body);
DetokenizeRequest parse_detokenize_request(const Json& body);

// Parses a request body: 400 for malformed JSON (including invalid UTF-8), nesting deeper than kMaxJsonDepth, or a
// body that is not an object.
Json parse_body(const std::string& body);

}  // namespace kestrel::server
