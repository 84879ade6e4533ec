#include "server/protocol.h"

#include <cmath>
#include <limits>
#include <set>

#include "server/api_error.h"

namespace kestrel::server {
namespace {

const char* type_of(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "boolean";
    case Json::value_t::string: return "string";
    case Json::value_t::array: return "array";
    case Json::value_t::object: return "object";
    case Json::value_t::number_float: return "number";
    default: return "integer";
  }
}

// Reads the fields of one JSON object with type checks, remembering which keys were read.
class Fields {
 public:
  Fields(const Json& obj, std::string where) : obj_(obj), where_(std::move(where)) {
    if (!obj_.is_object()) bad_request(where_, "'{}' must be an object, got {}", where_, type_of(obj_));
  }

  // The value of `key`, or nullptr when it is absent or JSON null.
  const Json* get(const std::string& key) {
    seen_.insert(key);
    const auto it = obj_.find(key);
    return it == obj_.end() || it->is_null() ? nullptr : &*it;
  }
  bool has(const std::string& key) { return get(key) != nullptr; }

  std::optional<bool> boolean(const std::string& key) {
    const Json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_boolean()) wrong(key, "a boolean", *v);
    return v->get<bool>();
  }
  std::optional<int64_t> integer(const std::string& key, int64_t lo = std::numeric_limits<int64_t>::min(),
                                 int64_t hi = std::numeric_limits<int64_t>::max()) {
    const Json* v = get(key);
    if (!v) return std::nullopt;
    int64_t x = 0;
    if (v->is_number_integer()) {
      if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi)) out_of_range(key, lo, hi, v);
      x = v->get<int64_t>();
    } else if (v->is_number_float()) {  // 5.0 is an integer, as pydantic reads it
      const double d = v->get<double>();
      if (d != std::floor(d) || !std::isfinite(d)) wrong(key, "an integer", *v);
      if (d < -9.2e18 || d > 9.2e18) out_of_range(key, lo, hi, v);
      x = static_cast<int64_t>(d);
    } else {
      wrong(key, "an integer", *v);
    }
    if (x < lo || x > hi) out_of_range(key, lo, hi, v);
    return x;
  }
  std::optional<double> number(const std::string& key) {
    const Json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_number()) wrong(key, "a number", *v);
    const double d = v->get<double>();
    if (!std::isfinite(d)) bad_request(key, "'{}' must be finite", key);
    return d;
  }
  std::optional<std::string> string(const std::string& key) {
    const Json* v = get(key);
    if (!v) return std::nullopt;
    if (!v->is_string()) wrong(key, "a string", *v);
    return v->get<std::string>();
  }

  // Fields present in the object that nobody read.
  std::vector<std::string> unread() const {
    std::vector<std::string> out;
    for (const auto& [k, v] : obj_.items())
      if (!seen_.count(k)) out.push_back(k);
    return out;
  }

  [[noreturn]] static void wrong(const std::string& key, const char* want, const Json& v) {
    bad_request(key, "'{}' must be {}, got {}", key, want, type_of(v));
  }

 private:
  [[noreturn]] static void out_of_range(const std::string& key, int64_t lo, int64_t hi, const Json* v) {
    if (hi == std::numeric_limits<int64_t>::max())
      bad_request(key, "'{}' must be at least {}, got {}", key, lo, v->dump());
    bad_request(key, "'{}' must be in [{}, {}], got {}", key, lo, hi, v->dump());
  }

  const Json& obj_;
  std::string where_;
  std::set<std::string> seen_;
};

// Fields vLLM or OpenAI define that this server does not implement: accepted only at their neutral value.
void reject_unsupported(Fields& f) {
  if (const Json* v = f.get("logit_bias"); v && !(v->is_object() && v->empty()))
    bad_request("logit_bias", "'logit_bias' is not supported");
  if (const auto v = f.integer("min_tokens", 0); v && *v > 0)
    bad_request("min_tokens", "'min_tokens' is not supported");
  if (const auto v = f.boolean("use_beam_search"); v && *v)
    bad_request("use_beam_search", "beam search is not supported");
  for (const char* k : {"truncate_prompt_tokens", "allowed_token_ids", "bad_words", "logits_processors",
                        "lora_request", "chat_template", "suffix"})
    if (f.has(k)) bad_request(k, "'{}' is not supported by this server", k);
}

// The structured-output fields, kept as given for server/structured_output.h.
Json structured_fields(Fields& f) {
  Json out;
  for (const char* k : {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                        "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern"})
    if (const Json* v = f.get(k)) out[k] = *v;
  return out;
}

