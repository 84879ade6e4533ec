// Incremental detokenisation for streaming: text is released as soon as it is final. Because decoding is the
// joined token bytes with invalid UTF-8 replaced, the only text a later token can change is an unfinished UTF-8
// sequence at the end; that is held back, everything before it is released. The concatenation of what push()
// returns followed by finish() equals Tokenizer::decode of all the ids, and no released text is ever revised.
#pragma once
#include <cstdint>
#include <string>

#include "text/tokenizer.h"

namespace kestrel::text {

class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tok, bool skip_special = false)
      : tok_(&tok), skip_special_(skip_special) {}

  // Adds one token; returns the text that became final (possibly empty). Throws for an unknown id.
  std::string push(int32_t id);
  // The held-back bytes, with an unfinished sequence replaced by U+FFFD, as a full decode would show them now.
  std::string pending_text() const;
  // Ends the stream: returns pending_text() and clears it.
  std::string finish();

 private:
  const Tokenizer* tok_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace kestrel::text
