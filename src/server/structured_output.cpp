#include "server/structured_output.h"

#include <algorithm>
#include <functional>
#include <set>

#include "grammar/json_schema.h"
#include "server/api_error.h"

namespace kestrel::server {
namespace {

using Kind = grammar::StructuredOutput::Kind;

// The guided decoding backends vLLM names whose request syntax (xgrammar's EBNF and regex) this engine reads.
const std::set<std::string> kBackends = {"auto", "xgrammar"};

std::string schema_text(const Json& v, const std::string& param) {
  if (v.is_object() || v.is_boolean()) return v.dump();
  if (v.is_string()) {
    const Json parsed = Json::parse(v.get<std::string>(), nullptr, false);
    if (parsed.is_discarded()) bad_request(param, "'{}' is not valid JSON", param);
    if (!parsed.is_object() && !parsed.is_boolean()) bad_request(param, "'{}' must be a JSON schema object", param);
    return parsed.dump();
  }
  bad_request(param, "'{}' must be a JSON schema (an object, or its text)", param);
}

std::vector<std::string> choices(const Json& v, const std::string& param) {
  if (!v.is_array() || v.empty()) bad_request(param, "'{}' must be a non-empty array of strings", param);
  std::vector<std::string> out;
  for (const Json& c : v) {
    if (!c.is_string()) bad_request(param, "'{}' must be a non-empty array of strings", param);
    out.push_back(c.get<std::string>());
  }
  return out;
}

std::string string_field(const Json& v, const std::string& param) {
  if (!v.is_string() || v.get<std::string>().empty()) bad_request(param, "'{}' must be a non-empty string", param);
  return v.get<std::string>();
}

OutputRequest from_response_format(const Json& rf) {
  const std::string p = "response_format";
  if (!rf.is_object()) bad_request(p, "'response_format' must be an object");
  const auto t = rf.find("type");
  if (t == rf.end() || !t->is_string()) bad_request(p, "'response_format.type' must be a string");
  OutputRequest r;
  r.param = p;
  const std::string type = t->get<std::string>();
  if (type == "json_object") {
    r.output.kind = Kind::json_object;
    return r;
  }
  if (type == "json_schema") {
    const auto js = rf.find("json_schema");
    if (js == rf.end() || !js->is_object()) bad_request(p, "'response_format.json_schema' must be an object");
    const auto schema = js->find("schema");
    if (schema == js->end()) bad_request(p, "'response_format.json_schema.schema' is required");
    if (const auto s = js->find("strict"); s != js->end() && !s->is_boolean() && !s->is_null())
      bad_request(p, "'response_format.json_schema.strict' must be a boolean");
    if (const auto n = js->find("name"); n != js->end() && !n->is_string())
      bad_request(p, "'response_format.json_schema.name' must be a string");
    r.output.kind = Kind::json_schema;
    r.output.text = schema_text(*schema, "response_format.json_schema.schema");
    return r;
  }
  if (type == "structural_tag")
    bad_request(p, "response_format type 'structural_tag' is not supported (json_object, json_schema and text are)");
  bad_request(p, "response_format type '{}' is not one of text, json_object, json_schema", type);
}

OutputRequest from_structured_outputs(const Json& so) {
  const std::string p = "structured_outputs";
  if (!so.is_object()) bad_request(p, "'structured_outputs' must be an object");
  OutputRequest r;
  r.param = p;
  int kinds = 0;
  for (const auto& [key, v] : so.items()) {
    if (v.is_null()) continue;
    const std::string where = p + "." + key;
    if (key == "json") {
      ++kinds;
      r.output.kind = Kind::json_schema;
      r.output.text = schema_text(v, where);
    } else if (key == "regex") {
      ++kinds;
      r.output.kind = Kind::regex;
      r.output.text = string_field(v, where);
    } else if (key == "choice") {
      ++kinds;
      r.output.kind = Kind::choice;
      r.output.choices = choices(v, where);
    } else if (key == "grammar") {
      ++kinds;
      r.output.kind = Kind::grammar;
      r.output.text = string_field(v, where);
    } else if (key == "json_object") {
      if (!v.is_boolean()) bad_request(where, "'{}' must be a boolean", where);
      if (v.get<bool>()) {
        ++kinds;
        r.output.kind = Kind::json_object;
      }
    } else if (key == "disable_any_whitespace") {
      if (!v.is_boolean()) bad_request(where, "'{}' must be a boolean", where);
      r.output.any_whitespace = !v.get<bool>();
    } else if (key == "disable_additional_properties" || key == "disable_fallback") {
      // Objects never take properties the schema does not list, and there is no fallback engine.
      if (!v.is_boolean()) bad_request(where, "'{}' must be a boolean", where);
    } else if (key == "whitespace_pattern") {
      bad_request(where, "'{}' is not supported (whitespace is [ \\n\\r\\t]*, or none with disable_any_whitespace)",
                  where);
    } else if (key == "structural_tag") {
      bad_request(where, "'{}' is not supported", where);
    } else {
      bad_request(where, "unknown field '{}' (json, regex, choice, grammar, json_object, disable_any_whitespace)",
                  where);
    }
  }
  if (kinds != 1)
    bad_request(p, "'structured_outputs' needs exactly one of json, regex, choice, grammar, json_object; got {}",
                kinds);
  return r;
}

}  // namespace

std::optional<OutputRequest> parse_output_request(const Json& structured) {
  if (structured.is_null() || structured.empty()) return std::nullopt;
  std::vector<OutputRequest> found;
  if (const auto it = structured.find("response_format"); it != structured.end()) {
    const Json& rf = *it;
    const bool text = rf.is_object() && rf.contains("type") && rf["type"].is_string() && rf["type"] == "text";
    if (!text) found.push_back(from_response_format(rf));
  }
  if (const auto it = structured.find("structured_outputs"); it != structured.end())
    found.push_back(from_structured_outputs(*it));
  for (const char* key : {"guided_json", "guided_regex", "guided_choice", "guided_grammar"}) {
    const auto it = structured.find(key);
    if (it == structured.end()) continue;
    OutputRequest r;
    r.param = key;
    const std::string k = key;
    if (k == "guided_json") r.output.kind = Kind::json_schema, r.output.text = schema_text(*it, k);
    else if (k == "guided_regex") r.output.kind = Kind::regex, r.output.text = string_field(*it, k);
    else if (k == "guided_choice") r.output.kind = Kind::choice, r.output.choices = choices(*it, k);
    else r.output.kind = Kind::grammar, r.output.text = string_field(*it, k);
    found.push_back(std::move(r));
  }
  if (const auto it = structured.find("guided_whitespace_pattern"); it != structured.end())
    bad_request("guided_whitespace_pattern", "'guided_whitespace_pattern' is not supported");
  if (const auto it = structured.find("guided_decoding_backend"); it != structured.end()) {
    if (!it->is_string()) bad_request("guided_decoding_backend", "'guided_decoding_backend' must be a string");
    if (!kBackends.count(it->get<std::string>()))
      bad_request("guided_decoding_backend",
                  "guided decoding backend '{}' is not available: Kestrel's engine reads xgrammar's syntax "
                  "('xgrammar' or 'auto')",
                  it->get<std::string>());
  }
  if (found.empty()) return std::nullopt;
  if (found.size() > 1)
    bad_request(found[1].param, "'{}' and '{}' both constrain the output; give one of them", found[0].param,
                found[1].param);
  return std::move(found[0]);
}

StructuredOutputs::StructuredOutputs(const text::Tokenizer& tok, int32_t vocab_size, int32_t eos,
                                     std::optional<ParserFormat> reasoning)
    : vocab_(grammar::Vocabulary::from_tokenizer(tok, vocab_size, {eos})), reasoning_(reasoning) {}

std::shared_ptr<const grammar::CompiledGrammar> StructuredOutputs::compile(
    const std::string& key, const std::string& param, const std::function<grammar::Grammar()>& build) {
  {
    std::lock_guard lock(mu_);
    if (const auto it = index_.find(key); it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return it->second->second;
    }
  }
  std::shared_ptr<const grammar::CompiledGrammar> g;
  try {
    auto compiled = std::make_shared<const grammar::CompiledGrammar>(build(), vocab_);
    // Every state's mask entry now, on this HTTP thread: the engine loop then only combines cached entries.
    compiled->precompute();
    g = std::move(compiled);
  } catch (const ApiError&) {
    throw;
  } catch (const Error& e) {
    bad_request(param, "'{}': {}", param, e.what());
  }
  std::lock_guard lock(mu_);
  if (const auto it = index_.find(key); it != index_.end()) return it->second->second;
  lru_.emplace_front(key, g);
  index_[key] = lru_.begin();
  if (lru_.size() > kCacheSize) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  return g;
}

std::shared_ptr<const grammar::OutputConstraint> StructuredOutputs::constrain(
    std::shared_ptr<const grammar::CompiledGrammar> g, Start start) {
  auto c = std::make_shared<grammar::OutputConstraint>();
  c->grammar = std::move(g);
  if (start != Start::text) {
    KESTREL_CHECK(reasoning_.has_value(), "a reasoning section without a reasoning parser");
    std::lock_guard lock(mu_);
    if (!markers_) {
      try {
        markers_ = std::make_shared<const grammar::ReasoningMarkers>(vocab_, reasoning_begin_marker(*reasoning_),
                                                                     reasoning_end_marker(*reasoning_));
      } catch (const Error& e) {
        throw ApiError(400, fmt::format("structured output after the reasoning section needs the markers as tokens: {}",
                                        e.what()));
      }
    }
    c->reasoning = markers_;
    c->starts_in_reasoning = start == Start::in_reasoning;
  }
  return c;
}

std::shared_ptr<const grammar::OutputConstraint> StructuredOutputs::output(const std::optional<OutputRequest>& output,
                                                                          Start start) {
  if (!output) return nullptr;
  const grammar::StructuredOutput& so = output->output;
  return constrain(compile(so.key(), output->param, [&] { return grammar::build_grammar(so); }), start);
}

std::shared_ptr<const grammar::OutputConstraint> StructuredOutputs::tool_calls(const ToolCallRequest& calls,
                                                                              ParserFormat format, Start start) {
  const Json key = {{"tools", calls.tools}, {"name", calls.name}, {"parallel", calls.parallel},
                    {"format", static_cast<int>(format)}};
  return constrain(compile(key.dump(-1, ' ', false, Json::error_handler_t::replace), "tools",
                           [&] { return tool_call_grammar(calls, format, *vocab_); }),
                   start);
}

namespace {

constexpr int kMaxToolCalls = 16;  // calls one forced section may hold (indices 0..15)

class ToolGrammar {
 public:
  ToolGrammar(const ToolCallRequest& c, const grammar::Vocabulary& v) : calls_(c), vocab_(v) {}

