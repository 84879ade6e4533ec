// libFuzzer harness: the input as a .safetensors file (written to a temporary file, then memory-mapped and
// validated); every tensor of a file that validates is read end to end.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include "core/error.h"
#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/kestrel_fuzz_" + std::to_string(getpid()) + ".safetensors";
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    const kestrel::SafetensorsFile f(path);
    unsigned sum = 0;
    for (const std::string& name : f.names())
      for (uint8_t b : f.get(name).bytes) sum += b;
    (void)sum;
  } catch (const kestrel::Error&) {
  }
  return 0;
}
