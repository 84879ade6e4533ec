// UTF-8 helpers shared by the tokenizers, the detokenizer and the template engine.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kestrel::text {

// Length in bytes of the valid UTF-8 sequence starting at s[i], or 0 when the bytes there are not one
// (truncated, overlong, surrogate, above U+10FFFF, stray continuation byte).
size_t utf8_valid_length(std::string_view s, size_t i);

// Byte offset of the first invalid sequence, or npos when s is valid UTF-8.
size_t utf8_first_invalid(std::string_view s);

// Throws kestrel::Error naming the offset of the first invalid byte; `what` says which input it was.
void require_utf8(std::string_view s, std::string_view what);

// Decodes a valid sequence at s[i] (as checked by utf8_valid_length) into a code point.
char32_t utf8_decode_at(std::string_view s, size_t i, size_t len);

void utf8_append(std::string& out, char32_t cp);

// Replaces each maximal invalid subpart with U+FFFD (the Unicode "substitution of maximal subparts" practice,
// which Python's errors="replace" and Rust's from_utf8_lossy both follow).
std::string utf8_lossy(std::string_view s);

// Length of the longest prefix of s that ends on a complete sequence or could not be completed by appending
// bytes: the bytes after it are a proper prefix of a valid sequence, which more bytes may still finish.
size_t utf8_stable_prefix(std::string_view s);

}  // namespace kestrel::text
