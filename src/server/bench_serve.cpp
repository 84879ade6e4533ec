#include "server/bench_serve.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <utility>  // before Asio: Boost 1.74's awaitable.hpp uses std::exchange without it

#include <boost/asio.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include "core/error.h"
#include "core/stats.h"

namespace kestrel::server {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using net::use_awaitable;
using Json = nlohmann::ordered_json;
template <typename T>
using awaitable = net::awaitable<T>;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Target {
  std::string host, port;
};

Target parse_base_url(const std::string& url) {
  std::string rest = url;
  if (rest.starts_with("http://")) rest = rest.substr(7);
  else if (rest.find("://") != std::string::npos) fail("--base-url {}: only http:// is supported", url);
  rest = rest.substr(0, rest.find('/'));
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos) return {rest, "80"};
  return {rest.substr(0, colon), rest.substr(colon + 1)};
}

struct RequestResult {
  bool ok = false;
  std::string error;
  int64_t sent_prompt_len = 0, prompt_tokens = 0, output_tokens = 0, cached_tokens = 0;
  bool has_usage = false;
  double start = 0, ttft = 0, e2e = 0;  // seconds (ttft and e2e relative to start)
  std::vector<double> chunk_times;      // arrival times of chunks with text
};

// The events of a server-sent-event stream, as they arrive.
class SseReader {
 public:
  explicit SseReader(RequestResult& r) : r_(r) {}
  void feed(std::string_view data) {
    buf_.append(data);
    size_t end;
    while ((end = buf_.find("\n\n")) != std::string::npos) {
      event(buf_.substr(0, end));
      buf_.erase(0, end + 2);
    }
  }
  bool done() const { return done_; }

 private:
  void event(const std::string& e) {
    if (!e.starts_with("data: ")) return;
    const std::string payload = e.substr(6);
    if (payload == "[DONE]") {
      done_ = true;
      return;
    }
    const double t = now();
    const Json j = Json::parse(payload, nullptr, false);
    if (j.is_discarded()) {
      r_.error = "malformed event: " + payload.substr(0, 200);
      return;
    }
    if (j.contains("error")) {
      r_.error = j["error"].dump();
      return;
    }
    if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
      const Json& c = j["choices"][0];
      const Json* text = c.contains("text") ? &c["text"] : nullptr;
      if (!text && c.contains("delta") && c["delta"].contains("content")) text = &c["delta"]["content"];
      if (text && text->is_string() && !text->get<std::string>().empty()) r_.chunk_times.push_back(t);
    }
    if (j.contains("usage") && j["usage"].is_object()) {
      const Json& u = j["usage"];
      r_.has_usage = true;
      r_.prompt_tokens = u.value("prompt_tokens", int64_t{0});
      r_.output_tokens = u.value("completion_tokens", int64_t{0});
      if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object())
        r_.cached_tokens = u["prompt_tokens_details"].value("cached_tokens", int64_t{0});
    }
  }

  RequestResult& r_;
  std::string buf_;
  bool done_ = false;
};

awaitable<void> connect(beast::tcp_stream& stream, const Target& t) {
  tcp::resolver resolver(co_await net::this_coro::executor);
  const auto endpoints = co_await resolver.async_resolve(t.host, t.port, use_awaitable);
  co_await stream.async_connect(endpoints, use_awaitable);
}

http::request<http::string_body> make_request(const Target& t, http::verb verb, const std::string& path,
                                              std::string body) {
  http::request<http::string_body> req{verb, path, 11};
  req.set(http::field::host, t.host);
  req.set(http::field::user_agent, "kestrel-bench");
  if (verb == http::verb::post) req.set(http::field::content_type, "application/json");
  req.keep_alive(false);
  req.body() = std::move(body);
  req.prepare_payload();
  return req;
}

// A plain request; returns (status, body).
awaitable<std::pair<int, std::string>> call(Target t, http::verb verb, std::string path, std::string body) {
  beast::tcp_stream stream(co_await net::this_coro::executor);
  stream.expires_after(std::chrono::seconds(120));
  co_await connect(stream, t);
  auto req = make_request(t, verb, path, std::move(body));
  co_await http::async_write(stream, req, use_awaitable);
  beast::flat_buffer buf;
  http::response_parser<http::string_body> p;
  p.body_limit(boost::none);
  co_await http::async_read(stream, buf, p, use_awaitable);
  co_return std::make_pair(static_cast<int>(p.get().result_int()), p.get().body());
}

