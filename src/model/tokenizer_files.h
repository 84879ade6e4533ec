// Tokenizer files that make-model writes next to the weights: a byte-level tokenizer.json (every byte one token,
// then the Kimi special tokens), tokenizer_config.json with the Kimi chat template. The text module trains a real
// BPE on top of this layout; the ids below stay fixed.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace kestrel {

constexpr int64_t kTinyBosId = 256;  // [BOS]
constexpr int64_t kTinyEosId = 258;  // <|im_end|>, the end of an assistant turn

// The special tokens, in id order starting at 256.
const std::vector<std::string>& kimi_special_tokens();
// The chat template of SERVING.md (Jinja).
const std::string& kimi_chat_template();

void write_tokenizer_files(const std::string& dir, const ModelConfig& cfg);

}  // namespace kestrel
