// The text side of one completion: generated token ids -> incremental detokenizer -> stop strings -> reasoning and
// tool-call parser -> deltas. Streaming sends each delta; non-streaming merges them, so both give the same result.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "server/output_parser.h"
#include "text/detokenizer.h"
#include "text/tokenizer.h"

namespace kestrel::server {

// Stop strings over a stream of text: releases text as soon as no stop string can start in it, and cuts the text
// at the stop string that is completed first.
class StopStringMatcher {
 public:
  StopStringMatcher(std::vector<std::string> stops, bool include_stop)
      : stops_(std::move(stops)), include_stop_(include_stop) {}
  // Adds text; returns what is final. After a match returns nothing more.
  std::string push(std::string_view text);
  // The held-back tail (no stop string matched it).
  std::string finish();
  const std::optional<std::string>& matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  bool include_stop_;
  std::string pending_;
  std::optional<std::string> matched_;
};

struct CompletionTextOptions {
  bool skip_special_tokens = true;
  std::vector<std::string> stop;
  bool include_stop_str_in_output = false;
  std::optional<ParserOptions> parser;  // none: all text is content
  // Tokens that end a completion (stop_token_ids, and EOS unless ignored): their text is not part of the output.
  std::vector<int32_t> stop_token_ids;
};

class CompletionText {
 public:
  CompletionText(const text::Tokenizer& tok, const CompletionTextOptions& opts);

  // One generated token; its text (if any became final) goes into `out`. Ignored after a stop string matched.
  void push(int32_t token, OutputDelta& out);
  // The completion ended: releases what was held back.
  void finish(OutputDelta& out);

  bool stopped_by_string() const { return stop_.matched().has_value(); }
  const std::optional<std::string>& stop_string() const { return stop_.matched(); }
  int num_tool_calls() const { return parser_ ? parser_->num_tool_calls() : 0; }

 private:
  void release(const std::string& text, OutputDelta& out);

  const text::Tokenizer& tok_;
  CompletionTextOptions opts_;
  text::IncrementalDetokenizer detok_;
  StopStringMatcher stop_;
  std::optional<OutputParser> parser_;
  bool finished_ = false;
};

}  // namespace kestrel::server
