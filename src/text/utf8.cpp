#include "text/utf8.h"

#include "core/error.h"

namespace kestrel::text {

namespace {

// For a lead byte: the sequence length and the allowed range of the second byte (later bytes are 80..BF).
struct LeadInfo {
  int len;
  unsigned char lo, hi;
};

LeadInfo lead_info(unsigned char b) {
  if (b < 0x80) return {1, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

// Number of bytes at s[i] that form a prefix of some valid sequence (>= 1 even for a bad lead byte), and whether
// that prefix is a complete sequence.
std::pair<size_t, bool> maximal_subpart(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  const LeadInfo li = lead_info(b);
  if (li.len == 0) return {1, false};
  if (li.len == 1) return {1, true};
  size_t n = 1;
  for (int k = 1; k < li.len; ++k) {
    if (i + n >= s.size()) return {n, false};
    const auto c = static_cast<unsigned char>(s[i + n]);
    const unsigned char lo = k == 1 ? li.lo : 0x80, hi = k == 1 ? li.hi : 0xBF;
    if (c < lo || c > hi) return {n, false};
    ++n;
  }
  return {n, true};
}

}  // namespace

size_t utf8_valid_length(std::string_view s, size_t i) {
  const auto [n, complete] = maximal_subpart(s, i);
  return complete ? n : 0;
}

size_t utf8_first_invalid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = utf8_valid_length(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

void require_utf8(std::string_view s, std::string_view what) {
  const size_t bad = utf8_first_invalid(s);
  if (bad != std::string_view::npos)
    fail("{} is not valid UTF-8: byte 0x{:02X} at offset {}", what, static_cast<unsigned char>(s[bad]), bad);
}

char32_t utf8_decode_at(std::string_view s, size_t i, size_t len) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (len == 1) return b0;
  char32_t cp = b0 & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

void utf8_append(std::string& out, char32_t cp) {
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

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      out += s[i++];
      continue;
    }
    const auto [n, complete] = maximal_subpart(s, i);
    if (complete) out.append(s.substr(i, n));
    else out += "\xEF\xBF\xBD";
    i += n;
  }
  return out;
}

size_t utf8_stable_prefix(std::string_view s) {
  // Only the last (at most 3) bytes can be an unfinished sequence; find where the last lead byte starts.
  const size_t from = s.size() > 4 ? s.size() - 4 : 0;
  size_t i = from;
  // Re-synchronise: walk from a point that is certainly a boundary of the maximal-subpart parse.
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  size_t stable = i;
  while (i < s.size()) {
    const auto [n, complete] = maximal_subpart(s, i);
    if (!complete && i + n == s.size() && lead_info(static_cast<unsigned char>(s[i])).len > 1) return i;
    i += n;
    stable = i;
  }
  return stable;
}

}  // namespace kestrel::text
