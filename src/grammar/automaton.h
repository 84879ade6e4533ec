// A grammar compiled into a pushdown automaton: one minimal DFA per rule that must stay a rule (the root and the
// recursive rules), every other rule inlined into its callers. A DFA's edges read symbols (bytes 0..255, then the
// vocabulary's special tokens 256..) or call a rule; a configuration is a stack of DFA states, the top one current.
// Reading a symbol from a state: its symbol edge, or a call (push the callee's start, the caller moves to the return
// state), or, in an accepting state, a return to the caller. Every state can reach an accepting one and every rule
// derives some string, so every configuration the automaton reaches can still be completed.
//
// Compilation is bounded: a grammar whose automaton would exceed the limits is refused with an Error naming the
// limit, as are left-recursive rules (a rule that can call itself before reading a symbol) and grammars that match
// no string.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "grammar/grammar.h"

namespace kestrel::grammar {

struct AutomatonLimits {
  int64_t max_nfa_states = 2'000'000;  // of the inlined rules before determinisation, all rules together
  int64_t max_dfa_states = 200'000;    // all rules together
  int64_t max_table_bytes = int64_t{256} << 20;
};

using StateId = int32_t;
constexpr StateId kNoState = -1;

class Automaton {
 public:
  struct Call {
    StateId callee_start;  // the start state of the called rule's DFA
    StateId ret;           // where the caller continues when the callee returns
  };

  // `special_tokens`: the vocabulary's special tokens, symbol 256 + i being special_tokens[i].
  static Automaton build(const Grammar& g, const std::vector<std::string>& special_tokens,
                         const AutomatonLimits& limits = {});

  int32_t num_symbols() const { return num_symbols_; }
  int32_t num_states() const { return static_cast<int32_t>(accepting_.size()); }
  StateId start() const { return start_; }
  // The state reading `symbol` from `s` leads to, or kNoState.
  StateId step(StateId s, int32_t symbol) const {
    return table_[static_cast<size_t>(s) * num_classes_ + symbol_class_[static_cast<size_t>(symbol)]];
  }
  bool accepting(StateId s) const { return accepting_[static_cast<size_t>(s)] != 0; }
  // Whether a frame in state s may return without reading anything: s is accepting, or calls of rules that match ""
  // lead to an accepting state.
  bool may_return(StateId s) const { return may_return_[static_cast<size_t>(s)] != 0; }
  std::span<const Call> calls(StateId s) const {
    return {calls_.data() + call_begin_[static_cast<size_t>(s)],
            calls_.data() + call_begin_[static_cast<size_t>(s) + 1]};
  }
  // Which kept rule (index among the automaton's rules) a state belongs to, and that rule's name.
  int32_t rule_of(StateId s) const { return rule_of_[static_cast<size_t>(s)]; }
  const std::string& rule_name(int32_t r) const { return rule_names_[static_cast<size_t>(r)]; }
  int32_t num_rules() const { return static_cast<int32_t>(rule_names_.size()); }
  int32_t num_classes() const { return num_classes_; }
  int32_t symbol_class(int32_t symbol) const { return symbol_class_[static_cast<size_t>(symbol)]; }
  // Bytes the automaton's tables take.
  int64_t memory_bytes() const;

 private:
  int32_t num_symbols_ = 0, num_classes_ = 0;
  std::vector<int32_t> symbol_class_;  // symbol -> class
  std::vector<StateId> table_;         // [state][class]
  std::vector<uint8_t> accepting_, may_return_;
  std::vector<int32_t> call_begin_;    // [state + 1]
  std::vector<Call> calls_;
  std::vector<int32_t> rule_of_;
  std::vector<std::string> rule_names_;
  StateId start_ = kNoState;
};

// The UTF-8 encodings of the code points in [lo, hi] as sequences of byte ranges: every code point's encoding
// matches exactly one sequence (each position's byte within that position's range).
struct ByteRange {
  uint8_t lo = 0, hi = 0;
};
std::vector<std::vector<ByteRange>> utf8_sequences(uint32_t lo, uint32_t hi);

}  // namespace kestrel::grammar
