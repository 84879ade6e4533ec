// Element types of stored tensors, spelled as safetensors spells them.
#pragma once
#include <cstddef>
#include <optional>
#include <string>

namespace kestrel {

enum class DType { F32, F16, BF16, F8_E4M3, F8_E5M2, F8_E8M0, U8, I8, I32, I64, F64, BOOL, U16, I16, U32, U64 };
const char* dtype_name(DType d);                      // the safetensors spelling: "F32", "BF16", "F8_E4M3", ...
size_t dtype_size(DType d);                           // bytes per element
std::optional<DType> find_dtype(const std::string& s);  // nullopt for a name safetensors does not define
DType parse_dtype(const std::string& s);              // throws Error naming the unknown dtype

}  // namespace kestrel
