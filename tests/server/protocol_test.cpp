// Request parsing: defaults, vLLM's conventions (top_k -1, max_completion_tokens, ignored unknown fields), and the
// 400 (with the offending field) for each kind of invalid request.
#include <gtest/gtest.h>

#include <string>

#include "server/api_error.h"
#include "server/protocol.h"

namespace kestrel::server {
namespace {

Json j(const std::string& s) { return Json::parse(s); }

// The `param` of the 400 a body gets, or "<ok>" when it parses.
template <typename F>
std::string rejected_param(F parse, const std::string& body) {
  try {
    parse(j(body));
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    EXPECT_EQ(e.body()["error"]["code"], 400);
    EXPECT_EQ(e.body()["error"]["type"], "BadRequestError");
    return e.param();
  }
  return "<ok>";
}

TEST(Protocol, CompletionDefaultsAndFields) {
  const CompletionRequest r = parse_completion_request(
      j(R"({"model": "m", "prompt": "hi", "max_tokens": 5.0, "temperature": 0.5, "top_k": -1, "seed": -3,
           "stop": "x", "logprobs": 2, "echo": true, "n": 2, "best_of": 2, "frobnicate": 1, "user": "u"})"));
  EXPECT_EQ(r.gen.model, "m");
  EXPECT_EQ(r.gen.max_tokens, 5);
  EXPECT_FLOAT_EQ(r.gen.sampling.temperature, 0.5f);
  EXPECT_EQ(r.gen.sampling.top_k, 0);  // -1 means all tokens
  EXPECT_TRUE(r.gen.seeded);
  EXPECT_EQ(r.gen.sampling.seed, static_cast<uint64_t>(-3));
  EXPECT_EQ(r.gen.stop, std::vector<std::string>{"x"});
  EXPECT_EQ(r.gen.top_logprobs, 2);
  EXPECT_TRUE(r.echo);
  EXPECT_EQ(r.gen.sampling.n, 2);
  EXPECT_EQ(r.gen.ignored_fields, std::vector<std::string>{"frobnicate"});
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(std::get<std::string>(r.prompts[0]), "hi");

  const CompletionRequest d = parse_completion_request(j(R"({"prompt": [1, 2, 3]})"));
  EXPECT_FALSE(d.gen.max_tokens.has_value());
  EXPECT_FALSE(d.gen.seeded);
  EXPECT_EQ(d.gen.top_logprobs, -1);
  EXPECT_TRUE(d.gen.skip_special_tokens);
  EXPECT_EQ(std::get<std::vector<int32_t>>(d.prompts[0]), (std::vector<int32_t>{1, 2, 3}));
  const CompletionRequest b = parse_completion_request(j(R"({"prompt": ["a", [7], "b"]})"));
  EXPECT_EQ(b.prompts.size(), 3u);
}

TEST(Protocol, ChatMessagesToolsAndChoice) {
  const ChatRequest r = parse_chat_request(j(R"({
      "messages": [{"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                   {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "c", "content": "ok"}],
      "tools": [{"type": "function", "function": {"name": "f"}}],
      "max_tokens": 3, "max_completion_tokens": 9, "logprobs": true, "top_logprobs": 4,
      "stream": true, "stream_options": {"include_usage": true},
      "chat_template_kwargs": {"thinking": true}})"));
  EXPECT_EQ(r.messages[0]["content"], "a\nb");  // text parts joined as vLLM does
  EXPECT_TRUE(r.messages[1]["content"].is_null());
  EXPECT_EQ(r.tool_choice, ToolChoice::automatic);  // tools given: auto by default
  EXPECT_EQ(r.gen.max_tokens, 9);                   // max_completion_tokens wins
  EXPECT_EQ(r.gen.top_logprobs, 4);
  EXPECT_TRUE(r.gen.stream && r.gen.include_usage);
  EXPECT_EQ(r.chat_template_kwargs["thinking"], true);

  const ChatRequest n = parse_chat_request(j(R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}})"));
  EXPECT_EQ(n.tool_choice, ToolChoice::named);
  EXPECT_EQ(n.tool_name, "f");
  const ChatRequest none = parse_chat_request(j(R"({"messages": [{"role": "user", "content": "x"}]})"));
  EXPECT_EQ(none.tool_choice, ToolChoice::none);
  EXPECT_EQ(none.gen.top_logprobs, -1);
}

TEST(Protocol, InvalidRequestsNameTheField) {
  const auto c = [](const Json& b) { parse_completion_request(b); };
  const auto chat = [](const Json& b) { parse_chat_request(b); };
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "max_tokens": "5"})"), "max_tokens");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "max_tokens": 0})"), "max_tokens");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "max_tokens": 1e30})"), "max_tokens");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "max_tokens": true})"), "max_tokens");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "n": 0})"), "n");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "n": 2, "best_of": 3})"), "best_of");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "top_p": 1.5})"), "top_p");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "presence_penalty": 3})"), "presence_penalty");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "repetition_penalty": 0})"), "repetition_penalty");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "stop": [""]})"), "stop");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "stop_token_ids": [-1]})"), "stop_token_ids");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "logprobs": true})"), "logprobs");
  EXPECT_EQ(rejected_param(c, R"({"prompt": ""})"), "prompt");
  EXPECT_EQ(rejected_param(c, R"({"prompt": []})"), "prompt");
  EXPECT_EQ(rejected_param(c, R"({"prompt": [1, -2]})"), "prompt");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "suffix": "y"})"), "suffix");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "min_tokens": 3})"), "min_tokens");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "stream_options": {}})"), "stream_options");
  EXPECT_EQ(rejected_param(c, R"({"prompt": "x", "logit_bias": {}})"), "<ok>");  // empty: neutral
  EXPECT_EQ(rejected_param(chat, R"({"messages": []})"), "messages");
  EXPECT_EQ(rejected_param(chat, R"({"messages": [{"content": "x"}]})"), "messages[0]");
  EXPECT_EQ(rejected_param(chat, R"({"messages": [{"role": "user"}]})"), "messages[0]");
  EXPECT_EQ(rejected_param(chat, R"({"messages": [{"role": "user", "content": 5}]})"), "messages[0].content");
  EXPECT_EQ(rejected_param(chat, R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"})"),
            "tool_choice");  // no tools
  EXPECT_EQ(rejected_param(chat, R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}})"),
            "tool_choice");
  EXPECT_EQ(rejected_param(chat, R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true,
      "top_logprobs": 21})"), "top_logprobs");
  EXPECT_EQ(rejected_param(chat, R"({"messages": [{"role": "user", "content": "x"}],
      "continue_final_message": true})"), "continue_final_message");
}

