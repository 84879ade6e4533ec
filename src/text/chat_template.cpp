#include "text/chat_template.h"

#include <ctime>
#include <fstream>
#include <sstream>
#include <unordered_set>

#include "core/error.h"

namespace kestrel::text {

using nlohmann::ordered_json;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot read {}", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool exists(const std::string& path) { return std::ifstream(path).good(); }

jinja::DictData base_context(const ordered_json& cfg) {
  jinja::DictData d;
  d.set("raise_exception", jinja::Value::function("raise_exception", [](jinja::CallArgs& a) -> jinja::Value {
          fail("chat template raised an exception: {}", a.get(0, "message").to_str());
        }));
  d.set("strftime_now", jinja::Value::function("strftime_now", [](jinja::CallArgs& a) {
          const std::string f = a.get(0, "format").to_str();
          const std::time_t t = std::time(nullptr);
          std::tm tm{};
          localtime_r(&t, &tm);
          char buf[512];
          const size_t n = std::strftime(buf, sizeof buf, f.c_str(), &tm);
          return jinja::Value(std::string(buf, n));
        }));
  if (cfg.is_object()) {
    for (const char* k : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
      if (!cfg.contains(k) || cfg[k].is_null()) continue;
      const ordered_json& v = cfg[k];
      if (v.is_string()) d.set(k, jinja::Value(v.get<std::string>()));
      else if (v.is_object() && v.contains("content")) d.set(k, jinja::Value(v["content"].get<std::string>()));
    }
    if (cfg.contains("additional_special_tokens") && cfg["additional_special_tokens"].is_array()) {
      std::vector<jinja::Value> items;
      for (const auto& t : cfg["additional_special_tokens"])
        items.emplace_back(t.is_string() ? t.get<std::string>() : t.value("content", std::string()));
      d.set("additional_special_tokens", jinja::Value::list(std::move(items)));
    }
  }
  return d;
}

jinja::Options hf_options() {
  jinja::Options o;
  o.trim_blocks = true;
  o.lstrip_blocks = true;
  return o;
}

}  // namespace

ChatTemplate::ChatTemplate(std::string_view source, const ordered_json& tokenizer_config)
    : tmpl_(source, hf_options()), base_(base_context(tokenizer_config)) {}

ChatTemplate ChatTemplate::from_model_dir(const std::string& model_dir, const std::string& override_file) {
  const std::string cfg_path = model_dir + "/tokenizer_config.json";
  ordered_json cfg = nullptr;
  if (exists(cfg_path)) {
    try {
      cfg = ordered_json::parse(read_file(cfg_path));
    } catch (const ordered_json::exception& e) {
      fail("{} is not valid JSON: {}", cfg_path, e.what());
    }
  }
  if (!override_file.empty()) return ChatTemplate(read_file(override_file), cfg);
  if (exists(model_dir + "/chat_template.jinja")) return ChatTemplate(read_file(model_dir + "/chat_template.jinja"), cfg);
  if (cfg.is_object() && cfg.contains("chat_template")) {
    const ordered_json& t = cfg["chat_template"];
    if (t.is_string()) return ChatTemplate(t.get<std::string>(), cfg);
    if (t.is_array())
      for (const auto& e : t)
        if (e.value("name", std::string()) == "default") return ChatTemplate(e.at("template").get<std::string>(), cfg);
  }
  fail("{} has no chat template (pass --chat-template FILE)", model_dir);
}

// The request's JSON goes straight into template values, never through a copy of the JSON: copying (like dump())
// recurses once per nesting level, while from_json refuses values nested deeper than jinja::kMaxValueDepth.
std::string ChatTemplate::render(const ordered_json& messages, const ordered_json& tools, bool add_generation_prompt,
                                  const ordered_json& extra, const jinja::Limits& limits) const {
  if (!messages.is_array()) fail("chat messages must be a list");
  jinja::DictData d = base_;
  d.set("messages", jinja::Value::from_json(messages));
  d.set("tools", jinja::Value::from_json(tools));
  d.set("documents", jinja::Value::none());
  d.set("add_generation_prompt", jinja::Value(add_generation_prompt));
  if (extra.is_object()) {
    // set() searches the keys it holds: fine for the globals, quadratic for a request's chat_template_kwargs of
    // thousands of keys (unique among themselves, being a JSON object's). Only a key the context already has is
    // searched for.
    std::unordered_set<std::string> held;
    for (const auto& [k, v] : d.items) held.insert(k);
    for (const auto& [k, v] : extra.items()) {
      if (held.count(k)) d.set(k, jinja::Value::from_json(v));
      else d.items.emplace_back(k, jinja::Value::from_json(v));
    }
  }
  return tmpl_.render(d, limits);
}

std::string ChatTemplate::render_context(const ordered_json& context, const jinja::Limits& limits) const {
  jinja::DictData d = base_;
  if (!context.is_object() && !context.is_null()) fail("template context must be an object");
  if (context.is_object()) {
    std::unordered_set<std::string> held;
    for (const auto& [k, v] : d.items) held.insert(k);
    for (const auto& [k, v] : context.items()) {
      if (held.count(k)) d.set(k, jinja::Value::from_json(v));
      else d.items.emplace_back(k, jinja::Value::from_json(v));
    }
  }
  return tmpl_.render(d, limits);
}

}  // namespace kestrel::text
