// Hand-worked tests of the BPE trainer and of the files written from it.
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "core/error.h"
#include "text/bpe_trainer.h"
#include "text/tokenizer.h"

namespace kestrel::text {
namespace {

TEST(BpeTrainer, MergesMostFrequentPairsFirst) {
  // Words (pattern [a-z]+): "ab" x3, "abc" x2. (a,b) occurs 5 times -> 256 = "ab"; then (ab,c) twice -> 257.
  const TrainedBpe t = train_bpe("ab ab ab abc abc", "[a-z]+", 300, {});
  ASSERT_EQ(t.merges.size(), 2u);
  EXPECT_EQ(t.merges[0], std::make_pair(int32_t{'a'}, int32_t{'b'}));
  EXPECT_EQ(t.merges[1], std::make_pair(int32_t{256}, int32_t{'c'}));
  EXPECT_EQ(t.id_bytes[257], "abc");
  EXPECT_EQ(t.first_merge_id, 256);
}

TEST(BpeTrainer, TiesGoToSmallerBytesAndSpecialsAreNeverSpelled) {
  const TrainedBpe t = train_bpe("cd ab cd ab", "[a-z]+", 300, {});
  ASSERT_EQ(t.merges.size(), 2u);
  EXPECT_EQ(t.id_bytes[256], "ab");
  EXPECT_EQ(t.id_bytes[257], "cd");
  const TrainedBpe s = train_bpe("cd ab cd ab", "[a-z]+", 300, {"ab", "<x>"});
  EXPECT_EQ(s.first_merge_id, 258);
  ASSERT_EQ(s.merges.size(), 1u);
  EXPECT_EQ(s.id_bytes[258], "cd");
  EXPECT_EQ(s.id_bytes[256], "ab");  // the special token's own id
  // Stops at vocab_size.
  EXPECT_EQ(train_bpe("ab ab ab abc abc", "[a-z]+", 257, {}).merges.size(), 1u);
  EXPECT_THROW(train_bpe("x", "[a-z]+", 100, {}), Error);
  EXPECT_THROW(train_bpe("bad \xFF", "[a-z]+", 300, {}), Error);
}

TEST(BpeTrainer, WrittenFilesLoadInBothFormsAndRoundTrip) {
  std::string text;
  for (int i = 0; i < 50; ++i)
    text += "In the beginning God created the heaven and the earth. And the earth was without form; 12345 "
            "你好世界 don't WON'T \n\n  ";
  const TrainedBpe t = train_bpe(text, kimi_split_pattern(), 400, {"[BOS]", "<|im_end|>"});
  EXPECT_GT(t.merges.size(), 50u);
  const auto dir = std::filesystem::temp_directory_path() / ("kestrel_bpe_trainer_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "tiktoken");
  TokenizerFilesSpec spec;
  spec.special_tokens = {"[BOS]", "<|im_end|>"};
  spec.bos_token = "[BOS]";
  spec.chat_template = "{{ messages }}";
  write_tokenizer_files(dir.string(), t, spec);
  std::filesystem::copy_file(dir / "tiktoken.model", dir / "tiktoken" / "tiktoken.model");
  std::filesystem::copy_file(dir / "tokenizer_config.json", dir / "tiktoken" / "tokenizer_config.json");
  const Tokenizer hf = Tokenizer::load(dir.string());
  const Tokenizer tk = Tokenizer::load((dir / "tiktoken").string());
  std::filesystem::remove_all(dir);
  EXPECT_EQ(hf.format(), Tokenizer::Format::hf_json);
  EXPECT_EQ(tk.format(), Tokenizer::Format::tiktoken);
  const std::string sample = "And God said<|im_end|> the earth 42 你好 unseen-words ü";
  for (const Tokenizer* tok : {&hf, &tk}) {
    const auto ids = tok->encode(sample);
    EXPECT_EQ(tok->decode(ids), sample);
    // A sentence of the training text is a handful of tokens (each word of it was seen 50 times).
    EXPECT_LE(tok->encode(" In the beginning God created the heaven").size(), 8u);
    EXPECT_EQ(tok->token_to_id("<|im_end|>"), 257);
    EXPECT_TRUE(tok->is_special(256));
    EXPECT_EQ(tok->id_count(), static_cast<int32_t>(t.id_bytes.size()));  // the small corpus ran out of pairs
  }
}

}  // namespace
}  // namespace kestrel::text