TEST(Protocol, BodyMustBeAJsonObject) {
  for (const char* bad : {"{", "[1]", "\"x\"", "{\"a\": \"\xff\"}", "{\"a\": \"\\ud800\"}"}) {
    try {
      parse_body(bad);
      ADD_FAILURE() << bad;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status(), 400);
    }
  }
  EXPECT_EQ(parse_body(R"({"a": 1})")["a"], 1);
  const auto nested = [](int depth) {
    return "{\"a\": " + std::string(depth, '[') + std::string(depth, ']') + "}";
  };
  EXPECT_NO_THROW(parse_body(nested(kMaxJsonDepth - 1)));  // the object is level 1
  EXPECT_THROW(parse_body(nested(kMaxJsonDepth)), ApiError);
}

// Issue 21: wrong JSON types and numbers out of range were uncaught nlohmann exceptions (500s); objects of very
// many keys cost quadratic time to parse.
TEST(Protocol, OutOfRangeNumbersWrongTypesAndHugeObjectsAre400) {
  auto status_of = [](const std::string& body, bool chat) {
    try {
      const Json j = parse_body(body);
      if (chat) parse_chat_request(j);
      else parse_completion_request(j);
    } catch (const ApiError& e) {
      return e.status();
    }
    return 200;
  };
  EXPECT_EQ(status_of(R"({"prompt": "x", "max_tokens": 1e400})", false), 400);
  EXPECT_EQ(status_of(R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": 5, "function": {"name": "f"}}]})", true), 400);
  EXPECT_EQ(status_of(R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": [], "function": {"name": "f"}}})",
                      true),
            400);
  auto object_of = [](int keys) {
    std::string o = "{";
    for (int i = 0; i < keys; ++i) o += fmt::format("{}\"k{}\": {}", i ? ", " : "", i, i);
    return o + "}";
  };
  EXPECT_EQ(parse_body(R"({"chat_template_kwargs": )" + object_of(kMaxJsonObjectKeys) + "}")["chat_template_kwargs"]
                .size(),
            static_cast<size_t>(kMaxJsonObjectKeys));
  try {
    parse_body(R"({"chat_template_kwargs": )" + object_of(kMaxJsonObjectKeys + 1) + "}");
    ADD_FAILURE() << "no error";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    EXPECT_NE(std::string(e.what()).find("more than 1024 keys"), std::string::npos);
  }
}

}  // namespace
}  // namespace kestrel::server
