#include "text/detokenizer.h"

#include "text/utf8.h"

namespace kestrel::text {

std::string IncrementalDetokenizer::push(int32_t id) {
  const std::string& bytes = tok_->token_bytes(id);
  if (skip_special_ && tok_->is_special(id)) return {};
  pending_ += bytes;
  const size_t stable = utf8_stable_prefix(pending_);
  if (stable == 0) return {};
  std::string out = utf8_lossy(std::string_view(pending_).substr(0, stable));
  pending_.erase(0, stable);
  return out;
}

std::string IncrementalDetokenizer::pending_text() const { return utf8_lossy(pending_); }

std::string IncrementalDetokenizer::finish() {
  std::string out = utf8_lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace kestrel::text
