#include <gtest/gtest.h>

#include "grammar/automaton.h"
#include "grammar/ebnf.h"

namespace kestrel::grammar {
namespace {

TEST(Utf8Sequences, CoverEveryCodePointOnce) {
  for (auto [lo, hi] : std::vector<std::pair<uint32_t, uint32_t>>{{0, 0x10FFFF}, {0x80, 0x7FF}, {0x7F, 0x801},
                                                                  {0xD7FF, 0xE001}, {0x1234, 0x23456}}) {
    const auto seqs = utf8_sequences(lo, hi);
    for (uint32_t cp = lo; cp <= hi; cp += (cp % 97 == 0 ? 1 : 13)) {
      std::string enc;
      if (cp < 0x80) enc = std::string(1, static_cast<char>(cp));
      else if (cp < 0x800) enc = {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
      else if (cp < 0x10000)
        enc = {static_cast<char>(0xE0 | (cp >> 12)), static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
               static_cast<char>(0x80 | (cp & 0x3F))};
      else
        enc = {static_cast<char>(0xF0 | (cp >> 18)), static_cast<char>(0x80 | ((cp >> 12) & 0x3F)),
               static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
      int matches = 0;
      for (const auto& seq : seqs) {
        if (seq.size() != enc.size()) continue;
        bool ok = true;
        for (size_t i = 0; i < seq.size(); ++i) {
          const auto b = static_cast<unsigned char>(enc[i]);
          ok = ok && b >= seq[i].lo && b <= seq[i].hi;
        }
        matches += ok;
      }
      EXPECT_EQ(matches, 1) << std::hex << cp;
    }
  }
}

}  // namespace
}  // namespace kestrel::grammar
