#include "server/output_parser.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kestrel::server {
namespace {

constexpr std::string_view kThinkBegin = "<think>";
constexpr std::string_view kThinkEnd = "</think>";

constexpr std::string_view kKimiSectionBegin = "<|tool_calls_section_begin|>";
constexpr std::string_view kKimiSectionEnd = "<|tool_calls_section_end|>";
constexpr std::string_view kKimiCallBegin = "<|tool_call_begin|>";
constexpr std::string_view kKimiArgsBegin = "<|tool_call_argument_begin|>";
constexpr std::string_view kKimiCallEnd = "<|tool_call_end|>";

constexpr std::string_view kDsmlSectionBegin = "<｜DSML｜function_calls>";
constexpr std::string_view kDsmlSectionEnd = "</｜DSML｜function_calls>";
constexpr std::string_view kDsmlInvokeBegin = "<｜DSML｜invoke name=\"";
constexpr std::string_view kDsmlInvokeEnd = "</｜DSML｜invoke>";
constexpr std::string_view kDsmlParamBegin = "<｜DSML｜parameter name=\"";
constexpr std::string_view kDsmlParamEnd = "</｜DSML｜parameter>";

// Length of the longest proper prefix of `marker` that `s` ends with.
size_t partial_suffix(std::string_view s, std::string_view marker) {
  for (size_t k = std::min(s.size(), marker.size() - 1); k > 0; --k)
    if (s.substr(s.size() - k) == marker.substr(0, k)) return k;
  return 0;
}

std::string_view trim(std::string_view s) {
  const auto ws = [](char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; };
  while (!s.empty() && ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && ws(s.back())) s.remove_suffix(1);
  return s;
}

// "functions.get_weather:0" -> "get_weather"; anything else is taken as the name itself.
std::string kimi_function_name(std::string_view id) {
  std::string_view n = id;
  if (const size_t colon = n.rfind(':'); colon != std::string_view::npos) n = n.substr(0, colon);
  if (const size_t dot = n.find('.'); dot != std::string_view::npos) n = n.substr(dot + 1);
  return std::string(n);
}

// The JSON object of an invoke's parameters: string="true" values are strings, others JSON (kept as strings when
// they do not parse).
std::string dsml_arguments(std::string_view body) {
  nlohmann::ordered_json args = nlohmann::ordered_json::object();
  size_t at = 0;
  while (true) {
    const size_t p = body.find(kDsmlParamBegin, at);
    if (p == std::string_view::npos) break;
    const size_t name_end = body.find('"', p + kDsmlParamBegin.size());
    const size_t tag_end = name_end == std::string_view::npos ? name_end : body.find('>', name_end);
    if (tag_end == std::string_view::npos) break;
    const size_t value_end = body.find(kDsmlParamEnd, tag_end + 1);
    if (value_end == std::string_view::npos) break;
    const std::string name(body.substr(p + kDsmlParamBegin.size(), name_end - p - kDsmlParamBegin.size()));
    const std::string_view attrs = body.substr(name_end, tag_end - name_end);
    const std::string value(body.substr(tag_end + 1, value_end - tag_end - 1));
    if (attrs.find("string=\"false\"") != std::string_view::npos) {
      auto parsed = nlohmann::ordered_json::parse(trim(value), nullptr, false);
      args[name] = parsed.is_discarded() ? nlohmann::ordered_json(value) : parsed;
    } else {
      args[name] = value;
    }
    at = value_end + kDsmlParamEnd.size();
  }
  return args.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace

ParserFormat parser_format(const std::string& name) {
  if (name == "kimi_k3") return ParserFormat::kimi_k3;
  if (name == "deepseek_v32") return ParserFormat::deepseek_v32;
  fail("parser '{}' is not one of kimi_k3, deepseek_v32", name);
}

void OutputDelta::merge(const OutputDelta& d) {
  reasoning += d.reasoning;
  content += d.content;
  for (const ToolCallDelta& c : d.tool_calls) {
    auto it = std::find_if(tool_calls.begin(), tool_calls.end(), [&](const ToolCallDelta& x) { return x.index == c.index; });
    if (it == tool_calls.end()) {
      tool_calls.push_back(c);
    } else {
      if (!c.id.empty()) it->id = c.id;
      if (!c.name.empty()) it->name = c.name;
      it->arguments += c.arguments;
    }
  }
}

const char* reasoning_begin_marker(ParserFormat) { return "<think>"; }
const char* reasoning_end_marker(ParserFormat) { return "</think>"; }

OutputParser::OutputParser(const ParserOptions& opts) : opts_(opts), state_(State::start) {
  if (opts_.reasoning && opts_.start_in_reasoning) state_ = State::reasoning;
}

void OutputParser::feed(std::string_view text, OutputDelta& out) {
  buf_.append(text);
  process(out, false);
}

void OutputParser::finish(OutputDelta& out) {
  feed("", out);
  process(out, true);
}

void OutputParser::begin_call(const std::string& id, const std::string& name, OutputDelta& out) {
  out.tool_calls.push_back({calls_, id, name, ""});
}

void OutputParser::emit_until_markers(std::string& to, std::initializer_list<std::string_view> markers, bool final) {
  size_t hold = 0;
  if (!final)
    for (std::string_view m : markers) hold = std::max(hold, partial_suffix(buf_, m));
  to.append(buf_, 0, buf_.size() - hold);
  buf_.erase(0, buf_.size() - hold);
}

void OutputParser::process(OutputDelta& out, bool final) {
  while (true) {
    switch (state_) {
      case State::start:
        if (opts_.reasoning) {
          if (buf_.starts_with(kThinkBegin)) {
            buf_.erase(0, kThinkBegin.size());
            state_ = State::reasoning;
            continue;
          }
          if (!final && kThinkBegin.starts_with(buf_)) return;  // may still become <think>
        }
        state_ = State::content;
        continue;
      case State::reasoning: {
        const size_t end = buf_.find(kThinkEnd);
        if (end == std::string::npos) {
          emit_until_markers(out.reasoning, {kThinkEnd}, final);
          return;
        }
        out.reasoning.append(buf_, 0, end);
        buf_.erase(0, end + kThinkEnd.size());
        state_ = State::content;
        continue;
      }
      case State::content: {
        if (!opts_.tools) {
          out.content += buf_;
          buf_.clear();
          return;
        }
        const std::string_view begin = *opts_.tools == ParserFormat::kimi_k3 ? kKimiSectionBegin : kDsmlSectionBegin;
        const size_t at = buf_.find(begin);
        if (at == std::string::npos) {
          emit_until_markers(out.content, {begin}, final);
          return;
        }
        out.content.append(buf_, 0, at);
        buf_.erase(0, at + begin.size());
        state_ = State::section;
        continue;
      }
      default:
        if (!(*opts_.tools == ParserFormat::kimi_k3 ? step_kimi_tools(out, final) : step_dsml_tools(out, final)))
          return;
    }
  }
}

// One transition inside the kimi_k3 tool-call section; false when it needs more text.
bool OutputParser::step_kimi_tools(OutputDelta& out, bool final) {
  switch (state_) {
    case State::section: {
      const size_t call = buf_.find(kKimiCallBegin), end = buf_.find(kKimiSectionEnd);
      if (end != std::string::npos && (call == std::string::npos || end < call)) {
        buf_.erase(0, end + kKimiSectionEnd.size());
        state_ = State::content;
        return true;
      }
      if (call == std::string::npos) {
        if (final) buf_.clear();
        return false;
      }
      buf_.erase(0, call + kKimiCallBegin.size());
      state_ = State::call_header;
      return true;
    }
    case State::call_header: {
      const size_t args = buf_.find(kKimiArgsBegin);
      if (args == std::string::npos && !final) return false;
      const std::string id(trim(std::string_view(buf_).substr(0, args == std::string::npos ? buf_.size() : args)));
      begin_call(id, kimi_function_name(id), out);
      buf_.erase(0, args == std::string::npos ? buf_.size() : args + kKimiArgsBegin.size());
      state_ = State::call_body;
      return args != std::string::npos;
    }
    default: {  // call_body: the arguments stream until the call ends
      const size_t end = buf_.find(kKimiCallEnd);
      std::string args;
      if (end == std::string::npos) emit_until_markers(args, {kKimiCallEnd}, final);
      else args = buf_.substr(0, end);
      if (!args.empty()) {
        if (!out.tool_calls.empty() && out.tool_calls.back().index == calls_) out.tool_calls.back().arguments += args;
        else out.tool_calls.push_back({calls_, "", "", args});
      }
      if (end == std::string::npos) {
        if (final) ++calls_;
        return false;
      }
      buf_.erase(0, end + kKimiCallEnd.size());
      ++calls_;
      state_ = State::section;
      return true;
    }
  }
}

// One transition inside a DSML function_calls block; false when it needs more text.
bool OutputParser::step_dsml_tools(OutputDelta& out, bool final) {
  switch (state_) {
    case State::section: {
      const size_t invoke = buf_.find(kDsmlInvokeBegin), end = buf_.find(kDsmlSectionEnd);
      if (end != std::string::npos && (invoke == std::string::npos || end < invoke)) {
        buf_.erase(0, end + kDsmlSectionEnd.size());
        state_ = State::content;
        return true;
      }
      if (invoke == std::string::npos) {
        if (final) buf_.clear();
        return false;
      }
      buf_.erase(0, invoke + kDsmlInvokeBegin.size());
      state_ = State::call_header;
      return true;
    }
    case State::call_header: {  // NAME">
      const size_t close = buf_.find("\">");
      if (close == std::string::npos) {
        if (final) buf_.clear();
        return false;
      }
      begin_call(opts_.call_id_prefix + std::to_string(calls_), buf_.substr(0, close), out);
      buf_.erase(0, close + 2);
      state_ = State::call_body;
      return true;
    }
    default: {  // call_body: parameters until the invoke closes; the arguments come whole
      const size_t end = buf_.find(kDsmlInvokeEnd);
      if (end == std::string::npos && !final) return false;
      const std::string args = dsml_arguments(std::string_view(buf_).substr(0, end == std::string::npos ? buf_.size() : end));
      if (!out.tool_calls.empty() && out.tool_calls.back().index == calls_) out.tool_calls.back().arguments += args;
      else out.tool_calls.push_back({calls_, "", "", args});
      ++calls_;
      buf_.erase(0, end == std::string::npos ? buf_.size() : end + kDsmlInvokeEnd.size());
      state_ = State::section;
      return end != std::string::npos;
    }
  }
}

}  // namespace kestrel::server
