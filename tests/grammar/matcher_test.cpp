// The matcher against a brute-force oracle: the strings of length <= L of each test grammar, enumerated from the
// grammar's expressions; a token is allowed after a prefix exactly when prefix + token begins one of them.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "core/error.h"
#include "grammar/ebnf.h"
#include "grammar/matcher.h"
#include "grammar/regex_grammar.h"

namespace kestrel::grammar {
namespace {

using Strings = std::set<std::string>;

// Strings of length <= L matched by the grammar's root: a fixpoint over the rules.
class Enumerator {
 public:
  Enumerator(const Grammar& g, size_t L) : g_(g), L_(L), rules_(g.num_rules()) {
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t r = 0; r < g.num_rules(); ++r) {
        Strings s = eval(g.rule(static_cast<RuleId>(r)).body);
        if (s.size() != rules_[r].size()) changed = true;
        rules_[r] = std::move(s);
      }
    }
  }
  const Strings& root() const { return rules_[static_cast<size_t>(g_.root())]; }

 private:
  Strings concat(const Strings& a, const Strings& b) const {
    Strings out;
    for (const auto& x : a)
      for (const auto& y : b)
        if (x.size() + y.size() <= L_) out.insert(x + y);
    return out;
  }
  Strings eval(ExprId id) const {
    const Expr& e = g_.expr(id);
    Strings out;
    switch (e.kind) {
      case Expr::Kind::empty: return {""};
      case Expr::Kind::bytes: return e.text.size() <= L_ ? Strings{e.text} : Strings{};
      case Expr::Kind::chars:
        for (const CodeRange& r : e.ranges)
          for (uint32_t c = r.lo; c <= r.hi && c < 128; ++c) out.insert(std::string(1, static_cast<char>(c)));
        return out;
      case Expr::Kind::seq: {
        out = {""};
        for (ExprId c : e.children) out = concat(out, eval(c));
        return out;
      }
      case Expr::Kind::alt:
        for (ExprId c : e.children) {
          Strings s = eval(c);
          out.insert(s.begin(), s.end());
        }
        return out;
      case Expr::Kind::repeat: {
        const Strings one = eval(e.children[0]);
        Strings cur = {""};
        for (int64_t i = 0; i < e.min; ++i) cur = concat(cur, one);
        out = cur;
        for (int64_t i = e.min; e.max < 0 || i < e.max; ++i) {
          cur = concat(cur, one);
          const size_t before = out.size();
          out.insert(cur.begin(), cur.end());
          if (out.size() == before && e.max < 0) break;
          if (cur.empty()) break;
        }
        return out;
      }
      case Expr::Kind::rule: return rules_[static_cast<size_t>(e.rule)];
      default: return out;
    }
  }
  const Grammar& g_;
  size_t L_;
  std::vector<Strings> rules_;
};

// Single characters of the alphabet, some longer tokens, a stop token (id 0) and an unknown id.
std::shared_ptr<const Vocabulary> test_vocab(const std::string& alphabet, const std::vector<std::string>& longer) {
  std::vector<Vocabulary::Kind> kinds = {Vocabulary::Kind::bytes, Vocabulary::Kind::none};
  std::vector<std::string> bytes = {"", ""};
  for (char c : alphabet) kinds.push_back(Vocabulary::Kind::bytes), bytes.push_back(std::string(1, c));
  for (const std::string& t : longer) kinds.push_back(Vocabulary::Kind::bytes), bytes.push_back(t);
  return std::make_shared<const Vocabulary>(kinds, bytes, std::vector<int32_t>{0});
}

struct Case {
  const char* name;
  const char* ebnf;
  std::string alphabet;
  std::vector<std::string> tokens;
  size_t max_len = 10;    // strings enumerated
  size_t max_prefix = 4;  // prefixes checked: short enough that their completions fit in max_len
};

const std::vector<Case> kCases = {
    {"literal_alternatives", R"g(root ::= "ab" | "abc" | "b" "c"*)g", "abc", {"ab", "bc", "abc", "cc", "ca"}},
    {"recursion", R"g(root ::= "(" root ")" | "x")g", "()x", {"((", "))", "(x", "x)", "x))", "()"}, 13, 4},
    {"nested_lists", R"g(root ::= "[" (item ("," item)*)? "]"
item ::= "a" | root)g", "[],a", {"[[", "]]", "],", ",[", "a]", "[a", "a,a", "],["}, 10, 3},
    {"nullable_recursion", R"g(root ::= x "z"
x ::= "" | "a" x | "b" x "c")g", "abcz", {"ab", "bc", "cz", "za", "abc", "az"}, 12, 3},
    {"repeat_ranges", R"g(root ::= "a"{2,3} "b"{0,2} ("c" | "d"){1,})g", "abcd", {"aa", "ab", "bb", "bc", "cd", "aab"}},
    {"shared_tail", R"g(root ::= a a a
a ::= "p" | "q" "r"?)g", "pqr", {"pq", "qr", "rp", "qq", "rq"}},
    {"classes", R"g(root ::= [a-c]+ [^a-z]? "!")g", "abcz1!", {"a1", "1!", "ab", "c!", "!!"}, 7, 4},
    {"mutual_recursion", R"g(root ::= a
a ::= "x" b | "y"
b ::= "(" a ")" | "z" a)g", "xyz()", {"x(", "(y", "y)", "zx", "))", "xz"}, 12, 4},
};

