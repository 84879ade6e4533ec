#include "server/completion_text.h"

#include <algorithm>

namespace kestrel::server {

std::string StopStringMatcher::push(std::string_view text) {
  if (matched_) return "";
  pending_.append(text);
  // The stop string completed first wins (the earliest end; at equal ends the longer one), which no split of the
  // text into pieces can change.
  size_t first = std::string::npos, first_end = std::string::npos;
  const std::string* which = nullptr;
  for (const std::string& s : stops_) {
    const size_t at = pending_.find(s);
    if (at == std::string::npos) continue;
    if (at + s.size() < first_end || (at + s.size() == first_end && at < first)) {
      first = at;
      first_end = at + s.size();
      which = &s;
    }
  }
  if (which) {
    matched_ = *which;
    std::string out = pending_.substr(0, first + (include_stop_ ? which->size() : 0));
    pending_.clear();
    return out;
  }
  // Hold back the longest tail that could still grow into a stop string.
  size_t hold = 0;
  for (const std::string& s : stops_)
    for (size_t k = std::min(pending_.size(), s.size() - 1); k > hold; --k)
      if (pending_.compare(pending_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopStringMatcher::finish() {
  std::string out = std::move(pending_);
  pending_.clear();
  return out;
}

CompletionText::CompletionText(const text::Tokenizer& tok, const CompletionTextOptions& opts)
    : tok_(tok),
      opts_(opts),
      // The parsers read the markup, which is written in special tokens.
      detok_(tok, opts.skip_special_tokens && !opts.parser),
      stop_(opts.stop, opts.include_stop_str_in_output) {
  if (opts_.parser) parser_.emplace(*opts_.parser);
}

void CompletionText::release(const std::string& text, OutputDelta& out) {
  if (parser_) parser_->feed(text, out);
  else out.content += text;
}

void CompletionText::push(int32_t token, OutputDelta& out) {
  if (finished_ || stop_.matched()) return;
  const auto& stops = opts_.stop_token_ids;
  // Ids beyond the tokenizer's vocabulary (a model's padded embedding rows) have no text.
  if (std::find(stops.begin(), stops.end(), token) != stops.end() || !tok_.is_known(token)) return;
  release(stop_.push(detok_.push(token)), out);
  if (stop_.matched()) {
    if (parser_) parser_->finish(out);
    finished_ = true;
  }
}

void CompletionText::finish(OutputDelta& out) {
  if (finished_) return;
  finished_ = true;
  release(stop_.push(detok_.finish()), out);
  if (!stop_.matched()) release(stop_.finish(), out);
  if (parser_) parser_->finish(out);
}

}  // namespace kestrel::server
