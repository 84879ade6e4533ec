// Byte-level BPE training, and the tokenizer files make-model writes from it.
//
// Id layout of a trained vocabulary: ids 0..255 are the single bytes (id = byte value), the special tokens
// follow from 256 in the order given, then one id per merge in merge order. The same vocabulary is written as a
// Hugging Face tokenizer.json (merges in rank order) and as a tiktoken rank file (rank = id), with the split
// pattern in both (a Split pre-tokenizer; `pat_str` in tokenizer_config.json), so both loaders are exercised.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::text {

struct TrainedBpe {
  int32_t first_merge_id = 0;
  std::vector<std::string> special_tokens;             // ids 256..
  std::vector<std::pair<int32_t, int32_t>> merges;     // merge k makes id first_merge_id + k
  std::vector<std::string> id_bytes;                   // bytes of every id (specials: their text)
};

// Learns merges on `text`, pre-tokenized by `pattern`, until the vocabulary holds `vocab_size` ids or no pair
// occurs at least twice. Deterministic: ties in pair frequency go to the pair whose merged bytes sort first.
// Merges whose result spells a special token are skipped (the two would share one vocabulary string).
TrainedBpe train_bpe(std::string_view text, const std::string& pattern, int64_t vocab_size,
                     const std::vector<std::string>& special_tokens);

// The split pattern trained tokenizers use (Kimi's: Han runs, case-aware words with contractions, 1-3 digit
// numbers, punctuation runs, newlines, whitespace; it needs `&&` class intersection and look-ahead).
const std::string& kimi_split_pattern();

struct TokenizerFilesSpec {
  int64_t vocab_size = 4096;
  std::vector<std::string> special_tokens;  // ids 256.. in this order
  std::string bos_token, eos_token, pad_token;
  std::string chat_template;
  int64_t model_max_length = 0;
};

// Writes tokenizer.json, tiktoken.model and tokenizer_config.json for `bpe` into `dir`.
void write_tokenizer_files(const std::string& dir, const TrainedBpe& bpe, const TokenizerFilesSpec& spec);

// Public-domain English text for training: the King James Bible as printed by the `bible` program of the
// Debian package bible-kjv (text from bible-kjv-text), or the file KESTREL_KJV_TEXT names (that program's output,
// for machines without the package). Throws kestrel::Error naming the package if missing.
std::string kjv_corpus();

// make-model's tokenizer: trains on kjv_corpus() and writes the files with spec.vocab_size ids (which must leave room
// for the 256 bytes and the special tokens). When the corpus runs out of pairs that occur twice (near 18000 ids for
// the KJV text), the rest are reserved entries "<|reserved_token_N|>" that no text encodes to.
void write_trained_tokenizer(const std::string& dir, const TokenizerFilesSpec& spec);

}  // namespace kestrel::text
