// libFuzzer harness: a tokenizer.json loaded, and when it loads, a fixed text encoded and decoded back.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/error.h"
#include "text/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  try {
    const kestrel::text::Tokenizer tok = kestrel::text::Tokenizer::from_hf_json(in);
    const auto ids = tok.encode("Hello world <|im_end|> 12345 héllo\n\n  x");
    tok.decode(ids);
    tok.decode(ids, true);
  } catch (const kestrel::Error&) {
  }
  return 0;
}
