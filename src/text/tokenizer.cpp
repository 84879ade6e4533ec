#include "text/tokenizer.h"

#include <algorithm>
#include <deque>
#include <forward_list>
#include <fstream>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/bpe.h"
#include "text/regex.h"
#include "text/utf8.h"

namespace kestrel::text {

using nlohmann::json;

namespace {

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Kimi's split pattern (it lives in Kimi's Python tokenizer code, not in its files).
constexpr const char* kKimiPattern =
    R"([\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::string read_text_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot read {}", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool file_exists(const std::string& path) { return std::ifstream(path).good(); }

json parse_json(std::string_view text, std::string_view what) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail("{} is not valid JSON: {}", what, e.what());
  }
}

// Rust's char::is_whitespace (the Unicode White_Space property), which `tokenizers` uses for lstrip/rstrip/Strip.
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

struct ByteMap {
  char32_t to_cp[256];
  std::unordered_map<char32_t, unsigned char> to_byte;
  ByteMap() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      to_cp[b] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      to_byte[to_cp[b]] = static_cast<unsigned char>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// A vocabulary string of a byte-level file as bytes: mapped back when every character belongs to the byte
// alphabet, else its own UTF-8 (what the ByteLevel decoder of `tokenizers` does per token).
std::string vocab_string_bytes(std::string_view s, bool* all_mapped) {
  const ByteMap& m = byte_map();
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    const size_t n = utf8_valid_length(s, i);
    if (n == 0) break;
    const auto it = m.to_byte.find(utf8_decode_at(s, i, n));
    if (it == m.to_byte.end()) break;
    out += static_cast<char>(it->second);
    i += n;
  }
  *all_mapped = i == s.size();
  return *all_mapped ? out : std::string(s);
}

struct AddedToken {
  std::string content;
  std::string pattern;  // what is searched for: the content, normalized for `normalized` tokens
  int32_t id = -1;
  bool special = false, lstrip = false, rstrip = false, normalized = false;
};

// Leftmost-longest matching of added tokens (what the Aho-Corasick automaton of `tokenizers` does).
class AddedMatcher {
 public:
  void build(const std::vector<const AddedToken*>& tokens) {
    tokens_ = tokens;
    std::stable_sort(tokens_.begin(), tokens_.end(),
                     [](const AddedToken* a, const AddedToken* b) { return a->pattern.size() > b->pattern.size(); });
    for (auto& v : first_) v.clear();
    for (const AddedToken* t : tokens_)
      if (!t->pattern.empty()) first_[static_cast<unsigned char>(t->pattern[0])].push_back(t);
  }
  bool empty() const { return tokens_.empty(); }

  // The first match at or after `from`: [begin, end) and the token.
  const AddedToken* find(std::string_view s, size_t from, size_t& begin, size_t& end) const {
    for (size_t i = from; i < s.size(); ++i) {
      for (const AddedToken* t : first_[static_cast<unsigned char>(s[i])]) {
        if (s.compare(i, t->pattern.size(), t->pattern) == 0) {
          begin = i;
          end = i + t->pattern.size();
          return t;
        }
      }
    }
    return nullptr;
  }

 private:
  std::vector<const AddedToken*> tokens_;
  std::vector<const AddedToken*> first_[256];
};

enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

SplitBehavior parse_behavior(const std::string& s) {
  if (s == "Removed") return SplitBehavior::removed;
  if (s == "Isolated") return SplitBehavior::isolated;
  if (s == "MergedWithPrevious") return SplitBehavior::merged_with_previous;
  if (s == "MergedWithNext") return SplitBehavior::merged_with_next;
  if (s == "Contiguous") return SplitBehavior::contiguous;
  fail("tokenizer.json: unknown Split behavior '{}'", s);
}

