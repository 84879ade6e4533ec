#include "server/rl_api.h"

#include <algorithm>

#include <random>

#include "server/api_error.h"
#include "server/prompt_logprobs.h"
#include "server/protocol.h"

namespace kestrel::server {
namespace {

std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// The query parameters of a request target, "path?a=1&b=2".
std::vector<std::pair<std::string, std::string>> query_of(std::string_view target) {
  std::vector<std::pair<std::string, std::string>> out;
  const size_t q = target.find('?');
  if (q == std::string_view::npos) return out;
  std::string_view rest = target.substr(q + 1);
  while (!rest.empty()) {
    const size_t amp = rest.find('&');
    const std::string_view kv = rest.substr(0, amp);
    const size_t eq = kv.find('=');
    out.emplace_back(std::string(kv.substr(0, eq)), eq == std::string_view::npos ? "" : std::string(kv.substr(eq + 1)));
    if (amp == std::string_view::npos) break;
    rest = rest.substr(amp + 1);
  }
  return out;
}

bool query_bool(const std::string& key, const std::string& v) {
  if (v == "true" || v == "1" || v == "True") return true;
  if (v == "false" || v == "0" || v == "False") return false;
  bad_request(key, "query parameter '{}' must be true or false, got '{}'", key, v);
}

void need(const HttpExchange& ex, http::verb v) {
  const auto m = ex.request().method();
  if (m != v && !(v == http::verb::get && m == http::verb::head))
    throw ApiError(405, fmt::format("{} is not allowed on {}", std::string(ex.request().method_string()), ex.path()));
}

}  // namespace

bool RlApi::handles(const std::string& path) {
  return path == "/pause" || path == "/resume" || path == "/is_paused" || path == "/v1/score_tokens";
}

awaitable<void> RlApi::handle(HttpExchange& ex) {
  const std::string path = ex.path();
  if (path == "/pause") {
    co_await pause(ex);
    co_return;
  }
  if (path == "/v1/score_tokens") {
    co_await score_tokens(ex);
    co_return;
  }
  // Built outside the co_await: GCC 12 cannot keep a braced list of string literals in a coroutine frame.
  Json body;
  if (path == "/resume") {
    need(ex, http::verb::post);
    loop_.resume();
    body["status"] = "resumed";
  } else {
    need(ex, http::verb::get);
    body["is_paused"] = loop_.paused();
  }
  co_await ex.reply(200, dump(body));
}

awaitable<void> RlApi::pause(HttpExchange& ex) {
  need(ex, http::verb::post);
  PauseMode mode = PauseMode::abort;
  bool clear_cache = true;
  const auto target = ex.request().target();
  for (const auto& [k, v] : query_of(std::string_view(target.data(), target.size()))) {
    if (k == "mode") {
      if (v == "abort") mode = PauseMode::abort;
      else if (v == "wait") mode = PauseMode::wait;
      else if (v == "keep") mode = PauseMode::keep;
      else bad_request("mode", "pause mode '{}' is not one of abort, wait, keep", v);
    } else if (k == "clear_cache") {
      clear_cache = query_bool(k, v);
    } else if (k == "wait_for_inflight_requests") {  // vLLM's older spelling of mode=wait
      if (query_bool(k, v)) mode = PauseMode::wait;
    } else {
      bad_request(k, "'{}' is not a parameter of /pause (mode, clear_cache)", k);
    }
  }
  loop_.pause(mode, clear_cache, ex.notifier());
  ex.watch_disconnect();
  while (!loop_.pause_settled() && !ex.client_gone()) co_await ex.wait();
  if (ex.client_gone()) co_return;  // the pause holds; nobody is left to tell
  Json body;
  body["status"] = "paused";
  co_await ex.reply(200, dump(body));
}

std::vector<int32_t> RlApi::ids_of(const std::variant<std::string, std::vector<int32_t>>& prompt, bool add_special,
                                   const char* param) const {
  if (const auto* s = std::get_if<std::string>(&prompt)) {
    // As the generation routes do: a text that cannot fit whatever its tokens is refused before it is tokenised
    // (each token stands for at most max_token_bytes() bytes; twice that leaves room for normalizers).
    const uint64_t max_len = static_cast<uint64_t>(loop_.max_model_len());
    if (s->size() > max_len * 2 * tok_.max_token_bytes())
      bad_request(param,
                  "This model's maximum context length is {} tokens. However, your request's {} is {} bytes long, "
                  "which is more than {} tokens whatever its text. Please reduce the length of the input.",
                  max_len, param, s->size(), max_len);
    return tok_.encode(*s, {.parse_special = true, .add_special_tokens = add_special});
  }
  return std::get<std::vector<int32_t>>(prompt);
}

awaitable<void> RlApi::score_tokens(HttpExchange& ex) {
  need(ex, http::verb::post);
  ScoreTokensRequest r;
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int64_t> starts;
  int32_t lora_id = 0;
  // Parsing and tokenising: on the text threads when the server has them (off the HTTP threads).
  auto prepare = [&](const std::atomic<bool>&) {
    r = parse_score_tokens_request(parse_body(ex.request().body()));
    lora_id = resolve_model_(r.model);
    const size_t P = r.prompts.size();
    const int64_t max_len = loop_.max_model_len();
    seqs.assign(P, {});
    starts.assign(P, 0);
    for (size_t i = 0; i < P; ++i) {
      seqs[i] = ids_of(r.prompts[i], false, "prompt");
      starts[i] = r.start;
      if (!r.responses.empty()) {
        const std::vector<int32_t> response = ids_of(r.responses[i], false, "response");
        if (response.empty()) bad_request("response", "response {} is empty after tokenisation", i);
        starts[i] = static_cast<int64_t>(seqs[i].size());
        seqs[i].insert(seqs[i].end(), response.begin(), response.end());
      }
      const int64_t len = static_cast<int64_t>(seqs[i].size());
      for (int32_t t : seqs[i])
        if (t >= vocab_size_) bad_request("prompt", "token id {} is out of the vocabulary (size {})", t, vocab_size_);
      if (starts[i] >= len)
        bad_request("start", "sequence {} of {} tokens has no token to score from position {}", i, len, starts[i]);
      if (len > max_len)
        bad_request("prompt", "This model's maximum context length is {} tokens. However, sequence {} has {} tokens.",
                    max_len, i, len);
    }
  };
  if (off_thread_) {
    if (!co_await off_thread_(ex, prepare, false)) co_return;
  } else {
    const std::atomic<bool> never{false};
    prepare(never);
  }
  const size_t P = r.prompts.size();

  std::vector<std::shared_ptr<RequestStream>> reqs;
  const auto notify = ex.notifier();
  try {
    for (size_t i = 0; i < P; ++i) {
      SamplingParams p;
      p.max_tokens = 0;
      p.prompt_logprobs = r.top_logprobs;
      p.prompt_logprobs_start = starts[i];
      p.lora_id = lora_id;
      reqs.push_back(loop_.submit(seqs[i], p, r.priority, notify));
    }
  } catch (const ApiError&) {
    for (auto& q : reqs) loop_.abort(q);
    throw;
  }
  ex.watch_disconnect();
  std::vector<std::optional<RequestOutput>> outs(P);
  std::vector<double> finish_time(P, 0);
  std::optional<ApiError> failure;
  size_t left = P;
  while (left > 0 && !failure && !ex.client_gone()) {
    for (size_t i = 0; i < P; ++i) {
      if (finish_time[i] > 0) continue;
      RequestEvents ev;
      const bool over = reqs[i]->take(ev);
      if (ev.finished) outs[i] = std::move(ev.finished);
      if (ev.error) failure = ApiError(ev.error_status == 400 ? 400 : 503, *ev.error);
      if (over) {
        finish_time[i] = ev.finish_time > 0 ? ev.finish_time : now_seconds();
        --left;
      }
    }
    if (left > 0 && !failure) co_await ex.wait();
  }
  const bool gone = ex.client_gone();
  for (size_t i = 0; i < P; ++i) {
    if (finish_time[i] == 0) loop_.abort(reqs[i]);
    RequestRecord rec;
    rec.arrival = reqs[i]->arrival_time();
    rec.scheduled = reqs[i]->scheduled_time();
    rec.finished = finish_time[i] > 0 ? finish_time[i] : now_seconds();
    rec.prompt_tokens = static_cast<int64_t>(seqs[i].size());
    rec.finished_reason = failure ? "error" : gone || !outs[i] ? "abort" : "length";
    metrics_.record(rec);
  }
  if (gone) co_return;
  if (failure) throw *failure;

  // The answer: every scored token (and its alternatives) detokenised, which grows with the sequences. On the text
  // threads too.
  auto token_text = [&](int32_t id) {
    if (r.return_tokens_as_token_ids) return fmt::format("token_id:{}", id);
    return tok_.is_known(id) ? tok_.decode({&id, 1}) : std::string();
  };
  std::string answer;
  auto build = [&](const std::atomic<bool>&) {
    Json data = Json::array();
    int64_t total = 0, cached = 0;
    for (size_t i = 0; i < P; ++i) {
      const RequestOutput& o = *outs[i];
      if (static_cast<int64_t>(o.prompt_logprobs.size()) != static_cast<int64_t>(seqs[i].size()) - starts[i])
        throw ApiError(503, fmt::format("sequence {} was aborted before it was scored", i));
      Json lps = Json::array(), tokens = Json::array(), top = Json::array();
      for (const TokenLogprob& lp : o.prompt_logprobs) {
        lps.push_back(lp.logprob);
        tokens.push_back(token_text(lp.token));
        if (r.top_logprobs > 0) {
          Json alt = Json::object();
          for (const auto& [t, l] : lp.top) alt[token_text(t)] = l;
          top.push_back(std::move(alt));
        }
      }
      Json item = {{"index", i},
                   {"start", starts[i]},
                   {"token_ids", std::vector<int32_t>(seqs[i].begin() + starts[i], seqs[i].end())},
                   {"tokens", tokens},
                   {"logprobs", lps},
                   {"top_logprobs", r.top_logprobs > 0 ? top : Json(nullptr)}};
      data.push_back(std::move(item));
      total += static_cast<int64_t>(seqs[i].size());
      cached += reqs[i]->cached_tokens();
    }
    thread_local std::mt19937_64 rng{std::random_device{}()};
    const Json body = {{"id", fmt::format("score-{:016x}", rng())},
                       {"object", "score_tokens"},
                       {"model", model_name_},
                       {"data", data},
                       {"usage",
                        {{"prompt_tokens", total},
                         {"total_tokens", total},
                         {"completion_tokens", 0},
                         {"prompt_tokens_details", {{"cached_tokens", cached}}}}}};
    answer = dump(body);
  };
  if (off_thread_) {
    if (!co_await off_thread_(ex, build, true)) co_return;
  } else {
    const std::atomic<bool> never{false};
    build(never);
  }
  co_await ex.reply(200, std::move(answer));
}

}  // namespace kestrel::server
