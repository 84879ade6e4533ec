#include "text/bpe_trainer.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/regex.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace kestrel::text {

using nlohmann::ordered_json;

const std::string& kimi_split_pattern() {
  static const std::string p =
      R"([\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  return p;
}

namespace {

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

struct Word {
  std::vector<int32_t> sym;
  int64_t count;
};

}  // namespace

TrainedBpe train_bpe(std::string_view text, const std::string& pattern, int64_t vocab_size,
                     const std::vector<std::string>& special_tokens) {
  require_utf8(text, "training text");
  TrainedBpe out;
  out.special_tokens = special_tokens;
  out.first_merge_id = 256 + static_cast<int32_t>(special_tokens.size());
  KESTREL_CHECK(vocab_size >= out.first_merge_id, "vocab_size {} leaves no room for 256 bytes and {} special tokens",
                vocab_size, special_tokens.size());
  for (int b = 0; b < 256; ++b) out.id_bytes.emplace_back(1, static_cast<char>(b));
  for (const std::string& s : special_tokens) out.id_bytes.push_back(s);
  const std::unordered_set<std::string> special_set(special_tokens.begin(), special_tokens.end());

  // Distinct pieces with their counts.
  std::unordered_map<std::string_view, int64_t> piece_counts;
  const Regex re(pattern);
  re.for_each_match(text, [&](size_t b, size_t e) { ++piece_counts[text.substr(b, e - b)]; });
  std::vector<std::pair<std::string_view, int64_t>> pieces(piece_counts.begin(), piece_counts.end());
  std::sort(pieces.begin(), pieces.end());  // deterministic word order
  std::vector<Word> words;
  for (const auto& [p, c] : pieces) {
    if (p.size() < 2) continue;
    Word w;
    w.count = c;
    for (char ch : p) w.sym.push_back(static_cast<unsigned char>(ch));
    words.push_back(std::move(w));
  }

  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::unordered_set<uint32_t>> where;
  for (uint32_t wi = 0; wi < words.size(); ++wi) {
    const Word& w = words[wi];
    for (size_t i = 0; i + 1 < w.sym.size(); ++i) {
      const uint64_t k = pair_key(w.sym[i], w.sym[i + 1]);
      pair_count[k] += w.count;
      where[k].insert(wi);
    }
  }

  struct Cand {
    int64_t count;
    uint64_t key;
    std::string merged;  // tie-break: smaller bytes first
  };
  auto worse = [](const Cand& x, const Cand& y) {
    if (x.count != y.count) return x.count < y.count;
    if (x.merged != y.merged) return x.merged > y.merged;
    return x.key > y.key;
  };
  std::priority_queue<Cand, std::vector<Cand>, decltype(worse)> heap(worse);
  auto bytes_of_pair = [&](uint64_t k) {
    return out.id_bytes[static_cast<size_t>(k >> 32)] + out.id_bytes[static_cast<size_t>(k & 0xFFFFFFFFu)];
  };
  for (const auto& [k, c] : pair_count) heap.push({c, k, bytes_of_pair(k)});

  std::unordered_set<std::string> made;  // byte strings already in the vocabulary
  for (const std::string& b : out.id_bytes) made.insert(b);
  while (static_cast<int64_t>(out.id_bytes.size()) < vocab_size && !heap.empty()) {
    const Cand top = heap.top();
    heap.pop();
    const auto it = pair_count.find(top.key);
    const int64_t current = it == pair_count.end() ? 0 : it->second;
    if (current != top.count) {  // stale entry: requeue with the current count
      if (current > 0) heap.push({current, top.key, top.merged});
      continue;
    }
    if (current < 2) break;
    if (special_set.count(top.merged) || made.count(top.merged)) {
      pair_count.erase(top.key);
      continue;
    }
    const int32_t a = static_cast<int32_t>(top.key >> 32), b = static_cast<int32_t>(top.key & 0xFFFFFFFFu);
    const int32_t id = static_cast<int32_t>(out.id_bytes.size());
    out.id_bytes.push_back(top.merged);
    out.merges.emplace_back(a, b);
    made.insert(top.merged);

    std::unordered_set<uint64_t> touched;
    const std::vector<uint32_t> affected(where[top.key].begin(), where[top.key].end());
    for (uint32_t wi : affected) {
      Word& w = words[wi];
      // Remove this word's pairs, merge left to right, add its pairs back.
      for (size_t i = 0; i + 1 < w.sym.size(); ++i) {
        const uint64_t k = pair_key(w.sym[i], w.sym[i + 1]);
        pair_count[k] -= w.count;
        touched.insert(k);
      }
      std::vector<int32_t> next;
      next.reserve(w.sym.size());
      for (size_t i = 0; i < w.sym.size(); ++i) {
        if (i + 1 < w.sym.size() && w.sym[i] == a && w.sym[i + 1] == b) {
          next.push_back(id);
          ++i;
        } else {
          next.push_back(w.sym[i]);
        }
      }
      for (size_t i = 0; i + 1 < w.sym.size(); ++i) where[pair_key(w.sym[i], w.sym[i + 1])].erase(wi);
      w.sym = std::move(next);
      for (size_t i = 0; i + 1 < w.sym.size(); ++i) {
        const uint64_t k = pair_key(w.sym[i], w.sym[i + 1]);
        pair_count[k] += w.count;
        where[k].insert(wi);
        touched.insert(k);
      }
    }
    pair_count.erase(top.key);
    where.erase(top.key);
    for (uint64_t k : touched) {
      const auto c = pair_count.find(k);
      if (c == pair_count.end()) continue;
      if (c->second <= 0) {
        pair_count.erase(c);
        where.erase(k);
        continue;
      }
      heap.push({c->second, k, bytes_of_pair(k)});
    }
  }
  return out;
}

