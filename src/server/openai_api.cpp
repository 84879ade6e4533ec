#include "server/openai_api.h"

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <random>

#include "server/api_error.h"
#include "server/completion_text.h"
#include "server/prompt_logprobs.h"
#include "server/responses_api.h"

namespace kestrel::server {
namespace {

constexpr const char* kVersion = "0.1.0";

std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

uint64_t random_u64() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return rng();
}

// Python's len() of a UTF-8 string: completions' text_offset counts characters, as vLLM's does.
int64_t char_count(const std::string& s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

std::string random_id(const char* prefix) { return fmt::format("{}{:016x}{:016x}", prefix, random_u64(), random_u64()); }

int64_t unix_time() { return static_cast<int64_t>(std::time(nullptr)); }

const char* finish_name(FinishReason r) {
  switch (r) {
    case FinishReason::stop: return "stop";
    case FinishReason::length: return "length";
    case FinishReason::abort: return "abort";
    default: return "stop";
  }
}

Json bytes_of(const std::string& s) {
  Json b = Json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}

// One choice of a response: completion `index` of prompt `prompt`.
struct Choice {
  int index = 0, prompt = 0;
  CompletionText text;
  OutputDelta total;          // everything so far (the non-streaming message)
  Json logprobs;              // chat: content entries; completions: the four parallel lists
  int64_t tokens = 0;
  double first_time = 0, last_time = 0;
  std::vector<double> gaps;
  std::optional<std::string> finish_reason;
  Json stop_reason;           // the matched stop string or stop token id
  int64_t text_chars = 0;     // completions' text_offset: characters of `text` before the next token

  Choice(int i, int p, const text::Tokenizer& tok, const CompletionTextOptions& o) : index(i), prompt(p), text(tok, o) {}
};

}  // namespace

struct OpenAIApi::Job {
  bool chat = false;
  int32_t lora_id = 0;  // the adapter the request's model names
  std::string id, model;
  GenerationParams gen;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> echo;  // prompt texts to prepend (completions with echo)
  CompletionTextOptions text;
  std::shared_ptr<const grammar::OutputConstraint> constraint;  // structured output
  bool responses = false;  // /v1/responses: a chat request answered as a Responses object or event stream
  Json responses_echoed;   // the request fields the response object repeats
};

OpenAIApi::OpenAIApi(const ApiOptions& opts, const text::Tokenizer& tok, const text::ChatTemplate* chat_template,
                     EngineLoop& loop, ServerMetrics& metrics, LoraApi* lora)
    : opts_(opts),
      tok_(tok),
      chat_template_(chat_template),
      loop_(loop),
      metrics_(metrics),
      lora_(lora),
      rl_(opts.served_model_name, tok, opts.vocab_size, loop, metrics),
      created_(unix_time()),
      seed_rng_(opts.seed ? *opts.seed : std::random_device{}()),
      structured_(tok, static_cast<int32_t>(opts.vocab_size), opts.eos_token_id, opts.reasoning_parser),
      text_pool_(opts.text_threads, opts.text_queue) {
  rl_.set_model_resolver([this](const std::string& model) { return check_model(model); });
  rl_.set_off_thread([this](HttpExchange& ex, std::function<void(const std::atomic<bool>&)> work, bool answer) {
    return off_thread(ex, std::move(work), answer);
  });
}

uint64_t OpenAIApi::draw_seed() {
  std::lock_guard lock(seed_mu_);
  return seed_rng_();
}

awaitable<void> OpenAIApi::handle(HttpExchange& ex) {
  std::optional<ApiError> error;
  try {
    co_await route(ex);
  } catch (const ApiError& e) {
    error = e;
  } catch (const Error& e) {  // tokenizer, chat template, engine admission: the request's content is at fault
    error = ApiError(400, e.what());
  } catch (const std::exception& e) {
    // A fault of the server, not of the request: logged with what it was, answered without it (the text of an
    // internal exception tells a client nothing it can act on, and may tell it about the server).
    std::fprintf(stderr, "[kestrel] internal error on %s: %s\n", ex.path().c_str(), e.what());
    error = ApiError(500, "internal server error; the server's log has the details");
  }
  if (error) {
    metrics_.record_rejected(error->status());
    if (!ex.replied()) co_await ex.reply(error->status(), dump(error->body()));
  }
}

Json generation_defaults(const std::string& dir) {
  Json out = Json::object();
  if (dir.empty()) return out;
  std::ifstream f(dir + "/generation_config.json");
  if (!f) return out;
  const Json g = Json::parse(f, nullptr, false);
  if (!g.is_object()) {
    std::fprintf(stderr, "[kestrel] %s/generation_config.json is not a JSON object; ignored\n", dir.c_str());
    return out;
  }
  for (const char* k : {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"})
    if (g.contains(k) && g[k].is_number()) out[k] = g[k];
  if (g.contains("max_new_tokens") && g["max_new_tokens"].is_number_integer()) out["max_tokens"] = g["max_new_tokens"];
  return out;
}

void OpenAIApi::apply_defaults(Json& body) const {
  for (const auto& [k, v] : opts_.generation_defaults.items()) {
    if (body.contains(k) && !body[k].is_null()) continue;
    if (k == "max_tokens" && body.contains("max_completion_tokens") && !body["max_completion_tokens"].is_null())
      continue;
    body[k] = v;
  }
}

int32_t OpenAIApi::check_model(const std::string& model) const {
  if (model.empty() || model == opts_.served_model_name ||
      std::find(opts_.model_aliases.begin(), opts_.model_aliases.end(), model) != opts_.model_aliases.end())
    return 0;
  if (lora_)
    if (const std::optional<int32_t> id = lora_->id_of(model)) return *id;
  throw ApiError(404, fmt::format("The model `{}` does not exist.", model), "model");
}

awaitable<void> OpenAIApi::route(HttpExchange& ex) {
  const std::string path = ex.path();
  // A CORS preflight: answered before authentication (browsers send no credentials with it), with the CORS headers
  // the HTTP layer adds.
  if (ex.request().method() == http::verb::options) {
    co_await ex.reply(200, "", "text/plain");
    co_return;
  }
  // The RL control routes change what every client gets: they need the key too.
  if (!opts_.api_key.empty() && (path.starts_with("/v1") || path == "/pause" || path == "/resume")) {
    const auto auth = ex.request()[http::field::authorization];
    if (std::string_view(auth.data(), auth.size()) != "Bearer " + opts_.api_key)
      throw ApiError(401, "Unauthorized: a missing or wrong API key");
  }
  if (path == "/v1/completions" || path == "/v1/chat/completions" || path == "/v1/responses") {
    if (ex.request().method() != http::verb::post)
      throw ApiError(405, fmt::format("{} is not allowed on {}", std::string(ex.request().method_string()), path));
    if (path == "/v1/completions") co_await completions(ex);
    else if (path == "/v1/chat/completions") co_await chat(ex);
    else co_await responses(ex);
    co_return;
  }
  if (RlApi::handles(path)) {
    co_await rl_.handle(ex);
    co_return;
  }
  if (LoraApi::handles(path)) {
    if (!lora_) bad_request("", "LoRA adapters are not enabled on this server: start it with --enable-lora");
    co_await lora_->handle(ex, [this](HttpExchange& e, std::function<void(const std::atomic<bool>&)> work) {
      return off_thread(e, std::move(work));
    });
    co_return;
  }
  // Text work (parsing, rendering, tokenising, detokenising: costs that grow with the request) runs on the text
  // threads, so that a large one never holds up an HTTP thread.
  if (path == "/tokenize" || path == "/detokenize") {
    SimpleResponse r{200, ""};
    if (!co_await off_thread(ex, [&](const std::atomic<bool>& cancel) { r = simple_route(ex, &cancel); })) co_return;
    co_await ex.reply(r.status, std::move(r.body), r.content_type);
    co_return;
  }
  SimpleResponse r = simple_route(ex);
  co_await ex.reply(r.status, std::move(r.body), r.content_type);
}

awaitable<bool> OpenAIApi::off_thread(HttpExchange& ex, std::function<void(const std::atomic<bool>&)> work,
                                      bool answer) {
  static const std::atomic<bool> never{false};
  std::shared_ptr<TextPool::Task> task;
  if (answer && text_pool_.stopped()) {
    work(never);
    co_return !ex.client_gone();
  }
  try {
    task = text_pool_.submit(work, ex.notifier(), !answer);
  } catch (const ApiError& e) {
    if (!answer || e.status() != 503) throw;
    work(never);  // stopped since the check above
    co_return !ex.client_gone();
  }
  ex.watch_disconnect();
  // `work` refers to this coroutine's frame: wait for it to end even when the client is gone (it was told to
  // cancel, and a cancelled render stops within a few hundred steps).
  while (!task->done) {
    if (ex.client_gone()) {
      task->cancel = true;
      co_await ex.sleep(std::chrono::milliseconds(2));
    } else {
      co_await ex.wait();
    }
  }
  if (ex.client_gone()) co_return false;
  if (answer && task->dropped) {
    work(never);
    co_return true;
  }
  if (task->error) {
    if (text_pool_.stopped()) {
      try {
        std::rethrow_exception(task->error);
      } catch (const ApiError&) {
        throw;
      } catch (const Error&) {  // cancelled by the shutdown
        throw ApiError(503, "the server is shutting down");
      }
    }
    std::rethrow_exception(task->error);
  }
  co_return true;
}

OpenAIApi::SimpleResponse OpenAIApi::simple_route(const HttpExchange& ex, const std::atomic<bool>* cancel) const {
  const std::string path = ex.path();
  const auto method = ex.request().method();
  auto need = [&](http::verb v) {
    if (method != v && !(v == http::verb::get && method == http::verb::head))
      throw ApiError(405, fmt::format("{} is not allowed on {}", std::string(ex.request().method_string()), path));
  };
  if (path == "/v1/models") {
    need(http::verb::get);
    Json cards = Json::array();
    std::vector<std::string> names = {opts_.served_model_name};
    names.insert(names.end(), opts_.model_aliases.begin(), opts_.model_aliases.end());
    for (const std::string& name : names)
      cards.push_back({{"id", name}, {"object", "model"}, {"created", created_}, {"owned_by", "kestrel"},
                       {"root", opts_.model_dir}, {"parent", nullptr}, {"max_model_len", loop_.max_model_len()}});
    if (lora_)
      for (const Json& card : lora_->model_cards(created_, loop_.max_model_len())) cards.push_back(card);
    return {200, dump(Json{{"object", "list"}, {"data", cards}})};
  }
  if (path == "/ping") {  // vLLM's (SageMaker's) liveness route: /health's answer, on GET or POST
    if (method != http::verb::get && method != http::verb::post && method != http::verb::head)
      throw ApiError(405, fmt::format("{} is not allowed on {}", std::string(ex.request().method_string()), path));
    if (!loop_.alive()) throw ApiError(503, "the engine loop is not running");
    if (!loop_.admitting()) throw ApiError(503, "the server is shutting down");
    return {200, "", "text/plain"};
  }
  if (path == "/health") {
    need(http::verb::get);
    if (!loop_.alive()) throw ApiError(503, "the engine loop is not running");
    // Draining after SIGTERM: a load balancer should stop sending here.
    if (!loop_.admitting()) throw ApiError(503, "the server is shutting down");
    return {200, "", "text/plain"};
  }
  if (path == "/metrics") {
    need(http::verb::get);
    ServerGauges g;
    g.open_connections = open_connections_ ? open_connections_() : 0;
    g.text_tasks_waiting = static_cast<int64_t>(text_pool_.queued());
    g.text_tasks_running = static_cast<int64_t>(text_pool_.running());
    if (lora_) {
      g.max_loras = lora_->options().max_loras;
      g.lora_name = [this](int32_t id) { return lora_->name_of(id); };
    }
    return {200, metrics_.render(loop_.snapshot(), g), "text/plain; version=0.0.4; charset=utf-8"};
  }
  if (path == "/version") {
    need(http::verb::get);
    return {200, dump(Json{{"version", kVersion}})};
  }
  if (path == "/tokenize") {
    need(http::verb::post);
    const TokenizeRequest r = parse_tokenize_request(parse_body(ex.request().body()));
    check_model(r.model);
    std::vector<int32_t> ids;
    if (r.prompt) ids = tok_.encode(*r.prompt, {.parse_special = true, .add_special_tokens = r.add_special_tokens});
    else ids = encode_prompt(render_chat(r.messages, nullptr, r.add_generation_prompt, false, nullptr, cancel));
    Json strs = nullptr;
    if (r.return_token_strs) {
      strs = Json::array();
      for (int32_t t : ids) strs.push_back(token_text(t));
    }
    return {200, dump(Json{{"count", ids.size()}, {"max_model_len", loop_.max_model_len()}, {"tokens", ids},
                           {"token_strs", strs}})};
  }
  if (path == "/detokenize") {
    need(http::verb::post);
    const DetokenizeRequest r = parse_detokenize_request(parse_body(ex.request().body()));
    check_model(r.model);
    for (int32_t t : r.tokens)
      if (!tok_.is_known(t)) bad_request("tokens", "token id {} is not in the tokenizer's vocabulary", t);
    return {200, dump(Json{{"prompt", tok_.decode(r.tokens)}})};
  }
  throw ApiError(404, fmt::format("no route {}", path));
}

std::string OpenAIApi::token_text(int32_t id) const { return tok_.is_known(id) ? tok_.decode({&id, 1}) : ""; }

std::vector<int32_t> OpenAIApi::encode_prompt(const std::string& text) const {
  return tok_.encode(text, {.parse_special = true, .add_special_tokens = false});
}

void OpenAIApi::check_text_length(const std::string& text, const char* param) const {
  // Each token stands for at most max_token_bytes() bytes; twice that leaves room for normalizers that shorten
  // text. Beyond it the prompt cannot fit, and tokenising it whole would only cost memory and time.
  const uint64_t max_len = static_cast<uint64_t>(loop_.max_model_len());
  const uint64_t bound = max_len * 2 * tok_.max_token_bytes();
  if (text.size() > bound)
    bad_request(param,
                "This model's maximum context length is {} tokens. However, your request's prompt is {} bytes long, "
                "which is more than {} tokens whatever its text. Please reduce the length of the input.",
                max_len, text.size(), max_len);
}

std::string OpenAIApi::render_chat(const Json& messages, const Json& tools, bool add_generation_prompt,
                                   bool continue_final_message, const Json& kwargs,
                                   const std::atomic<bool>* cancel) const {
  if (!chat_template_) bad_request("messages", "this model has no chat template; pass --chat-template FILE");
  text::jinja::Limits limits;
  limits.max_seconds = opts_.template_seconds;
  limits.cancel = cancel;
  std::string text = chat_template_->render(messages, tools, add_generation_prompt, kwargs, limits);
  if (continue_final_message) {
    // The prompt ends inside the final assistant message: cut what the template wrote after its content.
    const Json& last = messages.back()["content"];
    const std::string content = last.is_string() ? last.get<std::string>() : "";
    const size_t at = content.empty() ? std::string::npos : text.rfind(content);
    if (at == std::string::npos)
      bad_request("continue_final_message", "the final message's content is not in the rendered prompt");
    text.resize(at + content.size());
  }
  return text;
}

awaitable<void> OpenAIApi::completions(HttpExchange& ex) {
  Job job;
  if (!co_await off_thread(ex, [&](const std::atomic<bool>& cancel) { prepare_completions(ex.request().body(), job, cancel); }))
    co_return;
  co_await generate(ex, job);
}

void OpenAIApi::prepare_completions(const std::string& body, Job& job, const std::atomic<bool>&) {
  Json j = parse_body(body);
  apply_defaults(j);
  const CompletionRequest r = parse_completion_request(j);
  job.lora_id = check_model(r.gen.model);
  job.id = random_id("cmpl-");
  job.gen = r.gen;
  job.constraint = structured_.output(parse_output_request(r.gen.structured), StructuredOutputs::Start::text);
  for (const PromptInput& p : r.prompts) {
    if (const auto* s = std::get_if<std::string>(&p)) {
      check_text_length(*s, "prompt");
      job.prompts.push_back(encode_prompt(*s));
      if (r.echo) job.echo.push_back(*s);
    } else {
      const auto& ids = std::get<std::vector<int32_t>>(p);
      job.prompts.push_back(ids);
      if (r.echo) job.echo.push_back(tok_.decode(ids));
    }
  }
}

awaitable<void> OpenAIApi::chat(HttpExchange& ex) {
  Job job;
  if (!co_await off_thread(ex, [&](const std::atomic<bool>& cancel) { prepare_chat(ex.request().body(), job, cancel); }))
    co_return;
  co_await generate(ex, job);
}

awaitable<void> OpenAIApi::responses(HttpExchange& ex) {
  Job job;
  auto prepare = [&](const std::atomic<bool>& cancel) {
    const ResponsesRequest rr = translate_responses_request(parse_body(ex.request().body()));
    Json chat = rr.chat;
    prepare_chat_json(chat, job, cancel);
    job.responses = true;
    job.id = "resp_" + job.id.substr(9);
    job.responses_echoed = rr.echoed;
  };
  if (!co_await off_thread(ex, prepare)) co_return;
  co_await generate(ex, job);
}

void OpenAIApi::prepare_chat(const std::string& body, Job& job, const std::atomic<bool>& cancel) {
  Json j = parse_body(body);
  prepare_chat_json(j, job, cancel);
}

void OpenAIApi::prepare_chat_json(Json& j, Job& job, const std::atomic<bool>& cancel) {
  apply_defaults(j);
  const ChatRequest r = parse_chat_request(j);
  job.lora_id = check_model(r.gen.model);
  job.chat = true;
  job.id = random_id("chatcmpl-");
  job.gen = r.gen;
  const bool tools = r.tool_choice != ToolChoice::none;
  if (r.tool_choice == ToolChoice::automatic && !(opts_.enable_auto_tool_choice && opts_.tool_call_parser))
    bad_request("tool_choice",
                "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set");
  if ((r.tool_choice == ToolChoice::required || r.tool_choice == ToolChoice::named) && !opts_.tool_call_parser)
    bad_request("tool_choice", "tool_choice \"required\" or a named tool needs the server's --tool-call-parser");
  const std::string prompt = render_chat(r.messages, r.tools, r.add_generation_prompt, r.continue_final_message,
                                         r.chat_template_kwargs, &cancel);
  check_text_length(prompt, "messages");
  ParserOptions parser;
  if (tools) {
    parser.tools = opts_.tool_call_parser;
    parser.call_id_prefix = "call_" + job.id.substr(9, 8) + "_";
  }
  if (opts_.reasoning_parser) {
    parser.reasoning = opts_.reasoning_parser;
    parser.start_in_reasoning = prompt.ends_with(reasoning_begin_marker(*opts_.reasoning_parser));
  }
  if (parser.tools || parser.reasoning) job.text.parser = parser;
  // Constraints start where the reasoning parser's section ends. Forced tool calls are written by the model in its
  // own syntax, constrained to the tools' parameter schemas.
  const std::optional<OutputRequest> output = parse_output_request(r.gen.structured);
  // A prompt that closed the reasoning section (thinking turned off by the template) starts with the answer.
  const bool reasoning_closed = parser.reasoning && prompt.ends_with(reasoning_end_marker(*parser.reasoning));
  const auto start = !parser.reasoning || reasoning_closed ? StructuredOutputs::Start::text
                     : parser.start_in_reasoning          ? StructuredOutputs::Start::in_reasoning
                                                          : StructuredOutputs::Start::maybe_reasoning;
  if (r.tool_choice == ToolChoice::required || r.tool_choice == ToolChoice::named) {
    if (output)
      bad_request(output->param, "'{}' cannot be combined with tool_choice \"{}\"", output->param,
                  r.tool_choice == ToolChoice::named ? "named" : "required");
    job.constraint = structured_.tool_calls({r.tools, r.tool_name, r.parallel_tool_calls}, *opts_.tool_call_parser,
                                            start);
  } else {
    job.constraint = structured_.output(output, start);
  }
  job.prompts.push_back(encode_prompt(prompt));
}

awaitable<void> OpenAIApi::generate(HttpExchange& ex, Job& job) {
  const GenerationParams& gen = job.gen;
  const int n = gen.sampling.n, P = static_cast<int>(job.prompts.size());
  const int64_t max_len = loop_.max_model_len();
  if (!gen.ignored_fields.empty())
    std::fprintf(stderr, "[kestrel] request %s: ignored unknown fields: %s\n", job.id.c_str(),
                 fmt::format("{}", fmt::join(gen.ignored_fields, ", ")).c_str());

  if (gen.top_logprobs > opts_.max_logprobs)
    bad_request("logprobs", "the server allows at most {} logprobs (--max-logprobs), got {}", opts_.max_logprobs,
                gen.top_logprobs);
  if (gen.prompt_logprobs > opts_.max_logprobs)
    bad_request("prompt_logprobs", "the server allows at most {} prompt_logprobs (--max-logprobs), got {}",
                opts_.max_logprobs, gen.prompt_logprobs);
  const bool echo_logprobs = !job.chat && !job.echo.empty() && gen.top_logprobs >= 0 && !gen.stream;
  // Admission checks the engine would also make, answered in vLLM's words.
  std::vector<SamplingParams> params(P, gen.sampling);
  const uint64_t seed = gen.seeded ? gen.sampling.seed : draw_seed();
  for (int p = 0; p < P; ++p) {
    const auto& ids = job.prompts[p];
    const int64_t len = static_cast<int64_t>(ids.size());
    if (len == 0) bad_request("prompt", "the prompt is empty after tokenisation");
    for (int32_t t : ids)
      if (t >= opts_.vocab_size) bad_request("prompt", "token id {} is out of the vocabulary (size {})", t, opts_.vocab_size);
    if (len >= max_len)
      bad_request(job.chat ? "messages" : "prompt",
                  "This model's maximum context length is {} tokens. However, your request has {} input tokens. "
                  "Please reduce the length of the input messages.",
                  max_len, len);
    const int64_t want = gen.max_tokens.value_or(max_len - len);
    if (len + want > max_len)
      bad_request("max_tokens",
                  "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the "
                  "messages, {} in the completion). Please reduce the length of the messages or completion.",
                  max_len, len + want, len, want);
    params[p].max_tokens = static_cast<int>(want);
    params[p].seed = seed + static_cast<uint64_t>(p) * 0x9E3779B97F4A7C15ull;
    params[p].logprobs = gen.top_logprobs;
    params[p].prompt_logprobs = gen.prompt_logprobs;
    // echo with logprobs: the prompt's tokens come first in `logprobs`, with their log-probabilities (not streamed:
    // those are known once the request ends).
    if (echo_logprobs) params[p].prompt_logprobs = std::max(gen.prompt_logprobs, gen.top_logprobs);
    params[p].constraint = job.constraint;
    params[p].lora_id = job.lora_id;
    params[p].validate(opts_.vocab_size);
  }

  std::vector<std::shared_ptr<RequestStream>> reqs;
  const auto notify = ex.notifier();
  try {
    for (int p = 0; p < P; ++p) reqs.push_back(loop_.submit(job.prompts[p], params[p], gen.priority, notify));
  } catch (const ApiError&) {
    for (auto& r : reqs) loop_.abort(r);
    throw;
  }

  std::vector<Choice> choices;
  choices.reserve(static_cast<size_t>(P) * n);
  for (int p = 0; p < P; ++p)
    for (int i = 0; i < n; ++i) {
      CompletionTextOptions o = job.text;
      o.skip_special_tokens = gen.skip_special_tokens;
      o.stop = gen.stop;
      o.include_stop_str_in_output = gen.include_stop_str_in_output;
      o.stop_token_ids = gen.sampling.stop_token_ids;
      if (!gen.sampling.ignore_eos) o.stop_token_ids.push_back(opts_.eos_token_id);
      choices.emplace_back(p * n + i, p, tok_, o);
      if (!job.echo.empty()) choices.back().text_chars = char_count(job.echo[p]);
    }

  const int64_t created = unix_time();
  const std::string object = job.chat ? "chat.completion.chunk" : "text_completion";
  int64_t prompt_tokens = 0;
  for (const auto& ids : job.prompts) prompt_tokens += static_cast<int64_t>(ids.size());
  auto usage = [&] {
    int64_t completion = 0, cached = 0;
    for (const Choice& c : choices) completion += c.tokens;
    for (const auto& r : reqs) cached += r->cached_tokens();
    return Json{{"prompt_tokens", prompt_tokens},
                {"total_tokens", prompt_tokens + completion},
                {"completion_tokens", completion},
                {"prompt_tokens_details", {{"cached_tokens", cached}}}};
  };
  auto chunk = [&](Json choice) {
    Json c = {{"id", job.id}, {"object", object}, {"created", created}, {"model", opts_.served_model_name},
              {"choices", Json::array({std::move(choice)})}};
    if (gen.include_usage) c["usage"] = gen.continuous_usage_stats ? usage() : Json(nullptr);
    return dump(c);
  };
  auto delta_json = [](const OutputDelta& d) {
    Json j = Json::object();
    if (!d.reasoning.empty()) j["reasoning_content"] = d.reasoning;
    if (!d.content.empty()) j["content"] = d.content;
    if (!d.tool_calls.empty()) {
      Json calls = Json::array();
      for (const ToolCallDelta& t : d.tool_calls) {
        Json c = {{"index", t.index}};
        Json fn = Json::object();
        if (!t.id.empty()) {
          c["id"] = t.id;
          c["type"] = "function";
          fn["name"] = t.name;
        }
        fn["arguments"] = t.arguments;
        c["function"] = fn;
        calls.push_back(c);
      }
      j["tool_calls"] = calls;
    }
    return j;
  };
  // A token's log-probabilities in the response's format; appended to `into` (the choice's or a chunk's).
  auto logprob_token = [&](int32_t id) {
    return gen.return_tokens_as_token_ids ? fmt::format("token_id:{}", id) : token_text(id);
  };
  auto add_logprob = [&](Choice& c, const TokenLogprob& lp, Json& into) {
    const std::string text = logprob_token(lp.token);
    if (job.chat) {
      Json top = Json::array();
      for (const auto& [t, l] : lp.top) {
        const std::string s = logprob_token(t);
        top.push_back({{"token", s}, {"logprob", l}, {"bytes", bytes_of(s)}});
      }
      if (into.is_null()) into = {{"content", Json::array()}};
      into["content"].push_back({{"token", text}, {"logprob", lp.logprob}, {"bytes", bytes_of(text)}, {"top_logprobs", top}});
    } else {
      Json top = Json::object();
      for (const auto& [t, l] : lp.top) top[logprob_token(t)] = l;
      if (into.is_null())
        into = {{"text_offset", Json::array()}, {"token_logprobs", Json::array()}, {"tokens", Json::array()},
                {"top_logprobs", Json::array()}};
      into["text_offset"].push_back(c.text_chars);
      into["token_logprobs"].push_back(lp.logprob);
      into["tokens"].push_back(text);
      into["top_logprobs"].push_back(top);
    }
  };
  auto finish_reason = [&](const Choice& c, FinishReason r) -> std::string {
    if (job.chat && c.text.num_tool_calls() > 0 && r == FinishReason::stop) return "tool_calls";
    return finish_name(r);
  };
  auto stream_choice = [&](const Choice& c, const OutputDelta& d, Json logprobs) -> Json {
    Json j = {{"index", c.index}};
    if (job.chat) j["delta"] = delta_json(d);
    else j["text"] = d.content;
    j["logprobs"] = std::move(logprobs);
    j["finish_reason"] = nullptr;
    return j;
  };

  bool gone = false;
  std::optional<ResponsesStream> rs;
  if (job.responses) rs.emplace(job.id, created, opts_.served_model_name, job.responses_echoed);
  auto send_all = [&](std::vector<std::string> events) -> awaitable<void> {
    for (const std::string& e : events)
      if (!gone) gone = !co_await ex.send_event(e);
  };
  if (gen.stream && rs) {
    gone = !co_await ex.begin_events();
    co_await send_all(rs->begin());
  } else if (gen.stream) {
    gone = !co_await ex.begin_events();
    for (Choice& c : choices) {
      if (gone) break;
      Json first;
      if (job.chat) first = {{"index", c.index}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
      else if (!job.echo.empty()) first = {{"index", c.index}, {"text", job.echo[c.prompt]}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
      else continue;
      gone = !co_await ex.send_event(chunk(first));
    }
  }
  ex.watch_disconnect();

  std::vector<Json> prompt_logprobs(P);  // with gen.prompt_logprobs >= 0: built with the answer
  std::vector<std::vector<TokenLogprob>> prompt_lps(P);  // ... from these, once each request finished
  std::vector<int64_t> prompt_lps_start(P, 0);
  std::vector<std::vector<TokenLogprob>> echo_lps(P);  // with echo_logprobs: positions 1.. of each prompt
  std::vector<bool> over(P, false);
  std::vector<double> finish_time(P, 0);
  std::optional<ApiError> failure;
  auto close_choice = [&](Choice& c, const OutputDelta& last, const std::string& reason, Json stop_reason,
                          Json logprobs) -> awaitable<void> {
    c.total.merge(last);
    c.finish_reason = reason;
    c.stop_reason = std::move(stop_reason);
    if (!gen.stream || gone) co_return;
    if (rs) {
      co_await send_all(rs->delta(last));
      co_return;
    }
    if (!last.empty() || !logprobs.is_null()) gone = !co_await ex.send_event(chunk(stream_choice(c, last, std::move(logprobs))));
    Json fin = {{"index", c.index}};
    if (job.chat) fin["delta"] = Json::object();
    else fin["text"] = "";
    fin["logprobs"] = nullptr;
    fin["finish_reason"] = reason;
    fin["stop_reason"] = c.stop_reason;
    if (!gone) gone = !co_await ex.send_event(chunk(fin));
  };

  while (!gone) {
    for (int p = 0; p < P; ++p) {
      if (over[p]) continue;
      RequestEvents ev;
      over[p] = reqs[p]->take(ev);
      for (const TokenRecord& t : ev.tokens) {
        Choice& c = choices[static_cast<size_t>(p) * n + t.index];
        if (c.finish_reason) continue;  // ended by a stop string; the engine has not stopped it yet
        ++c.tokens;
        if (c.first_time == 0) c.first_time = t.time;
        else c.gaps.push_back(t.time - c.last_time);
        c.last_time = t.time;
        OutputDelta d;
        c.text.push(t.token, d);
        Json lp = nullptr;
        if (t.logprob) {
          add_logprob(c, *t.logprob, c.logprobs);
          add_logprob(c, *t.logprob, lp);
          c.text_chars += char_count(logprob_token(t.token));
        }
        if (c.text.stopped_by_string()) {
          co_await close_choice(c, d, "stop", *c.text.stop_string(), std::move(lp));
          const bool all = std::all_of(choices.begin() + p * n, choices.begin() + (p + 1) * n,
                                       [](const Choice& x) { return x.finish_reason.has_value(); });
          if (all) loop_.abort(reqs[p]);
          continue;
        }
        c.total.merge(d);
        if (gen.stream && !gone && rs) co_await send_all(rs->delta(d));
        else if (gen.stream && !gone && (!d.empty() || !lp.is_null()))
          gone = !co_await ex.send_event(chunk(stream_choice(c, d, std::move(lp))));
      }
      if (ev.error) failure = ApiError(ev.error_status == 400 ? 400 : 503, *ev.error);
      if (ev.finished) {
        finish_time[p] = ev.finish_time;
        if (gen.prompt_logprobs >= 0) {
          prompt_lps[p] = ev.finished->prompt_logprobs;
          prompt_lps_start[p] = ev.finished->prompt_logprobs_start;
        }
        if (echo_logprobs && ev.finished->prompt_logprobs_start == 1) echo_lps[p] = ev.finished->prompt_logprobs;
        for (const Completion& comp : ev.finished->completions) {
          Choice& c = choices[static_cast<size_t>(p) * n + comp.index];
          if (c.finish_reason) continue;
          OutputDelta d;
          c.text.finish(d);
          Json stop_reason = nullptr;
          if (comp.finish == FinishReason::stop && !comp.token_ids.empty() &&
              comp.token_ids.back() != opts_.eos_token_id)
            stop_reason = comp.token_ids.back();
          co_await close_choice(c, d, finish_reason(c, comp.finish), stop_reason, nullptr);
        }
      }
      if (over[p] && finish_time[p] == 0) finish_time[p] = ev.finish_time;
    }
    if (failure || std::all_of(over.begin(), over.end(), [](bool b) { return b; })) break;
    if (ex.client_gone()) gone = true;
    if (gone) break;
    co_await ex.wait();
    if (ex.client_gone()) gone = true;
  }
  gone = gone || ex.client_gone();
  if (gone || failure)
    for (int p = 0; p < P; ++p)
      if (!over[p]) loop_.abort(reqs[p]);

  for (int p = 0; p < P; ++p) {
    RequestRecord rec;
    rec.arrival = reqs[p]->arrival_time();
    rec.scheduled = reqs[p]->scheduled_time();
    rec.finished = finish_time[p] > 0 ? finish_time[p] : now_seconds();
    rec.prompt_tokens = static_cast<int64_t>(job.prompts[p].size());
    for (int i = 0; i < n; ++i) {
      const Choice& c = choices[static_cast<size_t>(p) * n + i];
      rec.generation_tokens += c.tokens;
      if (c.first_time > 0 && (rec.first_token == 0 || c.first_time < rec.first_token)) rec.first_token = c.first_time;
      rec.token_gaps.insert(rec.token_gaps.end(), c.gaps.begin(), c.gaps.end());
    }
    const Choice& c0 = choices[static_cast<size_t>(p) * n];
    rec.finished_reason = failure ? "error"
                          : gone || !c0.finish_reason ? "abort"
                          : *c0.finish_reason == "tool_calls" ? "stop"
                                                              : *c0.finish_reason;
    metrics_.record(rec);
  }
  if (gone) co_return;
  if (failure) {
    if (!gen.stream) throw *failure;
    co_await ex.send_event(dump(failure->body()));
    co_await ex.send_event("[DONE]");
    co_await ex.end_events();
    co_return;
  }

  auto response_end = [&] {
    ResponseEnd e;
    e.input_tokens = prompt_tokens;
    for (const auto& r : reqs) e.cached_tokens += r->cached_tokens();
    for (const Choice& c : choices) e.output_tokens += c.tokens;
    e.finish_reason = choices[0].finish_reason.value_or("abort");
    return e;
  };
  if (rs && gen.stream) {
    co_await send_all(rs->finish(response_end()));
    if (!gone) co_await ex.end_events();
    co_return;
  }
  if (rs) {
    const ResponseEnd end = response_end();
    co_await ex.reply(200, dump(response_object(job.id, created, opts_.served_model_name, job.responses_echoed,
                                                response_items(job.id, choices[0].total), &end)));
    co_return;
  }
  if (gen.stream) {
    if (gen.include_usage) {
      Json u = {{"id", job.id}, {"object", object}, {"created", created}, {"model", opts_.served_model_name},
                {"choices", Json::array()}, {"usage", usage()}};
      if (!co_await ex.send_event(dump(u))) co_return;
    }
    if (!co_await ex.send_event("[DONE]")) co_return;
    co_await ex.end_events();
    co_return;
  }

  // The answer of a non-streaming request: its prompt and alternative tokens detokenised (echo, prompt_logprobs)
  // and the JSON written, costs that grow with the request, on the text threads.
  std::string answer;
  auto build = [&](const std::atomic<bool>&) {
    for (int p = 0; p < P; ++p)
      if (gen.prompt_logprobs >= 0)
        prompt_logprobs[p] = prompt_logprobs_json(prompt_lps[p], prompt_lps_start[p], logprob_token);
    // The prompt's tokens before the generated ones (vLLM's echo with logprobs): the first has no context (null).
    auto with_prompt_logprobs = [&](const Choice& c) {
      const std::vector<int32_t>& ids = job.prompts[c.prompt];
      const std::vector<TokenLogprob>& lps = echo_lps[c.prompt];
      Json out = {{"text_offset", Json::array()}, {"token_logprobs", Json::array()}, {"tokens", Json::array()},
                  {"top_logprobs", Json::array()}};
      int64_t at = 0;
      for (size_t i = 0; i < ids.size(); ++i) {
        const std::string text = logprob_token(ids[i]);
        out["text_offset"].push_back(at);
        out["tokens"].push_back(text);
        at += char_count(text);
        if (i == 0 || i - 1 >= lps.size()) {
          out["token_logprobs"].push_back(nullptr);
          out["top_logprobs"].push_back(nullptr);
          continue;
        }
        const TokenLogprob& lp = lps[i - 1];
        out["token_logprobs"].push_back(lp.logprob);
        Json top = Json::object();
        for (size_t k = 0; k < lp.top.size() && static_cast<int>(k) < gen.top_logprobs; ++k)
          top[logprob_token(lp.top[k].first)] = lp.top[k].second;
        out["top_logprobs"].push_back(top);
      }
      if (c.logprobs.is_object())
        for (const char* k : {"text_offset", "token_logprobs", "tokens", "top_logprobs"})
          for (const Json& v : c.logprobs[k]) out[k].push_back(v);
      return out;
    };
    Json out_choices = Json::array();
    for (const Choice& c : choices) {
      Json j = {{"index", c.index}};
      if (job.chat) {
        Json calls = Json::array();
        for (const ToolCallDelta& t : c.total.tool_calls)
          calls.push_back({{"id", t.id}, {"type", "function"}, {"function", {{"name", t.name}, {"arguments", t.arguments}}}});
        const bool no_content = c.total.content.empty() && !calls.empty();
        j["message"] = {{"role", "assistant"},
                        {"content", no_content ? Json(nullptr) : Json(c.total.content)},
                        {"reasoning_content", c.total.reasoning.empty() ? Json(nullptr) : Json(c.total.reasoning)},
                        {"tool_calls", calls}};
      } else {
        j["text"] = (job.echo.empty() ? std::string() : job.echo[c.prompt]) + c.total.content;
      }
      j["logprobs"] = c.logprobs;
      if (echo_logprobs) j["logprobs"] = with_prompt_logprobs(c);
      j["finish_reason"] = c.finish_reason.value_or("abort");
      j["stop_reason"] = c.stop_reason;
      if (!job.chat && gen.prompt_logprobs >= 0) j["prompt_logprobs"] = prompt_logprobs[c.prompt];
      out_choices.push_back(std::move(j));
    }
    Json body = {{"id", job.id},
                 {"object", job.chat ? "chat.completion" : "text_completion"},
                 {"created", created},
                 {"model", opts_.served_model_name},
                 {"choices", out_choices},
                 {"usage", usage()}};
    if (job.chat && gen.prompt_logprobs >= 0) body["prompt_logprobs"] = prompt_logprobs[0];
    answer = dump(body);
  };
  if (!co_await off_thread(ex, build, true)) co_return;
  co_await ex.reply(200, std::move(answer));
}

}  // namespace kestrel::server