std::string regex_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (std::string_view("\\^$.|?*+()[]{}-/").find(c) != std::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

// Sequence components nest one level in published tokenizers. Each level is a recursive call, so a bound keeps
// a hostile tokenizer.json from exhausting the stack.
constexpr int kMaxSequenceNesting = 32;

void check_sequence_depth(int depth, std::string_view what) {
  if (depth >= kMaxSequenceNesting)
    fail("tokenizer.json: {} Sequence nesting deeper than {}", what, kMaxSequenceNesting);
}

// j[key], or null when absent, by reference: copying a JSON value recurses once per nesting level.
const json& member_or_null(const json& j, const char* key) {
  static const json absent;
  const auto it = j.find(key);
  return it != j.end() ? *it : absent;
}

// A Pattern of tokenizer.json: {"String": literal} or {"Regex": pattern}.
std::unique_ptr<Regex> parse_pattern(const json& p, std::string_view where) {
  if (p.is_object() && p.contains("Regex")) return std::make_unique<Regex>(p["Regex"].get<std::string>());
  if (p.is_object() && p.contains("String")) return std::make_unique<Regex>(regex_escape(p["String"].get<std::string>()));
  fail("tokenizer.json: {} pattern must be {{\"String\": ...}} or {{\"Regex\": ...}}", where);
}

struct Segment {
  size_t begin, end;
  bool match;
};

// Splits [0, s.size()) into matched and unmatched segments, then groups them as `tokenizers` does.
void split_pieces(std::string_view s, const Regex& re, SplitBehavior behavior, bool invert,
                  std::vector<std::string_view>& out) {
  thread_local std::vector<Segment> segs;
  segs.clear();
  size_t prev = 0;
  re.for_each_match(s, [&](size_t b, size_t e) {
    if (prev != b) segs.push_back({prev, b, invert});
    segs.push_back({b, e, !invert});
    prev = e;
  });
  if (prev != s.size()) segs.push_back({prev, s.size(), invert});

  thread_local std::vector<Segment> grouped;
  grouped.clear();
  switch (behavior) {
    case SplitBehavior::isolated:
      grouped = segs;
      break;
    case SplitBehavior::removed:
      for (const Segment& g : segs)
        if (!g.match) grouped.push_back(g);
      break;
    case SplitBehavior::merged_with_previous: {
      bool previous_match = false;
      for (const Segment& g : segs) {
        if (g.match && !previous_match && !grouped.empty()) grouped.back().end = g.end;
        else grouped.push_back(g);
        previous_match = g.match;
      }
      break;
    }
    case SplitBehavior::merged_with_next: {
      bool previous_match = false;
      for (size_t k = segs.size(); k-- > 0;) {
        const Segment& g = segs[k];
        if (g.match && !previous_match && !grouped.empty()) grouped.back().begin = g.begin;
        else grouped.push_back(g);
        previous_match = g.match;
      }
      std::reverse(grouped.begin(), grouped.end());
      break;
    }
    case SplitBehavior::contiguous: {
      bool previous_match = false;
      for (const Segment& g : segs) {
        if (g.match == previous_match && !grouped.empty()) grouped.back().end = g.end;
        else grouped.push_back(g);
        previous_match = g.match;
      }
      break;
    }
  }
  for (const Segment& g : grouped)
    if (g.end > g.begin) out.push_back(s.substr(g.begin, g.end - g.begin));
}

struct PreStep {
  enum Kind { split, byte_level } kind = split;
  std::unique_ptr<Regex> regex;  // split pattern; for byte_level with use_regex the GPT-2 pattern
  SplitBehavior behavior = SplitBehavior::isolated;
  bool invert = false;
  bool add_prefix_space = false;
};

struct NormStep {
  enum Kind { prepend, replace, strip } kind = prepend;
  std::string text;
  std::unique_ptr<Regex> regex;
  bool left = false, right = false;
};

}  // namespace

char32_t byte_to_unicode(unsigned char b) { return byte_map().to_cp[b]; }

int unicode_to_byte(char32_t cp) {
  const auto& m = byte_map().to_byte;
  const auto it = m.find(cp);
  return it == m.end() ? -1 : it->second;
}

struct Tokenizer::Impl {
  Format format = Format::hf_json;
  BpeModel bpe{{}};
  std::vector<uint8_t> special;  // per id
  std::vector<uint8_t> known;    // per id
  std::deque<AddedToken> added;
  AddedMatcher raw_matcher, normalized_matcher;
  std::vector<NormStep> normalizers;
  std::vector<PreStep> pre;
  std::vector<int32_t> prefix_ids, suffix_ids;
  std::unique_ptr<Regex> tiktoken_pattern;
  std::unordered_map<std::string, int32_t> by_text;
  // Ids whose decoded bytes differ from their vocabulary bytes (normalized added tokens).
  std::unordered_map<int32_t, std::string> decode_bytes;
  size_t max_token_bytes = 1;  // the longest text one token stands for (vocabulary bytes or an added token's text)

