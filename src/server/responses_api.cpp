#include "server/responses_api.h"

#include <fmt/format.h>

#include "server/api_error.h"

namespace kestrel::server {
namespace {

std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// A content value of an input message: a string, or parts of type input_text / output_text / text.
std::string content_text(const Json& c, const std::string& where) {
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array()) bad_request(where, "'{}' must be a string or a list of text parts", where);
  std::string out;
  for (const Json& p : c) {
    const std::string type = p.is_object() && p.contains("type") && p["type"].is_string() ? p["type"].get<std::string>() : "";
    if (type != "input_text" && type != "output_text" && type != "text")
      bad_request(where, "content part type '{}' is not supported (this model takes text only)", type);
    if (!p.contains("text") || !p["text"].is_string()) bad_request(where, "a text part of '{}' has no 'text'", where);
    out += p["text"].get<std::string>();
  }
  return out;
}

const Json* field(const Json& o, const char* k) {
  const auto it = o.find(k);
  return it == o.end() || it->is_null() ? nullptr : &*it;
}

std::string string_field(const Json& o, const char* k, const std::string& where) {
  const Json* v = field(o, k);
  if (!v || !v->is_string()) bad_request(where, "'{}.{}' must be a string", where, k);
  return v->get<std::string>();
}

}  // namespace

