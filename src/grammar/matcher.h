// The grammar state of one sequence: the set of automaton stacks its accepted tokens lead to, the mask of the tokens
// that may come next, and the history of states for rolling back rejected speculative tokens.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "grammar/compiled_grammar.h"

namespace kestrel::grammar {

class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar);

  // Accepts a token when the grammar allows it (a stop token: when the grammar is complete, which ends it); returns
  // false and changes nothing otherwise.
  bool accept_token(int32_t token);
  // Accepts bytes as if they were ordinary tokens read one byte at a time (tests, forced text).
  bool accept_bytes(std::string_view bytes);
  // The tokens allowed next: bit t of words[t / 32] for t in [0, vocab_size); `words` has mask_words() entries.
  // After the grammar ended (a stop token accepted) nothing is allowed.
  void fill_mask(std::span<uint32_t> words) const;
  // Whether the text so far is a complete match (a stop token is allowed).
  bool can_terminate() const;
  // Whether a stop token ended the grammar.
  bool terminated() const { return terminated_; }
  // Whether anything but a stop token may follow.
  bool can_continue() const;
  // Undoes the last n accepted tokens (n <= num_accepted()).
  void rollback(int n);
  int num_accepted() const { return static_cast<int>(history_.size()); }
  void reset();

  const CompiledGrammar& grammar() const { return *grammar_; }
  const std::shared_ptr<const CompiledGrammar>& grammar_ptr() const { return grammar_; }

 private:
  bool accept_symbols(std::span<const int32_t> symbols);
  bool node_can_terminate(NodeId n) const;
  // Adds the tokens allowed from stack node n (and, where n's state may return, from the nodes below) to `words`.
  void add_allowed(NodeId n, std::span<uint32_t> words, std::vector<NodeId>& done) const;
  bool suffix_allowed(int32_t token, int32_t offset, NodeId below) const;

  std::shared_ptr<const CompiledGrammar> grammar_;
  NodeArena arena_;
  std::vector<NodeId> tops_;
  struct Step {
    std::vector<NodeId> tops;
    bool terminated;
  };
  std::vector<Step> history_;
  bool terminated_ = false;
};

}  // namespace kestrel::grammar
