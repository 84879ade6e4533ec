// kestrel tokenize: encode text with a checkpoint's tokenizer and print ids and pieces (or serve JSON lines).
#include <iostream>
#include <memory>

#include "cli/commands.h"
#include "text/tokenize_cli.h"

namespace kestrel::cli {

Runner add_tokenize(CLI::App& app) {
  auto a = std::make_shared<text::TokenizeArgs>();
  auto* tk = app.add_subcommand("tokenize", "encode text with a checkpoint's tokenizer; print ids and pieces");
  tk->add_option("model_dir", a->model_dir, "checkpoint directory (tokenizer.json or tiktoken.model)")->required();
  tk->add_option("--text", a->text, "text to encode");
  tk->add_flag("--no-special", a->no_special, "encode special-token text as ordinary text");
  tk->add_flag("--add-special-tokens", a->add_special_tokens, "apply the post-processor (e.g. BOS)");
  tk->add_flag("--jsonl", a->jsonl, "read JSON requests from stdin, one per line, answer one line each");
  tk->add_option("--chat-template", a->chat_template, "Jinja chat template file (overrides tokenizer_config.json)");
  tk->add_option("--messages", a->messages_file, "JSON list of chat messages to render and encode");
  return [tk, a]() { return tk->parsed() ? text::run_tokenize(*a, std::cin, std::cout) : -1; };
}

}  // namespace kestrel::cli
