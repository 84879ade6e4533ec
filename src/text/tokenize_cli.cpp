#include "text/tokenize_cli.h"

#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/chat_template.h"
#include "text/detokenizer.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace kestrel::text {

using nlohmann::ordered_json;

std::string quote_token_bytes(const std::string& bytes) {
  std::string out = "\"";
  size_t i = 0;
  while (i < bytes.size()) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c >= 0x80) {
      const size_t n = utf8_valid_length(bytes, i);
      if (n > 0) {
        out.append(bytes, i, n);
        i += n;
        continue;
      }
    }
    switch (c) {
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      default:
        if (c < 0x20 || c >= 0x7F) out += fmt::format("\\x{:02X}", c);
        else out += static_cast<char>(c);
    }
    ++i;
  }
  return out + "\"";
}

namespace {

std::string hex_decode(const std::string& h) {
  if (h.size() % 2) fail("hex string has odd length");
  std::string out;
  for (size_t i = 0; i < h.size(); i += 2) {
    auto v = [&](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      fail("'{}' is not a hex digit", c);
    };
    out += static_cast<char>(v(h[i]) * 16 + v(h[i + 1]));
  }
  return out;
}

std::string request_text(const ordered_json& r) {
  if (r.contains("hex")) return hex_decode(r["hex"].get<std::string>());
  return r.at("text").get<std::string>();
}

struct Session {
  const TokenizeArgs& args;
  const Tokenizer& tok;
  std::unique_ptr<ChatTemplate> model_template;
  std::map<std::string, std::unique_ptr<ChatTemplate>> templates;

  const ChatTemplate& model_chat_template() {
    if (!model_template)
      model_template = std::make_unique<ChatTemplate>(ChatTemplate::from_model_dir(args.model_dir, args.chat_template));
    return *model_template;
  }
  const ChatTemplate& template_for(const std::string& source) {
    auto& t = templates[source];
    if (!t) t = std::make_unique<ChatTemplate>(source);
    return *t;
  }

  ordered_json answer(const ordered_json& r) {
    const std::string op = r.at("op").get<std::string>();
    if (op == "encode") {
      EncodeOptions o;
      o.parse_special = r.value("parse_special", true);
      o.add_special_tokens = r.value("add_special_tokens", false);
      return {{"ids", tok.encode(request_text(r), o)}};
    }
    if (op == "decode") {
      const auto ids = r.at("ids").get<std::vector<int32_t>>();
      return {{"text", tok.decode(ids, r.value("skip_special", false))}};
    }
    if (op == "stream") {
      // What a streaming client sees after each token: the released chunk and the text still held back.
      const auto ids = r.at("ids").get<std::vector<int32_t>>();
      IncrementalDetokenizer d(tok, r.value("skip_special", false));
      ordered_json chunks = ordered_json::array(), pending = ordered_json::array();
      for (int32_t id : ids) {
        chunks.push_back(d.push(id));
        pending.push_back(d.pending_text());
      }
      return {{"chunks", chunks}, {"pending", pending}};
    }
    if (op == "render") {
      // An explicit template and context, rendered with the chat-template environment.
      static const ordered_json empty_context = ordered_json::object();
      const auto context = r.find("context");
      const ChatTemplate& t = template_for(r.at("template").get<std::string>());
      return {{"text", t.render_context(context != r.end() ? *context : empty_context)}};
    }
    if (op == "chat") {
      // By reference (also the context above): copying request JSON recurses once per nesting level.
      static const ordered_json absent = nullptr;
      const auto tools = r.find("tools"), extra = r.find("extra");
      const std::string text = model_chat_template().render(r.at("messages"), tools != r.end() ? *tools : absent,
                                                            r.value("add_generation_prompt", false),
                                                            extra != r.end() ? *extra : absent);
      return {{"text", text}, {"ids", tok.encode(text)}};
    }
    fail("unknown op '{}'", op);
  }
};

}  // namespace

int run_tokenize(const TokenizeArgs& a, std::istream& in, std::ostream& out) {
  const Tokenizer tok = Tokenizer::load(a.model_dir);
  Session session{a, tok, nullptr, {}};
  if (a.jsonl) {
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      ordered_json reply;
      try {
        reply = session.answer(ordered_json::parse(line));
      } catch (const std::exception& e) {
        reply = {{"error", e.what()}};
      }
      out << reply.dump(-1, ' ', true, ordered_json::error_handler_t::replace) << '\n';
      out.flush();
    }
    return 0;
  }
  std::string text = a.text;
  if (!a.messages_file.empty()) {
    std::ifstream f(a.messages_file);
    if (!f) fail("cannot read {}", a.messages_file);
    ordered_json messages;
    try {
      messages = ordered_json::parse(f);
    } catch (const ordered_json::exception& e) {
      fail("{} is not valid JSON: {}", a.messages_file, e.what());
    }
    text = session.model_chat_template().render(messages, nullptr, true);
    out << "rendered: " << quote_token_bytes(text) << "\n";
  }
  EncodeOptions o;
  o.parse_special = !a.no_special;
  o.add_special_tokens = a.add_special_tokens;
  const std::vector<int32_t> ids = tok.encode(text, o);
  out << "ids: [";
  for (size_t i = 0; i < ids.size(); ++i) out << (i ? ", " : "") << ids[i];
  out << "]\n";
  for (int32_t id : ids)
    out << fmt::format("{:>8}  {}{}\n", id, quote_token_bytes(tok.token_bytes(id)), tok.is_special(id) ? "  (special)" : "");
  out << fmt::format("{} tokens, {} bytes\n", ids.size(), text.size());
  return 0;
}

}  // namespace kestrel::text
