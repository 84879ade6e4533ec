#include "grammar/compiled_grammar.h"

#include <algorithm>
#include <bit>

#include "core/error.h"

namespace kestrel::grammar {

NodeId NodeArena::intern(StateId state, NodeId parent) {
  if ((nodes_.size() + 1) * 2 > slots_.size()) grow();
  const size_t mask = slots_.size() - 1;
  size_t h = (static_cast<uint64_t>(static_cast<uint32_t>(state)) * 0x9E3779B97F4A7C15ull ^
              static_cast<uint64_t>(static_cast<uint32_t>(parent)) * 0xC2B2AE3D27D4EB4Full) >> 17;
  for (;; ++h) {
    NodeId& slot = slots_[h & mask];
    if (slot < 0) {
      slot = static_cast<NodeId>(nodes_.size());
      nodes_.push_back({state, parent});
      return slot;
    }
    const Node& n = nodes_[static_cast<size_t>(slot)];
    if (n.state == state && n.parent == parent) return slot;
  }
}

void NodeArena::grow() {
  std::vector<NodeId> old = std::move(slots_);
  slots_.assign(std::max<size_t>(64, old.size() * 2), -1);
  const size_t mask = slots_.size() - 1;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    size_t h = (static_cast<uint64_t>(static_cast<uint32_t>(n.state)) * 0x9E3779B97F4A7C15ull ^
                static_cast<uint64_t>(static_cast<uint32_t>(n.parent)) * 0xC2B2AE3D27D4EB4Full) >> 17;
    while (slots_[h & mask] >= 0) ++h;
    slots_[h & mask] = static_cast<NodeId>(i);
  }
}

void NodeArena::clear() {
  nodes_.clear();
  slots_.clear();
}

bool frames_can_return(const Automaton& a, const LocalStack& s) {
  for (StateId f : s.frames)
    if (!a.may_return(f)) return false;
  return true;
}

