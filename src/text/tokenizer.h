// Tokenizers of the two forms real checkpoints ship:
//  - Hugging Face tokenizer.json byte-level BPE (DeepSeek-V3.2 style): added/special tokens, normalizer,
//    pre-tokenizer sequence (Split with an Oniguruma regex, ByteLevel, Digits), BPE with merges, post-processor,
//    ByteLevel decoder. Encodes to the same ids as the Python `tokenizers` library.
//  - tiktoken (Kimi style): a `tiktoken.model` rank file (base64 token, rank), special tokens from
//    tokenizer_config.json `added_tokens_decoder`, and the split pattern (`pat_str` in tokenizer_config.json, else
//    the Kimi pattern). Encodes to the same ids as the Python `tiktoken` library.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::text {

struct EncodeOptions {
  // Recognise special tokens written in the text (tokenizers: encode_special_tokens=False; tiktoken:
  // allowed_special="all"). Non-special added tokens of a tokenizer.json are always recognised, as there.
  bool parse_special = true;
  // Apply the tokenizer.json post-processor (e.g. prepend BOS); tiktoken files have none.
  bool add_special_tokens = false;
};

class Tokenizer {
 public:
  enum class Format { hf_json, tiktoken };

  // Loads MODEL_DIR/tokenizer.json when present, else MODEL_DIR/tiktoken.model with tokenizer_config.json.
  static Tokenizer load(const std::string& model_dir);
  static Tokenizer from_hf_json(std::string_view tokenizer_json);
  // `config_json` is the text of tokenizer_config.json (special tokens, optional `pat_str`).
  static Tokenizer from_tiktoken(std::string_view rank_file, std::string_view config_json);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  Format format() const;

  // Throws kestrel::Error when `text` is not valid UTF-8.
  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& opts = {}) const;

  // Raw bytes of the tokens joined, with invalid UTF-8 replaced by U+FFFD as the reference libraries do.
  // Throws for an id outside the vocabulary.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  // The bytes one token stands for (may be part of a UTF-8 sequence). Throws for an unknown id.
  const std::string& token_bytes(int32_t id) const;
  bool is_special(int32_t id) const;
  bool is_known(int32_t id) const;
  // Id of an added/special token or of a vocabulary entry, by its text as written in the file.
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // One past the largest id.
  int32_t id_count() const;
  // The most bytes of text one token stands for: a text of B bytes encodes to at least B / max_token_bytes() tokens
  // (before normalizers), which bounds a prompt's length before it is tokenised.
  size_t max_token_bytes() const;

 private:
  static Tokenizer from_hf_json_unchecked(std::string_view tokenizer_json);
  static Tokenizer from_tiktoken_unchecked(std::string_view rank_file, std::string_view config_json);
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// GPT-2's reversible byte <-> printable code point mapping that byte-level BPE vocabularies are written in.
char32_t byte_to_unicode(unsigned char b);
// The byte a code point of that mapping stands for, or -1.
int unicode_to_byte(char32_t cp);

}  // namespace kestrel::text