GenerationParams parse_generation(Fields& f, bool chat) {
  GenerationParams g;
  SamplingParams& s = g.sampling;
  if (auto v = f.string("model")) g.model = *v;
  if (auto v = f.integer("n", 1, kMaxN)) s.n = static_cast<int>(*v);
  if (auto v = f.integer("best_of", 1, kMaxN); v && *v != s.n)
    bad_request("best_of", "'best_of' must equal n ({}); best-of sampling is not supported", s.n);
  if (auto v = f.integer("max_tokens", 1)) g.max_tokens = *v;
  if (chat)
    if (auto v = f.integer("max_completion_tokens", 1)) g.max_tokens = *v;
  if (auto v = f.number("temperature")) {
    if (*v < 0) bad_request("temperature", "'temperature' must be >= 0, got {}", *v);
    s.temperature = static_cast<float>(*v);
  }
  if (auto v = f.number("top_p")) {
    if (!(*v > 0 && *v <= 1)) bad_request("top_p", "'top_p' must be in (0, 1], got {}", *v);
    s.top_p = static_cast<float>(*v);
  }
  if (auto v = f.integer("top_k", -1, std::numeric_limits<int32_t>::max())) s.top_k = *v <= 0 ? 0 : static_cast<int>(*v);
  if (auto v = f.number("min_p")) {
    if (!(*v >= 0 && *v <= 1)) bad_request("min_p", "'min_p' must be in [0, 1], got {}", *v);
    s.min_p = static_cast<float>(*v);
  }
  for (auto [key, field] : {std::pair{"presence_penalty", &s.presence_penalty},
                             std::pair{"frequency_penalty", &s.frequency_penalty}})
    if (auto v = f.number(key)) {
      if (!(*v >= -2 && *v <= 2)) bad_request(key, "'{}' must be in [-2, 2], got {}", key, *v);
      *field = static_cast<float>(*v);
    }
  if (auto v = f.number("repetition_penalty")) {
    if (!(*v > 0)) bad_request("repetition_penalty", "'repetition_penalty' must be > 0, got {}", *v);
    s.repetition_penalty = static_cast<float>(*v);
  }
  if (auto v = f.integer("seed")) {
    s.seed = static_cast<uint64_t>(*v);
    g.seeded = true;
  }
  if (const Json* v = f.get("stop")) {
    if (v->is_string()) {
      g.stop.push_back(v->get<std::string>());
    } else if (v->is_array()) {
      for (const Json& x : *v) {
        if (!x.is_string()) bad_request("stop", "'stop' must be a string or an array of strings");
        g.stop.push_back(x.get<std::string>());
      }
    } else {
      Fields::wrong("stop", "a string or an array of strings", *v);
    }
    for (const std::string& x : g.stop)
      if (x.empty()) bad_request("stop", "stop strings must not be empty");
  }
  if (const Json* v = f.get("stop_token_ids")) {
    if (!v->is_array()) Fields::wrong("stop_token_ids", "an array of integers", *v);
    for (const Json& x : *v) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > std::numeric_limits<int32_t>::max())
        bad_request("stop_token_ids", "'stop_token_ids' must hold token ids (non-negative integers)");
      s.stop_token_ids.push_back(x.get<int32_t>());
    }
  }
  if (auto v = f.boolean("ignore_eos")) s.ignore_eos = *v;
  if (auto v = f.boolean("skip_special_tokens")) g.skip_special_tokens = *v;
  if (auto v = f.boolean("include_stop_str_in_output")) g.include_stop_str_in_output = *v;
  if (auto v = f.boolean("return_tokens_as_token_ids")) g.return_tokens_as_token_ids = *v;
  if (auto v = f.boolean("stream")) g.stream = *v;
  if (const Json* v = f.get("stream_options")) {
    if (!g.stream) bad_request("stream_options", "'stream_options' can only be given when 'stream' is true");
    Fields o(*v, "stream_options");
    if (auto u = o.boolean("include_usage")) g.include_usage = *u;
    if (auto u = o.boolean("continuous_usage_stats")) g.continuous_usage_stats = *u;
  }
  if (auto v = f.integer("priority", std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()))
    g.priority = static_cast<int>(*v);
  if (auto v = f.integer("prompt_logprobs", 0, kMaxLogprobs)) {
    if (g.stream) bad_request("prompt_logprobs", "'prompt_logprobs' are not available when 'stream' is true");
    g.prompt_logprobs = static_cast<int>(*v);
  }
  f.string("user");
  f.get("metadata");
  f.get("store");
  reject_unsupported(f);
  g.structured = structured_fields(f);
  return g;
}

