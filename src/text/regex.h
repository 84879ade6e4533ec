// Oniguruma regular expressions (the engine Hugging Face tokenizers use for pre-tokenizer patterns), UTF-8 only.
#pragma once
#include <array>
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
  void for_each_match(std::string_view s, F&& f) const {
    Cursor c;
    Batch batch;
    while (size_t n = next_matches(s, c, batch))
      for (size_t i = 0; i < n; ++i) f(batch[i].first, batch[i].second);
  }

  // First match starting at or after `from`, or false.
  bool search(std::string_view s, size_t from, size_t& begin, size_t& end) const;

 private:
  struct Cursor {
    size_t pos = 0;
    size_t last_match_end = std::string_view::npos;
  };
  static constexpr int kChain = 16;
  using Batch = std::array<std::pair<size_t, size_t>, kChain>;
  // Stores the next matches after the cursor in `out` and returns how many (0 when there are none).
  size_t next_matches(std::string_view s, Cursor& c, Batch& out) const;

  std::string pattern_;
  void* regex_ = nullptr;  // OnigRegex
  // The pattern chained with itself: "(P)(?:(P)(?:(P)...)?)?". One search then returns up to kChain consecutive
  // matches, which is what repeated searches would return (each copy takes its first-choice match, and a copy
  // that cannot match where the previous one ended ends the chain), at a fraction of Oniguruma's per-search cost.
  // Null when the pattern uses constructs a copy would change (back-references, named groups, \G).
  void* chain_ = nullptr;
  int chain_group_stride_ = 0;  // group number distance between consecutive copies
};

}  // namespace kestrel::text
