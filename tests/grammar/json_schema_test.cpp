// JSON Schema keywords that real-world schemas carry (the CloudFormation resource schemas of
// tests/python/test_grammar_parity_cfn_corpus.py among them): annotations and keywords that assert nothing are
// ignored, `definitions` is draft-07's `$defs`, formats JSON Schema does not define are annotations; what asserts
// something the engine cannot enforce is still refused by name.
#include <gtest/gtest.h>

#include <memory>

#include "core/error.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"

namespace kestrel::grammar {
namespace {

using Json = nlohmann::ordered_json;

std::shared_ptr<const Vocabulary> byte_vocab() {
  std::vector<Vocabulary::Kind> kinds = {Vocabulary::Kind::bytes, Vocabulary::Kind::none};
  std::vector<std::string> bytes = {"", ""};
  for (int c = 0x20; c < 0x7F; ++c) kinds.push_back(Vocabulary::Kind::bytes), bytes.push_back(std::string(1, char(c)));
  return std::make_shared<const Vocabulary>(kinds, bytes, std::vector<int32_t>{0});
}

// Whether the schema's grammar takes `text` as a whole value.
class Schema {
 public:
  explicit Schema(const char* schema)
      : g_(std::make_shared<CompiledGrammar>(json_schema_grammar(Json::parse(schema)), byte_vocab())) {}
  bool accepts(const std::string& text) const {
    GrammarMatcher m(g_);
    return m.accept_bytes(text) && m.can_terminate();
  }