// One streaming completion; fills `r` (never throws).
awaitable<void> stream_completion(Target t, std::string path, std::string body, double timeout, RequestResult& r) {
  r.start = now();
  try {
    beast::tcp_stream stream(co_await net::this_coro::executor);
    stream.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(timeout)));
    co_await connect(stream, t);
    auto req = make_request(t, http::verb::post, path, std::move(body));
    co_await http::async_write(stream, req, use_awaitable);
    beast::flat_buffer buf;
    http::response_parser<http::string_body> p;
    p.body_limit(boost::none);
    SseReader sse(r);
    std::function<size_t(uint64_t, beast::string_view, beast::error_code&)> on_chunk =
        [&sse](uint64_t, beast::string_view data, beast::error_code&) {
          sse.feed(std::string_view(data.data(), data.size()));
          return data.size();
        };
    p.on_chunk_body(on_chunk);
    co_await http::async_read_header(stream, buf, p, use_awaitable);
    const int status = p.get().result_int();
    while (!p.is_done()) co_await http::async_read_some(stream, buf, p, use_awaitable);
    if (!p.chunked()) sse.feed(p.get().body());  // a server that does not chunk its event stream
    if (status != 200) {
      r.error = fmt::format("HTTP {}: {}", status, p.get().body().substr(0, 300));
    } else if (r.error.empty() && !sse.done()) {
      r.error = "the stream ended without [DONE]";
    }
  } catch (const std::exception& e) {
    r.error = e.what();
  }
  const double end = now();
  r.e2e = end - r.start;
  if (!r.chunk_times.empty()) r.ttft = r.chunk_times.front() - r.start;
  if (!r.has_usage) r.output_tokens = static_cast<int64_t>(r.chunk_times.size());
  r.ok = r.error.empty();
}

// Token ids of random words under the server's tokenizer: the pool prompts are cut from.
std::vector<int32_t> token_pool(net::io_context& ioc, const Target& t, const std::string& model, size_t want,
                                std::mt19937_64& rng) {
  std::vector<int32_t> pool;
  while (pool.size() < want) {
    std::string text;
    for (int w = 0; w < 4096; ++w) {
      const int len = 2 + static_cast<int>(rng() % 8);
      for (int i = 0; i < len; ++i) text += static_cast<char>('a' + rng() % 26);
      text += w % 17 == 16 ? ". " : " ";
    }
    Json body = {{"prompt", text}, {"add_special_tokens", false}};
    if (!model.empty()) body["model"] = model;
    auto f = net::co_spawn(ioc, call(t, http::verb::post, "/tokenize", body.dump()), net::use_future);
    ioc.restart();
    ioc.run();
    const auto [status, reply] = f.get();
    if (status != 200) fail("POST /tokenize answered {}: {}", status, reply.substr(0, 300));
    const Json j = Json::parse(reply);
    for (const Json& id : j["tokens"]) pool.push_back(id.get<int32_t>());
  }
  return pool;
}

// A prompt of `len` tokens from random 16-token pieces of the pool (two prompts practically never share a block).
std::vector<int32_t> random_tokens(const std::vector<int32_t>& pool, int64_t len, std::mt19937_64& rng) {
  std::vector<int32_t> out;
  while (static_cast<int64_t>(out.size()) < len) {
    const size_t at = rng() % (pool.size() - 16);
    const int64_t n = std::min<int64_t>(16, len - static_cast<int64_t>(out.size()));
    out.insert(out.end(), pool.begin() + static_cast<int64_t>(at), pool.begin() + static_cast<int64_t>(at) + n);
  }
  return out;
}

Json completion_body(const BenchServeOptions& o, const std::string& model, const std::vector<int32_t>& prompt,
                     int max_tokens) {
  Json b = {{"model", model},         {"prompt", prompt},
            {"max_tokens", max_tokens}, {"stream", true},
            {"stream_options", {{"include_usage", true}}}, {"temperature", 0.0}};
  if (o.ignore_eos) b["ignore_eos"] = true;
  return b;
}

// Caps the requests (or sessions) in flight; single-threaded, so plain counters.
class Slots {
 public:
  Slots(net::io_context& ioc, int cap) : cap_(cap), freed_(ioc, net::steady_timer::time_point::max()) {}
  awaitable<void> acquire() {
    while (cap_ > 0 && used_ >= cap_) {
      freed_.expires_at(net::steady_timer::time_point::max());
      beast::error_code ec;
      co_await freed_.async_wait(net::redirect_error(use_awaitable, ec));
    }
    ++used_;
  }
  void release() {
    --used_;
    freed_.cancel();
  }

