// Stop strings over streamed text: hand-worked cases, and random texts and splits against the direct definition
// (the text up to the stop string occurrence that ends first; at equal ends the longer one).
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "server/completion_text.h"

namespace kestrel::server {
namespace {

std::string run(StopStringMatcher& m, const std::vector<std::string>& pieces, std::vector<std::string>* released) {
  std::string out;
  for (const std::string& p : pieces) {
    std::string r = m.push(p);
    if (released) released->push_back(r);
    out += r;
  }
  if (!m.matched()) out += m.finish();
  return out;
}

TEST(StopStrings, CutsAtTheStopAndHoldsPossibleStarts) {
  StopStringMatcher m({"o w"}, false);
  std::vector<std::string> released;
  EXPECT_EQ(run(m, {"Hel", "lo", " wo", "rld"}, &released), "Hell");
  EXPECT_EQ(released, (std::vector<std::string>{"Hel", "l", "", ""}));  // "o" waits: it may start "o w"
  EXPECT_EQ(m.matched(), "o w");
}

TEST(StopStrings, HeldTextIsReleasedWhenItCannotMatch) {
  StopStringMatcher m({"bc"}, false);
  EXPECT_EQ(m.push("ab"), "a");
  EXPECT_EQ(m.push("d"), "bd");
  EXPECT_EQ(m.push("b"), "");
  EXPECT_EQ(m.finish(), "b");
  EXPECT_FALSE(m.matched());
}

TEST(StopStrings, FirstCompletedStopWinsAndCanBeKept) {
  StopStringMatcher a({"world", "lo"}, false);
  EXPECT_EQ(run(a, {"Hello world"}, nullptr), "Hel");
  EXPECT_EQ(a.matched(), "lo");
  StopStringMatcher d({"abcd", "c"}, false);  // "c" is complete before "abcd" is, whatever the pieces
  EXPECT_EQ(run(d, {"abcd"}, nullptr), "ab");
  StopStringMatcher e({"c", "bc"}, false);  // equal ends: the longer one
  EXPECT_EQ(run(e, {"abc"}, nullptr), "a");
  StopStringMatcher b({"world", "lo"}, true);
  EXPECT_EQ(run(b, {"Hel", "lo world"}, nullptr), "Hello");
  StopStringMatcher c({"é!"}, false);  // multi-byte stop split inside a character
  EXPECT_EQ(run(c, {"caf\xC3", "\xA9", "!x"}, nullptr), "caf");
}

TEST(StopStrings, RandomTextsAndSplitsMatchTheDefinition) {
  std::mt19937 rng(11);
  const std::string alphabet = "abc";
  for (int trial = 0; trial < 2000; ++trial) {
    std::string text;
    for (int i = 0, n = static_cast<int>(rng() % 24); i < n; ++i) text += alphabet[rng() % 3];
    std::vector<std::string> stops;
    for (int k = 0, n = 1 + static_cast<int>(rng() % 3); k < n; ++k) {
      std::string s;
      for (int i = 0, len = 1 + static_cast<int>(rng() % 3); i < len; ++i) s += alphabet[rng() % 3];
      stops.push_back(s);
    }
    size_t first = std::string::npos, end = std::string::npos;
    std::string which;
    for (const std::string& s : stops) {
      const size_t at = text.find(s);
      if (at != std::string::npos && (at + s.size() < end || (at + s.size() == end && at < first)))
        first = at, end = at + s.size(), which = s;
    }
    const std::string want = first == std::string::npos ? text : text.substr(0, first);
    std::vector<std::string> pieces;
    for (size_t i = 0; i < text.size();) {
      const size_t n = 1 + rng() % 4;
      pieces.push_back(text.substr(i, n));
      i += n;
    }
    StopStringMatcher m(stops, false);
    ASSERT_EQ(run(m, pieces, nullptr), want) << text;
    if (first != std::string::npos) {
      ASSERT_EQ(m.matched(), which);
    }
  }
}

}  // namespace
}  // namespace kestrel::server
