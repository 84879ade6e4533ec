#include "core/dtype.h"

#include "core/error.h"

namespace kestrel {

namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::F64, "F64", 8},   {DType::F32, "F32", 4},         {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2}, {DType::F8_E4M3, "F8_E4M3", 1}, {DType::I64, "I64", 8},
    {DType::I32, "I32", 4},   {DType::I16, "I16", 2},         {DType::I8, "I8", 1},
    {DType::U64, "U64", 8},   {DType::U32, "U32", 4},         {DType::U16, "U16", 2},
    {DType::U8, "U8", 1},     {DType::BOOL, "BOOL", 1},       {DType::F8_E5M2, "F8_E5M2", 1},
    {DType::F8_E8M0, "F8_E8M0", 1},  // MXFP4 block scales in some checkpoints
};

const DTypeInfo& dtype_info(DType d) {
  for (const auto& info : kDTypes)
    if (info.dtype == d) return info;
  fail("invalid DType value {}", static_cast<int>(d));
}

}  // namespace

const char* dtype_name(DType d) { return dtype_info(d).name; }

size_t dtype_size(DType d) { return dtype_info(d).size; }

std::optional<DType> find_dtype(const std::string& s) {
  for (const auto& info : kDTypes)
    if (s == info.name) return info.dtype;
  return std::nullopt;
}

DType parse_dtype(const std::string& s) {
  if (auto d = find_dtype(s)) return *d;
  fail("unknown dtype '{}'", s);
}

}  // namespace kestrel
