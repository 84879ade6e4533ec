#include "grammar/output_constraint.h"

#include <algorithm>

#include "core/error.h"

namespace kestrel::grammar {

ReasoningMarkers::ReasoningMarkers(std::shared_ptr<const Vocabulary> vocab, std::string open, std::string close)
    : vocab_(std::move(vocab)), open_(std::move(open)), close_(std::move(close)) {
  KESTREL_CHECK(!open_.empty() && !close_.empty(), "reasoning markers must not be empty");
  const Vocabulary& v = *vocab_;
  for (int32_t id = 0; id < v.size(); ++id) {
    const auto k = v.kind(id);
    if (k != Vocabulary::Kind::bytes && k != Vocabulary::Kind::special) continue;
    if (v.bytes(id) == open_) open_ids_.push_back(id);
    if (v.bytes(id) == close_) close_ids_.push_back(id);
  }
  KESTREL_CHECK(!close_ids_.empty(), "the vocabulary has no token '{}' (the end of the reasoning section)", close_);
  const int32_t n = length();
  failure_.assign(static_cast<size_t>(n) + 1, 0);
  for (int32_t i = 1, k = 0; i < n; ++i) {
    while (k > 0 && close_[static_cast<size_t>(i)] != close_[static_cast<size_t>(k)]) k = failure_[static_cast<size_t>(k)];
    if (close_[static_cast<size_t>(i)] == close_[static_cast<size_t>(k)]) ++k;
    failure_[static_cast<size_t>(i) + 1] = k;
  }
  completing_.resize(static_cast<size_t>(n));
  for (int32_t id = 0; id < v.size(); ++id) {
    const auto k = v.kind(id);
    if ((k != Vocabulary::Kind::bytes && k != Vocabulary::Kind::special) || is_close(id)) continue;
    for (int32_t st = 0; st < n; ++st)
      if (scan(st, id) == n) completing_[static_cast<size_t>(st)].push_back(id);
  }
}

bool ReasoningMarkers::is_close(int32_t id) const {
  return std::find(close_ids_.begin(), close_ids_.end(), id) != close_ids_.end();
}

int32_t ReasoningMarkers::scan(int32_t state, int32_t token) const {
  const int32_t n = length();
  for (char c : vocab_->bytes(token)) {
    while (state > 0 && c != close_[static_cast<size_t>(state)]) state = failure_[static_cast<size_t>(state)];
    if (c == close_[static_cast<size_t>(state)]) ++state;
    if (state == n) return n;
  }
  return state;
}

OutputMatcher::OutputMatcher(std::shared_ptr<const OutputConstraint> c)
    : constraint_(std::move(c)), grammar_(constraint_->grammar) {
  phase_ = !constraint_->reasoning       ? Phase::grammar
           : constraint_->starts_in_reasoning ? Phase::reasoning
                                              : Phase::start;
}

void OutputMatcher::fill_mask(std::span<uint32_t> words) const {
  if (phase_ != Phase::reasoning) {
    grammar_.fill_mask(words);
    if (phase_ == Phase::start)
      for (int32_t id : constraint_->reasoning->open_tokens()) words[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
    return;
  }
  const ReasoningMarkers& r = *constraint_->reasoning;
  const std::vector<uint32_t>& all = r.vocabulary().grammar_tokens();
  std::copy(all.begin(), all.end(), words.begin());
  for (int32_t id : r.completing(partial_)) words[static_cast<size_t>(id) >> 5] &= ~(1u << (id & 31));
  for (int32_t id : r.close_tokens()) words[static_cast<size_t>(id) >> 5] |= 1u << (id & 31);
}

bool OutputMatcher::accept_token(int32_t token) {
  const Vocabulary& v = constraint_->grammar->vocabulary();
  if (token < 0 || token >= v.size()) return false;
  const Step before{phase_, partial_, false};
  if (phase_ == Phase::start) {
    const auto& open = constraint_->reasoning->open_tokens();
    if (std::find(open.begin(), open.end(), token) != open.end()) {
      phase_ = Phase::reasoning;
      partial_ = 0;
      history_.push_back(before);
      return true;
    }
  }
  if (phase_ == Phase::reasoning) {
    const ReasoningMarkers& r = *constraint_->reasoning;
    if (r.is_close(token)) {
      phase_ = Phase::grammar;
    } else {
      const auto k = v.kind(token);
      if (k != Vocabulary::Kind::bytes && k != Vocabulary::Kind::special) return false;
      const int32_t next = r.scan(partial_, token);
      if (next == r.length()) return false;
      partial_ = next;
    }
    history_.push_back(before);
    return true;
  }
  if (!grammar_.accept_token(token)) return false;
  phase_ = Phase::grammar;
  history_.push_back({before.phase, before.partial, true});
  return true;
}

void OutputMatcher::rollback(int n) {
  KESTREL_CHECK(n >= 0 && n <= num_accepted(), "cannot roll back {} tokens of {}", n, num_accepted());
  int grammar_tokens = 0;
  for (int i = 0; i < n; ++i) {
    const Step s = history_.back();
    history_.pop_back();
    grammar_tokens += s.to_grammar;
    phase_ = s.phase;
    partial_ = s.partial;
  }
  grammar_.rollback(grammar_tokens);
}

}  // namespace kestrel::grammar