Json content_text(const Json& content, const std::string& where) {
  if (content.is_null() || content.is_string()) return content;
  if (!content.is_array()) bad_request(where, "'{}' must be a string, null or an array of content parts", where);
  std::string text;
  bool first = true;
  for (const Json& part : content) {
    if (!part.is_object()) bad_request(where, "content parts of '{}' must be objects", where);
    const auto t = part.find("type");
    if (t == part.end() || !t->is_string()) bad_request(where, "a content part of '{}' has no 'type'", where);
    if (*t != "text")
      bad_request(where, "content part type '{}' is not supported (this model takes text only)",
                  t->get<std::string>());
    const auto x = part.find("text");
    if (x == part.end() || !x->is_string()) bad_request(where, "a text content part of '{}' has no 'text'", where);
    if (!first) text += "\n";
    text += x->get<std::string>();
    first = false;
  }
  return text;
}

Json parse_messages(const Json* v) {
  if (!v) bad_request("messages", "'messages' is required");
  if (!v->is_array() || v->empty()) bad_request("messages", "'messages' must be a non-empty array");
  Json out = Json::array();
  for (size_t i = 0; i < v->size(); ++i) {
    const Json& m = (*v)[i];
    const std::string where = fmt::format("messages[{}]", i);
    if (!m.is_object()) bad_request(where, "'{}' must be an object", where);
    const auto role = m.find("role");
    if (role == m.end() || !role->is_string()) bad_request(where, "'{}.role' must be a string", where);
    const std::string r = role->get<std::string>();
    static const std::set<std::string> roles = {"system", "developer", "user", "assistant", "tool"};
    if (!roles.count(r)) bad_request(where, "'{}.role' '{}' is not one of system, developer, user, assistant, tool", where, r);
    Json n = m;
    const auto content = m.find("content");
    if (content == m.end()) {
      if (r != "assistant") bad_request(where, "'{}.content' is required for role '{}'", where, r);
      n["content"] = nullptr;
    } else {
      n["content"] = content_text(*content, where + ".content");
    }
    if (const auto tc = m.find("tool_calls"); tc != m.end() && !tc->is_null()) {
      if (r != "assistant" || !tc->is_array()) bad_request(where, "'{}.tool_calls' must be an array on an assistant message", where);
      for (const Json& c : *tc) {
        const auto fn = c.is_object() ? c.find("function") : c.end();
        if (fn == c.end() || !fn->is_object() || !fn->contains("name") || !(*fn)["name"].is_string())
          bad_request(where, "each of '{}.tool_calls' needs a function with a name", where);
      }
    }
    if (const auto rc = m.find("reasoning_content"); rc != m.end() && !rc->is_null() && !rc->is_string())
      bad_request(where, "'{}.reasoning_content' must be a string", where);
    out.push_back(std::move(n));
  }
  return out;
}

Json parse_tools(const Json* v) {
  if (!v) return nullptr;
  if (!v->is_array()) Fields::wrong("tools", "an array", *v);
  for (size_t i = 0; i < v->size(); ++i) {
    const Json& t = (*v)[i];
    const std::string where = fmt::format("tools[{}]", i);
    const auto type = t.is_object() ? t.find("type") : t.end();
    if (!t.is_object() || type == t.end() || !type->is_string() || *type != "function")
      bad_request(where, "'{}' must be an object of type 'function'", where);
    const auto fn = t.find("function");
    if (fn == t.end() || !fn->is_object()) bad_request(where, "'{}.function' must be an object", where);
    const auto name = fn->find("name");
    if (name == fn->end() || !name->is_string() || name->get<std::string>().empty())
      bad_request(where, "'{}.function.name' must be a non-empty string", where);
    if (const auto p = fn->find("parameters"); p != fn->end() && !p->is_null() && !p->is_object())
      bad_request(where, "'{}.function.parameters' must be an object", where);
  }
  return v->empty() ? Json(nullptr) : *v;
}

