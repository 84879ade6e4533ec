// The model's vocabulary as the grammar engine sees it: every token id is a byte string (an ordinary token, read
// byte by byte), a special token (one symbol of its own: grammars name it explicitly, free text never contains it),
// a stop token (accepted when the grammar is complete) or nothing (ids the tokenizer does not know, padding rows of
// the LM head: never allowed). Ordinary and special tokens are kept in a trie in preorder, so that the tokens of a
// prefix form one contiguous subtree that a mask computation skips at once when the prefix is rejected.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kestrel::text {
class Tokenizer;
}

namespace kestrel::grammar {

class Vocabulary {
 public:
  enum class Kind : uint8_t { none, bytes, special, stop };

  // `kinds` and `bytes` per id (bytes: the token's bytes, or a special token's text). Stop tokens may be of any kind
  // here; they are stop tokens from then on.
  Vocabulary(std::vector<Kind> kinds, std::vector<std::string> bytes, const std::vector<int32_t>& stop_tokens);
  // Ids [0, vocab_size) of the model: the tokenizer's tokens by their bytes, its special tokens as specials, ids it
  // does not know as none.
  static std::shared_ptr<const Vocabulary> from_tokenizer(const text::Tokenizer& tok, int32_t vocab_size,
                                                          const std::vector<int32_t>& stop_tokens);

  int32_t size() const { return static_cast<int32_t>(kinds_.size()); }
  Kind kind(int32_t id) const { return kinds_[static_cast<size_t>(id)]; }
  const std::string& bytes(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }
  const std::vector<int32_t>& stop_tokens() const { return stop_tokens_; }
  // Special tokens in symbol order: symbol 256 + i is special_texts()[i]; its ids (one text may have several).
  const std::vector<std::string>& special_texts() const { return special_texts_; }
  int32_t special_symbol(int32_t id) const { return special_symbol_[static_cast<size_t>(id)]; }
  // The id of the special token with this text, or -1.
  int32_t special_id(const std::string& text) const;
  // The id of an ordinary token with exactly these bytes, or -1.
  int32_t bytes_id(const std::string& text) const;

  // The trie in preorder. Node 0 is the root (no symbol). A node's subtree is [node, subtree_end(node)).
  struct Node {
    int32_t symbol = -1;
    int32_t depth = 0;
    int32_t subtree_end = 0;
    int32_t tokens_begin = 0, tokens_end = 0;  // ids ending here: node_tokens()[tokens_begin, tokens_end)
  };
  const std::vector<Node>& trie() const { return trie_; }
  const std::vector<int32_t>& node_tokens() const { return node_tokens_; }
  int32_t max_token_symbols() const { return max_len_; }
  // Bitmask (bit t of word t/32) of the ordinary and special tokens: every id a grammar can ever allow but stops.
  const std::vector<uint32_t>& grammar_tokens() const { return grammar_tokens_; }

 private:
  void build_trie();

  std::vector<Kind> kinds_;
  std::vector<std::string> bytes_;
  std::vector<int32_t> stop_tokens_;
  std::vector<std::string> special_texts_;
  std::vector<int32_t> special_symbol_;  // per id: 256 + i for specials, else -1
  std::vector<Node> trie_;
  std::vector<int32_t> node_tokens_;
  int32_t max_len_ = 0;
  std::vector<uint32_t> grammar_tokens_;
};

}  // namespace kestrel::grammar
