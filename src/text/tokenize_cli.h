// `kestrel tokenize MODEL_DIR`: encode text and print ids and pieces, or serve JSON-lines requests (the batch
// mode the golden tests drive).
#pragma once
#include <iosfwd>
#include <string>

namespace kestrel::text {

struct TokenizeArgs {
  std::string model_dir;
  std::string text;               // --text
  bool no_special = false;        // --no-special: special-token text is encoded as ordinary text
  bool add_special_tokens = false;  // --add-special-tokens: apply the post-processor (e.g. BOS)
  bool jsonl = false;             // --jsonl: read one JSON request per line from `in`, answer one line each
  std::string chat_template;      // --chat-template FILE: overrides tokenizer_config.json's template
  std::string messages_file;      // --messages FILE: a JSON list of chat messages, rendered with the chat
                                  // template (add_generation_prompt) and then encoded instead of --text
};

// Returns the process exit code. Errors a user can cause throw kestrel::Error, except in --jsonl mode, where a
// bad request is answered with {"error": "..."} and the next line is read.
int run_tokenize(const TokenizeArgs& args, std::istream& in, std::ostream& out);

// The display form of a token's bytes: a double-quoted string with \n, \t, \r, \", \\ and \xNN (bytes that are
// not part of valid UTF-8, and control bytes) escaped.
std::string quote_token_bytes(const std::string& bytes);

}  // namespace kestrel::text