// A completions-style prompt field: a string, an array of strings, token ids, or an array of token-id arrays.
std::vector<PromptInput> parse_prompts(const Json* p, const std::string& key) {
  if (!p) bad_request(key, "'{}' is required", key);
  auto ids = [&](const Json& a) {
    std::vector<int32_t> out;
    for (const Json& x : a) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > std::numeric_limits<int32_t>::max())
        bad_request(key, "token-id prompts must hold non-negative integers");
      out.push_back(x.get<int32_t>());
    }
    if (out.empty()) bad_request(key, "a prompt must not be empty");
    return out;
  };
  std::vector<PromptInput> prompts;
  if (p->is_string()) {
    prompts.emplace_back(p->get<std::string>());
  } else if (p->is_array() && !p->empty()) {
    if ((*p)[0].is_number_integer()) {
      prompts.emplace_back(ids(*p));
    } else {
      for (const Json& x : *p) {
        if (x.is_string()) prompts.emplace_back(x.get<std::string>());
        else if (x.is_array()) prompts.emplace_back(ids(x));
        else bad_request(key, "'{}' must be a string, an array of strings, or token ids", key);
      }
    }
  } else {
    bad_request(key, "'{}' must be a non-empty string, array of strings, or token ids", key);
  }
  for (const PromptInput& x : prompts)
    if (const auto* s = std::get_if<std::string>(&x); s && s->empty()) bad_request(key, "a prompt must not be empty");
  return prompts;
}

}  // namespace

Json parse_body(const std::string& body) {
  // Deeply nested values would exhaust the stack of whatever walks them recursively later (templates, dumps).
  // Objects of many keys cost quadratic time to build (an ordered object finds each key among those before it):
  // kMaxJsonObjectKeys bounds it.
  std::vector<int> keys;  // per open container: keys so far (objects), -1 (arrays)
  const Json::parser_callback_t limit_depth = [&keys](int depth, Json::parse_event_t event, Json&) {
    // `depth` counts the containers around the one starting: the top-level object is level 1.
    const bool opens = event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start;
    if (opens && depth >= kMaxJsonDepth)
      throw ApiError(400, fmt::format("the request body nests JSON deeper than {} levels", kMaxJsonDepth));
    switch (event) {
      case Json::parse_event_t::object_start: keys.push_back(0); break;
      case Json::parse_event_t::array_start: keys.push_back(-1); break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case Json::parse_event_t::key:
        if (!keys.empty() && ++keys.back() > kMaxJsonObjectKeys)
          throw ApiError(400, fmt::format("an object in the request body has more than {} keys", kMaxJsonObjectKeys));
        break;
      default: break;
    }
    return true;
  };
  Json j;
  try {
    j = Json::parse(body, limit_depth);
  } catch (const Json::parse_error& e) {
    throw ApiError(400, fmt::format("the request body is not valid JSON: {}", e.what()));
  } catch (const Json::out_of_range& e) {  // a number beyond double's range, e.g. 1e400
    throw ApiError(400, fmt::format("the request body holds a number out of range: {}", e.what()));
  } catch (const Json::exception& e) {
    throw ApiError(400, fmt::format("the request body cannot be read as JSON: {}", e.what()));
  }
  if (!j.is_object()) throw ApiError(400, "the request body must be a JSON object");
  return j;
}

CompletionRequest parse_completion_request(const Json& body) {
  Fields f(body, "body");
  CompletionRequest r;
  r.gen = parse_generation(f, false);
  if (const Json* v = f.get("logprobs")) {
    if (v->is_boolean()) Fields::wrong("logprobs", "an integer", *v);
    r.gen.top_logprobs = static_cast<int>(*f.integer("logprobs", 0, kMaxLogprobs));
  }
  if (auto v = f.boolean("echo")) r.echo = *v;
  r.prompts = parse_prompts(f.get("prompt"), "prompt");
  r.gen.ignored_fields = f.unread();
  return r;
}

ScoreTokensRequest parse_score_tokens_request(const Json& body) {
  Fields f(body, "body");
  ScoreTokensRequest r;
  if (auto v = f.string("model")) r.model = *v;
  r.prompts = parse_prompts(f.get("prompt"), "prompt");
  if (const Json* v = f.get("response")) {
    r.responses = parse_prompts(v, "response");
    if (r.responses.size() != r.prompts.size())
      bad_request("response", "'response' must give one response per prompt ({} prompts, {} responses)",
                  r.prompts.size(), r.responses.size());
  }
  if (auto v = f.integer("start", 1)) {
    if (!r.responses.empty()) bad_request("start", "'start' and 'response' cannot both be given");
    r.start = *v;
  }
  if (auto v = f.integer("top_logprobs", 0, kMaxLogprobs)) r.top_logprobs = static_cast<int>(*v);
  if (auto v = f.boolean("return_tokens_as_token_ids")) r.return_tokens_as_token_ids = *v;
  if (auto v = f.integer("priority", std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()))
    r.priority = static_cast<int>(*v);
  if (const auto unread = f.unread(); !unread.empty())
    bad_request(unread[0], "'{}' is not a field of a score_tokens request", unread[0]);
  return r;
}