class MatcherOracle : public ::testing::TestWithParam<Case> {};

TEST_P(MatcherOracle, MasksEqualBruteForce) {
  const Case& c = GetParam();
  const size_t L = c.max_len;
  const Grammar g = parse_ebnf(c.ebnf);
  const Strings lang = Enumerator(g, L).root();
  ASSERT_FALSE(lang.empty());
  const auto vocab = test_vocab(c.alphabet, c.tokens);
  const auto compiled = std::make_shared<CompiledGrammar>(g, vocab);
  // Every short prefix of the language's strings, reached by accepting single-byte tokens.
  Strings prefixes, viable;
  for (const std::string& w : lang)
    for (size_t k = 0; k <= w.size(); ++k) {
      viable.insert(w.substr(0, k));
      if (k <= c.max_prefix) prefixes.insert(w.substr(0, k));
    }
  int checked = 0;
  for (const std::string& p : prefixes) {
    GrammarMatcher m(compiled);
    ASSERT_TRUE(m.accept_bytes(p)) << p;
    std::vector<uint32_t> words(static_cast<size_t>(compiled->mask_words()));
    m.fill_mask(words);
    for (int32_t id = 0; id < vocab->size(); ++id) {
      const bool got = words[static_cast<size_t>(id) >> 5] >> (id & 31) & 1;
      bool want = false;
      if (vocab->kind(id) == Vocabulary::Kind::stop) {
        want = lang.count(p) > 0;
      } else if (vocab->kind(id) == Vocabulary::Kind::bytes) {
        want = viable.count(p + vocab->bytes(id)) > 0;
      }
      EXPECT_EQ(got, want) << c.name << ": prefix '" << p << "' token '" << vocab->bytes(id) << "'";
      // accept_token agrees with the mask and leaves the matcher unchanged when it refuses.
      GrammarMatcher probe(compiled);
      probe.accept_bytes(p);
      EXPECT_EQ(probe.accept_token(id), want) << c.name << ": prefix '" << p << "' token " << id;
      ++checked;
    }
    EXPECT_EQ(m.can_terminate(), lang.count(p) > 0) << p;
  }
  EXPECT_GT(checked, 20);
}