  void encode_ordinary(std::string_view text, std::vector<int32_t>& out, PieceCache* cache) const;
  void encode_hf_segment(std::string_view text, bool parse_special, std::vector<int32_t>& out,
                         PieceCache* cache) const;
  std::string normalize(std::string_view s) const;
};

std::string Tokenizer::Impl::normalize(std::string_view s) const {
  std::string cur(s);
  for (const NormStep& n : normalizers) {
    switch (n.kind) {
      case NormStep::prepend:
        if (!cur.empty()) cur = n.text + cur;
        break;
      case NormStep::replace: {
        std::string next;
        size_t prev = 0;
        n.regex->for_each_match(cur, [&](size_t b, size_t e) {
          next.append(cur, prev, b - prev);
          next += n.text;
          prev = e;
        });
        next.append(cur, prev, std::string::npos);
        cur = std::move(next);
        break;
      }
      case NormStep::strip: {
        size_t b = 0, e = cur.size();
        if (n.left)
          while (b < e) {
            const size_t len = utf8_valid_length(cur, b);
            if (!is_white_space(utf8_decode_at(cur, b, len))) break;
            b += len;
          }
        if (n.right)
          while (e > b) {
            size_t k = e - 1;
            while (k > b && (static_cast<unsigned char>(cur[k]) & 0xC0) == 0x80) --k;
            if (!is_white_space(utf8_decode_at(cur, k, e - k))) break;
            e = k;
          }
        cur = cur.substr(b, e - b);
        break;
      }
    }
  }
  return cur;
}

// Pre-tokenizes and byte-pair encodes text that holds no added token.
void Tokenizer::Impl::encode_ordinary(std::string_view text, std::vector<int32_t>& out, PieceCache* cache) const {
  if (text.empty()) return;
  // Only views into the caller's text may enter the cache (it outlives the pieces made here with a prefix space).
  auto piece = [&](std::string_view p) {
    if (cache && p.data() >= text.data() && p.data() + p.size() <= text.data() + text.size())
      bpe.encode_piece(p, out, *cache);
    else bpe.encode_piece(p, out);
  };
  if (format == Format::tiktoken) {
    tiktoken_pattern->for_each_match(text, [&](size_t b, size_t e) { piece(text.substr(b, e - b)); });
    return;
  }
  std::forward_list<std::string> owned;  // pieces that no longer point into `text`
  thread_local std::vector<std::string_view> pieces, next;
  pieces.assign(1, text);
  for (const PreStep& step : pre) {
    next.clear();
    for (std::string_view p : pieces) {
      if (step.kind == PreStep::byte_level && step.add_prefix_space && p.front() != ' ') {
        std::string& s = owned.emplace_front();
        s.reserve(p.size() + 1);
        s += ' ';
        s.append(p);
        p = s;
      }
      if (step.regex) split_pieces(p, *step.regex, step.behavior, step.invert, next);
      else next.push_back(p);
    }
    std::swap(pieces, next);
  }
  for (std::string_view p : pieces) piece(p);
}

