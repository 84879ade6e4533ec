// The reasoning section before a grammar: opened by the first token (or by the prompt), free until the close marker
// token, which only a whole token may write; then the grammar. Rollback crosses the phases.
#include <gtest/gtest.h>

#include "grammar/ebnf.h"
#include "grammar/output_constraint.h"

namespace kestrel::grammar {
namespace {

struct Fixture {
  std::vector<std::string> texts = {"<eos>", "<think>", "</think>", "a", "b", "x", "</th", "ink>", "k>", "</think>y", "</"};
  std::vector<Vocabulary::Kind> kinds;
  std::shared_ptr<const Vocabulary> vocab;
  int32_t id(const std::string& t) const {
    return static_cast<int32_t>(std::find(texts.begin(), texts.end(), t) - texts.begin());
  }
  explicit Fixture(bool special_markers) {
    for (const std::string& t : texts)
      kinds.push_back(special_markers && (t == "<think>" || t == "</think>") ? Vocabulary::Kind::special
                                                                           : Vocabulary::Kind::bytes);
    vocab = std::make_shared<const Vocabulary>(kinds, texts, std::vector<int32_t>{0});
  }
  std::shared_ptr<const OutputConstraint> constraint(bool starts_inside) const {
    auto c = std::make_shared<OutputConstraint>();
    c->grammar = std::make_shared<CompiledGrammar>(parse_ebnf("root ::= \"a\"+ \"b\""), vocab);
    c->reasoning = std::make_shared<ReasoningMarkers>(vocab, "<think>", "</think>");
    c->starts_in_reasoning = starts_inside;
    return c;
  }
  std::vector<std::string> allowed(const OutputMatcher& m) const {
    std::vector<uint32_t> w(static_cast<size_t>(m.mask_words()));
    m.fill_mask(w);
    std::vector<std::string> out;
    for (size_t i = 0; i < texts.size(); ++i)
      if (w[i >> 5] >> (i & 31) & 1) out.push_back(texts[i]);
    return out;
  }
};

using Strings = std::vector<std::string>;

TEST(OutputConstraint, ReasoningThenGrammar) {
  for (bool special : {true, false}) {
    const Fixture f(special);
    OutputMatcher m(f.constraint(false));
    // First token: the grammar's first tokens or the open marker.
    EXPECT_EQ(f.allowed(m), (Strings{"<think>", "a"})) << special;
    ASSERT_TRUE(m.accept_token(f.id("<think>")));
    EXPECT_TRUE(m.in_reasoning());
    // Inside: everything but stops and tokens that would write the close marker inside their text.
    const Strings inside = {"<think>", "</think>", "a", "b", "x", "</th", "ink>", "k>", "</"};
    EXPECT_EQ(f.allowed(m), inside) << special;
    ASSERT_TRUE(m.accept_token(f.id("x")));
    ASSERT_TRUE(m.accept_token(f.id("</th")));
    // After "</th": "ink>" would complete the marker across tokens.
    Strings after_partial = inside;
    after_partial.erase(std::find(after_partial.begin(), after_partial.end(), "ink>"));
    EXPECT_EQ(f.allowed(m), after_partial) << special;
    EXPECT_FALSE(m.accept_token(f.id("ink>")));
    EXPECT_FALSE(m.accept_token(0));
    ASSERT_TRUE(m.accept_token(f.id("</think>")));
    EXPECT_FALSE(m.in_reasoning());
    EXPECT_EQ(f.allowed(m), (Strings{"a"}));
    ASSERT_TRUE(m.accept_token(f.id("a")));
    ASSERT_TRUE(m.accept_token(f.id("b")));
    EXPECT_EQ(f.allowed(m), (Strings{"<eos>"}));
    ASSERT_TRUE(m.accept_token(0));
    EXPECT_TRUE(m.terminated());
    // Back across the phases.
    m.rollback(4);  // to just after "</th"
    EXPECT_TRUE(m.in_reasoning());
    EXPECT_EQ(f.allowed(m), after_partial);
    m.rollback(2);  // to just after "<think>"
    EXPECT_EQ(f.allowed(m), inside);
    m.rollback(m.num_accepted());
    EXPECT_EQ(f.allowed(m), (Strings{"<think>", "a"}));
  }
}

TEST(OutputConstraint, WithoutTheOpenMarkerTheGrammarStartsAtOnce) {
  const Fixture f(true);
  OutputMatcher m(f.constraint(false));
  ASSERT_TRUE(m.accept_token(f.id("a")));
  EXPECT_EQ(f.allowed(m), (Strings{"a", "b"}));
  EXPECT_FALSE(m.accept_token(f.id("<think>")));
}

TEST(OutputConstraint, PromptThatOpenedReasoning) {
  const Fixture f(true);
  OutputMatcher m(f.constraint(true));
  EXPECT_TRUE(m.in_reasoning());
  EXPECT_FALSE(m.accept_token(f.id("</think>y")));
  ASSERT_TRUE(m.accept_token(f.id("</think>")));
  EXPECT_EQ(f.allowed(m), (Strings{"a"}));
}

}  // namespace
}  // namespace kestrel::grammar