void advance(const Automaton& a, const NodeArena* arena, std::span<const LocalStack> in, int32_t symbol,
             std::vector<LocalStack>& out) {
  out.clear();
  std::vector<LocalStack> todo(in.begin(), in.end()), seen;
  while (!todo.empty()) {
    LocalStack s = std::move(todo.back());
    todo.pop_back();
    if (std::find(seen.begin(), seen.end(), s) != seen.end()) continue;
    seen.push_back(s);
    const StateId top = s.frames.back();
    if (const StateId t = a.step(top, symbol); t != kNoState) {
      LocalStack n = s;
      n.frames.back() = t;
      out.push_back(std::move(n));
    }
    for (const Automaton::Call& c : a.calls(top)) {
      LocalStack n = s;
      n.frames.back() = c.ret;
      n.frames.push_back(c.callee_start);
      todo.push_back(std::move(n));
    }
    if (a.accepting(top)) {
      if (s.frames.size() > 1) {
        LocalStack n = s;
        n.frames.pop_back();
        todo.push_back(std::move(n));
      } else if (s.below != kNoNode) {
        const NodeArena::Node& b = arena->node(s.below);
        todo.push_back(LocalStack{{b.state}, b.parent});
      }
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
}

CompiledGrammar::CompiledGrammar(const Grammar& g, std::shared_ptr<const Vocabulary> vocab, const CompileLimits& limits)
    : automaton_(Automaton::build(g, vocab->special_texts(), limits.automaton)), vocab_(std::move(vocab)), limits_(limits) {
  group_states();
  const size_t n = static_cast<size_t>(num_classes_);
  cache_ = std::make_unique<std::atomic<const StateTokens*>[]>(n);
  for (size_t i = 0; i < n; ++i) cache_[i].store(nullptr);
  owned_.resize(n);
}

void CompiledGrammar::group_states() {
  // Moore's refinement, bounded: after r rounds two states share a class when no string of r steps (symbol classes,
  // calls with their callee, acceptance and may_return) tells them apart. A token is at most max_token_symbols
  // symbols; calls that read nothing add at most one step per rule, so that many rounds make a class's states
  // read every token alike. Fewer rounds suffice when the partition stops changing.
  const Automaton& a = automaton_;
  const int32_t N = a.num_states(), K = a.num_classes();
  class_of_.assign(static_cast<size_t>(N), 0);
  for (StateId s = 0; s < N; ++s) class_of_[static_cast<size_t>(s)] = (a.accepting(s) ? 1 : 0) | (a.may_return(s) ? 2 : 0);
  // One symbol per class: its first symbol.
  std::vector<int32_t> class_symbol(static_cast<size_t>(K), -1);
  for (int32_t sym = a.num_symbols() - 1; sym >= 0; --sym) class_symbol[static_cast<size_t>(a.symbol_class(sym))] = sym;
  const int rounds = vocab_->max_token_symbols() + a.num_rules() + 2;
  int32_t count = -1;
  std::vector<int32_t> sig;
  for (int r = 0; r < rounds; ++r) {
    std::unordered_map<std::string, int32_t> ids;
    std::vector<int32_t> next(static_cast<size_t>(N));
    for (StateId s = 0; s < N; ++s) {
      sig.assign({class_of_[static_cast<size_t>(s)]});
      for (int32_t c = 0; c < K; ++c) {
        const StateId t = a.step(s, class_symbol[static_cast<size_t>(c)]);
        sig.push_back(t == kNoState ? -1 : class_of_[static_cast<size_t>(t)]);
      }
      for (const Automaton::Call& call : a.calls(s)) {
        sig.push_back(call.callee_start);
        sig.push_back(class_of_[static_cast<size_t>(call.ret)]);
      }
      const std::string key(reinterpret_cast<const char*>(sig.data()), sig.size() * sizeof(int32_t));
      next[static_cast<size_t>(s)] = ids.emplace(key, static_cast<int32_t>(ids.size())).first->second;
    }
    class_of_ = std::move(next);
    const int32_t n = static_cast<int32_t>(ids.size());
    if (n == count) break;
    count = n;
  }
  num_classes_ = 0;
  for (int32_t c : class_of_) num_classes_ = std::max(num_classes_, c + 1);
}

const StateTokens& CompiledGrammar::tokens(StateId s) const {
  const size_t c = static_cast<size_t>(class_of_[static_cast<size_t>(s)]);
  if (const StateTokens* t = cache_[c].load(std::memory_order_acquire)) return *t;
  StateTokens computed = compute(s);
  std::lock_guard lock(mu_);
  if (const StateTokens* t = cache_[c].load(std::memory_order_acquire)) return *t;
  cache_bytes_ += computed.bytes();
  owned_[c] = std::make_unique<StateTokens>(std::move(computed));
  cache_[c].store(owned_[c].get(), std::memory_order_release);
  return *owned_[c];
}

const CompiledGrammar::CallerTokens& CompiledGrammar::caller_tokens(StateId s, StateId p) const {
  const uint64_t key = static_cast<uint64_t>(class_of_[static_cast<size_t>(s)]) << 32 |
                       static_cast<uint32_t>(class_of_[static_cast<size_t>(p)]);
  {
    std::lock_guard lock(mu_);
    if (const auto it = callers_.find(key); it != callers_.end()) return *it->second;
  }
  auto computed = std::make_unique<CallerTokens>(compute_caller(s, p));
  std::lock_guard lock(mu_);
  const auto [it, fresh] = callers_.emplace(key, std::move(computed));
  if (fresh) cache_bytes_ += static_cast<int64_t>(it->second->accepted.size() * 4 + it->second->uncertain.size() * 8);
  return *it->second;
}

CompiledGrammar::CallerTokens CompiledGrammar::compute_caller(StateId s, StateId p) const {
  const Automaton& a = automaton_;
  const Vocabulary& v = *vocab_;
  CallerTokens out;
  std::vector<LocalStack> cur, next;
  const auto& uncertain = tokens(s).uncertain;
  for (size_t i = 0; i < uncertain.size(); ++i) {
    const int32_t token = uncertain[i].token;
    if (!out.accepted.empty() && out.accepted.back() == token) continue;  // another offset already accepted it
    const std::string& b = v.bytes(token);
    cur.assign({LocalStack{{p}, kNoNode}});
    std::vector<int32_t> escapes;
    bool alive = true;
    for (size_t j = static_cast<size_t>(uncertain[i].offset); j <= b.size(); ++j) {
      bool escape = false;
      for (const LocalStack& st : cur) escape = escape || frames_can_return(a, st);
      if (escape && j < b.size()) escapes.push_back(static_cast<int32_t>(j));
      if (j == b.size()) break;
      advance(a, nullptr, cur, static_cast<unsigned char>(b[j]), next);
      std::swap(cur, next);
      if (cur.empty()) {
        alive = false;
        break;
      }
    }
    if (alive) {
      out.accepted.push_back(token);
      while (!out.uncertain.empty() && out.uncertain.back().token == token) out.uncertain.pop_back();
    } else {
      for (int32_t k : escapes) out.uncertain.push_back({token, k});
    }
  }
  return out;
}

void CompiledGrammar::precompute() const {
  for (StateId s = 0; s < automaton_.num_states(); ++s) {
    tokens(s);
    KESTREL_CHECK(cache_bytes_.load() <= limits_.max_mask_bytes,
                  "the grammar's token masks need more than {} MiB (CompileLimits::max_mask_bytes) over {} automaton "
                  "states; simplify it",
                  limits_.max_mask_bytes >> 20, automaton_.num_states());
  }
}

int64_t CompiledGrammar::cached_states() const {
  int64_t n = 0;
  for (int32_t c = 0; c < num_classes_; ++c) n += cache_[static_cast<size_t>(c)].load() != nullptr;
  return n;
}

namespace {

// The stacks after each prefix of the trie path being walked. Most levels are one stack of one frame with no calls
// at its state; those stay a plain state and step by a table lookup.
struct Level {
  StateId single = kNoState;     // the one stack's one frame, when `stacks` is unused
  std::vector<LocalStack> stacks;
  bool alive() const { return single != kNoState || !stacks.empty(); }
};

}  // namespace

StateTokens CompiledGrammar::compute(StateId s) const {
  const Automaton& a = automaton_;
  const Vocabulary& v = *vocab_;
  const auto& trie = v.trie();
  const auto& node_tokens = v.node_tokens();
  std::vector<uint32_t> accepted(static_cast<size_t>(mask_words()), 0);
  int64_t num_accepted = 0;
  StateTokens out;
  std::vector<Level> levels(static_cast<size_t>(v.max_token_symbols()) + 1);
  levels[0].single = s;
  std::vector<int32_t> escapes;  // depths >= 1 on the current path where the bottom frame may return
  std::vector<LocalStack> scratch;
  auto can_return = [&](const Level& l) {
    if (l.single != kNoState) return a.may_return(l.single);
    for (const LocalStack& st : l.stacks)
      if (frames_can_return(a, st)) return true;
    return false;
  };
  int32_t i = 1;
  const int32_t n = static_cast<int32_t>(trie.size());
  while (i < n) {
    const Vocabulary::Node& node = trie[static_cast<size_t>(i)];
    const int32_t d = node.depth;
    while (!escapes.empty() && escapes.back() >= d) escapes.pop_back();
    const Level& parent = levels[static_cast<size_t>(d - 1)];
    Level& here = levels[static_cast<size_t>(d)];
    here.single = kNoState;
    here.stacks.clear();
    if (parent.single != kNoState && a.calls(parent.single).empty()) {
      here.single = a.step(parent.single, node.symbol);
    } else {
      std::vector<LocalStack> from;
      if (parent.single != kNoState) from.push_back(LocalStack{{parent.single}, kNoNode});
      advance(a, nullptr, parent.single != kNoState ? std::span<const LocalStack>(from) : parent.stacks, node.symbol,
              scratch);
      if (scratch.size() == 1 && scratch[0].frames.size() == 1) here.single = scratch[0].frames[0];
      else here.stacks = scratch;
    }
    if (!here.alive()) {
      if (!escapes.empty())
        for (int32_t j = i; j < node.subtree_end; ++j) {
          const Vocabulary::Node& m = trie[static_cast<size_t>(j)];
          for (int32_t t = m.tokens_begin; t < m.tokens_end; ++t)
            for (int32_t k : escapes) out.uncertain.push_back({node_tokens[static_cast<size_t>(t)], k});
        }
      i = node.subtree_end;
      continue;
    }
    for (int32_t t = node.tokens_begin; t < node.tokens_end; ++t) {
      const int32_t id = node_tokens[static_cast<size_t>(t)];
      accepted[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
      ++num_accepted;
    }
    if (can_return(here)) escapes.push_back(d);
    ++i;
  }
  std::sort(out.uncertain.begin(), out.uncertain.end(),
            [](const StateTokens::Uncertain& x, const StateTokens::Uncertain& y) {
              return x.token != y.token ? x.token < y.token : x.offset < y.offset;
            });
  // Storage: accepted ids, or the ordinary/special ids not accepted, or the bitmask, whichever is smallest.
  int64_t candidates = 0;
  for (int32_t id = 0; id < v.size(); ++id)
    candidates += v.kind(id) == Vocabulary::Kind::bytes || v.kind(id) == Vocabulary::Kind::special;
  const int64_t words = mask_words();
  if (num_accepted <= words && num_accepted <= candidates - num_accepted) {
    out.form = StateTokens::Form::ids;
    for (int64_t w = 0; w < words; ++w)
      for (uint32_t bits = accepted[static_cast<size_t>(w)]; bits; bits &= bits - 1)
        out.ids.push_back(static_cast<int32_t>(w * 32 + std::countr_zero(bits)));
  } else if (candidates - num_accepted <= words) {
    out.form = StateTokens::Form::all_but;
    for (int32_t id = 0; id < v.size(); ++id) {
      const bool candidate = v.kind(id) == Vocabulary::Kind::bytes || v.kind(id) == Vocabulary::Kind::special;
      if (candidate && !(accepted[static_cast<size_t>(id) >> 5] >> (id & 31) & 1)) out.ids.push_back(id);
    }
  } else {
    out.form = StateTokens::Form::bitmask;
    out.bits = std::move(accepted);
  }
  return out;
}

}  // namespace kestrel::grammar
