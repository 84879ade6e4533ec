// Errors: every failure a user can cause is a kestrel::Error whose message names what is wrong.
#pragma once
#include <stdexcept>
#include <string>
#include <fmt/format.h>

namespace kestrel {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

#define KESTREL_CHECK(cond, ...)                  \
  do {                                            \
    if (!(cond)) ::kestrel::fail(__VA_ARGS__);    \
  } while (0)

}  // namespace kestrel
