#include "grammar/automaton.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <unordered_map>

#include <fmt/format.h>

#include "core/error.h"

namespace kestrel::grammar {

std::vector<std::vector<ByteRange>> utf8_sequences(uint32_t lo, uint32_t hi) {
  std::vector<std::vector<ByteRange>> out;
  // Splits [lo, hi] until each piece has one encoded length and continuation bytes that span whole ranges, so that
  // the byte ranges at each position describe exactly the piece.
  std::function<void(uint32_t, uint32_t)> split = [&](uint32_t a, uint32_t b) {
    for (uint32_t edge : {0x7Fu, 0x7FFu, 0xFFFFu})
      if (a <= edge && b > edge) {
        split(a, edge);
        split(edge + 1, b);
        return;
      }
    const int n = a <= 0x7F ? 1 : a <= 0x7FF ? 2 : a <= 0xFFFF ? 3 : 4;
    for (int i = 1; i < n; ++i) {
      const uint32_t m = (1u << (6 * i)) - 1;
      if ((a & ~m) != (b & ~m)) {
        if ((a & m) != 0) {
          split(a, a | m);
          split((a | m) + 1, b);
          return;
        }
        if ((b & m) != m) {
          split(a, (b & ~m) - 1);
          split(b & ~m, b);
          return;
        }
      }
    }
    auto encode = [n](uint32_t c, uint8_t* e) {
      if (n == 1) {
        e[0] = static_cast<uint8_t>(c);
      } else if (n == 2) {
        e[0] = static_cast<uint8_t>(0xC0 | (c >> 6));
        e[1] = static_cast<uint8_t>(0x80 | (c & 0x3F));
      } else if (n == 3) {
        e[0] = static_cast<uint8_t>(0xE0 | (c >> 12));
        e[1] = static_cast<uint8_t>(0x80 | ((c >> 6) & 0x3F));
        e[2] = static_cast<uint8_t>(0x80 | (c & 0x3F));
      } else {
        e[0] = static_cast<uint8_t>(0xF0 | (c >> 18));
        e[1] = static_cast<uint8_t>(0x80 | ((c >> 12) & 0x3F));
        e[2] = static_cast<uint8_t>(0x80 | ((c >> 6) & 0x3F));
        e[3] = static_cast<uint8_t>(0x80 | (c & 0x3F));
      }
    };
    uint8_t ea[4], eb[4];
    encode(a, ea);
    encode(b, eb);
    std::vector<ByteRange> seq;
    for (int i = 0; i < n; ++i) seq.push_back({ea[i], eb[i]});
    out.push_back(std::move(seq));
  };
  split(lo, hi);
  return out;
}

namespace {

// A rule used in several places is kept as a rule of its own (called, not copied) above this estimated size.
constexpr int64_t kShareSize = 256;

// Edges of the Thompson NFA: symbol-class intervals, epsilon, or a call of a kept rule.
struct NfaEdge {
  enum Kind : int8_t { symbols, epsilon, call } kind;
  int32_t lo = 0, hi = 0;  // class interval (symbols) or the callee (call: lo)
  int32_t target = 0;
};

class NfaBuilder {
 public:
  NfaBuilder(const Grammar& g, const std::vector<int32_t>& kept_index, const std::vector<int32_t>& symbol_class,
             const std::vector<std::string>& specials, int64_t limit)
      : g_(g), kept_(kept_index), cls_(symbol_class), specials_(specials), limit_(limit) {}

  int32_t add_state() {
    if (static_cast<int64_t>(out_.size()) >= limit_)
      fail("the grammar needs more than {} automaton states before determinisation (AutomatonLimits::max_nfa_states); "
           "it is too large or repeats large parts many times",
           limit_);
    out_.emplace_back();
    return static_cast<int32_t>(out_.size() - 1);
  }
  void edge(int32_t from, NfaEdge e) { out_[static_cast<size_t>(from)].push_back(e); }
  void eps(int32_t from, int32_t to) { edge(from, {NfaEdge::epsilon, 0, 0, to}); }
  void symbols(int32_t from, int32_t lo_sym, int32_t hi_sym, int32_t to) {
    edge(from, {NfaEdge::symbols, cls_[static_cast<size_t>(lo_sym)], cls_[static_cast<size_t>(hi_sym)], to});
  }

