// Hand-worked and property tests of the UTF-8 helpers, the BPE merge loop, both tokenizer loaders and the
// incremental detokenizer. (Equality with the reference Python libraries on a large corpus is checked by
// tests/python/test_text_tokenizer.py.)
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/bpe.h"
#include "text/detokenizer.h"
#include "text/tokenize_cli.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace kestrel::text {
namespace {

using nlohmann::json;
const std::string kFFFD = "\xEF\xBF\xBD";

std::string mapped(const std::string& bytes) {
  std::string s;
  for (unsigned char b : bytes) utf8_append(s, byte_to_unicode(b));
  return s;
}

TEST(Utf8, LossyReplacesMaximalSubparts) {
  EXPECT_EQ(utf8_lossy("abc"), "abc");
  EXPECT_EQ(utf8_lossy("\xE4\xB8\xAD"), "\xE4\xB8\xAD");
  EXPECT_EQ(utf8_lossy("\xE4\xB8"), kFFFD);                      // truncated: one replacement
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), kFFFD + kFFFD + kFFFD);  // surrogate: ED, A0, 80 each
  EXPECT_EQ(utf8_lossy("\xC0\xAF"), kFFFD + kFFFD);              // overlong lead C0 is never valid
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98" "A"), kFFFD + "A");
  EXPECT_EQ(utf8_lossy("\xF4\x90\x80\x80"), kFFFD + kFFFD + kFFFD + kFFFD);  // above U+10FFFF
  EXPECT_EQ(utf8_lossy("\x80x\xFF"), kFFFD + "x" + kFFFD);
}

TEST(Utf8, FirstInvalidAndRequire) {
  EXPECT_EQ(utf8_first_invalid("héllo"), std::string_view::npos);
  EXPECT_EQ(utf8_first_invalid("ab\xFF"), 2u);
  EXPECT_EQ(utf8_first_invalid("ab\xE4\xB8"), 2u);
  try {
    require_utf8("ok\xC3", "prompt");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("prompt is not valid UTF-8: byte 0xC3 at offset 2"), std::string::npos);
  }
}

TEST(Utf8, StablePrefixHoldsBackOnlyAnUnfinishedTail) {
  EXPECT_EQ(utf8_stable_prefix("ab\xE4\xB8"), 2u);
  EXPECT_EQ(utf8_stable_prefix("ab\xE4\xB8\xAD"), 5u);
  EXPECT_EQ(utf8_stable_prefix("ab\xF0"), 2u);
  EXPECT_EQ(utf8_stable_prefix("\xFF"), 1u);         // can never become valid
  EXPECT_EQ(utf8_stable_prefix("a\xED\xA0"), 3u);    // ED A0 is already decided
  EXPECT_EQ(utf8_stable_prefix("a\xE4" "b"), 3u);
  EXPECT_EQ(utf8_stable_prefix(""), 0u);
  // Property: lossy(prefix) + lossy(rest) == lossy(all) whenever prefix is the stable prefix.
  std::mt19937 rng(3);
  const unsigned char pool[] = {'a', 0x80, 0xBF, 0xC3, 0xA9, 0xE4, 0xB8, 0xAD, 0xED, 0xA0, 0xF0, 0x9F, 0x98, 0x80, 0xFF};
  for (int t = 0; t < 2000; ++t) {
    std::string s;
    const int n = static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) s += static_cast<char>(pool[rng() % sizeof(pool)]);
    const size_t k = utf8_stable_prefix(s);
    std::string more;
    for (int i = 0; i < 3; ++i) more += static_cast<char>(pool[rng() % sizeof(pool)]);
    const std::string all = s + more;
    EXPECT_EQ(utf8_lossy(all.substr(0, k)) + utf8_lossy(all.substr(k)), utf8_lossy(all));
  }
}

