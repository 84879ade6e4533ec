// A grammar's automaton over one vocabulary, with the token-mask cache that makes a step's mask cheap.
//
// For every automaton state s the cache holds what can be decided about each token from s alone, whatever lies
// below s on the stack:
//  - accepted: the token's symbols can all be read without returning below s's frame;
//  - uncertain: they cannot, but reading some prefix of k >= 1 symbols reaches a point where s's frame may return,
//    and then the caller must read the remaining symbols (checked against the real stack when a mask is made);
//  - rejected: everything else.
// The tokens whose prefix of length 0 needs the caller (s may return at once) are the caller's mask, which the
// matcher adds by walking down the stack. Computing a state's entry walks the vocabulary trie once, skipping every subtree whose
// prefix is dead; entries are computed on first use (or all at once by precompute()) and then shared by every
// matcher of the grammar, from any thread.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "grammar/automaton.h"
#include "grammar/grammar.h"
#include "grammar/vocabulary.h"

namespace kestrel::grammar {

// Per-state token classes; the accepted set stored as whichever of ids, excluded ids or a bitmask is smallest.
struct StateTokens {
  enum class Form : uint8_t { ids, all_but, bitmask } form = Form::ids;
  std::vector<int32_t> ids;      // ids: accepted ids; all_but: ordinary/special ids not accepted
  std::vector<uint32_t> bits;    // bitmask: bit t of word t/32
  struct Uncertain {
    int32_t token;
    int32_t offset;              // symbols read before the frame returns (>= 1)
  };
  std::vector<Uncertain> uncertain;  // sorted by token
  int64_t bytes() const { return static_cast<int64_t>(ids.size() * 4 + bits.size() * 4 + uncertain.size() * 8); }
};

struct CompileLimits {
  AutomatonLimits automaton;
  int64_t max_mask_bytes = int64_t{512} << 20;  // the mask cache of one grammar, once all states are computed
};

class CompiledGrammar {
 public:
  CompiledGrammar(const Grammar& g, std::shared_ptr<const Vocabulary> vocab, const CompileLimits& limits = {});

  const Automaton& automaton() const { return automaton_; }
  const Vocabulary& vocabulary() const { return *vocab_; }
  int32_t vocab_size() const { return vocab_->size(); }
  // Words of a token bitmask: ceil(vocab_size / 32).
  int32_t mask_words() const { return (vocab_size() + 31) / 32; }

  // The cache entry of state s (computed on first use).
  const StateTokens& tokens(StateId s) const;
  // The uncertain tokens of s (tokens(s).uncertain) as decided by a caller in state p: those whose remaining
  // symbols p's frame reads (accepted), and those that need p's caller too (uncertain, offsets from the token's
  // start). Computed on first use of the pair.
  struct CallerTokens {
    std::vector<int32_t> accepted;
    std::vector<StateTokens::Uncertain> uncertain;
  };
  const CallerTokens& caller_tokens(StateId s, StateId p) const;
  // Computes every state's entry now; Error when they would exceed CompileLimits::max_mask_bytes.
  void precompute() const;
  // States whose entries exist (states that read the vocabulary alike share one), and the bytes they take.
  int64_t cached_states() const;
  int64_t cache_bytes() const { return cache_bytes_.load(); }
  // States whose entries are computed (one per class of states that read every token alike).
  int32_t distinct_states() const { return num_classes_; }

 private:
  StateTokens compute(StateId s) const;
  CallerTokens compute_caller(StateId s, StateId p) const;
  // Groups states that cannot be told apart by any symbol string as long as a token (and the calls and returns it
  // may make): they have the same cache entries.
  void group_states();

  Automaton automaton_;
  std::shared_ptr<const Vocabulary> vocab_;
  CompileLimits limits_;
  std::vector<int32_t> class_of_;  // state -> its class; entries are per class
  int32_t num_classes_ = 0;
  mutable std::unique_ptr<std::atomic<const StateTokens*>[]> cache_;  // [class]
  mutable std::vector<std::unique_ptr<StateTokens>> owned_;
  mutable std::unordered_map<uint64_t, std::unique_ptr<CallerTokens>> callers_;  // (class of s, class of p)
  mutable std::mutex mu_;
  mutable std::atomic<int64_t> cache_bytes_{0};
};

// Stacks of automaton states and how one symbol moves them. A stack is `frames` (bottom first, the current state
// last) above `below`, a node of a persistent stack (NodeArena) or kNoNode for "whatever the caller has".
using NodeId = int32_t;
constexpr NodeId kNoNode = -1;

class NodeArena {
 public:
  struct Node {
    StateId state;
    NodeId parent;
  };
  NodeId intern(StateId state, NodeId parent);
  const Node& node(NodeId n) const { return nodes_[static_cast<size_t>(n)]; }
  size_t size() const { return nodes_.size(); }
  void clear();

 private:
  std::vector<Node> nodes_;
  std::vector<NodeId> slots_;  // open addressing on (state, parent); -1 free
  void grow();
};

struct LocalStack {
  std::vector<StateId> frames;
  NodeId below = kNoNode;
  bool operator==(const LocalStack& o) const { return below == o.below && frames == o.frames; }
  bool operator<(const LocalStack& o) const { return below != o.below ? below < o.below : frames < o.frames; }
};

// Reads one symbol from every stack of `in` (returns, calls and symbol edges, as the automaton allows) into `out`,
// sorted and without duplicates. With `below == kNoNode` a stack whose bottom frame would return cannot go on: such
// stacks are what StateTokens::uncertain records.
void advance(const Automaton& a, const NodeArena* arena, std::span<const LocalStack> in, int32_t symbol,
             std::vector<LocalStack>& out);
// Whether a stack's frames may all return without reading anything, not counting what lies below.
bool frames_can_return(const Automaton& a, const LocalStack& s);

}  // namespace kestrel::grammar
