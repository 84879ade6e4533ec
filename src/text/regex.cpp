#include "text/regex.h"

#include <mutex>

#include <oniguruma.h>

#include "core/error.h"

namespace kestrel::text {

namespace {

void init_oniguruma() {
  static std::once_flag once;
  std::call_once(once, [] {
    OnigEncoding encs[1] = {ONIG_ENCODING_UTF8};
    onig_initialize(encs, 1);
  });
}

std::string onig_message(int code, OnigErrorInfo* info) {
  OnigUChar buf[ONIG_MAX_ERROR_MESSAGE_LEN];
  const int n = info ? onig_error_code_to_str(buf, code, info) : onig_error_code_to_str(buf, code);
  return std::string(reinterpret_cast<const char*>(buf), n > 0 ? n : 0);
}

// One region per thread: onig_search writes match offsets into it, and a regex object may be shared by threads.
OnigRegion* thread_region() {
  struct Holder {
    OnigRegion* r = onig_region_new();
    ~Holder() { onig_region_free(r, 1); }
  };
  thread_local Holder h;
  return h.r;
}

int compile(const std::string& pattern, OnigRegex* out, OnigErrorInfo* info) {
  const auto* p = reinterpret_cast<const OnigUChar*>(pattern.data());
  return onig_new(out, p, p + pattern.size(), ONIG_OPTION_CAPTURE_GROUP, ONIG_ENCODING_UTF8, ONIG_SYNTAX_DEFAULT, info);
}

// Whether copies of the pattern can be chained without changing what each copy matches.
bool chainable(const std::string& p) {
  for (size_t i = 0; i + 1 < p.size(); ++i) {
    if (p[i] == '\\') {
      const char n = p[i + 1];
      if ((n >= '1' && n <= '9') || n == 'k' || n == 'g' || n == 'G') return false;
      ++i;
    } else if (p[i] == '(' && p[i + 1] == '?' && i + 2 < p.size() && (p[i + 2] == '<' || p[i + 2] == '\'' || p[i + 2] == 'P')) {
      if (i + 3 < p.size() && p[i + 2] == '<' && (p[i + 3] == '=' || p[i + 3] == '!')) continue;  // look-behind
      return false;
    }
  }
  return true;
}

size_t next_char(std::string_view s, size_t pos) {
  size_t step = 1;
  while (pos + step < s.size() && (static_cast<unsigned char>(s[pos + step]) & 0xC0) == 0x80) ++step;
  return pos + step;
}

}  // namespace

Regex::Regex(const std::string& pattern) : pattern_(pattern) {
  init_oniguruma();
  OnigRegex reg = nullptr;
  OnigErrorInfo info;
  const int rc = compile(pattern, &reg, &info);
  if (rc != ONIG_NORMAL) fail("regex '{}' does not compile: {}", pattern, onig_message(rc, &info));
  regex_ = reg;
  if (chainable(pattern)) {
    std::string chained = "(" + pattern + ")";
    for (int k = 1; k < kChain; ++k) chained += "(?:(" + pattern + ")";
    for (int k = 1; k < kChain; ++k) chained += ")?";
    OnigRegex ch = nullptr;
    if (compile(chained, &ch, &info) == ONIG_NORMAL) {
      chain_ = ch;
      chain_group_stride_ = onig_number_of_captures(reg) + 1;
    }
  }
}

Regex::~Regex() {
  if (regex_) onig_free(static_cast<OnigRegex>(regex_));
  if (chain_) onig_free(static_cast<OnigRegex>(chain_));
}

bool Regex::search(std::string_view s, size_t from, size_t& begin, size_t& end) const {
  OnigRegion* region = thread_region();
  const auto* str = reinterpret_cast<const OnigUChar*>(s.data());
  const OnigUChar* str_end = str + s.size();
  const int r = onig_search(static_cast<OnigRegex>(regex_), str, str_end, str + from, str_end, region,
                            ONIG_OPTION_NONE);
  if (r == ONIG_MISMATCH) return false;
  if (r < 0) fail("regex '{}' failed while matching: {}", pattern_, onig_message(r, nullptr));
  begin = static_cast<size_t>(region->beg[0]);
  end = static_cast<size_t>(region->end[0]);
  return true;
}

size_t Regex::next_matches(std::string_view s, Cursor& c, Batch& out) const {
  while (c.pos <= s.size()) {
    if (chain_) {
      OnigRegion* region = thread_region();
      const auto* str = reinterpret_cast<const OnigUChar*>(s.data());
      const OnigUChar* str_end = str + s.size();
      const int r = onig_search(static_cast<OnigRegex>(chain_), str, str_end, str + c.pos, str_end, region,
                                ONIG_OPTION_NONE);
      if (r == ONIG_MISMATCH) return 0;
      if (r < 0) fail("regex '{}' failed while matching: {}", pattern_, onig_message(r, nullptr));
      size_t n = 0;
      bool has_empty = false;
      for (int k = 0; k < kChain; ++k) {
        const int g = 1 + k * chain_group_stride_;
        if (g >= region->num_regs || region->beg[g] < 0) break;
        if (region->beg[g] == region->end[g]) has_empty = true;
        out[n++] = {static_cast<size_t>(region->beg[g]), static_cast<size_t>(region->end[g])};
      }
      if (!has_empty && n > 0) {
        c.pos = c.last_match_end = out[n - 1].second;
        return n;
      }
      // Empty matches follow find_iter's stepping rule below, one search at a time.
    }
    size_t b = 0, e = 0;
    if (!search(s, c.pos, b, e)) return 0;
    if (b == e && c.last_match_end == e) {
      // An empty match right where the previous one ended: step over one character and look again.
      if (c.pos >= s.size()) return 0;
      c.pos = next_char(s, c.pos);
      continue;
    }
    out[0] = {b, e};
    c.pos = c.last_match_end = e;
    return 1;
  }
  return 0;
}

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view s) const {
  std::vector<std::pair<size_t, size_t>> out;
  for_each_match(s, [&](size_t b, size_t e) { out.emplace_back(b, e); });
  return out;
}

}  // namespace kestrel::text
