// The tokenizer layout of the models make-model writes: the Kimi special tokens at ids 256.. (after the 256 byte
// tokens) and the Kimi chat template of SERVING.md. The files themselves are trained and written by the text
// module (text/bpe_trainer.h).
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

// Trains make-model's byte-level BPE (text module) for cfg.vocab_size ids and writes tokenizer.json,
// tiktoken.model and tokenizer_config.json into `dir`.
void write_model_tokenizer(const std::string& dir, const ModelConfig& cfg);

}  // namespace kestrel