  // Builds expression e starting at `from`; returns its end state.
  int32_t build(ExprId id, int32_t from, int depth = 0) {
    KESTREL_CHECK(depth < 10000, "the grammar nests expressions deeper than 10000 levels");
    const Expr& e = g_.expr(id);
    switch (e.kind) {
      case Expr::Kind::empty: return from;
      case Expr::Kind::bytes: {
        int32_t cur = from;
        for (unsigned char c : e.text) {
          const int32_t next = add_state();
          symbols(cur, c, c, next);
          cur = next;
        }
        return cur;
      }
      case Expr::Kind::chars: {
        const int32_t end = add_state();
        for (const CodeRange& r : e.ranges)
          for (const auto& seq : utf8_sequences(r.lo, r.hi)) {
            int32_t cur = from;
            for (size_t i = 0; i < seq.size(); ++i) {
              const int32_t next = i + 1 == seq.size() ? end : add_state();
              symbols(cur, seq[i].lo, seq[i].hi, next);
              cur = next;
            }
          }
        return end;
      }
      case Expr::Kind::byte_set: {
        const int32_t end = add_state();
        for (const CodeRange& r : e.ranges) symbols(from, static_cast<int32_t>(r.lo), static_cast<int32_t>(r.hi), end);
        return end;
      }
      case Expr::Kind::special: {
        const int32_t end = add_state();
        for (int32_t sym : special_symbols(e)) symbols(from, sym, sym, end);
        return end;
      }
      case Expr::Kind::seq: {
        int32_t cur = from;
        for (ExprId c : e.children) cur = build(c, cur, depth + 1);
        return cur;
      }
      case Expr::Kind::alt: {
        const int32_t end = add_state();
        for (ExprId c : e.children) {
          const int32_t s = add_state();
          eps(from, s);
          eps(build(c, s, depth + 1), end);
        }
        return end;
      }
      case Expr::Kind::repeat: {
        int32_t cur = from;
        const ExprId child = e.children[0];
        for (int64_t i = 0; i < e.min; ++i) {
          const int32_t s = add_state();
          eps(cur, s);
          cur = build(child, s, depth + 1);
        }
        if (e.max < 0) {
          const int32_t loop = add_state();
          eps(cur, loop);
          const int32_t body = add_state();
          eps(loop, body);
          eps(build(child, body, depth + 1), loop);
          return loop;
        }
        const int32_t end = add_state();
        eps(cur, end);
        for (int64_t i = e.min; i < e.max; ++i) {
          const int32_t s = add_state();
          eps(cur, s);
          cur = build(child, s, depth + 1);
          eps(cur, end);
        }
        return end;
      }
      case Expr::Kind::rule: {
        const int32_t k = kept_[static_cast<size_t>(e.rule)];
        if (k >= 0) {
          const int32_t to = add_state();
          edge(from, {NfaEdge::call, k, k, to});
          return to;
        }
        return build(g_.rule(e.rule).body, from, depth + 1);
      }
    }
    return from;
  }

  std::vector<int32_t> special_symbols(const Expr& e) const {
    std::vector<int32_t> syms;
    for (const std::string& t : e.tokens)
      KESTREL_CHECK(std::find(specials_.begin(), specials_.end(), t) != specials_.end(),
                    "special token '{}' is not in the vocabulary", t);
    for (size_t i = 0; i < specials_.size(); ++i) {
      const bool named = std::binary_search(e.tokens.begin(), e.tokens.end(), specials_[i]);
      if (named != e.negated) syms.push_back(256 + static_cast<int32_t>(i));
    }
    return syms;
  }

  std::vector<std::vector<NfaEdge>> out_;

