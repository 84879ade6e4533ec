// libFuzzer harness: config.json (any JSON) read as a model configuration.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded()) return 0;
  try {
    kestrel::ModelConfig::from_json(j);
  } catch (const kestrel::Error&) {
  }
  return 0;
}