  // Markup: its special token when the vocabulary has one, else its text.
  grammar::ExprId mark(const std::string& text) {
    if (vocab_.special_id(text) >= 0) return g_.special({text});
    return g_.bytes(text);
  }

  std::vector<const Json*> chosen() const {
    std::vector<const Json*> out;
    for (const Json& t : calls_.tools)
      if (calls_.name.empty() || t["function"]["name"] == calls_.name) out.push_back(&t["function"]);
    return out;
  }

  static Json parameters(const Json& fn) {
    const auto p = fn.find("parameters");
    if (p == fn.end() || p->is_null()) return Json{{"type", "object"}, {"properties", Json::object()}};
    return *p;
  }

  grammar::RuleId schema_rule(const Json& fn, const std::string& pointer = "#") {
    const std::string name = fn["name"].get<std::string>();
    try {
      return grammar::add_json_schema(g_, parameters(fn), "tool_" + sanitise(name), {}, pointer);
    } catch (const Error& e) {
      bad_request("tools", "the parameters of tool '{}': {}", name, e.what());
    }
  }

  static std::string sanitise(const std::string& s) {
    std::string out;
    for (char c : s) out += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
    return out;
  }

  // Calls numbered from i: call i, then optionally the next (parallel), up to kMaxToolCalls.
  grammar::ExprId call_chain(int i, const std::function<grammar::ExprId(int)>& call) {
    const grammar::ExprId here = call(i);
    if (!calls_.parallel || !calls_.name.empty() || i + 1 >= kMaxToolCalls) return here;
    return g_.seq({here, g_.optional(call_chain(i + 1, call))});
  }

