#include "grammar/escapes.h"

#include <fmt/format.h>

namespace kestrel::grammar {

namespace {
int hex(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
}  // namespace

std::optional<uint32_t> parse_escape(std::string_view s, size_t& i, bool in_class, std::string& why) {
  if (i + 1 >= s.size()) {
    why = "a backslash at the end of the text";
    return std::nullopt;
  }
  const char c = s[i + 1];
  uint32_t simple = 0xFFFFFFFF;
  switch (c) {
    case 'n': simple = '\n'; break;
    case 't': simple = '\t'; break;
    case 'r': simple = '\r'; break;
    case '\\': simple = '\\'; break;
    case '"': simple = '"'; break;
    case '\'': simple = '\''; break;
    case '/': simple = '/'; break;
    case '?': simple = '?'; break;
    case 'a': simple = '\a'; break;
    case 'b': simple = '\b'; break;
    case 'f': simple = '\f'; break;
    case 'v': simple = '\v'; break;
    case '0': simple = 0; break;
    case 'e': simple = 0x1B; break;
    default:
      if (in_class && (c == ']' || c == '[' || c == '-' || c == '^')) simple = static_cast<unsigned char>(c);
  }
  if (simple != 0xFFFFFFFF) {
    i += 2;
    return simple;
  }
  if (c == 'x') {
    size_t j = i + 2;
    uint64_t v = 0;
    while (j < s.size() && hex(s[j]) >= 0 && v <= 0x10FFFF) v = v * 16 + static_cast<uint64_t>(hex(s[j++]));
    if (j == i + 2 || v > 0x10FFFF) {
      why = "\\x needs hex digits of a code point up to 10FFFF";
      return std::nullopt;
    }
    i = j;
    return static_cast<uint32_t>(v);
  }
  if (c == 'u' || c == 'U') {
    const size_t n = c == 'u' ? 4 : 8;
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) {
      if (i + 2 + k >= s.size() || hex(s[i + 2 + k]) < 0) {
        why = fmt::format("\\{} needs {} hex digits", c, n);
        return std::nullopt;
      }
      v = v * 16 + static_cast<uint64_t>(hex(s[i + 2 + k]));
    }
    if (v > 0x10FFFF) {
      why = "a code point beyond U+10FFFF";
      return std::nullopt;
    }
    i += 2 + n;
    return static_cast<uint32_t>(v);
  }
  why = fmt::format("unknown escape '\\{}'", c);
  return std::nullopt;
}

std::optional<uint32_t> decode_utf8(std::string_view s, size_t& i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  int n = 0;
  uint32_t cp = 0;
  if (c < 0x80) n = 1, cp = c;
  else if (c >= 0xC2 && c <= 0xDF) n = 2, cp = c & 0x1F;
  else if (c >= 0xE0 && c <= 0xEF) n = 3, cp = c & 0x0F;
  else if (c >= 0xF0 && c <= 0xF4) n = 4, cp = c & 0x07;
  else return std::nullopt;
  if (i + static_cast<size_t>(n) > s.size()) return std::nullopt;
  for (int k = 1; k < n; ++k) {
    if ((b(i + static_cast<size_t>(k)) & 0xC0) != 0x80) return std::nullopt;
    cp = (cp << 6) | (b(i + static_cast<size_t>(k)) & 0x3F);
  }
  if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF))) return std::nullopt;
  i += static_cast<size_t>(n);
  return cp;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace kestrel::grammar