INSTANTIATE_TEST_SUITE_P(Grammars, MatcherOracle, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(Matcher, RollbackRestoresEveryEarlierState) {
  const Grammar g = parse_ebnf(R"g(root ::= "[" (item ("," item)*)? "]"
item ::= "a" | root)g");
  const auto vocab = test_vocab("[],a", {"[[", "a,", "],"});
  const auto compiled = std::make_shared<CompiledGrammar>(g, vocab);
  GrammarMatcher m(compiled);
  std::vector<std::vector<uint32_t>> masks;
  std::mt19937 rng(7);
  for (int step = 0; step < 40; ++step) {
    std::vector<uint32_t> words(static_cast<size_t>(compiled->mask_words()));
    m.fill_mask(words);
    masks.push_back(words);
    std::vector<int32_t> allowed;
    for (int32_t id = 1; id < vocab->size(); ++id)
      if (words[static_cast<size_t>(id) >> 5] >> (id & 31) & 1) allowed.push_back(id);
    if (allowed.empty()) break;
    ASSERT_TRUE(m.accept_token(allowed[rng() % allowed.size()]));
  }
  for (int n = 1; n <= m.num_accepted(); n += 3) {
    GrammarMatcher copy = m;
    copy.rollback(n);
    std::vector<uint32_t> words(static_cast<size_t>(compiled->mask_words()));
    copy.fill_mask(words);
    EXPECT_EQ(words, masks[masks.size() - 1 - static_cast<size_t>(n)]) << n;
  }
}

TEST(Matcher, StopTokenEndsTheGrammar) {
  const auto vocab = test_vocab("ab", {});
  const auto compiled = std::make_shared<CompiledGrammar>(parse_ebnf(R"g(root ::= "a" "b"?)g"), vocab);
  GrammarMatcher m(compiled);
  EXPECT_FALSE(m.accept_token(0));
  EXPECT_TRUE(m.accept_bytes("a"));
  EXPECT_TRUE(m.can_terminate());
  EXPECT_TRUE(m.can_continue());
  EXPECT_TRUE(m.accept_token(0));
  EXPECT_TRUE(m.terminated());
  EXPECT_FALSE(m.accept_bytes("b"));
  m.rollback(1);
  EXPECT_FALSE(m.terminated());
  EXPECT_TRUE(m.accept_bytes("b"));
  EXPECT_FALSE(m.can_continue());
}

TEST(Automaton, RefusesLeftRecursionAndEmptyLanguages) {
  const auto vocab = test_vocab("ab", {});
  try {
    CompiledGrammar(parse_ebnf("root ::= root \"a\" | \"b\""), vocab);
    FAIL() << "left recursion accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("left-recursive"), std::string::npos) << e.what();
  }
  try {
    CompiledGrammar(parse_ebnf("root ::= \"a\" root"), vocab);
    FAIL() << "a grammar without finite strings accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("matches no string"), std::string::npos) << e.what();
  }
  // A class that matches no character: the root's DFA minimises to no state at all (this crashed once).
  for (const char* g : {"root ::= [^\\x00-\\U0010FFFF]", "root ::= \"a\" b\nb ::= \"x\" b [^\\x00-\\U0010FFFF] | \"(\" b \")\""}) {
    try {
      CompiledGrammar(parse_ebnf(g), vocab);
      FAIL() << "an empty language accepted: " << g;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("matches no string"), std::string::npos) << e.what();
    }
  }
  // An empty rule that the root can do without is dropped, not an error.
  const auto ok = std::make_shared<CompiledGrammar>(
      parse_ebnf("root ::= \"a\" | \"(\" b \")\"\nb ::= \"x\" b [^\\x00-\\U0010FFFF]"), vocab);
  GrammarMatcher m(ok);
  EXPECT_TRUE(m.accept_bytes("a"));
  EXPECT_TRUE(m.can_terminate());
  GrammarMatcher m2(ok);
  EXPECT_FALSE(m2.accept_bytes("(x"));
}

// As in xgrammar, white space and comments may stand between an element and its quantifier.
TEST(Ebnf, QuantifierAfterWhiteSpace) {
  const auto vocab = test_vocab("ab", {});
  const auto g = std::make_shared<CompiledGrammar>(parse_ebnf("root ::= \"a\" { 2 , 3 } \"b\" * # c\n ?"), vocab);
  auto accepts = [&](const std::string& s) {
    GrammarMatcher m(g);
    return m.accept_bytes(s) && m.can_terminate();
  };
  EXPECT_TRUE(accepts("aa"));
  EXPECT_TRUE(accepts("aaabbb"));
  EXPECT_FALSE(accepts("ab"));
  EXPECT_FALSE(accepts("aaaa"));
}

// \s is ECMAScript's white space and line terminators (as in xgrammar), \S exactly the other code points, in and
// out of a class.
TEST(Regex, WhiteSpaceClassIsEcmaScripts) {
  const auto vocab = test_vocab("ab", {});
  const std::vector<std::string> space = {"\t", "\n", "\v", "\f", "\r", " ", "\u00a0", "\u1680", "\u2000", "\u2005",
                                          "\u200a", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\ufeff"};
  const std::vector<std::string> other = {std::string(1, '\0'), "\x01", "\u0085", "\u200b", "\u2060", "a", "\u597d",
                                          "\U0001F600"};
  for (const char* pattern : {"a\\sb", "a[\\s]b", "a\\Sb", "a[\\S]b", "a[^\\S]b", "a[^\\s]b"}) {
    const std::string p = pattern;
    const bool want_space = p == "a\\sb" || p == "a[\\s]b" || p == "a[^\\S]b";
    const auto compiled = std::make_shared<CompiledGrammar>(regex_grammar(p), vocab);
    for (const auto& [texts, is_space] : {std::pair{space, true}, std::pair{other, false}})
      for (const std::string& c : texts) {
        GrammarMatcher m(compiled);
        const bool ok = m.accept_bytes("a" + c + "b") && m.can_terminate();
        EXPECT_EQ(ok, want_space == is_space) << p << " on U+" << std::hex << static_cast<int>(c[0] & 0xFF);
      }
  }
}

TEST(Automaton, RefusesAutomataBeyondTheLimit) {
  const auto vocab = test_vocab("ab", {});
  CompileLimits limits;
  limits.automaton.max_dfa_states = 1000;
  try {
    CompiledGrammar(parse_ebnf("root ::= [ab]* \"a\" [ab]{12}"), vocab, limits);
    FAIL() << "an exponential DFA was built";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_dfa_states"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kestrel::grammar
