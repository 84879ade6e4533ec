// Errors the HTTP API reports to a client: an HTTP status and the OpenAI error object
// {"error": {"message", "type", "param", "code"}}. The type names are vLLM's, the code is the status.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kestrel::server {

class ApiError : public Error {
 public:
  ApiError(int status, const std::string& message, std::string param = "")
      : Error(message), status_(status), param_(std::move(param)) {}

  int status() const { return status_; }
  const std::string& param() const { return param_; }
  // The OpenAI error body.
  nlohmann::json body() const {
    return {{"error",
             {{"message", what()},
              {"type", type_name(status_)},
              {"param", param_.empty() ? nlohmann::json(nullptr) : nlohmann::json(param_)},
              {"code", status_}}}};
  }

  static const char* type_name(int status) {
    switch (status) {
      case 400: return "BadRequestError";
      case 401: return "AuthenticationError";
      case 404: return "NotFoundError";
      case 405: return "MethodNotAllowedError";
      case 413: return "RequestTooLargeError";
      case 429: return "RateLimitError";
      case 503: return "ServiceUnavailableError";
      default: return "InternalServerError";
    }
  }

 private:
  int status_;
  std::string param_;
};

template <typename... Args>
[[noreturn]] void bad_request(const std::string& param, fmt::format_string<Args...> f, Args&&... args) {
  throw ApiError(400, fmt::format(f, std::forward<Args>(args)...), param);
}

}  // namespace kestrel::server
