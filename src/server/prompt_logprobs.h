// vLLM's prompt_logprobs in a response: one entry per prompt token, null where none was computed (the first token,
// which has no context, and positions before the first one scored), else an object keyed by token id (as a string)
// holding the prompt token and its top alternatives: {"logprob", "rank", "decoded_token"}.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/sampler.h"

namespace kestrel::server {

using TokenText = std::function<std::string(int32_t)>;

// lps[i] is position start + i.
nlohmann::ordered_json prompt_logprobs_json(const std::vector<TokenLogprob>& lps, int64_t start,
                                            const TokenText& token_text);

}  // namespace kestrel::server
