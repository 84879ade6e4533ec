#include "grammar/vocabulary.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "core/error.h"
#include "text/tokenizer.h"

namespace kestrel::grammar {

Vocabulary::Vocabulary(std::vector<Kind> kinds, std::vector<std::string> bytes, const std::vector<int32_t>& stop_tokens)
    : kinds_(std::move(kinds)), bytes_(std::move(bytes)) {
  KESTREL_CHECK(kinds_.size() == bytes_.size(), "vocabulary kinds and bytes differ in size");
  for (int32_t t : stop_tokens) {
    KESTREL_CHECK(t >= 0 && t < size(), "stop token {} is outside the vocabulary of {} ids", t, size());
    kinds_[static_cast<size_t>(t)] = Kind::stop;
  }
  for (int32_t id = 0; id < size(); ++id)
    if (kinds_[static_cast<size_t>(id)] == Kind::stop) stop_tokens_.push_back(id);
  // Ordinary tokens without bytes can never be produced by a grammar.
  for (int32_t id = 0; id < size(); ++id)
    if (kinds_[static_cast<size_t>(id)] == Kind::bytes && bytes_[static_cast<size_t>(id)].empty())
      kinds_[static_cast<size_t>(id)] = Kind::none;
  std::map<std::string, int32_t> specials;
  for (int32_t id = 0; id < size(); ++id)
    if (kinds_[static_cast<size_t>(id)] == Kind::special) specials.emplace(bytes_[static_cast<size_t>(id)], 0);
  for (auto& [text, sym] : specials) {
    sym = 256 + static_cast<int32_t>(special_texts_.size());
    special_texts_.push_back(text);
  }
  special_symbol_.assign(static_cast<size_t>(size()), -1);
  for (int32_t id = 0; id < size(); ++id)
    if (kinds_[static_cast<size_t>(id)] == Kind::special)
      special_symbol_[static_cast<size_t>(id)] = specials.at(bytes_[static_cast<size_t>(id)]);
  grammar_tokens_.assign((static_cast<size_t>(size()) + 31) / 32, 0);
  for (int32_t id = 0; id < size(); ++id)
    if (kinds_[static_cast<size_t>(id)] == Kind::bytes || kinds_[static_cast<size_t>(id)] == Kind::special)
      grammar_tokens_[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
  build_trie();
}

std::shared_ptr<const Vocabulary> Vocabulary::from_tokenizer(const text::Tokenizer& tok, int32_t vocab_size,
                                                             const std::vector<int32_t>& stop_tokens) {
  KESTREL_CHECK(vocab_size > 0, "a vocabulary needs at least one id");
  std::vector<Kind> kinds(static_cast<size_t>(vocab_size), Kind::none);
  std::vector<std::string> bytes(static_cast<size_t>(vocab_size));
  for (int32_t id = 0; id < vocab_size; ++id) {
    if (!tok.is_known(id)) continue;
    kinds[static_cast<size_t>(id)] = tok.is_special(id) ? Kind::special : Kind::bytes;
    bytes[static_cast<size_t>(id)] = tok.token_bytes(id);
  }
  return std::make_shared<const Vocabulary>(std::move(kinds), std::move(bytes), stop_tokens);
}

int32_t Vocabulary::special_id(const std::string& text) const {
  for (int32_t id = 0; id < size(); ++id)
    if (kinds_[static_cast<size_t>(id)] == Kind::special && bytes_[static_cast<size_t>(id)] == text) return id;
  return -1;
}

int32_t Vocabulary::bytes_id(const std::string& text) const {
  for (int32_t id = 0; id < size(); ++id)
    if (kinds_[static_cast<size_t>(id)] == Kind::bytes && bytes_[static_cast<size_t>(id)] == text) return id;
  return -1;
}

void Vocabulary::build_trie() {
  // Ordinary tokens sorted by bytes (unsigned), then special tokens by symbol: a symbol sequence per token.
  std::vector<int32_t> ordinary;
  for (int32_t id = 0; id < size(); ++id)
    if (kinds_[static_cast<size_t>(id)] == Kind::bytes) ordinary.push_back(id);
  std::sort(ordinary.begin(), ordinary.end(), [&](int32_t a, int32_t b) {
    const std::string &x = bytes_[static_cast<size_t>(a)], &y = bytes_[static_cast<size_t>(b)];
    return x != y ? x < y : a < b;
  });
  trie_.clear();
  node_tokens_.clear();
  trie_.push_back({});
  std::vector<int32_t> path = {0};  // node at each depth of the current token
  std::string prev;
  auto close_to = [&](size_t depth) {
    while (path.size() > depth + 1) {
      trie_[static_cast<size_t>(path.back())].subtree_end = static_cast<int32_t>(trie_.size());
      path.pop_back();
    }
  };
  // Tokens end at nodes in the order they are appended, so each node's ids are contiguous.
  auto add_token_at = [&](int32_t node, int32_t id) {
    Node& n = trie_[static_cast<size_t>(node)];
    if (n.tokens_end == 0) n.tokens_begin = n.tokens_end = static_cast<int32_t>(node_tokens_.size());
    node_tokens_.push_back(id);
    n.tokens_end = static_cast<int32_t>(node_tokens_.size());
  };
  for (int32_t id : ordinary) {
    const std::string& s = bytes_[static_cast<size_t>(id)];
    size_t common = 0;
    while (common < s.size() && common < prev.size() && s[common] == prev[common] && common + 1 < path.size()) ++common;
    close_to(common);
    for (size_t d = common; d < s.size(); ++d) {
      Node n;
      n.symbol = static_cast<unsigned char>(s[d]);
      n.depth = static_cast<int32_t>(d + 1);
      trie_.push_back(n);
      path.push_back(static_cast<int32_t>(trie_.size() - 1));
    }
    add_token_at(path.back(), id);
    max_len_ = std::max(max_len_, static_cast<int32_t>(s.size()));
    prev = s;
  }
  close_to(0);
  for (size_t i = 0; i < special_texts_.size(); ++i) {
    Node n;
    n.symbol = 256 + static_cast<int32_t>(i);
    n.depth = 1;
    trie_.push_back(n);
    const int32_t node = static_cast<int32_t>(trie_.size() - 1);
    for (int32_t id = 0; id < size(); ++id)
      if (special_symbol_[static_cast<size_t>(id)] == n.symbol) add_token_at(node, id);
    trie_[static_cast<size_t>(node)].subtree_end = node + 1;
    max_len_ = std::max(max_len_, 1);
  }
  trie_[0].subtree_end = static_cast<int32_t>(trie_.size());
}

}  // namespace kestrel::grammar
