// The constraint of one request's completions: a compiled grammar that starts where the reasoning section ends.
//
// With a reasoning section (the server's reasoning parser is on), a completion may open it with the open marker
// (<think>) as its first token, or start inside it (the prompt ended with the open marker). Inside, every token is
// allowed except stop tokens and tokens that would complete the close marker (</think>) in the middle of their
// text or across tokens: the section ends only with a token that is exactly the close marker, so the text parser
// and the grammar agree on where the answer starts. From there the grammar constrains every token. Without a
// reasoning section the grammar constrains the completion from its first token.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "grammar/matcher.h"

namespace kestrel::grammar {

// The markers of a reasoning section over one vocabulary, with the tokens that would complete the close marker
// from each partial match (computed once, shared by every request).
class ReasoningMarkers {
 public:
  ReasoningMarkers(std::shared_ptr<const Vocabulary> vocab, std::string open, std::string close);

  const Vocabulary& vocabulary() const { return *vocab_; }
  const std::vector<int32_t>& open_tokens() const { return open_ids_; }
  const std::vector<int32_t>& close_tokens() const { return close_ids_; }
  bool is_close(int32_t id) const;
  // The partial match of the close marker after a token's text, from partial match `state` (0..len-1); len when the
  // text completes the marker.
  int32_t scan(int32_t state, int32_t token) const;
  // Tokens (other than the close tokens) whose text completes the close marker from partial match `state`.
  const std::vector<int32_t>& completing(int32_t state) const { return completing_[static_cast<size_t>(state)]; }
  int32_t length() const { return static_cast<int32_t>(close_.size()); }

 private:
  std::shared_ptr<const Vocabulary> vocab_;
  std::string open_, close_;
  std::vector<int32_t> open_ids_, close_ids_;
  std::vector<int32_t> failure_;                 // KMP failure function of close_
  std::vector<std::vector<int32_t>> completing_;  // [state]
};

struct OutputConstraint {
  std::shared_ptr<const CompiledGrammar> grammar;
  std::shared_ptr<const ReasoningMarkers> reasoning;  // null: the grammar starts at the first token
  bool starts_in_reasoning = false;                   // the prompt opened the reasoning section
};

class OutputMatcher {
 public:
  explicit OutputMatcher(std::shared_ptr<const OutputConstraint> c);

  // The tokens allowed next (bit t of words[t / 32]); words has the grammar's mask_words() entries.
  void fill_mask(std::span<uint32_t> words) const;
  // Accepts an allowed token; false (nothing changes) for any other.
  bool accept_token(int32_t token);
  void rollback(int n);
  int num_accepted() const { return static_cast<int>(history_.size()); }
  // A stop token ended the grammar.
  bool terminated() const { return phase_ == Phase::grammar && grammar_.terminated(); }
  bool in_reasoning() const { return phase_ == Phase::reasoning; }
  int32_t mask_words() const { return constraint_->grammar->mask_words(); }

 private:
  enum class Phase : uint8_t { start, reasoning, grammar };
  struct Step {
    Phase phase;     // before the token
    int32_t partial;
    bool to_grammar;  // the grammar accepted the token
  };

  std::shared_ptr<const OutputConstraint> constraint_;
  GrammarMatcher grammar_;
  Phase phase_;
  int32_t partial_ = 0;  // in reasoning: the close marker's partial match at the end of the text
  std::vector<Step> history_;
};

}  // namespace kestrel::grammar
