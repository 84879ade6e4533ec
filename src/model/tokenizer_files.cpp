#include "model/tokenizer_files.h"

#include "text/bpe_trainer.h"

namespace kestrel {

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

void write_model_tokenizer(const std::string& dir, const ModelConfig& cfg) {
  text::TokenizerFilesSpec spec;
  spec.vocab_size = cfg.vocab_size;
  spec.special_tokens = kimi_special_tokens();
  spec.bos_token = "[BOS]";
  spec.eos_token = "<|im_end|>";
  spec.pad_token = "[PAD]";
  spec.chat_template = kimi_chat_template();
  spec.model_max_length = cfg.max_position_embeddings;
  text::write_trained_tokenizer(dir, spec);
}

}  // namespace kestrel
