#include "server/prompt_logprobs.h"

namespace kestrel::server {

nlohmann::ordered_json prompt_logprobs_json(const std::vector<TokenLogprob>& lps, int64_t start,
                                            const TokenText& token_text) {
  using Json = nlohmann::ordered_json;
  Json out = Json::array();
  for (int64_t i = 0; i < start; ++i) out.push_back(nullptr);
  for (const TokenLogprob& lp : lps) {
    Json entry = Json::object();
    entry[std::to_string(lp.token)] = {{"logprob", lp.logprob}, {"rank", lp.rank}, {"decoded_token", token_text(lp.token)}};
    for (size_t k = 0; k < lp.top.size(); ++k) {
      const std::string key = std::to_string(lp.top[k].first);
      if (!entry.contains(key))
        entry[key] = {{"logprob", lp.top[k].second},
                      {"rank", static_cast<int64_t>(k) + 1},
                      {"decoded_token", token_text(lp.top[k].first)}};
    }
    out.push_back(std::move(entry));
  }
  return out;
}

}  // namespace kestrel::server