 private:
  int cap_, used_ = 0;
  net::steady_timer freed_;
};

awaitable<void> sleep_for(double seconds) {
  net::steady_timer t(co_await net::this_coro::executor);
  t.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(seconds)));
  beast::error_code ec;
  co_await t.async_wait(net::redirect_error(use_awaitable, ec));
}

struct Run {
  net::io_context& ioc;
  const BenchServeOptions& o;
  Target target;
  std::string model;
  std::vector<int32_t> pool;
  std::mt19937_64 rng;
  std::vector<RequestResult> results;
  Slots slots;
  int pending = 0;

  Run(net::io_context& c, const BenchServeOptions& opts, Target t, std::string m, std::vector<int32_t> p)
      : ioc(c), o(opts), target(std::move(t)), model(std::move(m)), pool(std::move(p)), rng(opts.seed + 1),
        slots(c, opts.max_concurrency) {}

  double arrival_gap() {
    if (o.request_rate <= 0) return 0;
    return std::exponential_distribution<double>(o.request_rate)(rng);
  }

  awaitable<void> one_request(size_t slot, std::vector<int32_t> prompt, int max_tokens) {
    results[slot].sent_prompt_len = static_cast<int64_t>(prompt.size());
    co_await stream_completion(target, "/v1/completions", completion_body(o, model, prompt, max_tokens).dump(),
                               o.timeout, results[slot]);
    slots.release();
  }

  awaitable<void> random_dataset() {
    results.resize(o.num_prompts);
    for (int i = 0; i < o.num_prompts; ++i) {
      const double r = o.random_range_ratio;
      const auto lo_in = static_cast<int64_t>(std::floor(o.random_input_len * (1 - r)));
      const auto hi_in = static_cast<int64_t>(std::ceil(o.random_input_len * (1 + r)));
      const auto lo_out = static_cast<int64_t>(std::floor(o.random_output_len * (1 - r)));
      const auto hi_out = static_cast<int64_t>(std::ceil(o.random_output_len * (1 + r)));
      const int64_t in = std::max<int64_t>(1, lo_in + static_cast<int64_t>(rng() % (hi_in - lo_in + 1)));
      const int64_t out = std::max<int64_t>(1, lo_out + static_cast<int64_t>(rng() % (hi_out - lo_out + 1)));
      std::vector<int32_t> prompt = random_tokens(pool, in, rng);
      if (i > 0) co_await sleep_for(arrival_gap());
      co_await slots.acquire();
      net::co_spawn(ioc, one_request(static_cast<size_t>(i), std::move(prompt), static_cast<int>(out)),
                    net::detached);
    }
  }

  awaitable<void> session(int user, int first_slot, int turns) {
    std::mt19937_64 srng(o.seed * 7919 + static_cast<uint64_t>(user) + 17);
    std::vector<int32_t> context = random_tokens(pool, o.agentic_salt_len, srng);  // per-user salt
    // The shared system + tools prefix (the same for every user, after the salt).
    context.insert(context.end(), pool.begin(), pool.begin() + o.agentic_prefix_len);
    for (int turn = 0; turn < turns; ++turn) {
      if (turn > 0 && o.agentic_think_time > 0)
        co_await sleep_for(std::exponential_distribution<double>(1.0 / o.agentic_think_time)(srng));
      const std::vector<int32_t> user_msg = random_tokens(pool, o.agentic_turn_len, srng);
      context.insert(context.end(), user_msg.begin(), user_msg.end());
      RequestResult& r = results[static_cast<size_t>(first_slot + turn)];
      r.sent_prompt_len = static_cast<int64_t>(context.size());
      co_await stream_completion(target, "/v1/completions",
                                 completion_body(o, model, context, o.random_output_len).dump(), o.timeout, r);
      if (!r.ok) break;
      // The answer joins the context (as tokens of the same length: only prompt blocks are reused anyway).
      const std::vector<int32_t> answer = random_tokens(pool, std::max<int64_t>(1, r.output_tokens), srng);
      context.insert(context.end(), answer.begin(), answer.end());
    }
    slots.release();
  }

  awaitable<void> agentic_dataset() {
    const int turns = std::max(1, o.agentic_turns);
    const int sessions = (o.num_prompts + turns - 1) / turns;
    results.resize(static_cast<size_t>(sessions) * turns);
    for (int u = 0; u < sessions; ++u) {
      if (u > 0) co_await sleep_for(arrival_gap());
      co_await slots.acquire();
      net::co_spawn(ioc, session(u, u * turns, turns), net::detached);
    }
  }
};

