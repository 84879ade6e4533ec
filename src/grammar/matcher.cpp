#include "grammar/matcher.h"

#include <algorithm>

#include "core/error.h"

namespace kestrel::grammar {

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar) : grammar_(std::move(grammar)) {
  reset();
}

void GrammarMatcher::reset() {
  arena_.clear();
  tops_ = {arena_.intern(grammar_->automaton().start(), kNoNode)};
  history_.clear();
  terminated_ = false;
}

bool GrammarMatcher::node_can_terminate(NodeId n) const {
  const Automaton& a = grammar_->automaton();
  for (; n != kNoNode; n = arena_.node(n).parent)
    if (!a.may_return(arena_.node(n).state)) return false;
  return true;
}

bool GrammarMatcher::can_terminate() const {
  if (terminated_) return false;
  for (NodeId t : tops_)
    if (node_can_terminate(t)) return true;
  return false;
}

bool GrammarMatcher::can_continue() const {
  if (terminated_) return false;
  std::vector<uint32_t> words(static_cast<size_t>(grammar_->mask_words()));
  fill_mask(words);
  const std::vector<uint32_t>& allowed = grammar_->vocabulary().grammar_tokens();
  for (size_t w = 0; w < words.size(); ++w)
    if (words[w] & allowed[w]) return true;
  return false;
}

bool GrammarMatcher::accept_symbols(std::span<const int32_t> symbols) {
  const Automaton& a = grammar_->automaton();
  std::vector<LocalStack> cur, next;
  for (NodeId t : tops_) cur.push_back({{arena_.node(t).state}, arena_.node(t).parent});
  for (int32_t sym : symbols) {
    advance(a, &arena_, cur, sym, next);
    if (next.empty()) return false;
    std::swap(cur, next);
  }
  std::vector<NodeId> tops;
  for (const LocalStack& s : cur) {
    NodeId n = s.below;
    for (StateId f : s.frames) n = arena_.intern(f, n);
    tops.push_back(n);
  }
  std::sort(tops.begin(), tops.end());
  tops.erase(std::unique(tops.begin(), tops.end()), tops.end());
  history_.push_back({std::move(tops_), terminated_});
  tops_ = std::move(tops);
  return true;
}

bool GrammarMatcher::accept_token(int32_t token) {
  if (terminated_) return false;
  const Vocabulary& v = grammar_->vocabulary();
  if (token < 0 || token >= v.size()) return false;
  switch (v.kind(token)) {
    case Vocabulary::Kind::none: return false;
    case Vocabulary::Kind::stop:
      if (!can_terminate()) return false;
      history_.push_back({tops_, terminated_});
      terminated_ = true;
      return true;
    case Vocabulary::Kind::special: {
      const int32_t sym = v.special_symbol(token);
      return accept_symbols({&sym, 1});
    }
    case Vocabulary::Kind::bytes: {
      const std::string& b = v.bytes(token);
      std::vector<int32_t> syms(b.begin(), b.end());
      for (int32_t& s : syms) s &= 0xFF;
      return accept_symbols(syms);
    }
  }
  return false;
}

bool GrammarMatcher::accept_bytes(std::string_view bytes) {
  if (terminated_) return false;
  std::vector<int32_t> syms;
  for (unsigned char c : bytes) syms.push_back(c);
  return accept_symbols(syms);
}

void GrammarMatcher::rollback(int n) {
  KESTREL_CHECK(n >= 0 && n <= num_accepted(), "cannot roll back {} tokens of {}", n, num_accepted());
  if (n == 0) return;
  Step& s = history_[history_.size() - static_cast<size_t>(n)];
  tops_ = std::move(s.tops);
  terminated_ = s.terminated;
  history_.resize(history_.size() - static_cast<size_t>(n));
}

bool GrammarMatcher::suffix_allowed(int32_t token, int32_t offset, NodeId below) const {
  if (below == kNoNode) return false;
  const Vocabulary& v = grammar_->vocabulary();
  const Automaton& a = grammar_->automaton();
  std::vector<LocalStack> cur = {{{arena_.node(below).state}, arena_.node(below).parent}}, next;
  if (v.kind(token) == Vocabulary::Kind::special) return false;  // one symbol: no suffix after offset >= 1
  const std::string& b = v.bytes(token);
  for (size_t i = static_cast<size_t>(offset); i < b.size(); ++i) {
    advance(a, &arena_, cur, static_cast<unsigned char>(b[i]), next);
    if (next.empty()) return false;
    std::swap(cur, next);
  }
  return true;
}

void GrammarMatcher::add_allowed(NodeId n, std::span<uint32_t> words, std::vector<NodeId>& done) const {
  for (; n != kNoNode; n = arena_.node(n).parent) {
    if (std::find(done.begin(), done.end(), n) != done.end()) return;
    done.push_back(n);
    const StateId state = arena_.node(n).state;
    const StateTokens& t = grammar_->tokens(state);
    switch (t.form) {
      case StateTokens::Form::ids:
        for (int32_t id : t.ids) words[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
        break;
      case StateTokens::Form::all_but: {
        const std::vector<uint32_t>& all = grammar_->vocabulary().grammar_tokens();
        size_t j = 0;  // t.ids is sorted
        for (size_t w = 0; w < words.size(); ++w) {
          uint32_t m = all[w];
          for (; j < t.ids.size() && static_cast<size_t>(t.ids[j]) >> 5 == w; ++j) m &= ~(1u << (t.ids[j] & 31));
          words[w] |= m;
        }
        break;
      }
      case StateTokens::Form::bitmask:
        for (size_t w = 0; w < words.size(); ++w) words[w] |= t.bits[w];
        break;
    }
    // The uncertain tokens as the caller's state decides them (cached per pair of states); those that need the
    // caller's caller too are checked against the real stack.
    const NodeId below = arena_.node(n).parent;
    if (below != kNoNode && !t.uncertain.empty()) {
      const CompiledGrammar::CallerTokens& c = grammar_->caller_tokens(state, arena_.node(below).state);
      for (int32_t id : c.accepted) words[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
      const NodeId further = arena_.node(below).parent;
      for (const StateTokens::Uncertain& u : c.uncertain) {
        if (words[static_cast<size_t>(u.token) >> 5] >> (u.token & 31) & 1) continue;
        if (suffix_allowed(u.token, u.offset, further)) words[static_cast<size_t>(u.token) >> 5] |= 1u << (u.token & 31);
      }
    }
    if (!grammar_->automaton().may_return(state)) return;
  }
}

void GrammarMatcher::fill_mask(std::span<uint32_t> words) const {
  KESTREL_CHECK(static_cast<int32_t>(words.size()) == grammar_->mask_words(), "a mask of {} words, {} expected",
                words.size(), grammar_->mask_words());
  std::fill(words.begin(), words.end(), 0u);
  if (terminated_) return;
  std::vector<NodeId> done;
  bool end = false;
  for (NodeId t : tops_) {
    add_allowed(t, words, done);
    end = end || node_can_terminate(t);
  }
  if (end)
    for (int32_t id : grammar_->vocabulary().stop_tokens()) words[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
}

}  // namespace kestrel::grammar