void Tokenizer::Impl::encode_hf_segment(std::string_view text, bool parse_special, std::vector<int32_t>& out,
                                        PieceCache* cache) const {
  // Added tokens that match the raw text come out first, then the rest is normalized and searched for the
  // tokens that match normalized text.
  auto split_added = [&](std::string_view s, const AddedMatcher& m, auto&& on_text) {
    size_t pos = 0, start = 0;
    size_t b = 0, e = 0;
    while (!m.empty()) {
      const AddedToken* t = m.find(s, pos, b, e);
      if (!t) break;
      pos = e;
      if (!parse_special && t->special) continue;
      if (t->lstrip) {
        size_t nb = b;
        while (nb > start) {
          size_t k = nb - 1;
          while (k > start && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
          if (!is_white_space(utf8_decode_at(s, k, nb - k))) break;
          nb = k;
        }
        b = nb;
      }
      if (t->rstrip) {
        while (e < s.size()) {
          const size_t len = utf8_valid_length(s, e);
          if (!is_white_space(utf8_decode_at(s, e, len))) break;
          e += len;
        }
        pos = std::max(pos, e);
      }
      if (start < b) on_text(s.substr(start, b - start));
      out.push_back(t->id);
      start = e;
    }
    if (start < s.size()) on_text(s.substr(start));
  };
  split_added(text, raw_matcher, [&](std::string_view piece) {
    if (normalizers.empty()) {
      split_added(piece, normalized_matcher, [&](std::string_view p) { encode_ordinary(p, out, cache); });
    } else {
      // The cache holds views into the text it saw; normalized text is a temporary, so it is not cached.
      const std::string norm = normalize(piece);
      split_added(norm, normalized_matcher, [&](std::string_view p) { encode_ordinary(p, out, nullptr); });
    }
  });
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  size_t m = 1;
  for (size_t id = 0; id < impl_->known.size(); ++id)
    if (impl_->known[id]) m = std::max(m, impl_->bpe.bytes_of(static_cast<int32_t>(id)).size());
  for (const AddedToken& t : impl_->added) m = std::max({m, t.content.size(), t.pattern.size()});
  impl_->max_token_bytes = m;
}

size_t Tokenizer::max_token_bytes() const { return impl_->max_token_bytes; }
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer::Format Tokenizer::format() const { return impl_->format; }

std::vector<int32_t> Tokenizer::encode(std::string_view text, const EncodeOptions& opts) const {
  require_utf8(text, "text to encode");
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  const Impl& m = *impl_;
  if (opts.add_special_tokens) out = m.prefix_ids;
  // Long texts repeat their words; short ones would only pay for setting the cache up.
  std::optional<PieceCache> cache;
  if (text.size() >= 4096) cache.emplace();
  PieceCache* c = cache ? &*cache : nullptr;
  if (m.format == Format::hf_json) {
    m.encode_hf_segment(text, opts.parse_special, out, c);
  } else if (!opts.parse_special) {
    m.encode_ordinary(text, out, c);
  } else {
    size_t start = 0, b = 0, e = 0;
    while (const AddedToken* t = m.raw_matcher.find(text, start, b, e)) {
      m.encode_ordinary(text.substr(start, b - start), out, c);
      out.push_back(t->id);
      start = e;
    }
    m.encode_ordinary(text.substr(start), out, c);
  }
  if (opts.add_special_tokens) out.insert(out.end(), m.suffix_ids.begin(), m.suffix_ids.end());
  return out;
}

bool Tokenizer::is_known(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->known.size() && impl_->known[static_cast<size_t>(id)];
}

bool Tokenizer::is_special(int32_t id) const { return is_known(id) && impl_->special[static_cast<size_t>(id)]; }

const std::string& Tokenizer::token_bytes(int32_t id) const {
  if (!is_known(id)) fail("token id {} is not in the vocabulary (ids 0..{})", id, id_count() - 1);
  if (!impl_->decode_bytes.empty()) {
    const auto it = impl_->decode_bytes.find(id);
    if (it != impl_->decode_bytes.end()) return it->second;
  }
  return impl_->bpe.bytes_of(id);
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string bytes;
  for (int32_t id : ids) {
    const std::string& b = token_bytes(id);
    if (skip_special && impl_->special[static_cast<size_t>(id)]) continue;
    bytes += b;
  }
  return utf8_lossy(bytes);
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const auto it = impl_->by_text.find(std::string(token));
  if (it == impl_->by_text.end()) return std::nullopt;
  return it->second;
}

int32_t Tokenizer::id_count() const { return static_cast<int32_t>(impl_->known.size()); }

namespace {

AddedToken parse_added(const json& a) {
  AddedToken t;
  t.content = a.at("content").get<std::string>();
  t.id = a.at("id").get<int32_t>();
  t.special = a.value("special", false);
  t.lstrip = a.value("lstrip", false);
  t.rstrip = a.value("rstrip", false);
  t.normalized = a.value("normalized", !t.special);
  if (a.value("single_word", false))
    fail("tokenizer.json: added token '{}' uses single_word, which Kestrel does not support", t.content);
  return t;
}

void parse_normalizer(const json& n, std::vector<NormStep>& out, int depth = 0) {
  if (n.is_null()) return;
  const std::string type = n.at("type").get<std::string>();
  if (type == "Sequence") {
    check_sequence_depth(depth, "normalizer");
    for (const json& c : n.at("normalizers")) parse_normalizer(c, out, depth + 1);
  } else if (type == "Prepend") {
    NormStep s;
    s.kind = NormStep::prepend;
    s.text = n.at("prepend").get<std::string>();
    out.push_back(std::move(s));
  } else if (type == "Replace") {
    NormStep s;
    s.kind = NormStep::replace;
    s.regex = parse_pattern(n.at("pattern"), "Replace normalizer");
    s.text = n.at("content").get<std::string>();
    out.push_back(std::move(s));
  } else if (type == "Strip") {
    NormStep s;
    s.kind = NormStep::strip;
    s.left = n.value("strip_left", false);
    s.right = n.value("strip_right", false);
    out.push_back(std::move(s));
  } else {
    fail("tokenizer.json: normalizer '{}' is not supported (supported: Sequence, Prepend, Replace, Strip)", type);
  }
}

void parse_pre_tokenizer(const json& p, std::vector<PreStep>& out, bool& has_byte_level, int depth = 0) {
  if (p.is_null()) return;
  const std::string type = p.at("type").get<std::string>();
  if (type == "Sequence") {
    check_sequence_depth(depth, "pre-tokenizer");
    for (const json& c : p.at("pretokenizers")) parse_pre_tokenizer(c, out, has_byte_level, depth + 1);
  } else if (type == "Split") {
    PreStep s;
    s.kind = PreStep::split;
    s.regex = parse_pattern(p.at("pattern"), "Split");
    s.behavior = parse_behavior(p.at("behavior").get<std::string>());
    s.invert = p.value("invert", false);
    out.push_back(std::move(s));
  } else if (type == "ByteLevel") {
    PreStep s;
    s.kind = PreStep::byte_level;
    s.add_prefix_space = p.value("add_prefix_space", true);
    if (p.value("use_regex", true)) s.regex = std::make_unique<Regex>(kGpt2Pattern);
    out.push_back(std::move(s));
    has_byte_level = true;
  } else if (type == "Digits") {
    PreStep s;
    s.kind = PreStep::split;
    s.regex = std::make_unique<Regex>(R"(\p{N})");
    s.behavior = p.value("individual_digits", false) ? SplitBehavior::isolated : SplitBehavior::contiguous;
    out.push_back(std::move(s));
  } else {
    fail("tokenizer.json: pre-tokenizer '{}' is not supported (supported: Sequence, Split, ByteLevel, Digits)", type);
  }
}

std::vector<int32_t> special_ids_of(const json& proc, const std::string& name) {
  const json& st = proc.at("special_tokens");
  if (!st.contains(name)) fail("tokenizer.json: post-processor names special token '{}' it does not define", name);
  return st[name].at("ids").get<std::vector<int32_t>>();
}

void parse_post_processor(const json& p, std::vector<int32_t>& prefix, std::vector<int32_t>& suffix, int depth = 0) {
  if (p.is_null()) return;
  const std::string type = p.at("type").get<std::string>();
  if (type == "Sequence") {
    check_sequence_depth(depth, "post-processor");
    for (const json& c : p.at("processors")) parse_post_processor(c, prefix, suffix, depth + 1);
  } else if (type == "ByteLevel") {
    // Adjusts offsets only.
  } else if (type == "TemplateProcessing") {
    bool seen_sequence = false;
    for (const json& item : p.at("single")) {
      if (item.contains("Sequence")) {
        seen_sequence = true;
      } else if (item.contains("SpecialToken")) {
        const auto ids = special_ids_of(p, item["SpecialToken"].at("id").get<std::string>());
        auto& dst = seen_sequence ? suffix : prefix;
        dst.insert(dst.end(), ids.begin(), ids.end());
      }
    }
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    prefix.push_back(p.at("cls").at(1).get<int32_t>());
    suffix.insert(suffix.begin(), p.at("sep").at(1).get<int32_t>());
  } else {
    fail("tokenizer.json: post-processor '{}' is not supported", type);
  }
}

void check_decoder(const json& d, int depth = 0) {
  if (d.is_null()) fail("tokenizer.json: no decoder; only byte-level BPE (ByteLevel decoder) is supported");
  const std::string type = d.at("type").get<std::string>();
  if (type == "Sequence") {
    check_sequence_depth(depth, "decoder");
    for (const json& c : d.at("decoders")) check_decoder(c, depth + 1);
  } else if (type != "ByteLevel") {
    fail("tokenizer.json: decoder '{}' is not supported (only ByteLevel)", type);
  }
}

std::pair<std::string, std::string> parse_merge(const json& m) {
  if (m.is_string()) {
    const std::string s = m.get<std::string>();
    const size_t sp = s.find(' ');
    if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
      fail("tokenizer.json: merge '{}' is not two tokens separated by one space", s);
    return {s.substr(0, sp), s.substr(sp + 1)};
  }
  if (m.is_array() && m.size() == 2) return {m[0].get<std::string>(), m[1].get<std::string>()};
  fail("tokenizer.json: a merge must be \"A B\" or [\"A\", \"B\"], got a JSON {}", m.type_name());
}

std::string base64_decode(std::string_view s, size_t line) {
  auto val = [&](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    fail("tiktoken.model line {}: '{}' is not base64", line, std::string(s));
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : s) {
    if (c == '=') break;
    acc = (acc << 6) | static_cast<uint32_t>(val(c));
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xFF);
    }
  }
  return out;
}

}  // namespace