// The counters of /metrics, each name (without its namespace: "prefix_cache_hits_total") summed over its labels;
// nothing when the server has no /metrics.
std::optional<std::map<std::string, double>> server_counters(net::io_context& ioc, const Target& t) {
  auto f = net::co_spawn(ioc, call(t, http::verb::get, "/metrics", ""), net::use_future);
  ioc.restart();
  ioc.run();
  std::pair<int, std::string> reply;
  try {
    reply = f.get();
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (reply.first != 200) return std::nullopt;
  std::map<std::string, double> out;
  std::istringstream in(reply.second);
  std::string line;
  while (std::getline(in, line)) {
    if (line.starts_with("#")) continue;
    const size_t brace = line.find('{'), space = line.rfind(' ');
    if (space == std::string::npos) continue;
    std::string name = line.substr(0, std::min(brace, space));
    if (const size_t colon = name.rfind(':'); colon != std::string::npos) name = name.substr(colon + 1);
    out[name] += std::strtod(line.c_str() + space + 1, nullptr);
  }
  return out;
}

// Kestrel's or vLLM's prefix-cache counters: (queries, hits) in tokens, or nothing.
std::optional<std::pair<double, double>> prefix_counters(const std::optional<std::map<std::string, double>>& m) {
  if (!m || !m->count("prefix_cache_queries_total") || !m->count("prefix_cache_hits_total")) return std::nullopt;
  return std::make_pair(m->at("prefix_cache_queries_total"), m->at("prefix_cache_hits_total"));
}

// A counter's growth between two scrapes (0 when either lacks it).
double counter_delta(const std::optional<std::map<std::string, double>>& before,
                     const std::optional<std::map<std::string, double>>& after, const std::string& name) {
  if (!before || !after || !before->count(name) || !after->count(name)) return 0.0;
  return after->at(name) - before->at(name);
}

struct Stats {
  double mean = 0, median = 0, std = 0, p90 = 0, p99 = 0;
};

Stats stats_ms(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  for (double& x : v) x *= 1000;
  std::sort(v.begin(), v.end());
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  double var = 0;
  for (double x : v) var += (x - s.mean) * (x - s.mean);
  s.std = std::sqrt(var / static_cast<double>(v.size()));
  s.median = percentile(v, 50);
  s.p90 = percentile(v, 90);
  s.p99 = percentile(v, 99);
  return s;
}

void put_stats(Json& out, const std::string& key, const Stats& s) {
  out["mean_" + key + "_ms"] = s.mean;
  out["median_" + key + "_ms"] = s.median;
  out["std_" + key + "_ms"] = s.std;
  out["p90_" + key + "_ms"] = s.p90;
  out["p99_" + key + "_ms"] = s.p99;
}

}  // namespace