ResponsesRequest translate_responses_request(const Json& body) {
  ResponsesRequest r;
  Json& chat = r.chat;
  chat = Json::object();
  Json messages = Json::array();
  if (field(body, "previous_response_id"))
    bad_request("previous_response_id", "'previous_response_id' is not supported: responses are not stored; send the "
                                        "whole conversation in 'input'");
  if (const Json* v = field(body, "instructions")) {
    if (!v->is_string()) bad_request("instructions", "'instructions' must be a string");
    messages.push_back({{"role", "system"}, {"content", *v}});
  }
  const Json* input = field(body, "input");
  if (!input) bad_request("input", "'input' is required");
  if (input->is_string()) {
    messages.push_back({{"role", "user"}, {"content", *input}});
  } else if (input->is_array()) {
    for (size_t i = 0; i < input->size(); ++i) {
      const Json& item = (*input)[i];
      const std::string where = fmt::format("input[{}]", i);
      if (!item.is_object()) bad_request(where, "'{}' must be an object", where);
      const Json* t = field(item, "type");
      if (t && !t->is_string()) bad_request(where, "'{}.type' must be a string", where);
      const std::string type = t ? t->get<std::string>() : "message";
      if (type == "message") {
        const std::string role = string_field(item, "role", where);
        const Json* content = field(item, "content");
        if (!content) bad_request(where, "'{}.content' is required", where);
        messages.push_back({{"role", role}, {"content", content_text(*content, where + ".content")}});
      } else if (type == "function_call") {
        Json call = {{"id", string_field(item, "call_id", where)},
                     {"type", "function"},
                     {"function", {{"name", string_field(item, "name", where)},
                                   {"arguments", string_field(item, "arguments", where)}}}};
        // Calls in a row belong to one assistant turn.
        if (!messages.empty() && messages.back()["role"] == "assistant" && messages.back().contains("tool_calls"))
          messages.back()["tool_calls"].push_back(call);
        else
          messages.push_back({{"role", "assistant"}, {"content", nullptr}, {"tool_calls", Json::array({call})}});
      } else if (type == "function_call_output") {
        const Json* out = field(item, "output");
        messages.push_back({{"role", "tool"},
                            {"tool_call_id", string_field(item, "call_id", where)},
                            {"content", out && out->is_string() ? out->get<std::string>()
                                                                : content_text(out ? *out : Json(""), where)}});
      } else if (type == "reasoning") {
        // The model's earlier reasoning: carried as the next assistant turn's reasoning_content.
        std::string text;
        if (const Json* c = field(item, "content"); c && c->is_array())
          for (const Json& p : *c)
            if (p.is_object() && p.contains("text") && p["text"].is_string()) text += p["text"].get<std::string>();
        messages.push_back({{"role", "assistant"}, {"content", ""}, {"reasoning_content", text}});
      } else {
        bad_request(where, "input item type '{}' is not supported (message, function_call, function_call_output, "
                           "reasoning)",
                    type);
      }
    }
    // A reasoning item followed by its assistant turn: merge them.
    Json merged = Json::array();
    for (Json& m : messages) {
      if (!merged.empty() && merged.back()["role"] == "assistant" && merged.back().contains("reasoning_content") &&
          merged.back()["content"] == "" && !merged.back().contains("tool_calls") && m["role"] == "assistant") {
        m["reasoning_content"] = merged.back()["reasoning_content"];
        merged.back() = std::move(m);
        continue;
      }
      merged.push_back(std::move(m));
    }
    messages = std::move(merged);
  } else {
    bad_request("input", "'input' must be a string or a list of items");
  }
  chat["messages"] = messages;

  Json echoed = Json::object();
  echoed["instructions"] = body.contains("instructions") ? body["instructions"] : Json(nullptr);
  Json flat_tools = Json::array();
  if (const Json* tools = field(body, "tools")) {
    if (!tools->is_array()) bad_request("tools", "'tools' must be a list");
    Json chat_tools = Json::array();
    for (size_t i = 0; i < tools->size(); ++i) {
      const Json& t = (*tools)[i];
      const std::string where = fmt::format("tools[{}]", i);
      if (!t.is_object() || !field(t, "type") || !t["type"].is_string() || t["type"] != "function")
        bad_request(where, "only tools of type 'function' are supported");
      Json fn = {{"name", string_field(t, "name", where)}};
      if (const Json* d = field(t, "description")) fn["description"] = *d;
      if (const Json* p = field(t, "parameters")) fn["parameters"] = *p;
      chat_tools.push_back({{"type", "function"}, {"function", fn}});
      flat_tools.push_back(t);
    }
    if (!chat_tools.empty()) chat["tools"] = chat_tools;
  }
  echoed["tools"] = flat_tools;
  if (const Json* tc = field(body, "tool_choice")) {
    if (tc->is_string()) {
      chat["tool_choice"] = *tc;
    } else if (tc->is_object() && field(*tc, "type") && (*tc)["type"] == "function") {
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", string_field(*tc, "name", "tool_choice")}}}};
    } else {
      bad_request("tool_choice", "'tool_choice' must be none, auto, required or {{\"type\": \"function\", \"name\"}}");
    }
    echoed["tool_choice"] = *tc;
  } else {
    echoed["tool_choice"] = "auto";
  }
  for (const char* k : {"temperature", "top_p", "stream", "parallel_tool_calls", "seed", "top_k", "min_p",
                        "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "model", "priority",
                        "chat_template_kwargs", "skip_special_tokens"})
    if (const Json* v = field(body, k)) chat[k] = *v;
  if (const Json* v = field(body, "max_output_tokens")) chat["max_tokens"] = *v;
  if (const Json* v = field(body, "n"); v && *v != 1) bad_request("n", "the Responses API returns one output ('n' 1)");
  if (const Json* text = field(body, "text")) {
    if (!text->is_object()) bad_request("text", "'text' must be an object");
    if (const Json* f = field(*text, "format")) {
      const std::string type = f->is_object() && field(*f, "type") && (*f)["type"].is_string()
                                   ? (*f)["type"].get<std::string>()
                                   : "";
      if (type == "json_schema") {
        Json js = {{"name", f->value("name", std::string("schema"))}};
        if (const Json* s = field(*f, "schema")) js["schema"] = *s;
        if (const Json* s = field(*f, "strict")) js["strict"] = *s;
        chat["response_format"] = {{"type", "json_schema"}, {"json_schema", js}};
      } else if (type == "json_object") {
        chat["response_format"] = {{"type", "json_object"}};
      } else if (type != "text") {
        bad_request("text.format", "'text.format.type' must be text, json_object or json_schema");
      }
    }
    echoed["text"] = *text;
  } else {
    echoed["text"] = {{"format", {{"type", "text"}}}};
  }
  if (const Json* v = field(body, "reasoning")) echoed["reasoning"] = *v;
  else echoed["reasoning"] = {{"effort", nullptr}, {"summary", nullptr}};
  echoed["temperature"] = body.contains("temperature") ? body["temperature"] : Json(1.0);
  echoed["top_p"] = body.contains("top_p") ? body["top_p"] : Json(1.0);
  echoed["max_output_tokens"] = body.contains("max_output_tokens") ? body["max_output_tokens"] : Json(nullptr);
  echoed["parallel_tool_calls"] = body.contains("parallel_tool_calls") ? body["parallel_tool_calls"] : Json(true);
  echoed["metadata"] = body.contains("metadata") && body["metadata"].is_object() ? body["metadata"] : Json::object();
  r.echoed = std::move(echoed);
  return r;
}