  grammar::Grammar kimi() {
    std::vector<std::pair<std::string, grammar::RuleId>> tools;
    for (const Json* fn : chosen()) tools.emplace_back((*fn)["name"].get<std::string>(), schema_rule(*fn));
    auto call = [&](int i) {
      std::vector<grammar::ExprId> alts;
      for (const auto& [name, rule] : tools)
        alts.push_back(g_.seq({g_.bytes(fmt::format("functions.{}:{}", name, i)), mark("<|tool_call_argument_begin|>"),
                               g_.ref(rule)}));
      return g_.seq({mark("<|tool_call_begin|>"), g_.alt(std::move(alts)), mark("<|tool_call_end|>")});
    };
    const grammar::ExprId body = g_.seq({mark("<|tool_calls_section_begin|>"), call_chain(0, call),
                                         mark("<|tool_calls_section_end|>")});
    g_.set_root(g_.add_rule(g_.fresh_name("root"), body));
    return std::move(g_);
  }

  // DSML parameters of one tool: its object schema's properties in order (the required ones always), each a
  // <｜DSML｜parameter> element; a plain string property may be written raw (string="true", no '<') or as JSON.
  grammar::ExprId dsml_parameters(const Json& fn) {
    const Json params = parameters(fn);
    const std::string name = fn["name"].get<std::string>();
    if (!params.is_object() || (params.contains("type") && params["type"] != "object"))
      bad_request("tools", "the parameters of tool '{}' must be an object schema to be written as DSML parameters",
                  name);
    for (const char* k : {"anyOf", "oneOf", "allOf", "$ref"})
      if (params.contains(k))
        bad_request("tools", "the parameters of tool '{}': '{}' at the top level cannot be written as DSML parameters",
                    name, k);
    std::set<std::string> required;
    if (const auto r = params.find("required"); r != params.end() && r->is_array())
      for (const Json& x : *r)
        if (x.is_string()) required.insert(x.get<std::string>());
    std::vector<grammar::ExprId> items;
    const auto props = params.find("properties");
    if (props != params.end() && props->is_object()) {
      for (const auto& [pname, sub] : props->items()) {
        const grammar::RuleId json = schema_rule(fn, "#/properties/" + escape_pointer(pname));
        const bool plain_string = sub.is_object() && sub.value("type", Json()) == "string" &&
                                  std::all_of(sub.items().begin(), sub.items().end(), [](const auto& kv) {
                                    return kv.key() == "type" || kv.key() == "description" || kv.key() == "title";
                                  });
        std::vector<grammar::ExprId> forms = {g_.seq({g_.bytes("false\">"), g_.ref(json)})};
        if (plain_string)
          forms.push_back(g_.seq({g_.bytes("true\">"), g_.star(g_.chars({{'<', '<'}}, true))}));
        const grammar::ExprId element =
            g_.seq({mark("<｜DSML｜parameter"), g_.bytes(fmt::format(" name=\"{}\" string=\"", pname)),
                    g_.alt(std::move(forms)), mark("</｜DSML｜parameter>"), g_.bytes("\n")});
        items.push_back(required.count(pname) ? element : g_.optional(element));
      }
    }
    return g_.seq(std::move(items));
  }