namespace {

std::string mapped(const std::string& bytes) {
  std::string s;
  for (unsigned char b : bytes) utf8_append(s, byte_to_unicode(b));
  return s;
}

std::string base64(const std::string& s) {
  static const char* t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < s.size(); i += 3) {
    const uint32_t v = (static_cast<uint32_t>(static_cast<unsigned char>(s[i])) << 16) |
                       (static_cast<uint32_t>(static_cast<unsigned char>(s[i + 1])) << 8) |
                       static_cast<unsigned char>(s[i + 2]);
    out += {t[v >> 18], t[(v >> 12) & 63], t[(v >> 6) & 63], t[v & 63]};
  }
  const size_t rest = s.size() - i;
  if (rest > 0) {
    uint32_t v = static_cast<uint32_t>(static_cast<unsigned char>(s[i])) << 16;
    if (rest == 2) v |= static_cast<uint32_t>(static_cast<unsigned char>(s[i + 1])) << 8;
    out += t[v >> 18];
    out += t[(v >> 12) & 63];
    out += rest == 2 ? t[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  if (!f) fail("cannot write {}", path);
  f << text;
  if (!f) fail("error writing {}", path);
}

}  // namespace

void write_tokenizer_files(const std::string& dir, const TrainedBpe& bpe, const TokenizerFilesSpec& spec) {
  const std::string& pattern = kimi_split_pattern();
  ordered_json vocab = ordered_json::object();
  for (size_t id = 0; id < bpe.id_bytes.size(); ++id) {
    const bool special = id >= 256 && id < static_cast<size_t>(bpe.first_merge_id);
    vocab[special ? bpe.id_bytes[id] : mapped(bpe.id_bytes[id])] = id;
  }
  ordered_json merges = ordered_json::array();
  for (const auto& [a, b] : bpe.merges)
    merges.push_back(ordered_json::array({mapped(bpe.id_bytes[static_cast<size_t>(a)]), mapped(bpe.id_bytes[static_cast<size_t>(b)])}));
  ordered_json added = ordered_json::array();
  for (size_t i = 0; i < bpe.special_tokens.size(); ++i)
    added.push_back({{"id", 256 + i},
                     {"content", bpe.special_tokens[i]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  const ordered_json tok = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", merges}}}};
  write_text(dir + "/tokenizer.json", tok.dump(2) + "\n");

  std::string ranks;
  for (size_t id = 0; id < bpe.id_bytes.size(); ++id) {
    if (id >= 256 && id < static_cast<size_t>(bpe.first_merge_id)) continue;
    ranks += base64(bpe.id_bytes[id]) + " " + std::to_string(id) + "\n";
  }
  write_text(dir + "/tiktoken.model", ranks);

  ordered_json decoder = ordered_json::object();
  for (size_t i = 0; i < bpe.special_tokens.size(); ++i)
    decoder[std::to_string(256 + i)] = {{"content", bpe.special_tokens[i]},
                                        {"lstrip", false},
                                        {"normalized", false},
                                        {"rstrip", false},
                                        {"single_word", false},
                                        {"special", true}};
  ordered_json cfg = {{"tokenizer_class", "PreTrainedTokenizerFast"}};
  if (!spec.bos_token.empty()) cfg["bos_token"] = spec.bos_token;
  if (!spec.eos_token.empty()) cfg["eos_token"] = spec.eos_token;
  if (!spec.pad_token.empty()) cfg["pad_token"] = spec.pad_token;
  if (spec.model_max_length > 0) cfg["model_max_length"] = spec.model_max_length;
  cfg["added_tokens_decoder"] = decoder;
  cfg["pat_str"] = pattern;
  if (!spec.chat_template.empty()) cfg["chat_template"] = spec.chat_template;
  write_text(dir + "/tokenizer_config.json", cfg.dump(2) + "\n");
}

std::string kjv_corpus() {
  // A machine without the Debian package (the GPU machine) is given the same text as a file.
  if (const char* file = std::getenv("KESTREL_KJV_TEXT")) {
    std::ifstream in(file, std::ios::binary);
    KESTREL_CHECK(in.good(), "KESTREL_KJV_TEXT names {}, which cannot be read", file);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    KESTREL_CHECK(text.size() >= 1'000'000, "KESTREL_KJV_TEXT: {} does not hold the King James text", file);
    return text;
  }
  FILE* p = popen("bible Gen1:1-Rev22:21 2>/dev/null", "r");
  if (!p) fail("cannot run the `bible` program (install the Debian package bible-kjv-text)");
  std::string text;
  char buf[1 << 16];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) text.append(buf, n);
  const int rc = pclose(p);
  if (rc != 0 || text.size() < 1'000'000)
    fail("the `bible` program of Debian's bible-kjv did not print the King James text (install the Debian package "
         "bible-kjv-text)");
  return text;
}

void write_trained_tokenizer(const std::string& dir, const TokenizerFilesSpec& spec) {
  TrainedBpe bpe = train_bpe(kjv_corpus(), kimi_split_pattern(), spec.vocab_size, spec.special_tokens);
  // Past what the corpus trains (about 18000 ids), reserved entries fill the vocabulary, as real tokenizers have them,
  // so that every id of a model's vocabulary decodes: ordinary entries no merge produces (the split pattern cuts
  // "<|" from the letters before any merge could join them).
  for (int64_t id = static_cast<int64_t>(bpe.id_bytes.size()); id < spec.vocab_size; ++id)
    bpe.id_bytes.push_back("<|reserved_token_" + std::to_string(id) + "|>");
  write_tokenizer_files(dir, bpe, spec);
}

}  // namespace kestrel::text