// Reference merge loop written the obvious way: rescan for the lowest-ranked pair, leftmost first.
std::vector<int32_t> naive_bpe(const std::vector<std::pair<std::pair<int32_t, int32_t>, int32_t>>& merges,
                               std::vector<int32_t> sym) {
  for (;;) {
    size_t best = SIZE_MAX, best_rank = SIZE_MAX;
    int32_t best_new = -1;
    for (size_t i = 0; i + 1 < sym.size(); ++i)
      for (size_t r = 0; r < merges.size(); ++r)
        if (merges[r].first == std::make_pair(sym[i], sym[i + 1]) && r < best_rank) {
          best_rank = r;
          best = i;
          best_new = merges[r].second;
        }
    if (best == SIZE_MAX) return sym;
    sym[best] = best_new;
    sym.erase(sym.begin() + static_cast<long>(best) + 1);
  }
}

TEST(Bpe, LeftmostLowestRankAndLongPiecesAgreeWithNaiveLoop) {
  // ids 0..255 are bytes; 256 = "ab", 257 = "aa", 258 = "aab", 259 = "abab"
  std::vector<std::string> bytes(260);
  for (int b = 0; b < 256; ++b) bytes[b] = std::string(1, static_cast<char>(b));
  bytes[256] = "ab";
  bytes[257] = "aa";
  bytes[258] = "aab";
  bytes[259] = "abab";
  std::vector<std::pair<std::pair<int32_t, int32_t>, int32_t>> merges = {
      {{'a', 'b'}, 256}, {{'a', 'a'}, 257}, {{257, 'b'}, 258}, {{256, 256}, 259}};
  BpeModel m(bytes);
  for (size_t r = 0; r < merges.size(); ++r)
    m.add_merge(merges[r].first.first, merges[r].first.second, static_cast<int32_t>(r), merges[r].second);
  auto enc = [&](const std::string& s) {
    std::vector<int32_t> out;
    m.encode_piece(s, out);
    return out;
  };
  // "aab": (a,b) has the lower rank, so a + ab, never aa + b.
  EXPECT_EQ(enc("aab"), (std::vector<int32_t>{'a', 256}));
  // "aaa": (a,a) at positions 0 and 1; the leftmost is merged.
  EXPECT_EQ(enc("aaa"), (std::vector<int32_t>{257, 'a'}));
  EXPECT_EQ(enc("abab"), (std::vector<int32_t>{259}));
  EXPECT_EQ(enc("x"), (std::vector<int32_t>{'x'}));
  std::mt19937 rng(5);
  for (int t = 0; t < 200; ++t) {
    const size_t n = 1 + rng() % 300;  // crosses the small/large algorithm boundary at 64
    std::string s;
    std::vector<int32_t> init;
    for (size_t i = 0; i < n; ++i) {
      s += "ab"[rng() % 2];
      init.push_back(static_cast<unsigned char>(s.back()));
    }
    EXPECT_EQ(enc(s), naive_bpe(merges, init)) << s;
  }
}

