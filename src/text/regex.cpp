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

}  // namespace

Regex::Regex(const std::string& pattern) : pattern_(pattern) {
  init_oniguruma();
  OnigRegex reg = nullptr;
  OnigErrorInfo info;
  const auto* p = reinterpret_cast<const OnigUChar*>(pattern.data());
  const int rc = onig_new(&reg, p, p + pattern.size(), ONIG_OPTION_CAPTURE_GROUP, ONIG_ENCODING_UTF8,
                          ONIG_SYNTAX_DEFAULT, &info);
  if (rc != ONIG_NORMAL) fail("regex '{}' does not compile: {}", pattern, onig_message(rc, &info));
  regex_ = reg;
}

Regex::~Regex() {
  if (regex_) onig_free(static_cast<OnigRegex>(regex_));
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

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view s) const {
  std::vector<std::pair<size_t, size_t>> out;
  for_each_match(s, [&](size_t b, size_t e) { out.emplace_back(b, e); });
  return out;
}

}  // namespace kestrel::text