// The largest token id a tokenizer may use: every id gets a slot in per-id tables, so an id far beyond the tokens a
// file defines (a typo, or a hostile 1e9) would allocate gigabytes for nothing. Gaps of reserved ids are common
// (tiktoken rank files with special tokens after a reserved range); twice the defined tokens plus 64K covers them.
size_t id_table_limit(size_t defined) { return std::min<size_t>(2 * defined + 65536, size_t{1} << 24); }

void check_id_range(int64_t max_id, size_t defined, const char* file) {
  if (max_id >= 0 && static_cast<size_t>(max_id) >= id_table_limit(defined))
    fail("{}: token id {} is far beyond the {} tokens the file defines (ids must stay below {})", file, max_id,
         defined, id_table_limit(defined));
}

Tokenizer Tokenizer::from_hf_json(std::string_view tokenizer_json) {
  // Field access on the wrong JSON type (a `model` that is a list, an id that is a string) throws nlohmann's
  // exceptions: report them as the file's error.
  try {
    return from_hf_json_unchecked(tokenizer_json);
  } catch (const json::exception& e) {
    fail("tokenizer.json: unexpected structure: {}", e.what());
  }
}

Tokenizer Tokenizer::from_hf_json_unchecked(std::string_view tokenizer_json) {
  const json j = parse_json(tokenizer_json, "tokenizer.json");
  if (!j.is_object()) fail("tokenizer.json: the top level must be a JSON object");
  auto impl = std::make_unique<Impl>();
  impl->format = Format::hf_json;
  const json& model = j.at("model");
  if (!model.is_object()) fail("tokenizer.json: 'model' must be an object, got a JSON {}", model.type_name());
  const std::string mtype = model.value("type", std::string("BPE"));
  if (mtype != "BPE") fail("tokenizer.json: model type '{}' is not supported (only BPE)", mtype);
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(k) && !model[k].is_null() && !model[k].get<std::string>().empty())
      fail("tokenizer.json: BPE '{}' is not supported", k);
  if (model.value("byte_fallback", false)) fail("tokenizer.json: BPE byte_fallback is not supported");
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0)
    fail("tokenizer.json: BPE dropout is not supported");
  check_decoder(member_or_null(j, "decoder"));
  bool has_byte_level = false;
  parse_pre_tokenizer(member_or_null(j, "pre_tokenizer"), impl->pre, has_byte_level);
  if (!has_byte_level) fail("tokenizer.json: no ByteLevel pre-tokenizer; only byte-level BPE is supported");
  parse_normalizer(member_or_null(j, "normalizer"), impl->normalizers);
  if (j.contains("post_processor"))
    parse_post_processor(j["post_processor"], impl->prefix_ids, impl->suffix_ids);

  const json& vocab = model.at("vocab");
  static const json no_added_tokens = json::array();
  const json& added_json = j.contains("added_tokens") ? j["added_tokens"] : no_added_tokens;
  if (!vocab.is_object()) fail("tokenizer.json: 'model.vocab' must be an object, got a JSON {}", vocab.type_name());
  if (!added_json.is_array()) fail("tokenizer.json: 'added_tokens' must be a list");
  int64_t max_id = -1;
  for (const auto& [k, v] : vocab.items()) max_id = std::max<int64_t>(max_id, v.get<int64_t>());
  for (const json& a : added_json) max_id = std::max<int64_t>(max_id, a.at("id").get<int64_t>());
  check_id_range(max_id, vocab.size() + added_json.size(), "tokenizer.json");
  const size_t n = static_cast<size_t>(max_id + 1);
  std::vector<std::string> bytes(n);
  impl->known.assign(n, 0);
  impl->special.assign(n, 0);
  std::vector<int32_t> mapped_ids;  // vocabulary entries written wholly in the byte alphabet
  for (const auto& [k, v] : vocab.items()) {
    const int32_t id = v.get<int32_t>();
    if (id < 0) fail("tokenizer.json: negative id {} for '{}'", id, k);
    bool all_mapped = false;
    bytes[static_cast<size_t>(id)] = vocab_string_bytes(k, &all_mapped);
    if (all_mapped) mapped_ids.push_back(id);
    impl->known[static_cast<size_t>(id)] = 1;
    impl->by_text.emplace(k, id);
  }
  for (const json& a : added_json) {
    impl->added.push_back(parse_added(a));
    const AddedToken& t = impl->added.back();
    if (t.id < 0) fail("tokenizer.json: negative id {} for added token '{}'", t.id, t.content);
    bool all_mapped = false;
    bytes[static_cast<size_t>(t.id)] = vocab_string_bytes(t.content, &all_mapped);
    impl->known[static_cast<size_t>(t.id)] = 1;
    impl->special[static_cast<size_t>(t.id)] = t.special;
    impl->by_text[t.content] = t.id;
  }
  impl->bpe = BpeModel(std::move(bytes));
  impl->bpe.require_all_bytes("tokenizer.json");

  const json& merges = model.at("merges");
  auto id_of = [&](const std::string& s) -> int32_t {
    const auto it = vocab.find(s);
    if (it == vocab.end()) fail("tokenizer.json: merge refers to '{}', which is not in the vocabulary", s);
    return it->get<int32_t>();
  };
  int32_t rank = 0;
  for (const json& m : merges) {
    const auto [a, b] = parse_merge(m);
    impl->bpe.add_merge(id_of(a), id_of(b), rank++, id_of(a + b));
  }
  // With ignore_merges a piece that is a vocabulary entry is that token. Without it, the same shortcut is exact
  // for the entries that the merges rebuild from their own bytes, and saves the merge loop for common words.
  impl->bpe.enable_whole_piece_lookup(model.value("ignore_merges", false) ? mapped_ids
                                                                          : impl->bpe.self_reaching(mapped_ids));

  // As in `tokenizers`, a normalized token is searched for in its normalized form in normalized text, and that
  // form is also its token string: what it decodes to, and what skip-special decoding compares with the special
  // tokens' contents.
  std::vector<const AddedToken*> raw, normalized;
  std::unordered_set<std::string> special_contents;
  for (const AddedToken& t : impl->added)
    if (t.special) special_contents.insert(t.content);
  for (AddedToken& t : impl->added) {
    t.pattern = t.normalized ? impl->normalize(t.content) : t.content;
    (t.normalized ? normalized : raw).push_back(&t);
    if (t.pattern != t.content) {
      bool all_mapped = false;
      impl->decode_bytes[t.id] = vocab_string_bytes(t.pattern, &all_mapped);
      impl->special[static_cast<size_t>(t.id)] = special_contents.count(t.pattern) > 0;
    }
  }
  impl->raw_matcher.build(raw);
  impl->normalized_matcher.build(normalized);
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_tiktoken(std::string_view rank_file, std::string_view config_json) {
  try {
    return from_tiktoken_unchecked(rank_file, config_json);
  } catch (const json::exception& e) {
    fail("tokenizer_config.json: unexpected structure: {}", e.what());
  }
}

