#include "server/lora_api.h"

#include <algorithm>
#include <memory>

#include "model/lora.h"
#include "server/api_error.h"
#include "server/protocol.h"

namespace kestrel::server {
namespace {

std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

void need_post(const HttpExchange& ex) {
  if (ex.request().method() != http::verb::post)
    throw ApiError(405, fmt::format("{} is not allowed on {}", std::string(ex.request().method_string()), ex.path()));
}

// The request body's fields, each checked for its type; a field the route does not take is refused by name.
struct AdapterRequest {
  std::string name, path;
  bool load_inplace = false;
};

AdapterRequest parse_adapter_request(const std::string& body, bool load) {
  const Json j = parse_body(body);
  if (!j.is_object()) bad_request("", "the request body must be a JSON object");
  AdapterRequest r;
  for (const auto& [k, v] : j.items()) {
    if (k == "lora_name" || (load && k == "lora_path")) {
      if (!v.is_string() || v.get<std::string>().empty()) bad_request(k, "'{}' must be a non-empty string", k);
      (k == "lora_name" ? r.name : r.path) = v.get<std::string>();
    } else if (load && k == "load_inplace") {
      if (!v.is_boolean()) bad_request(k, "'load_inplace' must be true or false");
      r.load_inplace = v.get<bool>();
    } else if (!load && k == "lora_int_id") {
      if (!v.is_number_integer() && !v.is_null()) bad_request(k, "'lora_int_id' must be an integer");
    } else {
      bad_request(k, "'{}' is not a field of {} (lora_name{})", k,
                  load ? "/v1/load_lora_adapter" : "/v1/unload_lora_adapter",
                  load ? ", lora_path, load_inplace" : ", lora_int_id");
    }
  }
  if (r.name.empty()) bad_request("lora_name", "'lora_name' is required");
  if (load && r.path.empty()) bad_request("lora_path", "'lora_path' is required");
  return r;
}

Json status_body(const std::string& message) { return Json{{"status", "success"}, {"message", message}}; }

}  // namespace

LoraApi::LoraApi(LoraOptions opts, Model& model, EngineLoop& loop, std::vector<std::string> base_names)
    : opts_(opts), model_(model), loop_(loop), base_names_(std::move(base_names)) {}

void LoraApi::check_name(const std::string& name) const {
  if (std::find(base_names_.begin(), base_names_.end(), name) != base_names_.end())
    bad_request("lora_name", "'{}' is the base model's name; an adapter needs a name of its own", name);
}

void LoraApi::load_at_start(const std::string& name, const std::string& path) {
  KESTREL_CHECK(opts_.enabled, "--lora-modules needs --enable-lora");
  try {
    check_name(name);
  } catch (const ApiError& e) {
    fail("--lora-modules {}: {}", name, e.what());
  }
  KESTREL_CHECK(!loaded_.count(name), "--lora-modules names '{}' twice", name);
  KESTREL_CHECK(static_cast<int>(loaded_.size()) < opts_.max_loras,
                "--lora-modules gives more than --max-loras {} adapters", opts_.max_loras);
  const LoraAdapter adapter = load_lora_adapter(path, opts_.max_lora_rank);
  const int32_t id = next_id_++;
  model_.load_lora(id, adapter);
  loaded_[name] = Entry{id, path};
}

std::optional<int32_t> LoraApi::id_of(const std::string& name) const {
  std::lock_guard lock(mu_);
  const auto it = loaded_.find(name);
  if (it == loaded_.end()) return std::nullopt;
  return it->second.id;
}

std::string LoraApi::name_of(int32_t id) const {
  std::lock_guard lock(mu_);
  for (const auto& [name, e] : loaded_)
    if (e.id == id) return name;
  return std::to_string(id);
}

Json LoraApi::model_cards(int64_t created, int64_t max_model_len) const {
  Json cards = Json::array();
  std::lock_guard lock(mu_);
  for (const auto& [name, e] : loaded_)
    cards.push_back({{"id", name}, {"object", "model"}, {"created", created}, {"owned_by", "kestrel"},
                     {"root", e.path}, {"parent", base_names_.front()}, {"max_model_len", max_model_len}});
  return cards;
}

awaitable<void> LoraApi::handle(HttpExchange& ex, const OffThread& off_thread) {
  need_post(ex);
  if (!opts_.enabled)
    bad_request("", "LoRA adapters are not enabled on this server: start it with --enable-lora");
  if (ex.path() == "/v1/load_lora_adapter") co_await load(ex, off_thread);
  else co_await unload(ex);
}

awaitable<void> LoraApi::load(HttpExchange& ex, const OffThread& off_thread) {
  // Read and checked on a text thread; installed on the engine thread.
  auto adapter = std::make_shared<LoraAdapter>();
  AdapterRequest r;
  bool reserved = false;  // this request holds the name in busy_
  auto read = [&](const std::atomic<bool>&) {
    r = parse_adapter_request(ex.request().body(), true);
    check_name(r.name);
    {
      std::lock_guard lock(mu_);
      if (busy_.count(r.name))
        throw ApiError(400, fmt::format("The lora adapter '{}' is being loaded or unloaded; retry", r.name),
                       "lora_name");
      if (loaded_.count(r.name) && !r.load_inplace)
        throw ApiError(400, fmt::format("The lora adapter '{}' has already been loaded.", r.name), "lora_name");
      if (!loaded_.count(r.name) && static_cast<int>(loaded_.size() + busy_.size()) >= opts_.max_loras)
        throw ApiError(400,
                       fmt::format("{} LoRA adapters are loaded, the most --max-loras {} allows; unload one first",
                                   loaded_.size(), opts_.max_loras),
                       "lora_name");
      busy_.insert(r.name);
      reserved = true;
    }
    try {
      *adapter = load_lora_adapter(r.path, opts_.max_lora_rank);
    } catch (const Error& e) {
      std::lock_guard lock(mu_);
      busy_.erase(r.name);
      reserved = false;
      throw ApiError(400, fmt::format("LoRA adapter '{}' cannot be loaded: {}", r.name, e.what()), "lora_path");
    }
  };
  bool read_ok = false;
  std::exception_ptr read_error;
  try {
    read_ok = co_await off_thread(ex, read);
  } catch (...) {
    read_error = std::current_exception();
  }
  if (!read_ok) {
    // Refused, or the client left: the name is free again (a no-op when the read never reserved it).
    {
      std::lock_guard lock(mu_);
      if (reserved) busy_.erase(r.name);
    }
    if (read_error) std::rethrow_exception(read_error);
    co_return;
  }
  const std::string name = r.name, path = r.path;
  // The task owns what it needs: it runs even when this client is gone.
  auto install = [this, adapter, name, path](const std::vector<int32_t>& in_use) -> std::optional<EngineTask::Failure> {
    std::optional<int32_t> old;
    {
      std::lock_guard lock(mu_);
      if (const auto it = loaded_.find(name); it != loaded_.end()) old = it->second.id;
    }
    std::optional<EngineTask::Failure> failure;
    if (old && std::count(in_use.begin(), in_use.end(), *old) > 0) {
      failure = EngineTask::Failure{400, fmt::format("The lora adapter '{}' is in use by requests in flight; reload "
                                                     "it once they finish (or pause the server first)",
                                                     name)};
    } else {
      int32_t id = 0;
      {
        std::lock_guard lock(mu_);
        id = next_id_++;
      }
      try {
        model_.load_lora(id, *adapter);
        if (old) model_.unload_lora(*old);
        std::lock_guard lock(mu_);
        loaded_[name] = Entry{id, path};
      } catch (const Error& e) {
        failure = EngineTask::Failure{400, fmt::format("LoRA adapter '{}' cannot be loaded: {}", name, e.what())};
      }
    }
    std::lock_guard lock(mu_);
    busy_.erase(name);
    return failure;
  };
  co_await run_on_engine(ex, std::move(install), name, "lora_path",
                         fmt::format("Success: LoRA adapter '{}' added successfully.", name));
}

awaitable<void> LoraApi::unload(HttpExchange& ex) {
  const AdapterRequest r = parse_adapter_request(ex.request().body(), false);
  int32_t id = 0;
  {
    std::lock_guard lock(mu_);
    const auto it = loaded_.find(r.name);
    if (it == loaded_.end() || busy_.count(r.name))
      throw ApiError(404, fmt::format("The lora adapter '{}' cannot be found.", r.name), "lora_name");
    id = it->second.id;
    busy_.insert(r.name);
  }
  const std::string name = r.name;
  auto drop = [this, name, id](const std::vector<int32_t>& in_use) -> std::optional<EngineTask::Failure> {
    std::optional<EngineTask::Failure> failure;
    if (std::count(in_use.begin(), in_use.end(), id) > 0) {
      failure = EngineTask::Failure{400, fmt::format("The lora adapter '{}' is in use by requests in flight; unload "
                                                     "it once they finish",
                                                     name)};
    } else {
      model_.unload_lora(id);
    }
    std::lock_guard lock(mu_);
    if (!failure) loaded_.erase(name);
    busy_.erase(name);
    return failure;
  };
  co_await run_on_engine(ex, std::move(drop), name, "lora_name",
                         fmt::format("Success: LoRA adapter '{}' removed successfully.", name));
}

awaitable<void> LoraApi::run_on_engine(HttpExchange& ex, EngineFn fn, const std::string& name, const char* param,
                                       const std::string& success) {
  std::shared_ptr<EngineTask> task;
  try {
    task = loop_.post(std::move(fn), ex.notifier());
  } catch (...) {
    std::lock_guard lock(mu_);
    busy_.erase(name);
    throw;
  }
  ex.watch_disconnect();
  while (!task->done && !ex.client_gone()) co_await ex.wait();
  if (ex.client_gone()) co_return;  // the task still runs (it owns what it needs)
  if (task->failure) throw ApiError(task->failure->status, task->failure->message, param);
  co_await ex.reply(200, dump(status_body(success)));
}

}  // namespace kestrel::server