Json bench_serve(const BenchServeOptions& o) {
  if (o.dataset != "random" && o.dataset != "agentic") fail("--dataset '{}' is not one of random, agentic", o.dataset);
  KESTREL_CHECK(o.num_prompts >= 1, "--num-prompts must be >= 1");
  KESTREL_CHECK(o.random_range_ratio >= 0 && o.random_range_ratio < 1, "--random-range-ratio must be in [0, 1)");
  const Target target = parse_base_url(o.base_url);
  net::io_context ioc;
  std::string model = o.model;
  if (model.empty()) {
    auto f = net::co_spawn(ioc, call(target, http::verb::get, "/v1/models", ""), net::use_future);
    ioc.run();
    const auto [status, body] = f.get();
    if (status != 200) fail("GET /v1/models answered {}: {}", status, body.substr(0, 300));
    model = Json::parse(body)["data"][0]["id"].get<std::string>();
  }
  std::mt19937_64 rng(o.seed);
  const size_t need = static_cast<size_t>(std::max({o.random_input_len * 2, o.agentic_prefix_len + 64, 4096}));
  Run run(ioc, o, target, model, token_pool(ioc, target, model, need, rng));

  const auto counters_before = server_counters(ioc, target);
  const auto before = prefix_counters(counters_before);
  const std::time_t date = std::time(nullptr);
  const double t0 = now();
  if (o.dataset == "random") net::co_spawn(ioc, run.random_dataset(), net::detached);
  else net::co_spawn(ioc, run.agentic_dataset(), net::detached);
  ioc.restart();
  ioc.run();
  const double duration = now() - t0;
  const auto counters_after = server_counters(ioc, target);
  const auto after = prefix_counters(counters_after);

  int completed = 0;
  int64_t input = 0, output = 0, cached = 0;
  std::vector<double> ttft, tpot, itl, e2el, chunk_times;
  std::vector<int64_t> input_lens, output_lens;
  std::vector<std::string> errors;
  int good = 0;
  for (const RequestResult& r : run.results) {
    if (r.start == 0) continue;  // a session stopped before this turn
    if (!r.ok) {
      errors.push_back(r.error);
      continue;
    }
    ++completed;
    const int64_t in = r.has_usage ? r.prompt_tokens : r.sent_prompt_len;
    input += in;
    output += r.output_tokens;
    cached += r.cached_tokens;
    input_lens.push_back(in);
    output_lens.push_back(r.output_tokens);
    ttft.push_back(r.ttft);
    e2el.push_back(r.e2e);
    const double per_token = r.output_tokens > 1 ? (r.e2e - r.ttft) / static_cast<double>(r.output_tokens - 1) : 0;
    if (r.output_tokens > 1) tpot.push_back(per_token);
    for (size_t i = 1; i < r.chunk_times.size(); ++i) itl.push_back(r.chunk_times[i] - r.chunk_times[i - 1]);
    chunk_times.insert(chunk_times.end(), r.chunk_times.begin(), r.chunk_times.end());
    bool meets = true;
    for (const auto& [k, ms] : o.goodput) {
      const double v = k == "ttft" ? r.ttft : k == "tpot" ? per_token : r.e2e;
      meets = meets && v * 1000 <= ms;
    }
    good += meets;
  }
  // Peak output tokens per second: chunks (one token each) in one-second windows.
  double peak = 0;
  if (!chunk_times.empty()) {
    std::vector<int64_t> per_second(static_cast<size_t>(duration) + 2, 0);
    for (double t : chunk_times) ++per_second[static_cast<size_t>(std::max(0.0, t - t0))];
    peak = static_cast<double>(*std::max_element(per_second.begin(), per_second.end()));
  }

  char date_text[32];
  std::strftime(date_text, sizeof date_text, "%Y%m%d-%H%M%S", std::localtime(&date));
  Json out;
  out["date"] = date_text;
  out["backend"] = "openai";
  out["base_url"] = o.base_url;
  out["model_id"] = model;
  out["dataset"] = o.dataset;
  out["num_prompts"] = static_cast<int64_t>(run.results.size());
  out["request_rate"] = o.request_rate > 0 ? Json(o.request_rate) : Json("inf");
  out["max_concurrency"] = o.max_concurrency > 0 ? Json(o.max_concurrency) : Json(nullptr);
  out["duration"] = duration;
  out["completed"] = completed;
  out["failed"] = static_cast<int64_t>(errors.size());
  out["total_input_tokens"] = input;
  out["total_output_tokens"] = output;
  out["request_throughput"] = completed / duration;
  if (!o.goodput.empty()) out["request_goodput"] = good / duration;
  out["output_throughput"] = static_cast<double>(output) / duration;
  out["total_token_throughput"] = static_cast<double>(input + output) / duration;
  out["max_output_tokens_per_s"] = peak;
  put_stats(out, "ttft", stats_ms(ttft));
  put_stats(out, "tpot", stats_ms(tpot));
  put_stats(out, "itl", stats_ms(itl));
  put_stats(out, "e2el", stats_ms(e2el));
  // Interactivity: tokens per second one user sees once its answer streams.
  const double mean_tpot = out["mean_tpot_ms"].get<double>();
  out["output_tokens_per_s_per_user"] = mean_tpot > 0 ? 1000.0 / mean_tpot : 0.0;
  out["prefix_cached_tokens"] = cached;
  out["prefix_hit_rate"] = input > 0 ? static_cast<double>(cached) / static_cast<double>(input) : 0.0;
  if (before && after && after->first > before->first)
    out["server_prefix_hit_rate"] = (after->second - before->second) / (after->first - before->first);
  // Speculative decoding (vLLM's counters): acceptance over the run, as vLLM's bench serve prints it.
  const double drafts = counter_delta(counters_before, counters_after, "spec_decode_num_drafts_total");
  if (drafts > 0) {
    const double accepted = counter_delta(counters_before, counters_after, "spec_decode_num_accepted_tokens_total");
    const double draft_tokens = counter_delta(counters_before, counters_after, "spec_decode_num_draft_tokens_total");
    out["spec_decode_acceptance_length"] = 1.0 + accepted / drafts;
    out["spec_decode_acceptance_rate"] = draft_tokens > 0 ? accepted / draft_tokens : 0.0;
    out["spec_decode_num_drafts"] = drafts;
    out["spec_decode_draft_tokens"] = draft_tokens;
    out["spec_decode_accepted_tokens"] = accepted;
  }
  if (o.dataset == "agentic")
    out["agentic"] = {{"turns", o.agentic_turns},       {"prefix_len", o.agentic_prefix_len},
                      {"turn_len", o.agentic_turn_len}, {"salt_len", o.agentic_salt_len},
                      {"think_time_s", o.agentic_think_time}};
  else
    out["random"] = {{"input_len", o.random_input_len}, {"output_len", o.random_output_len},
                     {"range_ratio", o.random_range_ratio}};
  out["input_lens"] = input_lens;
  out["output_lens"] = output_lens;
  out["errors"] = errors;
  return out;
}

