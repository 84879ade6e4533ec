#include "text/tokenize_cli.h"

#include <iostream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/detokenizer.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace kestrel::text {

using nlohmann::json;

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

std::string request_text(const json& r) {
  if (r.contains("hex")) return hex_decode(r["hex"].get<std::string>());
  return r.at("text").get<std::string>();
}

json answer(const Tokenizer& tok, const json& r) {
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
    json chunks = json::array(), pending = json::array();
    for (int32_t id : ids) {
      chunks.push_back(d.push(id));
      pending.push_back(d.pending_text());
    }
    return {{"chunks", chunks}, {"pending", pending}};
  }
  fail("unknown op '{}'", op);
}

}  // namespace

int run_tokenize(const TokenizeArgs& a, std::istream& in, std::ostream& out) {
  const Tokenizer tok = Tokenizer::load(a.model_dir);
  if (a.jsonl) {
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      json reply;
      try {
        reply = answer(tok, json::parse(line));
      } catch (const std::exception& e) {
        reply = {{"error", e.what()}};
      }
      out << reply.dump(-1, ' ', true, json::error_handler_t::replace) << '\n';
      out.flush();
    }
    return 0;
  }
  EncodeOptions o;
  o.parse_special = !a.no_special;
  o.add_special_tokens = a.add_special_tokens;
  const std::vector<int32_t> ids = tok.encode(a.text, o);
  out << "ids: [";
  for (size_t i = 0; i < ids.size(); ++i) out << (i ? ", " : "") << ids[i];
  out << "]\n";
  for (int32_t id : ids)
    out << fmt::format("{:>8}  {}{}\n", id, quote_token_bytes(tok.token_bytes(id)), tok.is_special(id) ? "  (special)" : "");
  out << fmt::format("{} tokens, {} bytes\n", ids.size(), a.text.size());
  return 0;
}

}  // namespace kestrel::text