Tokenizer Tokenizer::from_tiktoken_unchecked(std::string_view rank_file, std::string_view config_json) {
  auto impl = std::make_unique<Impl>();
  impl->format = Format::tiktoken;
  std::vector<std::pair<std::string, int32_t>> ranks;
  int32_t max_id = -1;
  size_t line_no = 0, pos = 0;
  while (pos < rank_file.size()) {
    size_t eol = rank_file.find('\n', pos);
    if (eol == std::string_view::npos) eol = rank_file.size();
    std::string_view line = rank_file.substr(pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string_view::npos) fail("tiktoken.model line {}: expected 'BASE64 RANK'", line_no);
    const std::string_view rank_text = line.substr(sp + 1);
    int64_t r = 0;
    if (rank_text.empty() || rank_text.size() > 9) fail("tiktoken.model line {}: bad rank", line_no);
    for (char c : rank_text) {
      if (c < '0' || c > '9') fail("tiktoken.model line {}: bad rank '{}'", line_no, std::string(rank_text));
      r = r * 10 + (c - '0');
    }
    ranks.emplace_back(base64_decode(line.substr(0, sp), line_no), static_cast<int32_t>(r));
    max_id = std::max(max_id, static_cast<int32_t>(r));
  }
  if (ranks.empty()) fail("tiktoken.model holds no tokens");

  const json cfg = parse_json(config_json, "tokenizer_config.json");
  if (cfg.contains("added_tokens_decoder")) {
    for (const auto& [k, v] : cfg["added_tokens_decoder"].items()) {
      AddedToken t;
      try {
        t.id = std::stoi(k);
      } catch (const std::exception&) {
        fail("tokenizer_config.json: added_tokens_decoder key '{}' is not an id", k);
      }
      if (t.id < 0) fail("tokenizer_config.json: added_tokens_decoder id {} is negative", t.id);
      t.content = v.at("content").get<std::string>();
      t.pattern = t.content;
      t.special = true;
      impl->added.push_back(t);
      max_id = std::max(max_id, t.id);
    }
  }
  const std::string pattern = cfg.value("pat_str", std::string(kKimiPattern));
  impl->tiktoken_pattern = std::make_unique<Regex>(pattern);

  check_id_range(max_id, ranks.size() + impl->added.size(), "tiktoken.model / tokenizer_config.json");
  const size_t n = static_cast<size_t>(max_id + 1);
  std::vector<std::string> bytes(n);
  impl->known.assign(n, 0);
  impl->special.assign(n, 0);
  std::unordered_map<std::string_view, int32_t> rank_of;
  rank_of.reserve(ranks.size());
  std::vector<int32_t> rank_ids;
  for (auto& [b, r] : ranks) {
    if (impl->known[static_cast<size_t>(r)]) fail("tiktoken.model: rank {} appears twice", r);
    impl->known[static_cast<size_t>(r)] = 1;
    bytes[static_cast<size_t>(r)] = b;
    rank_ids.push_back(r);
    impl->by_text.emplace(b, r);
  }
  for (const AddedToken& t : impl->added) {
    if (impl->known[static_cast<size_t>(t.id)])
      fail("tokenizer_config.json: special token '{}' has id {}, which the rank file already uses", t.content, t.id);
    impl->known[static_cast<size_t>(t.id)] = 1;
    impl->special[static_cast<size_t>(t.id)] = 1;
    bytes[static_cast<size_t>(t.id)] = t.content;
    impl->by_text[t.content] = t.id;
  }
  impl->bpe = BpeModel(std::move(bytes));
  impl->bpe.require_all_bytes("tiktoken.model");
  for (int32_t r : rank_ids) rank_of.emplace(std::string_view(impl->bpe.bytes_of(r)), r);
  // Every way of cutting a token into two tokens is a pair whose merge has that token's rank.
  for (int32_t r : rank_ids) {
    const std::string& s = impl->bpe.bytes_of(r);
    for (size_t k = 1; k < s.size(); ++k) {
      const auto l = rank_of.find(std::string_view(s).substr(0, k));
      if (l == rank_of.end()) continue;
      const auto rr = rank_of.find(std::string_view(s).substr(k));
      if (rr == rank_of.end()) continue;
      impl->bpe.add_merge(l->second, rr->second, r, r);
    }
  }
  impl->bpe.enable_whole_piece_lookup(rank_ids);
  std::vector<const AddedToken*> all;
  for (const AddedToken& t : impl->added) all.push_back(&t);
  impl->raw_matcher.build(all);
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::load(const std::string& model_dir) {
  const std::string hf = model_dir + "/tokenizer.json";
  if (file_exists(hf)) return from_hf_json(read_text_file(hf));
  const std::string tk = model_dir + "/tiktoken.model";
  if (file_exists(tk)) {
    const std::string cfg = model_dir + "/tokenizer_config.json";
    return from_tiktoken(read_text_file(tk), file_exists(cfg) ? read_text_file(cfg) : std::string("{}"));
  }
  fail("{} has neither tokenizer.json nor tiktoken.model", model_dir);
}

}  // namespace kestrel::text
