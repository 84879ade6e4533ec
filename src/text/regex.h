// Oniguruma regular expressions (the engine Hugging Face tokenizers use for pre-tokenizer patterns), UTF-8 only.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::text {

class Regex {
 public:
  // Throws kestrel::Error with Oniguruma's message when the pattern does not compile.
  explicit Regex(const std::string& pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  const std::string& pattern() const { return pattern_; }

  // All leftmost non-overlapping matches in s as [begin, end) byte offsets. An empty match is reported once and the
  // search then moves on by one character, the way the onig crate's find_iter does.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const;

  // Calls f(begin, end) for each match, as find_all reports them, without building a vector.
  template <typename F>
  void for_each_match(std::string_view s, F&& f) const;

  // First match starting at or after `from`, or false.
  bool search(std::string_view s, size_t from, size_t& begin, size_t& end) const;

 private:
  std::string pattern_;
  void* regex_ = nullptr;  // OnigRegex
};

template <typename F>
void Regex::for_each_match(std::string_view s, F&& f) const {
  size_t pos = 0;
  size_t last_match_end = std::string_view::npos;
  while (pos <= s.size()) {
    size_t b = 0, e = 0;
    if (!search(s, pos, b, e)) break;
    if (b == e && last_match_end == e) {
      // An empty match right where the previous one ended: step over one character and look again.
      if (pos >= s.size()) break;
      size_t step = 1;
      while (pos + step < s.size() && (static_cast<unsigned char>(s[pos + step]) & 0xC0) == 0x80) ++step;
      pos += step;
      continue;
    }
    f(b, e);
    pos = e;
    last_match_end = e;
  }
}

}  // namespace kestrel::text
