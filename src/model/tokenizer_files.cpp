#include "model/tokenizer_files.h"

#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kestrel {

using nlohmann::json;

const std::vector<std::string>& kimi_special_tokens() {
  static const std::vector<std::string> t = {
      "[BOS]",       "[EOS]",          "<|im_end|>",      "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
      "<|im_middle|>", "<think>",      "</think>",        "<|tool_calls_section_begin|>",
      "<|tool_calls_section_end|>",    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
      "[PAD]"};
  return t;
}

const std::string& kimi_chat_template() {
  static const std::string t =
      "{%- for message in messages -%}"
      "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ message['content'] }}<|im_end|>"
      "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ message['content'] }}<|im_end|>"
      "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>{{ message['content'] }}"
      "<|im_end|>"
      "{%- endif -%}"
      "{%- endfor -%}"
      "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}";
  return t;
}

namespace {

// GPT-2's reversible byte -> printable code point mapping used by byte-level BPE.
std::string byte_symbol(int b) {
  int cp = b;
  const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
  if (!printable) {
    int n = 0;
    for (int x = 0; x < b; ++x)
      if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) ++n;
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

void write_json(const std::string& path, const json& j) {
  std::ofstream f(path);
  if (!f) fail("cannot write {}", path);
  f << j.dump(2) << "\n";
}

}  // namespace

void write_tokenizer_files(const std::string& dir, const ModelConfig& cfg) {
  const auto& specials = kimi_special_tokens();
  KESTREL_CHECK(cfg.vocab_size >= 256 + static_cast<int64_t>(specials.size()),
                "vocab_size {} is too small for the byte-level tokenizer", cfg.vocab_size);
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_symbol(b)] = b;
  json added = json::array();
  for (size_t i = 0; i < specials.size(); ++i) {
    const int64_t id = 256 + static_cast<int64_t>(i);
    vocab[specials[i]] = id;
    added.push_back({{"id", id},
                     {"content", specials[i]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  json tok = {{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", added},
              {"normalizer", nullptr},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
              {"post_processor", nullptr},
              {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
              {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
                         {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
                         {"vocab", vocab}, {"merges", json::array()}}}};
  write_json(dir + "/tokenizer.json", tok);

  json decoder = json::object();
  for (size_t i = 0; i < specials.size(); ++i)
    decoder[std::to_string(256 + i)] = {{"content", specials[i]}, {"special", true}};
  json cfgj = {{"tokenizer_class", "PreTrainedTokenizerFast"},
               {"bos_token", "[BOS]"},
               {"eos_token", "<|im_end|>"},
               {"pad_token", "[PAD]"},
               {"model_max_length", cfg.max_position_embeddings},
               {"added_tokens_decoder", decoder},
               {"chat_template", kimi_chat_template()}};
  write_json(dir + "/tokenizer_config.json", cfgj);
}

}  // namespace kestrel