ChatRequest parse_chat_request(const Json& body) {
  Fields f(body, "body");
  ChatRequest r;
  r.gen = parse_generation(f, true);
  const auto logprobs = f.boolean("logprobs");
  if (auto v = f.integer("top_logprobs", 0, kMaxLogprobs)) {
    if (!logprobs.value_or(false)) bad_request("top_logprobs", "'top_logprobs' needs 'logprobs' to be true");
    r.gen.top_logprobs = static_cast<int>(*v);
  } else if (logprobs.value_or(false)) {
    r.gen.top_logprobs = 0;
  }
  r.messages = parse_messages(f.get("messages"));
  r.tools = parse_tools(f.get("tools"));
  if (auto v = f.boolean("parallel_tool_calls")) r.parallel_tool_calls = *v;
  r.tool_choice = r.tools.is_null() ? ToolChoice::none : ToolChoice::automatic;
  if (const Json* v = f.get("tool_choice")) {
    if (v->is_string()) {
      const std::string c = v->get<std::string>();
      if (c == "none") r.tool_choice = ToolChoice::none;
      else if (c == "auto") r.tool_choice = ToolChoice::automatic;
      else if (c == "required") r.tool_choice = ToolChoice::required;
      else bad_request("tool_choice", "'tool_choice' '{}' is not one of none, auto, required", c);
    } else if (v->is_object()) {
      const auto fn = v->find("function");
      const auto type = v->find("type");
      if (type == v->end() || !type->is_string() || *type != "function" || fn == v->end() || !fn->is_object() || !fn->contains("name") ||
          !(*fn)["name"].is_string())
        bad_request("tool_choice", "a named 'tool_choice' is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}");
      r.tool_choice = ToolChoice::named;
      r.tool_name = (*fn)["name"].get<std::string>();
    } else {
      Fields::wrong("tool_choice", "a string or an object", *v);
    }
    if (r.tool_choice != ToolChoice::none && r.tools.is_null())
      bad_request("tool_choice", "'tool_choice' '{}' needs 'tools'", v->is_string() ? v->get<std::string>() : "named");
    if (r.tool_choice == ToolChoice::named) {
      bool found = false;
      for (const Json& t : r.tools) found = found || t["function"]["name"] == r.tool_name;
      if (!found) bad_request("tool_choice", "tool '{}' of 'tool_choice' is not among 'tools'", r.tool_name);
    }
  }
  if (auto v = f.boolean("add_generation_prompt")) r.add_generation_prompt = *v;
  if (auto v = f.boolean("continue_final_message")) r.continue_final_message = *v;
  if (r.add_generation_prompt && r.continue_final_message)
    bad_request("continue_final_message", "'continue_final_message' and 'add_generation_prompt' cannot both be true");
  if (r.continue_final_message && r.messages.back()["role"] != "assistant")
    bad_request("continue_final_message", "'continue_final_message' needs the last message to be an assistant's");
  if (const Json* v = f.get("chat_template_kwargs")) {
    if (!v->is_object()) Fields::wrong("chat_template_kwargs", "an object", *v);
    r.chat_template_kwargs = *v;
  }
  r.gen.ignored_fields = f.unread();
  return r;
}

TokenizeRequest parse_tokenize_request(const Json& body) {
  Fields f(body, "body");
  TokenizeRequest r;
  if (auto v = f.string("model")) r.model = *v;
  r.prompt = f.string("prompt");
  if (const Json* m = f.get("messages")) r.messages = parse_messages(m);
  if (r.prompt.has_value() == !r.messages.is_null())
    bad_request("prompt", "give exactly one of 'prompt' and 'messages'");
  if (auto v = f.boolean("add_special_tokens")) r.add_special_tokens = *v;
  if (auto v = f.boolean("add_generation_prompt")) r.add_generation_prompt = *v;
  if (auto v = f.boolean("return_token_strs")) r.return_token_strs = *v;
  return r;
}

DetokenizeRequest parse_detokenize_request(const Json& body) {
  Fields f(body, "body");
  DetokenizeRequest r;
  if (auto v = f.string("model")) r.model = *v;
  const Json* t = f.get("tokens");
  if (!t || !t->is_array()) bad_request("tokens", "'tokens' must be an array of token ids");
  for (const Json& x : *t) {
    if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > std::numeric_limits<int32_t>::max())
      bad_request("tokens", "'tokens' must hold non-negative integers");
    r.tokens.push_back(x.get<int32_t>());
  }
  return r;
}

}  // namespace kestrel::server