 private:
  std::shared_ptr<const CompiledGrammar> g_;
};

std::string refusal(const char* schema) {
  try {
    json_schema_grammar(Json::parse(schema));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(JsonSchema, AnnotationsAreIgnoredEverywhere) {
  const Schema s(R"({"$schema": "http://json-schema.org/draft-07/schema#", "$id": "https://example.com/s",
    "$comment": "c", "title": "T", "description": "d", "examples": [{"a": 1}], "default": {}, "deprecated": false,
    "readOnly": true, "writeOnly": false, "type": "object", "additionalProperties": false, "required": ["a"],
    "properties": {"a": {"type": "integer", "title": "A", "description": "an a", "default": 3, "examples": [1],
                         "$comment": "x", "deprecated": true, "readOnly": true, "minimum": 0},
                   "b": {"$ref": "#/definitions/B", "description": "beside $ref", "title": "B"}},
    "definitions": {"B": {"type": "string", "enum": ["x", "y"], "insertionOrder": false, "relationshipRef": {}}}})");
  EXPECT_TRUE(s.accepts(R"({"a": 1})"));
  EXPECT_TRUE(s.accepts(R"({"a": 0, "b": "y"})"));
  EXPECT_FALSE(s.accepts(R"({"a": -1})"));
  EXPECT_FALSE(s.accepts(R"({"a": 1, "b": "z"})"));
  EXPECT_FALSE(s.accepts(R"({"b": "x"})"));
  EXPECT_FALSE(s.accepts(R"({"a": 1, "c": 2})"));
}

TEST(JsonSchema, DefinitionsWorkLikeDefs) {
  for (const char* defs : {"definitions", "$defs"}) {
    const std::string text = std::string(R"({"$ref": "#/)") + defs + R"(/Node", ")" + defs +
                             R"(": {"Node": {"type": "object", "additionalProperties": false, "required": ["v"],
                               "properties": {"v": {"type": "integer"},
                                              "kids": {"type": "array", "items": {"$ref": "#/)" + defs +
                             R"(/Node"}}}}}})";
    const Schema s(text.c_str());
    EXPECT_TRUE(s.accepts(R"({"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]})")) << defs;
    EXPECT_FALSE(s.accepts(R"({"v": 1, "kids": [{"w": 2}]})")) << defs;
  }
}

TEST(JsonSchema, KeywordsThatAssertNothingAreIgnored) {
  const Schema s(R"({"type": "array", "uniqueItems": false, "items": {"type": "integer"}, "maxItems": 2})");
  EXPECT_TRUE(s.accepts("[1, 1]"));
  EXPECT_FALSE(s.accepts("[1, 1, 1]"));
  const Schema o(R"({"type": "object", "minProperties": 0, "properties": {"a": {"type": "null"}}})");
  EXPECT_TRUE(o.accepts("{}"));
  EXPECT_TRUE(o.accepts(R"({"a": null})"));
  // The same keywords asserting something are refused, by name.
  EXPECT_NE(refusal(R"({"type": "array", "uniqueItems": true})").find("'uniqueItems' is not supported"),
            std::string::npos);
  EXPECT_NE(refusal(R"({"type": "object", "minProperties": 1})").find("'minProperties' is not supported"),
            std::string::npos);
}

TEST(JsonSchema, FormatsJsonSchemaDoesNotDefineAreAnnotations) {
  const Schema plain(R"({"type": "string", "format": "AWS::EC2::VPC.Id"})");
  EXPECT_TRUE(plain.accepts(R"("anything at all")"));
  EXPECT_TRUE(plain.accepts(R"("")"));
  // With a vendor's format, length bounds and patterns apply as without it.
  const Schema bounded(R"({"type": "string", "format": "json", "minLength": 2, "maxLength": 3})");
  EXPECT_TRUE(bounded.accepts(R"("ab")"));
  EXPECT_FALSE(bounded.accepts(R"("a")"));
  EXPECT_FALSE(bounded.accepts(R"("abcd")"));
  const Schema pattern(R"({"type": "string", "format": "int64", "pattern": "^[0-9]+$"})");
  EXPECT_TRUE(pattern.accepts(R"("123")"));
  EXPECT_FALSE(pattern.accepts(R"("12a")"));
  // Kestrel's formats are enforced; JSON Schema's formats it has no regex for are refused, by name.
  const Schema date(R"({"type": "string", "format": "date"})");
  EXPECT_TRUE(date.accepts(R"("2024-02-29")"));
  EXPECT_FALSE(date.accepts(R"("yesterday")"));
  for (const char* f : {"uri", "ipv6", "uri-reference", "regex"})
    EXPECT_NE(refusal((std::string(R"({"type": "string", "format": ")") + f + "\"}").c_str()).find(
                  std::string("format '") + f + "' is not supported"),
              std::string::npos)
        << f;
  EXPECT_NE(refusal(R"({"type": "string", "format": "date", "pattern": "^2"})").find("together with 'format'"),
            std::string::npos);
}

// `pattern` with minLength/maxLength: the pattern's language restricted to the bound, counted in characters of the
// decoded string.
TEST(JsonSchemaKeywords, PatternWithLengthBounds) {
  // One repetition: its count narrowed (here 2..4 letters after the fixed 'x').
  const Schema one(R"({"type": "string", "pattern": "^x[a-z]*$", "minLength": 3, "maxLength": 5})");
  EXPECT_FALSE(one.accepts(R"("xa")"));
  EXPECT_TRUE(one.accepts(R"("xab")"));
  EXPECT_TRUE(one.accepts(R"("xabcd")"));
  EXPECT_FALSE(one.accepts(R"("xabcde")"));
  EXPECT_FALSE(one.accepts(R"("xAbc")"));
  // A repeated part two characters wide: lengths 1 + 2k within 2..6, so k is 1 or 2.
  const Schema wide(R"({"type": "string", "pattern": "^a(bc)*$", "minLength": 2, "maxLength": 6})");
  EXPECT_FALSE(wide.accepts(R"("a")"));
  EXPECT_TRUE(wide.accepts(R"("abc")"));
  EXPECT_TRUE(wide.accepts(R"("abcbc")"));
  EXPECT_FALSE(wide.accepts(R"("abcbcbc")"));
  // Alternatives are restricted one by one; one that cannot meet the bound is dropped.
  const Schema alts(R"({"type": "string", "pattern": "^(ab|[0-9]+)$", "minLength": 3})");
  EXPECT_FALSE(alts.accepts(R"("ab")"));
  EXPECT_FALSE(alts.accepts(R"("12")"));
  EXPECT_TRUE(alts.accepts(R"("123")"));
  // A bound the pattern implies changes nothing; multi-byte characters count once.
  const Schema implied(R"({"type": "string", "pattern": "^[0-9]{12}$", "maxLength": 64})");
  EXPECT_TRUE(implied.accepts(R"("123456789012")"));
  EXPECT_FALSE(implied.accepts(R"("12345678901")"));
  const Schema utf8(R"({"type": "string", "pattern": "^.*$", "maxLength": 2})");
  EXPECT_TRUE(utf8.accepts("\"\xC3\xA9\xC3\xA9\""));
  EXPECT_FALSE(utf8.accepts("\"\xC3\xA9\xC3\xA9\xC3\xA9\""));
  // Refused: two repeated parts, a bound no string of the pattern meets, a reversed bound.
  EXPECT_NE(refusal(R"({"type": "string", "pattern": "^[a-z]+-[a-z]+$", "maxLength": 8})")
                .find("'pattern' together with 'minLength'/'maxLength' is supported where"),
            std::string::npos);
  EXPECT_NE(refusal(R"({"type": "string", "pattern": "^[0-9]{12}$", "maxLength": 5})").find("no string matches"),
            std::string::npos);
  EXPECT_NE(refusal(R"({"type": "string", "pattern": "^a*$", "minLength": 4, "maxLength": 2})")
                .find("'maxLength' 2 is below 'minLength' 4"),
            std::string::npos);
}

}  // namespace
}  // namespace kestrel::grammar