json byte_level_tokenizer(const std::vector<std::pair<std::string, std::string>>& merges_bytes,
                          const json& pre_tokenizer) {
  json vocab = json::object();
  int32_t next = 0;
  for (int b = 0; b < 256; ++b) vocab[mapped(std::string(1, static_cast<char>(b)))] = next++;
  json merges = json::array();
  for (const auto& [a, b] : merges_bytes) {
    merges.push_back(mapped(a) + " " + mapped(b));
    if (!vocab.contains(mapped(a + b))) vocab[mapped(a + b)] = next++;
  }
  json added = json::array({{{"id", next}, {"content", "<|im_end|>"}, {"special", true}, {"normalized", false}}});
  return {{"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre_tokenizer},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
}

TEST(HfTokenizer, HandWorkedEncodeDecode) {
  // Merges: " w"=256, "or"=257, " wor"=258, "ld"=259, " world"=260... as ranks 0..4
  const json pre = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  const json tj = byte_level_tokenizer({{" ", "w"}, {"o", "r"}, {" w", "or"}, {"l", "d"}, {" wor", "ld"}}, pre);
  const Tokenizer tok = Tokenizer::from_hf_json(tj.dump());
  EXPECT_EQ(tok.id_count(), 262);
  // GPT-2 regex splits "hi world<|im_end|>!" into "hi", " world", then the special token, then "!".
  EXPECT_EQ(tok.encode("hi world<|im_end|>!"), (std::vector<int32_t>{'h', 'i', 260, 261, '!'}));
  EncodeOptions ordinary;
  ordinary.parse_special = false;
  // Without special parsing: "<|" is one regex piece ( ?[^\s\p{L}\p{N}]+ ), then "im", "_", "end", "|>!".
  EXPECT_EQ(tok.encode("<|im_end|>!", ordinary),
            (std::vector<int32_t>{'<', '|', 'i', 'm', '_', 'e', 'n', 'd', '|', '>', '!'}));
  EXPECT_TRUE(tok.is_special(261));
  EXPECT_FALSE(tok.is_special(260));
  const std::vector<int32_t> ids = {'h', 'i', 260, 261, '!'};
  EXPECT_EQ(tok.decode(ids), "hi world<|im_end|>!");
  EXPECT_EQ(tok.decode(ids, true), "hi world!");
  EXPECT_EQ(tok.token_bytes(258), " wor");
  EXPECT_EQ(tok.token_to_id(mapped(" world")), 260);
  EXPECT_EQ(tok.token_to_id("<|im_end|>"), 261);
  const std::vector<int32_t> broken = {0xE4, 0xB8, 'x'};
  EXPECT_EQ(tok.decode(broken), kFFFD + "x");
}

TEST(HfTokenizer, ErrorsAreClear) {
  const json pre = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  const Tokenizer tok = Tokenizer::from_hf_json(byte_level_tokenizer({}, pre).dump());
  EXPECT_THROW(tok.encode("ab\xFF"), Error);
  const std::vector<int32_t> bad = {5, 999};
  EXPECT_THROW(tok.decode(bad), Error);
  EXPECT_THROW(tok.token_bytes(-1), Error);

  json split = byte_level_tokenizer({}, pre);
  split["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  EXPECT_THROW(Tokenizer::from_hf_json(split.dump()), Error);  // bad regex, and no ByteLevel
  json norm = byte_level_tokenizer({}, pre);
  norm["normalizer"] = {{"type", "NFKC"}};
  try {
    Tokenizer::from_hf_json(norm.dump());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("normalizer 'NFKC' is not supported"), std::string::npos);
  }
  json bad_merge = byte_level_tokenizer({}, pre);
  bad_merge["model"]["merges"] = json::array({"a"});
  EXPECT_THROW(Tokenizer::from_hf_json(bad_merge.dump()), Error);
  EXPECT_THROW(Tokenizer::from_hf_json("{not json"), Error);
}

// Issue 21: structure of the wrong JSON type was an uncaught nlohmann exception (SIGABRT in serve/generate), and an
// added token id of 1e9 a bad_alloc; both are now kestrel::Error naming the problem.
std::string error_of(const std::string& tokenizer_json) {
  try {
    Tokenizer::from_hf_json(tokenizer_json);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(HfTokenizer, WrongJsonTypesAndHugeIdsAreErrors) {
  const json pre = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  json array_model = byte_level_tokenizer({}, pre);
  array_model["model"] = json::array({1, 2});
  EXPECT_NE(error_of(array_model.dump()).find("'model' must be an object"), std::string::npos);
  json string_vocab = byte_level_tokenizer({}, pre);
  string_vocab["model"]["vocab"]["!"] = "zero";
  EXPECT_NE(error_of(string_vocab.dump()).find("tokenizer.json: unexpected structure"), std::string::npos);
  json added_string = byte_level_tokenizer({}, pre);
  added_string["added_tokens"][0]["content"] = json::array();
  EXPECT_NE(error_of(added_string.dump()).find("tokenizer.json"), std::string::npos);
  EXPECT_NE(error_of("[1, 2]").find("top level must be a JSON object"), std::string::npos);

  json huge = byte_level_tokenizer({}, pre);
  huge["added_tokens"][0]["id"] = 1000000000;
  const std::string e = error_of(huge.dump());
  EXPECT_NE(e.find("token id 1000000000 is far beyond the 257 tokens"), std::string::npos) << e;
  huge["added_tokens"][0]["id"] = int64_t{1} << 40;  // beyond int32: not wrapped into range
  EXPECT_NE(error_of(huge.dump()).find("far beyond"), std::string::npos);
  // A gap of reserved ids of ordinary size still loads.
  json gap = byte_level_tokenizer({}, pre);
  gap["added_tokens"][0]["id"] = 5000;
  EXPECT_EQ(Tokenizer::from_hf_json(gap.dump()).id_count(), 5001);
}

TEST(Tiktoken, HugeSpecialIdIsAnError) {
  std::string ranks;
  for (int b = 0; b < 256; ++b) {
    static const char* t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    ranks += std::string{t[b >> 2], t[(b & 3) << 4], '=', '='} + " " + std::to_string(b) + "\n";
  }
  const json cfg = {{"added_tokens_decoder", {{"999999999", {{"content", "<|x|>"}}}}}};
  try {
    Tokenizer::from_tiktoken(ranks, cfg.dump());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("far beyond"), std::string::npos) << e.what();
  }
  const json neg = {{"added_tokens_decoder", {{"-3", {{"content", "<|x|>"}}}}}};
  EXPECT_THROW(Tokenizer::from_tiktoken(ranks, neg.dump()), Error);
  const json wrong = {{"added_tokens_decoder", {{"300", {{"content", 7}}}}}};
  EXPECT_THROW(Tokenizer::from_tiktoken(ranks, wrong.dump()), Error);
}

std::string b64(const std::string& s) {
  static const char* t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < s.size(); i += 3) {
    const uint32_t v = (static_cast<unsigned char>(s[i]) << 16) | (static_cast<unsigned char>(s[i + 1]) << 8) |
                       static_cast<unsigned char>(s[i + 2]);
    out += {t[v >> 18], t[(v >> 12) & 63], t[(v >> 6) & 63], t[v & 63]};
  }
  if (s.size() - i == 1) {
    const uint32_t v = static_cast<unsigned char>(s[i]) << 16;
    out += {t[v >> 18], t[(v >> 12) & 63], '=', '='};
  } else if (s.size() - i == 2) {
    const uint32_t v = (static_cast<unsigned char>(s[i]) << 16) | (static_cast<unsigned char>(s[i + 1]) << 8);
    out += {t[v >> 18], t[(v >> 12) & 63], t[(v >> 6) & 63], '='};
  }
  return out;
}

TEST(Tiktoken, HandWorkedRanksAndSpecials) {
  std::string ranks;
  for (int b = 0; b < 256; ++b) ranks += b64(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  // "ab" = 256, "bc" = 257, "abc" = 258. In "abc" both (a,b) and (b,c) are tokens; "ab" has the lower rank.
  ranks += b64("ab") + " 256\n" + b64("bc") + " 257\n" + b64("abc") + " 258\n" + b64("xbc") + " 259\n";
  const json cfg = {{"added_tokens_decoder", {{"300", {{"content", "<|im_end|>"}, {"special", true}}}}},
                    {"pat_str", R"(\p{L}+|\s+|[^\s\p{L}]+)"}};
  const Tokenizer tok = Tokenizer::from_tiktoken(ranks, cfg.dump());
  EXPECT_EQ(tok.format(), Tokenizer::Format::tiktoken);
  EXPECT_EQ(tok.id_count(), 301);
  EXPECT_EQ(tok.encode("abc"), (std::vector<int32_t>{258}));  // whole piece is a token
  // "xbcc": pieces "xbcc"; pairs (x,b) none, (b,c) 257, (c,c) none -> x,bc,c; then (x,bc) = "xbc" = 259.
  EXPECT_EQ(tok.encode("xbcc"), (std::vector<int32_t>{259, 'c'}));
  // "abcc": (a,b)=256 beats (b,c)=257 -> ab,c,c; then (ab,c) is "abc" = 258.
  EXPECT_EQ(tok.encode("abcc"), (std::vector<int32_t>{258, 'c'}));
  EXPECT_EQ(tok.encode("a<|im_end|>b"), (std::vector<int32_t>{'a', 300, 'b'}));
  EncodeOptions ordinary;
  ordinary.parse_special = false;
  EXPECT_EQ(tok.encode("<|", ordinary), (std::vector<int32_t>{'<', '|'}));
  const std::vector<int32_t> ids = {258, 300};
  EXPECT_EQ(tok.decode(ids), "abc<|im_end|>");
  EXPECT_EQ(tok.decode(ids, true), "abc");
  EXPECT_THROW(Tokenizer::from_tiktoken("!!! 1\n", "{}"), Error);
  EXPECT_THROW(Tokenizer::from_tiktoken(b64("a") + " x\n", "{}"), Error);
}

TEST(Detokenizer, HoldsBackOnlyUnfinishedSequences) {
  const json pre = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  const Tokenizer tok = Tokenizer::from_hf_json(byte_level_tokenizer({}, pre).dump());
  IncrementalDetokenizer d(tok, true);
  EXPECT_EQ(d.push('a'), "a");
  EXPECT_EQ(d.push(0xE4), "");
  EXPECT_EQ(d.pending_text(), kFFFD);
  EXPECT_EQ(d.push(0xB8), "");
  EXPECT_EQ(d.push(0xAD), "\xE4\xB8\xAD");
  EXPECT_EQ(d.push(256), "");  // special, skipped
  EXPECT_EQ(d.push(0xF0), "");
  EXPECT_EQ(d.push('z'), kFFFD + "z");  // the F0 can no longer complete
  EXPECT_EQ(d.push(0xC3), "");
  EXPECT_EQ(d.finish(), kFFFD);
  EXPECT_THROW(d.push(100000), Error);

  // Property: after every token, released + pending equals the full decode of the prefix.
  std::mt19937 rng(9);
  for (int t = 0; t < 300; ++t) {
    std::vector<int32_t> ids;
    IncrementalDetokenizer s(tok);
    std::string released;
    const int n = 1 + static_cast<int>(rng() % 16);
    for (int i = 0; i < n; ++i) {
      const int32_t pool[] = {'a', ' ', 0xC3, 0xA9, 0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x98, 0x80, 0xFF, 256};
      ids.push_back(pool[rng() % 13]);
      released += s.push(ids.back());
      ASSERT_EQ(released + s.pending_text(), tok.decode(ids));
    }
  }
}

}  // namespace
}  // namespace kestrel::text

namespace kestrel::text {
namespace {

TEST(TokenizeCli, QuotesTokenBytes) {
  EXPECT_EQ(quote_token_bytes("ab"), "\"ab\"");
  EXPECT_EQ(quote_token_bytes(" \n\t\"\\"), "\" \\n\\t\\\"\\\\\"");
  EXPECT_EQ(quote_token_bytes("\xE4\xB8\xAD"), "\"\xE4\xB8\xAD\"");
  EXPECT_EQ(quote_token_bytes("\xE4\xB8"), "\"\\xE4\\xB8\"");  // part of a sequence
  EXPECT_EQ(quote_token_bytes(std::string("\x01\x7F", 2)), "\"\\x01\\x7F\"");
}

}  // namespace
}  // namespace kestrel::text
