// Encoding throughput of Kestrel's tokenizers, single thread, best of --repeat runs.
//   tokenizer_bench train DIR VOCAB                       write make-model's tokenizer files (KJV-trained BPE)
//   tokenizer_bench encode MODEL_DIR TEXT_FILE [--repeat N]   encode the whole file as one text
//   tokenizer_bench lines MODEL_DIR JSONL_FILE [--repeat N]   encode each line's JSON string separately
// MODEL_DIR holding tokenizer.json is read as that; a directory with only tiktoken.model (+ tokenizer_config.json)
// as tiktoken. bench/text/reference_bench.py measures `tokenizers` and `tiktoken` the same way.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/bpe_trainer.h"
#include "text/tokenizer.h"

namespace {

std::string read_file(const char* path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) kestrel::fail("cannot read {}", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

template <typename F>
double best_of(int repeat, F&& f) {
  double best = 1e30;
  for (int r = 0; r < repeat; ++r) {
    const auto a = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  return best;
}

int run(int argc, char** argv) {
  const std::string mode = argv[1];
  if (mode == "train") {
    kestrel::text::TokenizerFilesSpec spec;
    spec.vocab_size = std::atoll(argv[3]);
    spec.special_tokens = {"[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                           "<|im_middle|>", "<think>", "</think>", "<|tool_calls_section_begin|>",
                           "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                           "<|tool_call_end|>", "[PAD]"};
    spec.bos_token = "[BOS]";
    spec.eos_token = "<|im_end|>";
    spec.pad_token = "[PAD]";
    kestrel::text::write_trained_tokenizer(argv[2], spec);
    return 0;
  }
  int repeat = 5;
  for (int i = 4; i < argc; ++i)
    if (!std::strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = std::atoi(argv[++i]);
  const auto tok = kestrel::text::Tokenizer::load(argv[2]);
  const char* form = tok.format() == kestrel::text::Tokenizer::Format::tiktoken ? "tiktoken" : "tokenizer.json";
  size_t bytes = 0, tokens = 0;
  double t = 0;
  if (mode == "encode") {
    const std::string text = read_file(argv[3]);
    bytes = text.size();
    t = best_of(repeat, [&] { tokens = tok.encode(text).size(); });
  } else if (mode == "lines") {
    std::vector<std::string> texts;
    std::istringstream in(read_file(argv[3]));
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) texts.push_back(nlohmann::json::parse(line).get<std::string>());
    for (const auto& s : texts) bytes += s.size();
    t = best_of(repeat, [&] {
      tokens = 0;
      for (const auto& s : texts) tokens += tok.encode(s).size();
    });
  } else {
    kestrel::fail("unknown mode '{}' (train, encode, lines)", mode);
  }
  std::printf("kestrel %s (%d ids) %s: %zu bytes -> %zu tokens, best %.4f s, %.2f MB/s\n", form, tok.id_count(),
              mode.c_str(), bytes, tokens, t, static_cast<double>(bytes) / t / 1e6);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s train DIR VOCAB | encode MODEL_DIR TEXT_FILE [--repeat N] | lines MODEL_DIR JSONL "
                 "[--repeat N]\n", argv[0]);
    return 2;
  }
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
