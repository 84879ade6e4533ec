// The reasoning / tool-call state machine: hand-worked outputs of both formats, and the property that matters for
// streaming: any split of the text into pieces gives the same merged result as the whole text at once.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "server/output_parser.h"

namespace kestrel::server {
namespace {

OutputDelta parse_pieces(const ParserOptions& o, const std::vector<std::string>& pieces) {
  OutputParser p(o);
  OutputDelta total;
  for (const std::string& s : pieces) {
    OutputDelta d;
    p.feed(s, d);
    total.merge(d);
  }
  OutputDelta d;
  p.finish(d);
  total.merge(d);
  return total;
}

OutputDelta parse_whole(const ParserOptions& o, const std::string& text) { return parse_pieces(o, {text}); }

// Splits at random points (byte granularity, so markers and UTF-8 sequences are cut too).
std::vector<std::string> random_split(const std::string& s, std::mt19937& rng) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < s.size()) {
    const size_t n = 1 + rng() % 7;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

void expect_same(const OutputDelta& a, const OutputDelta& b) {
  EXPECT_EQ(a.reasoning, b.reasoning);
  EXPECT_EQ(a.content, b.content);
  ASSERT_EQ(a.tool_calls.size(), b.tool_calls.size());
  for (size_t i = 0; i < a.tool_calls.size(); ++i) {
    EXPECT_EQ(a.tool_calls[i].index, b.tool_calls[i].index);
    EXPECT_EQ(a.tool_calls[i].id, b.tool_calls[i].id);
    EXPECT_EQ(a.tool_calls[i].name, b.tool_calls[i].name);
    EXPECT_EQ(a.tool_calls[i].arguments, b.tool_calls[i].arguments);
  }
}

ParserOptions kimi() {
  ParserOptions o;
  o.reasoning = ParserFormat::kimi_k3;
  o.tools = ParserFormat::kimi_k3;
  return o;
}

ParserOptions dsml() {
  ParserOptions o;
  o.reasoning = ParserFormat::deepseek_v32;
  o.tools = ParserFormat::deepseek_v32;
  o.call_id_prefix = "call_x_";
  return o;
}

const std::string kKimiText =
    "<think>Need the weather in 東京.</think>Let me look.<|tool_calls_section_begin|>"
    "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"東京\"}<|tool_call_end|>"
    "<|tool_call_begin|> functions.get_time:1 <|tool_call_argument_begin|>{}<|tool_call_end|>"
    "<|tool_calls_section_end|>";

const std::string kDsmlText =
    "<think>plan</think>Sure.\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"opts\" string=\"false\">{\"unit\": \"C\"}</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"noop\">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>";

TEST(OutputParser, KimiReasoningContentAndTwoCalls) {
  const OutputDelta d = parse_whole(kimi(), kKimiText);
  EXPECT_EQ(d.reasoning, "Need the weather in 東京.");
  EXPECT_EQ(d.content, "Let me look.");
  ASSERT_EQ(d.tool_calls.size(), 2u);
  EXPECT_EQ(d.tool_calls[0].index, 0);
  EXPECT_EQ(d.tool_calls[0].id, "functions.get_weather:0");
  EXPECT_EQ(d.tool_calls[0].name, "get_weather");
  EXPECT_EQ(d.tool_calls[0].arguments, "{\"city\": \"東京\"}");
  EXPECT_EQ(d.tool_calls[1].index, 1);
  EXPECT_EQ(d.tool_calls[1].id, "functions.get_time:1");  // whitespace around the id is not part of it
  EXPECT_EQ(d.tool_calls[1].name, "get_time");
  EXPECT_EQ(d.tool_calls[1].arguments, "{}");
}

TEST(OutputParser, DsmlArgumentsBecomeJson) {
  const OutputDelta d = parse_whole(dsml(), kDsmlText);
  EXPECT_EQ(d.reasoning, "plan");
  EXPECT_EQ(d.content, "Sure.\n");
  ASSERT_EQ(d.tool_calls.size(), 2u);
  EXPECT_EQ(d.tool_calls[0].id, "call_x_0");
  EXPECT_EQ(d.tool_calls[0].name, "get_weather");
  EXPECT_EQ(d.tool_calls[0].arguments, "{\"city\":\"Paris\",\"days\":3,\"opts\":{\"unit\":\"C\"}}");
  EXPECT_EQ(d.tool_calls[1].id, "call_x_1");
  EXPECT_EQ(d.tool_calls[1].name, "noop");
  EXPECT_EQ(d.tool_calls[1].arguments, "{}");
}

TEST(OutputParser, AnySplitGivesTheWholeResult) {
  std::mt19937 rng(5);
  for (const auto& [opts, text] : {std::pair{kimi(), kKimiText}, std::pair{dsml(), kDsmlText}}) {
    const OutputDelta whole = parse_whole(opts, text);
    for (int trial = 0; trial < 200; ++trial) expect_same(parse_pieces(opts, random_split(text, rng)), whole);
    std::vector<std::string> bytes;
    for (char c : text) bytes.emplace_back(1, c);
    expect_same(parse_pieces(opts, bytes), whole);
  }
}

TEST(OutputParser, KimiArgumentsStreamBeforeTheCallEnds) {
  OutputParser p(kimi());
  OutputDelta d;
  p.feed("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": ", d);
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0].name, "f");
  EXPECT_EQ(d.tool_calls[0].arguments, "{\"a\": ");
  OutputDelta d2;
  p.feed("1}<|tool_call_e", d2);  // the start of the end marker is held back
  ASSERT_EQ(d2.tool_calls.size(), 1u);
  EXPECT_EQ(d2.tool_calls[0].id, "");
  EXPECT_EQ(d2.tool_calls[0].arguments, "1}");
  OutputDelta d3;
  p.feed("nd|><|tool_calls_section_end|> done", d3);
  EXPECT_TRUE(d3.tool_calls.empty());
  EXPECT_EQ(d3.content, " done");
}

TEST(OutputParser, WithoutParsersMarkupIsContent) {
  const OutputDelta d = parse_whole(ParserOptions{}, kKimiText);
  EXPECT_EQ(d.content, kKimiText);
  EXPECT_TRUE(d.reasoning.empty());
  EXPECT_TRUE(d.tool_calls.empty());
}

TEST(OutputParser, ToolsOffKeepsCallsInContent) {
  ParserOptions o = kimi();
  o.tools.reset();
  const OutputDelta d = parse_whole(o, kKimiText);
  EXPECT_EQ(d.reasoning, "Need the weather in 東京.");
  EXPECT_EQ(d.content, kKimiText.substr(kKimiText.find("Let me look.")));
}

TEST(OutputParser, ReasoningOnlyAtTheStart) {
  EXPECT_EQ(parse_whole(kimi(), "Hi <think>x</think>").content, "Hi <think>x</think>");
  EXPECT_EQ(parse_whole(kimi(), "<thinking>").content, "<thinking>");  // a near-marker is text
  const OutputDelta d = parse_whole(kimi(), "<think>unfinished");
  EXPECT_EQ(d.reasoning, "unfinished");
  EXPECT_TRUE(d.content.empty());
}

TEST(OutputParser, PromptOpenedReasoning) {
  ParserOptions o = kimi();
  o.start_in_reasoning = true;
  const OutputDelta d = parse_pieces(o, {"step 1, st", "ep 2</th", "ink>answer"});
  EXPECT_EQ(d.reasoning, "step 1, step 2");
  EXPECT_EQ(d.content, "answer");
}

}  // namespace
}  // namespace kestrel::server