Json response_object(const std::string& id, int64_t created, const std::string& model, const Json& echoed,
                     const Json& output, const ResponseEnd* end) {
  Json r = {{"id", id}, {"object", "response"}, {"created_at", created}, {"model", model}};
  std::string status = "in_progress";
  Json incomplete = nullptr;
  if (end) {
    status = end->finish_reason == "length" || end->finish_reason == "abort" ? "incomplete" : "completed";
    if (end->finish_reason == "length") incomplete = {{"reason", "max_output_tokens"}};
  }
  r["status"] = status;
  r["error"] = nullptr;
  r["incomplete_details"] = incomplete;
  for (const auto& [k, v] : echoed.items()) r[k] = v;
  r["output"] = output;
  r["previous_response_id"] = nullptr;
  r["store"] = false;
  r["truncation"] = "disabled";
  if (end)
    r["usage"] = {{"input_tokens", end->input_tokens},
                  {"input_tokens_details", {{"cached_tokens", end->cached_tokens}}},
                  {"output_tokens", end->output_tokens},
                  {"output_tokens_details", {{"reasoning_tokens", 0}}},
                  {"total_tokens", end->input_tokens + end->output_tokens}};
  else
    r["usage"] = nullptr;
  return r;
}

namespace {

Json reasoning_item(const std::string& id, const std::string& text, const char* status) {
  Json content = text.empty() && std::string(status) == "in_progress"
                     ? Json::array()
                     : Json::array({{{"type", "reasoning_text"}, {"text", text}}});
  return {{"type", "reasoning"}, {"id", id}, {"summary", Json::array()}, {"content", content}, {"status", status}};
}

Json text_part(const std::string& text) {
  return {{"type", "output_text"}, {"text", text}, {"annotations", Json::array()}, {"logprobs", Json::array()}};
}

Json message_item(const std::string& id, const std::string& text, const char* status) {
  Json content = std::string(status) == "in_progress" ? Json::array() : Json::array({text_part(text)});
  return {{"type", "message"}, {"id", id}, {"role", "assistant"}, {"status", status}, {"content", content}};
}

Json call_item(const std::string& id, const std::string& call_id, const std::string& name, const std::string& args,
               const char* status) {
  return {{"type", "function_call"}, {"id", id},          {"call_id", call_id},
          {"name", name},            {"arguments", args}, {"status", status}};
}

std::string item_id(const std::string& response_id, const char* prefix, int index) {
  return fmt::format("{}_{}_{}", prefix, response_id.substr(response_id.find('_') + 1, 16), index);
}

}  // namespace

Json response_items(const std::string& id, const OutputDelta& total) {
  Json items = Json::array();
  int i = 0;
  if (!total.reasoning.empty()) items.push_back(reasoning_item(item_id(id, "rs", i++), total.reasoning, "completed"));
  if (!total.content.empty() || total.tool_calls.empty())
    items.push_back(message_item(item_id(id, "msg", i++), total.content, "completed"));
  for (const ToolCallDelta& t : total.tool_calls)
    items.push_back(call_item(item_id(id, "fc", i++), t.id, t.name, t.arguments, "completed"));
  return items;
}

ResponsesStream::ResponsesStream(std::string id, int64_t created, std::string model, Json echoed)
    : id_(std::move(id)), model_(std::move(model)), created_(created), echoed_(std::move(echoed)) {}

std::vector<std::string> ResponsesStream::take() {
  std::vector<std::string> r;
  r.swap(out_);
  return r;
}

void ResponsesStream::emit(Json ev) {
  ev["sequence_number"] = seq_++;
  out_.push_back(dump(ev));
}