  static std::string escape_pointer(const std::string& s) {
    std::string out;
    for (char c : s) {
      if (c == '~') out += "~0";
      else if (c == '/') out += "~1";
      else out += c;
    }
    return out;
  }

  grammar::Grammar dsml() {
    std::vector<std::pair<std::string, grammar::ExprId>> tools;
    for (const Json* fn : chosen()) tools.emplace_back((*fn)["name"].get<std::string>(), dsml_parameters(*fn));
    std::vector<grammar::ExprId> invokes;
    for (const auto& [name, params] : tools)
      invokes.push_back(g_.seq({mark("<｜DSML｜invoke"), g_.bytes(fmt::format(" name=\"{}\">\n", name)), params,
                                mark("</｜DSML｜invoke>"), g_.bytes("\n")}));
    const grammar::RuleId invoke = g_.add_rule(g_.fresh_name("invoke"), g_.alt(std::move(invokes)));
    const grammar::ExprId body = g_.seq({mark("<｜DSML｜function_calls>"), g_.bytes("\n"),
                                         call_chain(0, [&](int) { return g_.ref(invoke); }),
                                         mark("</｜DSML｜function_calls>")});
    g_.set_root(g_.add_rule(g_.fresh_name("root"), body));
    return std::move(g_);
  }

 private:
  const ToolCallRequest& calls_;
  const grammar::Vocabulary& vocab_;
  grammar::Grammar g_;
};

}  // namespace

grammar::Grammar tool_call_grammar(const ToolCallRequest& calls, ParserFormat format, const grammar::Vocabulary& vocab) {
  if (!calls.tools.is_array() || calls.tools.empty()) bad_request("tools", "forced tool calls need 'tools'");
  ToolGrammar t(calls, vocab);
  if (t.chosen().empty()) bad_request("tool_choice", "tool '{}' is not among 'tools'", calls.name);
  return format == ParserFormat::kimi_k3 ? t.kimi() : t.dsml();
}

}  // namespace kestrel::server
