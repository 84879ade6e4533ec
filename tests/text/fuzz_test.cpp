// Bounded fuzzing of the tokenizers and the template engine (each test runs for a fixed time budget from a fixed
// seed, so CI time stays small and failures reproduce). Findings are: a crash, an exception other than
// kestrel::Error, or a broken property (decode(encode(s)) != s for valid UTF-8; incremental detokenisation
// differing from decode; invalid UTF-8 accepted).
#include <chrono>
#include <filesystem>
#include <span>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/bpe_trainer.h"
#include "text/chat_template.h"
#include "text/detokenizer.h"
#include "text/jinja.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace kestrel::text {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kBudgetSeconds = 1.5;

bool time_left(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count() < kBudgetSeconds;
}

std::string random_text(std::mt19937& rng) {
  static const std::vector<std::string> atoms = {
      "a", "Z", " ", "  ", "\n", "\r\n", "\t", "'s", "'LL", "1", "123456", "中", "文字", "ー", "é", "e\xCC\x81",
      "\xF0\x9F\x98\x80", "<|im_end|>", "<|im_", "[BOS]", "<think>", "!", "...", "\xC2\xA0", "\xE3\x80\x80", "{",
      "}", "%", "#", "\xE2\x80\xA8", "x"};
  std::string s;
  const int n = static_cast<int>(rng() % 40);
  for (int i = 0; i < n; ++i) {
    if (rng() % 8 == 0) s += static_cast<char>(rng() % 256);  // raw byte: may break UTF-8
    else s += atoms[rng() % atoms.size()];
  }
  return s;
}

std::vector<Tokenizer> fuzz_tokenizers() {
  std::string text;
  for (int i = 0; i < 30; ++i) text += "The quick brown fox 12345 jumps; 中文字符 don't 😀 <|im_end|>\n  \t";
  const TrainedBpe t = train_bpe(text, kimi_split_pattern(), 600, {"[BOS]", "<|im_end|>", "<think>"});
  const auto dir = std::filesystem::temp_directory_path() / ("kestrel_fuzz_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "tk");
  TokenizerFilesSpec spec;
  spec.special_tokens = t.special_tokens;
  write_tokenizer_files(dir.string(), t, spec);
  std::filesystem::copy_file(dir / "tiktoken.model", dir / "tk" / "tiktoken.model");
  std::filesystem::copy_file(dir / "tokenizer_config.json", dir / "tk" / "tokenizer_config.json");
  std::vector<Tokenizer> out;
  out.push_back(Tokenizer::load(dir.string()));
  out.push_back(Tokenizer::load((dir / "tk").string()));
  std::filesystem::remove_all(dir);
  return out;
}

TEST(Fuzz, TokenizersRoundTripOrRejectInvalidUtf8) {
  const std::vector<Tokenizer> toks = fuzz_tokenizers();
  std::mt19937 rng(1234);
  const auto start = Clock::now();
  int iterations = 0;
  while (time_left(start)) {
    ++iterations;
    const std::string s = random_text(rng);
    const bool valid = utf8_first_invalid(s) == std::string_view::npos;
    for (const Tokenizer& tok : toks) {
      EncodeOptions o;
      o.parse_special = rng() % 2;
      if (!valid) {
        EXPECT_THROW(tok.encode(s, o), Error) << s;
        continue;
      }
      const std::vector<int32_t> ids = tok.encode(s, o);
      ASSERT_EQ(tok.decode(ids), s);
      // Random ids: decoding never fails for known ids, and streaming equals decoding at every prefix.
      std::vector<int32_t> rnd;
      for (int i = 0; i < 10; ++i) rnd.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(tok.id_count())));
      IncrementalDetokenizer d(tok);
      std::string released;
      for (size_t i = 0; i < rnd.size(); ++i) {
        released += d.push(rnd[i]);
        ASSERT_EQ(released + d.pending_text(), tok.decode(std::span(rnd).first(i + 1)));
      }
    }
  }
  EXPECT_GT(iterations, 100);
}

// Fragments of real chat-template syntax, spliced and mutated at random.
std::string random_template(std::mt19937& rng) {
  static const std::vector<std::string> parts = {
      "{{ ", " }}", "{% ", " %}", "{%- ", " -%}", "{# c #}", "if ", "elif ", "else", "endif", "for ", " in ",
      "endfor", "set ", "macro ", "endmacro", "namespace(", ")", "(", "[", "]", "{", "}", "messages", "m", "ns.x",
      "loop.index", "loop.last", " | ", "tojson", "trim", "length", "join(',')", "map(attribute='role')",
      "selectattr('role', 'equalto', 'user')", ".strip()", ".split('x')", "[1:]", "[-1]", " ~ ", " + ", " * ",
      " // ", " % ", " ** ", " == ", " and ", " or ", " not ", " is ", "defined", "none", "string", "'str'",
      "\"q\"", "1", "2.5", "-3", "true", "None", ",", ":", "=", ".", "raise_exception('boom')", "range(3)",
      "break", "continue", "raw", "endraw", "\n", "  ", "text", "message['content']", "add_generation_prompt",
      "'\\u00e9\\n'", "9999999999999999999999", "x if y else z", "dict(a=1)", "'{}'.format(1)", "'%s'|format(2)"};
  std::string t;
  const int n = 1 + static_cast<int>(rng() % 30);
  for (int i = 0; i < n; ++i) t += parts[rng() % parts.size()];
  // Byte-level mutations.
  const int m = static_cast<int>(rng() % 3);
  for (int i = 0; i < m && !t.empty(); ++i) {
    const size_t pos = rng() % t.size();
    switch (rng() % 3) {
      case 0: t.erase(pos, 1); break;
      case 1: t.insert(pos, 1, "{}%#-+|'\"()[]"[rng() % 13]); break;
      default: t[pos] = static_cast<char>(32 + rng() % 95);
    }
  }
  return t;
}

TEST(Fuzz, TemplateParserAndRendererFailOnlyWithErrors) {
  std::mt19937 rng(4321);
  const nlohmann::ordered_json messages = {{{"role", "user"}, {"content", "hi"}},
                                           {{"role", "assistant"}, {"content", nullptr}}};
  const auto start = Clock::now();
  int iterations = 0, rendered = 0;
  while (time_left(start)) {
    ++iterations;
    const std::string src = random_template(rng);
    try {
      const ChatTemplate t(src);
      t.render(messages, nullptr, rng() % 2);
      ++rendered;
    } catch (const Error&) {
      // A clear error is an accepted outcome for a malformed template or a failing render.
    } catch (const std::exception& e) {
      FAIL() << "template raised a non-kestrel exception: " << e.what() << "\n" << src;
    }
  }
  EXPECT_GT(iterations, 100);
  EXPECT_GT(rendered, 0);
}

}  // namespace
}  // namespace kestrel::text