std::vector<std::string> ResponsesStream::begin() {
  const Json r = response_object(id_, created_, model_, echoed_, Json::array(), nullptr);
  emit({{"type", "response.created"}, {"response", r}});
  emit({{"type", "response.in_progress"}, {"response", r}});
  return take();
}

void ResponsesStream::open(Kind k, const ToolCallDelta* call) {
  close();
  kind_ = k;
  ++output_index_;
  text_.clear();
  Json item;
  if (k == Kind::reasoning) {
    item_id_ = item_id(id_, "rs", output_index_);
    item = reasoning_item(item_id_, "", "in_progress");
  } else if (k == Kind::message) {
    item_id_ = item_id(id_, "msg", output_index_);
    item = message_item(item_id_, "", "in_progress");
  } else {
    item_id_ = item_id(id_, "fc", output_index_);
    call_id_ = call->id;
    call_name_ = call->name;
    call_index_ = call->index;
    item = call_item(item_id_, call_id_, call_name_, "", "in_progress");
  }
  emit({{"type", "response.output_item.added"}, {"output_index", output_index_}, {"item", item}});
  if (k == Kind::message)
    emit({{"type", "response.content_part.added"}, {"item_id", item_id_}, {"output_index", output_index_},
          {"content_index", 0}, {"part", text_part("")}});
}

void ResponsesStream::close() {
  const Json base = {{"item_id", item_id_}, {"output_index", output_index_}};
  Json item;
  switch (kind_) {
    case Kind::none: return;
    case Kind::reasoning: {
      Json ev = base;
      ev["type"] = "response.reasoning_text.done";
      ev["content_index"] = 0;
      ev["text"] = text_;
      emit(ev);
      item = reasoning_item(item_id_, text_, "completed");
      break;
    }
    case Kind::message: {
      Json ev = base;
      ev["type"] = "response.output_text.done";
      ev["content_index"] = 0;
      ev["text"] = text_;
      ev["logprobs"] = Json::array();
      emit(ev);
      Json part = base;
      part["type"] = "response.content_part.done";
      part["content_index"] = 0;
      part["part"] = text_part(text_);
      emit(part);
      item = message_item(item_id_, text_, "completed");
      break;
    }
    case Kind::call: {
      Json ev = base;
      ev["type"] = "response.function_call_arguments.done";
      ev["arguments"] = text_;
      ev["name"] = call_name_;
      emit(ev);
      item = call_item(item_id_, call_id_, call_name_, text_, "completed");
      break;
    }
  }
  emit({{"type", "response.output_item.done"}, {"output_index", output_index_}, {"item", item}});
  items_.push_back(item);
  kind_ = Kind::none;
}

std::vector<std::string> ResponsesStream::delta(const OutputDelta& d) {
  if (!d.reasoning.empty()) {
    if (kind_ != Kind::reasoning) open(Kind::reasoning);
    text_ += d.reasoning;
    emit({{"type", "response.reasoning_text.delta"}, {"item_id", item_id_}, {"output_index", output_index_},
          {"content_index", 0}, {"delta", d.reasoning}});
  }
  if (!d.content.empty()) {
    if (kind_ != Kind::message) open(Kind::message);
    text_ += d.content;
    emit({{"type", "response.output_text.delta"}, {"item_id", item_id_}, {"output_index", output_index_},
          {"content_index", 0}, {"delta", d.content}, {"logprobs", Json::array()}});
  }
  for (const ToolCallDelta& t : d.tool_calls) {
    if (kind_ != Kind::call || t.index != call_index_) open(Kind::call, &t);
    if (t.arguments.empty()) continue;
    text_ += t.arguments;
    emit({{"type", "response.function_call_arguments.delta"}, {"item_id", item_id_}, {"output_index", output_index_},
          {"delta", t.arguments}});
  }
  return take();
}

std::vector<std::string> ResponsesStream::finish(const ResponseEnd& end) {
  close();
  if (items_.empty()) {  // nothing generated: an empty message, as the whole response has
    open(Kind::message);
    close();
  }
  emit({{"type", end.finish_reason == "length" || end.finish_reason == "abort" ? "response.incomplete"
                                                                               : "response.completed"},
        {"response", response_object(id_, created_, model_, echoed_, items_, &end)}});
  return take();
}

}  // namespace kestrel::server
