// Parsing of what scoring adds to the API: prompt_logprobs on completions and chat (vLLM's range, refused with
// streaming), and the /v1/score_tokens body (prompts as completions take them, optional responses, start,
// top_logprobs), each invalid field named in the 400.
#include <gtest/gtest.h>

#include <string>

#include "server/api_error.h"
#include "server/protocol.h"

namespace kestrel::server {
namespace {

Json j(const std::string& s) { return Json::parse(s); }

template <typename F>
std::string rejected_param(F parse, const std::string& body) {
  try {
    parse(j(body));
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    return e.param();
  }
  return "<ok>";
}

TEST(ProtocolScoring, PromptLogprobsOnCompletionsAndChat) {
  EXPECT_EQ(parse_completion_request(j(R"({"prompt": "x"})")).gen.prompt_logprobs, -1);
  EXPECT_EQ(parse_completion_request(j(R"({"prompt": "x", "prompt_logprobs": 3})")).gen.prompt_logprobs, 3);
  EXPECT_EQ(parse_chat_request(j(R"({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0})"))
                .gen.prompt_logprobs,
            0);
  const auto c = [](const Json& b) { parse_completion_request(b); };
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "prompt_logprobs": 21})"), "prompt_logprobs");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "prompt_logprobs": -1})"), "prompt_logprobs");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "prompt_logprobs": "2"})"), "prompt_logprobs");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "prompt_logprobs": 1, "stream": true})"), "prompt_logprobs");
}

TEST(ProtocolScoring, ScoreTokensRequest) {
  const ScoreTokensRequest a = parse_score_tokens_request(j(R"({"prompt": [[1, 2, 3], "text"], "start": 2,
      "top_logprobs": 4, "model": "m", "return_tokens_as_token_ids": true, "priority": -1})"));
  ASSERT_EQ(a.prompts.size(), 2u);
  EXPECT_EQ(std::get<std::vector<int32_t>>(a.prompts[0]), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(std::get<std::string>(a.prompts[1]), "text");
  EXPECT_TRUE(a.responses.empty());
  EXPECT_EQ(a.start, 2);
  EXPECT_EQ(a.top_logprobs, 4);
  EXPECT_EQ(a.model, "m");
  EXPECT_TRUE(a.return_tokens_as_token_ids);
  EXPECT_EQ(a.priority, -1);

  const ScoreTokensRequest b = parse_score_tokens_request(j(R"({"prompt": [5, 6], "response": [7, 8, 9]})"));
  ASSERT_EQ(b.responses.size(), 1u);
  EXPECT_EQ(std::get<std::vector<int32_t>>(b.responses[0]), (std::vector<int32_t>{7, 8, 9}));
  EXPECT_EQ(b.start, 1);
  EXPECT_EQ(b.top_logprobs, 0);

  const auto s = [](const Json& body) { parse_score_tokens_request(body); };
  EXPECT_EQ(rejected_param(s, R"({})"), "prompt");
  EXPECT_EQ(rejected_param(s, R"({"prompt": []})"), "prompt");
  EXPECT_EQ(rejected_param(s, R"({"prompt": [[1], [2]], "response": [[3]]})"), "response");
  EXPECT_EQ(rejected_param(s, R"({"prompt": [1, 2], "response": [3], "start": 1})"), "start");
  EXPECT_EQ(rejected_param(s, R"({"prompt": [1, 2], "start": 0})"), "start");
  EXPECT_EQ(rejected_param(s, R"({"prompt": [1, 2], "top_logprobs": 21})"), "top_logprobs");
  EXPECT_EQ(rejected_param(s, R"({"prompt": [1, 2], "max_tokens": 3})"), "max_tokens");
}

}  // namespace
}  // namespace kestrel::server
