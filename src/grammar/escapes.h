// Escapes and UTF-8 shared by the grammar parsers (EBNF, regex).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kestrel::grammar {

// The code point of the escape at s[i] (a backslash), advancing i past it: \n \t \r \\ \" \' \/ \? \a \b \f \v \0 \e,
// \xH... (any number of hex digits), \uHHHH, \UHHHHHHHH; in a class also \] \[ \- \^. Empty with `why` set when it
// is not an escape.
std::optional<uint32_t> parse_escape(std::string_view s, size_t& i, bool in_class, std::string& why);
// The code point of the well-formed UTF-8 sequence at s[i], advancing i past it.
std::optional<uint32_t> decode_utf8(std::string_view s, size_t& i);
void append_utf8(std::string& out, uint32_t cp);

}  // namespace kestrel::grammar