 private:
  const Grammar& g_;
  const std::vector<int32_t>& kept_;
  const std::vector<int32_t>& cls_;
  const std::vector<std::string>& specials_;
  int64_t limit_;
};

// A DFA of one kept rule before it joins the automaton: transitions on classes and on calls (callee -> target).
struct RuleDfa {
  std::vector<std::vector<int32_t>> next;                      // [state][class], -1: none
  std::vector<std::vector<std::pair<int32_t, int32_t>>> calls;  // [state] (callee, target), sorted by callee
  std::vector<uint8_t> accepting;
  int32_t size() const { return static_cast<int32_t>(accepting.size()); }
};

RuleDfa determinise(const NfaBuilder& nfa, int32_t start, int32_t accept, int32_t num_classes, int64_t& budget,
                    int64_t max_states) {
  RuleDfa d;
  std::map<std::vector<int32_t>, int32_t> ids;
  std::vector<std::vector<int32_t>> sets;
  std::vector<uint8_t> mark(nfa.out_.size(), 0);
  auto closure = [&](std::vector<int32_t> seeds) {
    std::vector<int32_t> stack = seeds, out;
    for (int32_t s : seeds) mark[static_cast<size_t>(s)] = 1;
    out = seeds;
    while (!stack.empty()) {
      const int32_t s = stack.back();
      stack.pop_back();
      for (const NfaEdge& e : nfa.out_[static_cast<size_t>(s)])
        if (e.kind == NfaEdge::epsilon && !mark[static_cast<size_t>(e.target)]) {
          mark[static_cast<size_t>(e.target)] = 1;
          stack.push_back(e.target);
          out.push_back(e.target);
        }
    }
    for (int32_t s : out) mark[static_cast<size_t>(s)] = 0;
    // Only states with a non-epsilon edge or the accept state tell DFA states apart.
    std::vector<int32_t> key;
    for (int32_t s : out) {
      bool useful = s == accept;
      for (const NfaEdge& e : nfa.out_[static_cast<size_t>(s)]) useful = useful || e.kind != NfaEdge::epsilon;
      if (useful) key.push_back(s);
    }
    std::sort(key.begin(), key.end());
    return key;
  };
  auto intern = [&](std::vector<int32_t> key) {
    const auto it = ids.find(key);
    if (it != ids.end()) return it->second;
    if (--budget < 0)
      fail("the grammar's automaton needs more than {} states (AutomatonLimits::max_dfa_states); simplify it (fewer "
           "alternatives that overlap, smaller repetition counts)",
           max_states);
    const int32_t id = static_cast<int32_t>(sets.size());
    ids.emplace(key, id);
    sets.push_back(std::move(key));
    d.next.emplace_back(static_cast<size_t>(num_classes), -1);
    d.calls.emplace_back();
    d.accepting.push_back(0);
    return id;
  };
  intern(closure({start}));
  std::vector<std::vector<int32_t>> bucket(static_cast<size_t>(num_classes));
  std::vector<int32_t> touched;
  for (size_t q = 0; q < sets.size(); ++q) {
    const std::vector<int32_t> set = sets[q];
    std::map<int32_t, std::vector<int32_t>> call_targets;
    for (int32_t s : set) {
      if (s == accept) d.accepting[q] = 1;
      for (const NfaEdge& e : nfa.out_[static_cast<size_t>(s)]) {
        if (e.kind == NfaEdge::symbols) {
          for (int32_t c = e.lo; c <= e.hi; ++c) {
            if (bucket[static_cast<size_t>(c)].empty()) touched.push_back(c);
            bucket[static_cast<size_t>(c)].push_back(e.target);
          }
        } else if (e.kind == NfaEdge::call) {
          call_targets[e.lo].push_back(e.target);
        }
      }
    }
    // Classes with the same target set share one closure.
    std::map<std::vector<int32_t>, int32_t> by_targets;
    for (int32_t c : touched) {
      std::vector<int32_t>& t = bucket[static_cast<size_t>(c)];
      std::sort(t.begin(), t.end());
      t.erase(std::unique(t.begin(), t.end()), t.end());
      auto it = by_targets.find(t);
      if (it == by_targets.end()) it = by_targets.emplace(t, intern(closure(t))).first;
      d.next[q][static_cast<size_t>(c)] = it->second;
      t.clear();
    }
    touched.clear();
    for (auto& [callee, targets] : call_targets) {
      std::sort(targets.begin(), targets.end());
      targets.erase(std::unique(targets.begin(), targets.end()), targets.end());
      const int32_t to = intern(closure(targets));  // before indexing: intern grows d.calls
      d.calls[q].emplace_back(callee, to);
    }
  }
  return d;
}

// Hopcroft's partition refinement over classes and call labels; returns the minimal DFA (start state 0).
RuleDfa minimise(const RuleDfa& d, int32_t num_classes, int32_t num_rules) {
  const int32_t n = d.size() + 1;  // + a sink
  const int32_t sink = n - 1;
  const int32_t A = num_classes + num_rules;
  auto target = [&](int32_t q, int32_t a) -> int32_t {
    if (q == sink) return sink;
    if (a < num_classes) {
      const int32_t t = d.next[static_cast<size_t>(q)][static_cast<size_t>(a)];
      return t < 0 ? sink : t;
    }
    for (const auto& [callee, t] : d.calls[static_cast<size_t>(q)])
      if (callee == a - num_classes) return t;
    return sink;
  };
  // Only labels some state uses can split blocks.
  std::vector<int32_t> labels;
  {
    std::vector<uint8_t> used(static_cast<size_t>(A), 0);
    for (int32_t q = 0; q < d.size(); ++q) {
      for (int32_t c = 0; c < num_classes; ++c)
        if (d.next[static_cast<size_t>(q)][static_cast<size_t>(c)] >= 0) used[static_cast<size_t>(c)] = 1;
      for (const auto& [callee, t] : d.calls[static_cast<size_t>(q)]) used[static_cast<size_t>(num_classes + callee)] = 1;
    }
    for (int32_t a = 0; a < A; ++a)
      if (used[static_cast<size_t>(a)]) labels.push_back(a);
  }
  // Inverse transitions per used label (CSR).
  const size_t L = labels.size();
  std::vector<std::vector<int32_t>> inv_begin(L), inv(L);
  for (size_t li = 0; li < L; ++li) {
    std::vector<int32_t> count(static_cast<size_t>(n) + 1, 0);
    std::vector<int32_t> tgt(static_cast<size_t>(n));
    for (int32_t q = 0; q < n; ++q) ++count[static_cast<size_t>(tgt[static_cast<size_t>(q)] = target(q, labels[li])) + 1];
    for (int32_t i = 0; i < n; ++i) count[static_cast<size_t>(i) + 1] += count[static_cast<size_t>(i)];
    inv_begin[li] = count;
    inv[li].resize(static_cast<size_t>(n));
    for (int32_t q = 0; q < n; ++q) inv[li][static_cast<size_t>(count[static_cast<size_t>(tgt[static_cast<size_t>(q)])]++)] = q;
  }
  // Partition: elements grouped by block.
  std::vector<int32_t> elems(static_cast<size_t>(n)), pos(static_cast<size_t>(n)), block(static_cast<size_t>(n));
  std::vector<int32_t> bstart, bend, bmarked;
  std::vector<uint8_t> in_work;
  {
    int32_t k = 0;
    for (int pass = 0; pass < 2; ++pass) {
      const int32_t b0 = k;
      for (int32_t q = 0; q < n; ++q) {
        const bool acc = q != sink && d.accepting[static_cast<size_t>(q)];
        if (acc == (pass == 0)) {
          elems[static_cast<size_t>(k)] = q;
          pos[static_cast<size_t>(q)] = k;
          block[static_cast<size_t>(q)] = static_cast<int32_t>(bstart.size());
          ++k;
        }
      }
      if (k > b0) {
        bstart.push_back(b0);
        bend.push_back(k);
        bmarked.push_back(b0);
        in_work.push_back(1);
      }
    }
  }
  std::vector<int32_t> work;
  for (size_t b = 0; b < bstart.size(); ++b) work.push_back(static_cast<int32_t>(b));
  std::vector<int32_t> touched, splitter;
  while (!work.empty()) {
    const int32_t A_block = work.back();
    work.pop_back();
    in_work[static_cast<size_t>(A_block)] = 0;
    splitter.assign(elems.begin() + bstart[static_cast<size_t>(A_block)], elems.begin() + bend[static_cast<size_t>(A_block)]);
    for (size_t li = 0; li < L; ++li) {
      for (int32_t t : splitter)
        for (int32_t i = inv_begin[li][static_cast<size_t>(t)]; i < inv_begin[li][static_cast<size_t>(t) + 1]; ++i) {
          const int32_t q = inv[li][static_cast<size_t>(i)];
          const int32_t b = block[static_cast<size_t>(q)];
          const int32_t p = pos[static_cast<size_t>(q)];
          int32_t& m = bmarked[static_cast<size_t>(b)];
          if (p < m) continue;  // marked already
          if (m == bstart[static_cast<size_t>(b)]) touched.push_back(b);
          // Swap q into the marked prefix.
          const int32_t other = elems[static_cast<size_t>(m)];
          std::swap(elems[static_cast<size_t>(m)], elems[static_cast<size_t>(p)]);
          pos[static_cast<size_t>(other)] = p;
          pos[static_cast<size_t>(q)] = m;
          ++m;
        }
      for (int32_t b : touched) {
        const int32_t s = bstart[static_cast<size_t>(b)], e = bend[static_cast<size_t>(b)], m = bmarked[static_cast<size_t>(b)];
        bmarked[static_cast<size_t>(b)] = s;
        if (m == e) continue;  // all of it marked: no split
        const int32_t nb = static_cast<int32_t>(bstart.size());
        bstart.push_back(s);
        bend.push_back(m);
        bmarked.push_back(s);
        in_work.push_back(0);
        bstart[static_cast<size_t>(b)] = m;
        bmarked[static_cast<size_t>(b)] = m;
        for (int32_t i = s; i < m; ++i) block[static_cast<size_t>(elems[static_cast<size_t>(i)])] = nb;
        if (in_work[static_cast<size_t>(b)] || (m - s) <= (e - m)) {
          in_work[static_cast<size_t>(nb)] = 1;
          work.push_back(nb);
        } else {
          in_work[static_cast<size_t>(b)] = 1;
          work.push_back(b);
        }
      }
      touched.clear();
    }
  }
  // Blocks become states, numbered by first visit from the start (the sink's block is dropped).
  const int32_t nblocks = static_cast<int32_t>(bstart.size());
  std::vector<int32_t> number(static_cast<size_t>(nblocks), -1);
  const int32_t sink_block = block[static_cast<size_t>(sink)];
  RuleDfa m;
  std::vector<int32_t> order;
  auto visit = [&](int32_t b) {
    if (b == sink_block) return -1;
    if (number[static_cast<size_t>(b)] < 0) {
      number[static_cast<size_t>(b)] = static_cast<int32_t>(order.size());
      order.push_back(b);
    }
    return number[static_cast<size_t>(b)];
  };
  visit(block[0]);
  for (size_t i = 0; i < order.size(); ++i) {
    const int32_t rep = elems[static_cast<size_t>(bstart[static_cast<size_t>(order[i])])];
    std::vector<int32_t> row(static_cast<size_t>(num_classes), -1);
    for (int32_t c = 0; c < num_classes; ++c) row[static_cast<size_t>(c)] = visit(block[static_cast<size_t>(target(rep, c))]);
    std::vector<std::pair<int32_t, int32_t>> calls;
    for (const auto& [callee, t] : d.calls[static_cast<size_t>(rep)]) {
      const int32_t v = visit(block[static_cast<size_t>(t)]);
      if (v >= 0) calls.emplace_back(callee, v);
    }
    m.next.push_back(std::move(row));
    m.calls.push_back(std::move(calls));
    m.accepting.push_back(d.accepting[static_cast<size_t>(rep)]);
  }
  return m;
}

}  // namespace

int64_t Automaton::memory_bytes() const {
  return static_cast<int64_t>(table_.size() * sizeof(StateId) + calls_.size() * sizeof(Call) +
                              accepting_.size() * (1 + 2 * sizeof(int32_t)) + symbol_class_.size() * sizeof(int32_t));
}

Automaton Automaton::build(const Grammar& g, const std::vector<std::string>& special_tokens,
                           const AutomatonLimits& limits) {
  g.check_complete();
  const int32_t R = static_cast<int32_t>(g.num_rules());
  // Rules each rule refers to.
  std::vector<std::vector<int32_t>> refs(static_cast<size_t>(R));
  for (int32_t r = 0; r < R; ++r) {
    std::vector<ExprId> stack = {g.rule(r).body};
    while (!stack.empty()) {
      const Expr& e = g.expr(stack.back());
      stack.pop_back();
      if (e.kind == Expr::Kind::rule) refs[static_cast<size_t>(r)].push_back(e.rule);
      for (ExprId c : e.children) stack.push_back(c);
    }
  }
  // Rules reachable from the root, and the recursive ones among them (in a cycle of references: Tarjan's SCCs).
  std::vector<int32_t> index(static_cast<size_t>(R), -1), low(static_cast<size_t>(R), 0), comp(static_cast<size_t>(R), -1);
  std::vector<uint8_t> on_stack(static_cast<size_t>(R), 0), recursive(static_cast<size_t>(R), 0);
  std::vector<int32_t> stack;
  int32_t counter = 0, ncomp = 0;
  std::function<void(int32_t)> strong = [&](int32_t v) {
    index[static_cast<size_t>(v)] = low[static_cast<size_t>(v)] = counter++;
    stack.push_back(v);
    on_stack[static_cast<size_t>(v)] = 1;
    for (int32_t w : refs[static_cast<size_t>(v)]) {
      if (w == v) recursive[static_cast<size_t>(v)] = 1;
      if (index[static_cast<size_t>(w)] < 0) {
        strong(w);
        low[static_cast<size_t>(v)] = std::min(low[static_cast<size_t>(v)], low[static_cast<size_t>(w)]);
      } else if (on_stack[static_cast<size_t>(w)]) {
        low[static_cast<size_t>(v)] = std::min(low[static_cast<size_t>(v)], index[static_cast<size_t>(w)]);
      }
    }
    if (low[static_cast<size_t>(v)] == index[static_cast<size_t>(v)]) {
      std::vector<int32_t> members;
      int32_t w;
      do {
        w = stack.back();
        stack.pop_back();
        on_stack[static_cast<size_t>(w)] = 0;
        comp[static_cast<size_t>(w)] = ncomp;
        members.push_back(w);
      } while (w != v);
      if (members.size() > 1)
        for (int32_t m : members) recursive[static_cast<size_t>(m)] = 1;
      ++ncomp;
    }
  };
  KESTREL_CHECK(R < 100000, "the grammar has {} rules; at most 100000 are supported", R);
  strong(g.root());
  std::vector<int32_t> kept_index(static_cast<size_t>(R), -1), kept;
  kept_index[static_cast<size_t>(g.root())] = 0;
  kept.push_back(g.root());
  auto keep = [&](int32_t r) {
    kept_index[static_cast<size_t>(r)] = static_cast<int32_t>(kept.size());
    kept.push_back(r);
  };
  for (int32_t r = 0; r < R; ++r)
    if (index[static_cast<size_t>(r)] >= 0 && recursive[static_cast<size_t>(r)] && r != g.root()) keep(r);
  // Other rules are inlined at each use, except a rule used in several places whose inlined form is large: it stays
  // a rule of its own, so that nested uses do not multiply its copies. Sizes in NFA edges, estimated bottom up.
  {
    std::vector<int64_t> size(static_cast<size_t>(R), -1), uses(static_cast<size_t>(R), 0);
    for (int32_t r = 0; r < R; ++r)
      if (index[static_cast<size_t>(r)] >= 0)
        for (int32_t w : refs[static_cast<size_t>(r)]) ++uses[static_cast<size_t>(w)];
    std::function<int64_t(ExprId)> weight = [&](ExprId id) -> int64_t {
      const Expr& e = g.expr(id);
      int64_t w = 1;
      switch (e.kind) {
        case Expr::Kind::bytes: w = static_cast<int64_t>(e.text.size()); break;
        case Expr::Kind::chars: w = static_cast<int64_t>(e.ranges.size()) * 4; break;
        case Expr::Kind::seq:
        case Expr::Kind::alt:
          w = 1;
          for (ExprId c : e.children) w = std::min<int64_t>(w + weight(c), int64_t{1} << 40);
          break;
        case Expr::Kind::repeat:
          w = std::min<int64_t>(weight(e.children[0]) * (e.max < 0 ? e.min + 1 : e.max) + 1, int64_t{1} << 40);
          break;
        case Expr::Kind::rule: {
          const int32_t t = e.rule;
          if (kept_index[static_cast<size_t>(t)] >= 0) break;
          if (size[static_cast<size_t>(t)] < 0) {
            size[static_cast<size_t>(t)] = 0;  // a placeholder while it is measured (rules here are not recursive)
            const int64_t sz = weight(g.rule(t).body);
            size[static_cast<size_t>(t)] = sz;
            if (uses[static_cast<size_t>(t)] >= 2 && sz > kShareSize) keep(t);
          }
          w = kept_index[static_cast<size_t>(t)] >= 0 ? 1 : size[static_cast<size_t>(t)];
          break;
        }
        default: break;
      }
      return w;
    };
    for (size_t i = 0; i < kept.size(); ++i) weight(g.rule(kept[i]).body);
  }

  // The alphabet's classes: maximal intervals of symbols no expression tells apart.
  const int32_t num_symbols = 256 + static_cast<int32_t>(special_tokens.size());
  std::vector<uint8_t> boundary(static_cast<size_t>(num_symbols) + 1, 0);
  boundary[0] = boundary[static_cast<size_t>(num_symbols)] = 1;
  auto mark = [&](int32_t lo, int32_t hi) {
    boundary[static_cast<size_t>(lo)] = 1;
    boundary[static_cast<size_t>(hi) + 1] = 1;
  };
  for (size_t i = 0; i < g.num_exprs(); ++i) {
    const Expr& e = g.expr(static_cast<ExprId>(i));
    if (e.kind == Expr::Kind::bytes)
      for (unsigned char c : e.text) mark(c, c);
    if (e.kind == Expr::Kind::byte_set)
      for (const CodeRange& r : e.ranges) mark(static_cast<int32_t>(r.lo), static_cast<int32_t>(r.hi));
    if (e.kind == Expr::Kind::chars)
      for (const CodeRange& r : e.ranges)
        for (const auto& seq : utf8_sequences(r.lo, r.hi))
          for (const ByteRange& b : seq) mark(b.lo, b.hi);
    if (e.kind == Expr::Kind::special)
      for (size_t k = 0; k < special_tokens.size(); ++k)
        if (std::binary_search(e.tokens.begin(), e.tokens.end(), special_tokens[k]))
          mark(256 + static_cast<int32_t>(k), 256 + static_cast<int32_t>(k));
  }
  mark(256, num_symbols - 1 < 256 ? 255 : num_symbols - 1);  // bytes and special tokens are never one class
  Automaton a;
  a.num_symbols_ = num_symbols;
  a.symbol_class_.resize(static_cast<size_t>(num_symbols));
  int32_t cls = -1;
  for (int32_t s = 0; s < num_symbols; ++s) {
    if (boundary[static_cast<size_t>(s)]) ++cls;
    a.symbol_class_[static_cast<size_t>(s)] = cls;
  }
  const int32_t K = cls + 1;
  a.num_classes_ = K;

  // One NFA holds every kept rule; each is determinised and minimised on its own.
  NfaBuilder nfa(g, kept_index, a.symbol_class_, special_tokens, limits.max_nfa_states);
  const int32_t KR = static_cast<int32_t>(kept.size());
  std::vector<RuleDfa> dfas;
  int64_t budget = limits.max_dfa_states;
  for (int32_t k = 0; k < KR; ++k) {
    const int32_t s = nfa.add_state();
    const int32_t e = nfa.build(g.rule(kept[static_cast<size_t>(k)]).body, s);
    RuleDfa d = determinise(nfa, s, e, K, budget, limits.max_dfa_states);
    dfas.push_back(minimise(d, K, KR));
  }

  // Productive rules (derive some string): fixpoint over "an accepting state is reachable, calling only productive
  // rules". Then every state that cannot reach acceptance, or is unreachable, goes.
  std::vector<uint8_t> productive(static_cast<size_t>(KR), 0);
  auto coreachable = [&](int32_t k) {
    const RuleDfa& d = dfas[static_cast<size_t>(k)];
    std::vector<uint8_t> ok(d.accepting.begin(), d.accepting.end());
    for (bool changed = true; changed;) {
      changed = false;
      for (int32_t q = 0; q < d.size(); ++q) {
        if (ok[static_cast<size_t>(q)]) continue;
        bool any = false;
        for (int32_t t : d.next[static_cast<size_t>(q)]) any = any || (t >= 0 && ok[static_cast<size_t>(t)]);
        for (const auto& [callee, t] : d.calls[static_cast<size_t>(q)])
          any = any || (productive[static_cast<size_t>(callee)] && ok[static_cast<size_t>(t)]);
        if (any) ok[static_cast<size_t>(q)] = 1, changed = true;
      }
    }
    return ok;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (int32_t k = 0; k < KR; ++k)
      // A rule whose DFA minimised to nothing (no accepting state: `[^\x00-\U0010FFFF]`) is not productive.
      if (!productive[static_cast<size_t>(k)] && dfas[static_cast<size_t>(k)].size() > 0 && coreachable(k)[0])
        productive[static_cast<size_t>(k)] = 1, changed = true;
  }
  KESTREL_CHECK(productive[0], "the grammar matches no string (its root rule '{}' can never be completed)",
                g.rule(g.root()).name);
  // Global numbering: states kept per rule, reachable from the root's start through symbol edges and calls.
  std::vector<std::vector<uint8_t>> alive(static_cast<size_t>(KR));
  for (int32_t k = 0; k < KR; ++k) alive[static_cast<size_t>(k)] = coreachable(k);
  std::vector<std::vector<int32_t>> gid(static_cast<size_t>(KR));
  for (int32_t k = 0; k < KR; ++k) gid[static_cast<size_t>(k)].assign(static_cast<size_t>(dfas[static_cast<size_t>(k)].size()), -1);
  std::vector<std::pair<int32_t, int32_t>> order;  // (rule, local state)
  auto reach = [&](int32_t k, int32_t q) {
    if (!alive[static_cast<size_t>(k)][static_cast<size_t>(q)] || gid[static_cast<size_t>(k)][static_cast<size_t>(q)] >= 0) return;
    gid[static_cast<size_t>(k)][static_cast<size_t>(q)] = static_cast<int32_t>(order.size());
    order.emplace_back(k, q);
  };
  reach(0, 0);
  for (size_t i = 0; i < order.size(); ++i) {
    const auto [k, q] = order[i];
    const RuleDfa& d = dfas[static_cast<size_t>(k)];
    for (int32_t t : d.next[static_cast<size_t>(q)])
      if (t >= 0) reach(k, t);
    for (const auto& [callee, t] : d.calls[static_cast<size_t>(q)])
      if (productive[static_cast<size_t>(callee)] && alive[static_cast<size_t>(k)][static_cast<size_t>(t)]) {
        reach(callee, 0);
        reach(k, t);
      }
  }
  const int64_t N = static_cast<int64_t>(order.size());
  KESTREL_CHECK(N * K * static_cast<int64_t>(sizeof(StateId)) <= limits.max_table_bytes,
                "the grammar's automaton ({} states x {} symbol classes) needs more than {} MiB of tables "
                "(AutomatonLimits::max_table_bytes)",
                N, K, limits.max_table_bytes >> 20);
  a.table_.assign(static_cast<size_t>(N * K), kNoState);
  a.accepting_.resize(static_cast<size_t>(N));
  a.rule_of_.resize(static_cast<size_t>(N));
  a.call_begin_.assign(static_cast<size_t>(N) + 1, 0);
  for (int64_t i = 0; i < N; ++i) {
    const auto [k, q] = order[static_cast<size_t>(i)];
    const RuleDfa& d = dfas[static_cast<size_t>(k)];
    for (int32_t c = 0; c < K; ++c) {
      const int32_t t = d.next[static_cast<size_t>(q)][static_cast<size_t>(c)];
      if (t >= 0 && alive[static_cast<size_t>(k)][static_cast<size_t>(t)])
        a.table_[static_cast<size_t>(i * K + c)] = gid[static_cast<size_t>(k)][static_cast<size_t>(t)];
    }
    a.accepting_[static_cast<size_t>(i)] = d.accepting[static_cast<size_t>(q)];
    a.rule_of_[static_cast<size_t>(i)] = k;
    for (const auto& [callee, t] : d.calls[static_cast<size_t>(q)])
      if (productive[static_cast<size_t>(callee)] && alive[static_cast<size_t>(k)][static_cast<size_t>(t)])
        a.calls_.push_back({gid[static_cast<size_t>(callee)][0], gid[static_cast<size_t>(k)][static_cast<size_t>(t)]});
    a.call_begin_[static_cast<size_t>(i) + 1] = static_cast<int32_t>(a.calls_.size());
  }
  for (int32_t k = 0; k < KR; ++k) a.rule_names_.push_back(g.rule(kept[static_cast<size_t>(k)]).name);
  a.start_ = 0;

  // Left recursion: a rule that, through rules that may match "", calls itself before reading anything would push
  // frames forever. Nullable rules first (an accepting state reachable through calls of nullable rules only).
  std::vector<StateId> rule_start(static_cast<size_t>(KR), kNoState);
  for (int64_t i = 0; i < N; ++i)
    if (order[static_cast<size_t>(i)].second == 0) rule_start[static_cast<size_t>(order[static_cast<size_t>(i)].first)] = static_cast<StateId>(i);
  auto nullable_closure = [&](StateId s, const std::vector<uint8_t>& nullable) {
    std::vector<StateId> seen = {s};
    for (size_t i = 0; i < seen.size(); ++i)
      for (const Call& c : a.calls(seen[i]))
        if (nullable[static_cast<size_t>(a.rule_of(c.callee_start))] &&
            std::find(seen.begin(), seen.end(), c.ret) == seen.end())
          seen.push_back(c.ret);
    return seen;
  };
  std::vector<uint8_t> nullable(static_cast<size_t>(KR), 0);
  for (bool changed = true; changed;) {
    changed = false;
    for (int32_t k = 0; k < KR; ++k) {
      if (nullable[static_cast<size_t>(k)] || rule_start[static_cast<size_t>(k)] == kNoState) continue;
      for (StateId s : nullable_closure(rule_start[static_cast<size_t>(k)], nullable))
        if (a.accepting(s)) {
          nullable[static_cast<size_t>(k)] = 1;
          changed = true;
          break;
        }
    }
  }
  a.may_return_.resize(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i)
    for (StateId s : nullable_closure(static_cast<StateId>(i), nullable))
      if (a.accepting(s)) a.may_return_[static_cast<size_t>(i)] = 1;
  std::vector<std::vector<int32_t>> left(static_cast<size_t>(KR));
  for (int32_t k = 0; k < KR; ++k) {
    if (rule_start[static_cast<size_t>(k)] == kNoState) continue;
    for (StateId s : nullable_closure(rule_start[static_cast<size_t>(k)], nullable))
      for (const Call& c : a.calls(s)) left[static_cast<size_t>(k)].push_back(a.rule_of(c.callee_start));
  }
  std::vector<uint8_t> color(static_cast<size_t>(KR), 0);
  std::function<void(int32_t)> dfs = [&](int32_t k) {
    color[static_cast<size_t>(k)] = 1;
    for (int32_t j : left[static_cast<size_t>(k)]) {
      if (color[static_cast<size_t>(j)] == 1)
        fail("rule '{}' is left-recursive (it can reach itself through '{}' before matching any text); left recursion "
             "is not supported: rewrite it with repetition, e.g. a ::= b (\"x\" b)*",
             a.rule_names_[static_cast<size_t>(j)], a.rule_names_[static_cast<size_t>(k)]);
      if (color[static_cast<size_t>(j)] == 0) dfs(j);
    }
    color[static_cast<size_t>(k)] = 2;
  };
  for (int32_t k = 0; k < KR; ++k)
    if (color[static_cast<size_t>(k)] == 0) dfs(k);
  return a;
}

}  // namespace kestrel::grammar