std::string format_bench_result(const Json& r) {
  std::string s;
  auto line = [&](const std::string& k, const std::string& v) { s += fmt::format("{:<40}{:<10}\n", k, v); };
  auto num = [&](const char* key) { return fmt::format("{:.2f}", r[key].get<double>()); };
  auto title = [&](const std::string& t) { s += fmt::format("{:-^50}\n", t); };
  s += fmt::format("{:=^50}\n", " Serving Benchmark Result ");
  line("Successful requests:", std::to_string(r["completed"].get<int>()));
  line("Failed requests:", std::to_string(r["failed"].get<int64_t>()));
  if (!r["max_concurrency"].is_null())
    line("Maximum request concurrency:", std::to_string(r["max_concurrency"].get<int>()));
  line("Benchmark duration (s):", num("duration"));
  line("Total input tokens:", std::to_string(r["total_input_tokens"].get<int64_t>()));
  line("Total generated tokens:", std::to_string(r["total_output_tokens"].get<int64_t>()));
  line("Request throughput (req/s):", num("request_throughput"));
  if (r.contains("request_goodput")) line("Request goodput (req/s):", num("request_goodput"));
  line("Output token throughput (tok/s):", num("output_throughput"));
  line("Peak output token throughput (tok/s):", num("max_output_tokens_per_s"));
  line("Total Token throughput (tok/s):", num("total_token_throughput"));
  if (r["dataset"] == "agentic" || r["prefix_cached_tokens"].get<int64_t>() > 0) {
    line("Prefix cache hit rate (usage):", fmt::format("{:.2f}%", 100 * r["prefix_hit_rate"].get<double>()));
    if (r.contains("server_prefix_hit_rate"))
      line("Prefix cache hit rate (/metrics):",
           fmt::format("{:.2f}%", 100 * r["server_prefix_hit_rate"].get<double>()));
  }
  if (r.contains("spec_decode_acceptance_length")) {
    title(" Speculative Decoding ");
    line("Acceptance rate (%):", fmt::format("{:.2f}", 100 * r["spec_decode_acceptance_rate"].get<double>()));
    line("Acceptance length:", num("spec_decode_acceptance_length"));
    line("Drafts:", fmt::format("{:.0f}", r["spec_decode_num_drafts"].get<double>()));
    line("Draft tokens:", fmt::format("{:.0f}", r["spec_decode_draft_tokens"].get<double>()));
    line("Accepted tokens:", fmt::format("{:.0f}", r["spec_decode_accepted_tokens"].get<double>()));
  }
  for (const auto& [key, name] : {std::pair{"ttft", "Time to First Token"},
                                  std::pair{"tpot", "Time per Output Token (excl. 1st token)"},
                                  std::pair{"itl", "Inter-token Latency"}, std::pair{"e2el", "End-to-end Latency"}}) {
    title(std::string(" ") + name + " ");
    const std::string k = key, upper = k == "e2el" ? "E2EL" : fmt::format("{}", k == "ttft" ? "TTFT" : k == "tpot" ? "TPOT" : "ITL");
    line("Mean " + upper + " (ms):", num(("mean_" + k + "_ms").c_str()));
    line("Median " + upper + " (ms):", num(("median_" + k + "_ms").c_str()));
    line("P99 " + upper + " (ms):", num(("p99_" + k + "_ms").c_str()));
  }
  s += std::string(50, '=') + "\n";
  return s;
}

}  // namespace kestrel::server
