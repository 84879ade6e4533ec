// The byte-pair merge loop shared by both tokenizer formats. Tokens are byte strings; a merge table maps an
// adjacent pair of ids to (rank, merged id) and the lowest rank, leftmost first, is merged until none applies.
// Hugging Face BPE ranks a pair by its line in `merges`; tiktoken ranks it by the rank of the concatenated bytes,
// which is the same loop once every split of every token into two tokens is entered in the table.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kestrel::text {

class BpeModel {
 public:
  // id_bytes[id] is the byte string of each id (ids with no bytes are holes and never produced by merges).
  explicit BpeModel(std::vector<std::string> id_bytes);
  BpeModel(const BpeModel&) = delete;  // whole_ points into id_bytes_
  BpeModel& operator=(const BpeModel&) = delete;
  BpeModel(BpeModel&&) = default;
  BpeModel& operator=(BpeModel&&) = default;

  void add_merge(int32_t left, int32_t right, int32_t rank, int32_t merged);
  // Enables the shortcut that returns a piece as one token when its bytes are a token (tiktoken always does
  // this; Hugging Face BPE does it with `ignore_merges`). `ids` lists the ids eligible for it.
  void enable_whole_piece_lookup(const std::vector<int32_t>& ids);
  // Throws unless every single byte is a token (byte-level BPE starts from bytes).
  void require_all_bytes(std::string_view what) const;

  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

  size_t id_count() const { return id_bytes_.size(); }
  const std::string& bytes_of(int32_t id) const { return id_bytes_[static_cast<size_t>(id)]; }
  int32_t byte_id(unsigned char b) const { return byte_id_[b]; }
  size_t merge_count() const { return merges_.size(); }

 private:
  struct Merge {
    int32_t rank, merged;
  };
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  const Merge* find_merge(int32_t a, int32_t b) const;
  void merge_small(std::vector<int32_t>& sym) const;
  void merge_large(std::vector<int32_t>& sym) const;

  std::vector<std::string> id_bytes_;
  std::array<int32_t, 256> byte_id_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::unordered_map<std::string_view, int32_t> whole_;
  bool whole_piece_ = false;
};

}  // namespace kestrel::text
