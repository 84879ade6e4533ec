// The structured-output fields of a request (which one, its errors) and the grammars of forced tool calls in both
// formats: canonical calls are accepted to the end, broken ones refused.
#include <gtest/gtest.h>

#include "grammar/matcher.h"
#include "server/api_error.h"
#include "server/structured_output.h"

namespace kestrel::server {
namespace {

using Kind = grammar::StructuredOutput::Kind;

// The ApiError of parsing `fields`: its param and message.
std::pair<std::string, std::string> error_of(const char* fields) {
  try {
    parse_output_request(Json::parse(fields));
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    return {e.param(), e.what()};
  }
  ADD_FAILURE() << "no error for " << fields;
  return {};
}

TEST(StructuredOutputFields, WhichConstraint) {
  EXPECT_FALSE(parse_output_request(Json()).has_value());
  EXPECT_FALSE(parse_output_request(Json::parse(R"({"response_format": {"type": "text"}})")).has_value());
  auto r = parse_output_request(Json::parse(R"({"response_format": {"type": "json_object"}})"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->output.kind, Kind::json_object);
  r = parse_output_request(Json::parse(
      R"({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true,
          "schema": {"type": "object", "properties": {"b": {}, "a": {}}}}}})"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->output.kind, Kind::json_schema);
  EXPECT_EQ(r->output.text, R"({"type":"object","properties":{"b":{},"a":{}}})") << "property order is kept";
  r = parse_output_request(Json::parse(R"({"structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": true}})"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->output.kind, Kind::choice);
  EXPECT_EQ(r->output.choices, (std::vector<std::string>{"a", "b"}));
  EXPECT_FALSE(r->output.any_whitespace);
  r = parse_output_request(Json::parse(R"({"guided_json": "{\"type\": \"integer\"}", "guided_decoding_backend": "xgrammar"})"));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->param, "guided_json");
  EXPECT_EQ(r->output.text, R"({"type":"integer"})");
  r = parse_output_request(Json::parse(R"({"guided_grammar": "root ::= \"x\""})"));
  ASSERT_TRUE(r && r->output.kind == Kind::grammar);
}

TEST(StructuredOutputFields, ErrorsNameTheField) {
  EXPECT_EQ(error_of(R"({"guided_regex": "a", "guided_choice": ["b"]})").first, "guided_choice");
  EXPECT_EQ(error_of(R"({"response_format": {"type": "json_schema", "json_schema": {}}})").first, "response_format");
  EXPECT_EQ(error_of(R"({"response_format": {"type": "yaml"}})").first, "response_format");
  EXPECT_EQ(error_of(R"({"structured_outputs": {"json": {}, "regex": "a"}})").first, "structured_outputs");
  EXPECT_EQ(error_of(R"({"structured_outputs": {"lark": "x"}})").first, "structured_outputs.lark");
  EXPECT_EQ(error_of(R"({"structured_outputs": {"json": {}, "whitespace_pattern": " "}})").first,
            "structured_outputs.whitespace_pattern");
  EXPECT_EQ(error_of(R"({"guided_json": "{oops"})").first, "guided_json");
  EXPECT_EQ(error_of(R"({"guided_choice": [1]})").first, "guided_choice");
  EXPECT_EQ(error_of(R"({"guided_regex": "a", "guided_decoding_backend": "outlines"})").first, "guided_decoding_backend");
  EXPECT_NE(error_of(R"({"guided_regex": "a", "guided_decoding_backend": "outlines"})").second.find("outlines"),
            std::string::npos);
}

// A vocabulary of single bytes plus the Kimi markup as special tokens (id 0: the stop token).
std::shared_ptr<const grammar::Vocabulary> vocab_with(const std::vector<std::string>& specials) {
  std::vector<grammar::Vocabulary::Kind> kinds = {grammar::Vocabulary::Kind::bytes};
  std::vector<std::string> bytes = {"<eos>"};
  for (int b = 1; b < 256; ++b) kinds.push_back(grammar::Vocabulary::Kind::bytes), bytes.push_back(std::string(1, static_cast<char>(b)));
  for (const std::string& s : specials) kinds.push_back(grammar::Vocabulary::Kind::special), bytes.push_back(s);
  return std::make_shared<const grammar::Vocabulary>(kinds, bytes, std::vector<int32_t>{0});
}

// Feeds `pieces` (special token texts as their tokens, other text byte by byte); true when all are accepted and
// the grammar may end.
bool accepts(const std::shared_ptr<const grammar::CompiledGrammar>& g, const std::vector<std::string>& pieces) {
  grammar::GrammarMatcher m(g);
  const grammar::Vocabulary& v = g->vocabulary();
  for (const std::string& p : pieces) {
    const int32_t id = v.special_id(p);
    if (id >= 0 ? !m.accept_token(id) : !m.accept_bytes(p)) return false;
  }
  return m.accept_token(0);
}

const char* kTools = R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"]}}},
  {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}])";

TEST(ToolCallGrammar, KimiCalls) {
  const auto vocab = vocab_with({"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                                 "<|tool_call_argument_begin|>", "<|tool_call_end|>"});
  const Json tools = Json::parse(kTools);
  auto compile = [&](const std::string& name, bool parallel) {
    return std::make_shared<grammar::CompiledGrammar>(
        tool_call_grammar({tools, name, parallel}, ParserFormat::kimi_k3, *vocab), vocab);
  };
  const std::string S = "<|tool_calls_section_begin|>", E = "<|tool_calls_section_end|>", B = "<|tool_call_begin|>",
                    A = "<|tool_call_argument_begin|>", C = "<|tool_call_end|>";
  const auto any = compile("", true);
  EXPECT_TRUE(accepts(any, {S, B, "functions.get_weather:0", A, R"({"city": "Oslo", "days": 3})", C, E}));
  EXPECT_TRUE(accepts(any, {S, B, "functions.now:0", A, "{}", C, B, "functions.get_weather:1", A, R"({"city":"x"})", C, E}));
  EXPECT_FALSE(accepts(any, {S, E})) << "at least one call";
  EXPECT_FALSE(accepts(any, {S, B, "functions.get_weather:0", A, R"({"days": 3})", C, E})) << "city is required";
  EXPECT_FALSE(accepts(any, {S, B, "functions.get_weather:0", A, R"({"city": "x", "days": 9})", C, E}));
  EXPECT_FALSE(accepts(any, {S, B, "functions.lookup:0", A, "{}", C, E})) << "unknown tool";
  EXPECT_FALSE(accepts(any, {S, B, "functions.now:1", A, "{}", C, E})) << "calls are numbered from 0";
  EXPECT_FALSE(accepts(any, {"Sure! ", S, B, "functions.now:0", A, "{}", C, E})) << "no text before the calls";
  const auto one = compile("", false);
  EXPECT_FALSE(accepts(one, {S, B, "functions.now:0", A, "{}", C, B, "functions.now:1", A, "{}", C, E}));
  EXPECT_TRUE(accepts(one, {S, B, "functions.now:0", A, "{}", C, E}));
  const auto named = compile("get_weather", true);
  EXPECT_FALSE(accepts(named, {S, B, "functions.now:0", A, "{}", C, E}));
  EXPECT_TRUE(accepts(named, {S, B, "functions.get_weather:0", A, R"({"city": "y"})", C, E}));
}

TEST(ToolCallGrammar, DsmlCalls) {
  const auto vocab = vocab_with({});
  const Json tools = Json::parse(kTools);
  const auto g = std::make_shared<grammar::CompiledGrammar>(
      tool_call_grammar({tools, "", true}, ParserFormat::deepseek_v32, *vocab), vocab);
  const std::string call = "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                           "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
                           "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
                           "</｜DSML｜invoke>\n";
  EXPECT_TRUE(accepts(g, {call + "</｜DSML｜function_calls>"}));
  EXPECT_TRUE(accepts(g, {call + "<｜DSML｜invoke name=\"now\">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>"}));
  // A string as JSON is allowed too; a JSON value out of bounds, a raw non-string, a missing required one are not.
  EXPECT_TRUE(accepts(g, {"<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                          "<｜DSML｜parameter name=\"city\" string=\"false\">\"Rome\"</｜DSML｜parameter>\n"
                          "</｜DSML｜invoke>\n</｜DSML｜function_calls>"}));
  EXPECT_FALSE(accepts(g, {"<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                           "<｜DSML｜parameter name=\"city\" string=\"true\">Rome</｜DSML｜parameter>\n"
                           "<｜DSML｜parameter name=\"days\" string=\"false\">8</｜DSML｜parameter>\n"
                           "</｜DSML｜invoke>\n</｜DSML｜function_calls>"}));
  EXPECT_FALSE(accepts(g, {"<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                           "<｜DSML｜parameter name=\"days\" string=\"true\">3</｜DSML｜parameter>\n"
                           "</｜DSML｜invoke>\n</｜DSML｜function_calls>"}));
  EXPECT_FALSE(accepts(g, {"<｜DSML｜function_calls>\n</｜DSML｜function_calls>"}));
}

TEST(ToolCallGrammar, ParametersThatDsmlCannotWrite) {
  const auto vocab = vocab_with({});
  const Json tools = Json::parse(R"([{"type": "function", "function": {"name": "f",
      "parameters": {"anyOf": [{"type": "object"}, {"type": "null"}]}}}])");
  try {
    tool_call_grammar({tools, "", true}, ParserFormat::deepseek_v32, *vocab);
    FAIL() << "a top-level anyOf was written as DSML parameters";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param(), "tools");
    EXPECT_NE(std::string(e.what()).find("anyOf"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kestrel::server
