// The byte-pair merge loop shared by both tokenizer formats. Tokens are byte strings; a merge table maps an
// adjacent pair of ids to (rank, merged id) and the lowest rank, leftmost first, is merged until none applies.
// Hugging Face BPE ranks a pair by its line in `merges`; tiktoken ranks it by the rank of the concatenated bytes,
// which is the same loop once every split of every token into two tokens is entered in the table.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::text {

// Results of encode_piece for the distinct pieces of one long text (words repeat): a piece seen before is one hash
// probe instead of a merge loop. Holds views into the text, so it lives only as long as one encode call.
class PieceCache {
 public:
  PieceCache();
  // The cached ids of `piece` appended to `out`, or false.
  bool lookup(std::string_view piece, uint64_t hash, std::vector<int32_t>& out) const;
  void insert(std::string_view piece, uint64_t hash, const int32_t* ids, size_t n);

 private:
  struct Slot {
    uint64_t hash;
    const char* ptr;  // null: free
    uint32_t len, offset, count;
  };
  void grow();
  std::vector<Slot> slots_;
  std::vector<int32_t> ids_;
  size_t used_ = 0;
};

uint64_t bytes_hash(std::string_view s);

class BpeModel {
 public:
  // id_bytes[id] is the byte string of each id (ids with no bytes are holes and never produced by merges).
  explicit BpeModel(std::vector<std::string> id_bytes);

  void add_merge(int32_t left, int32_t right, int32_t rank, int32_t merged);
  // Enables the shortcut that returns a piece as one token when its bytes are one of `ids` (tiktoken always does
  // this; Hugging Face BPE does it with `ignore_merges`). Call after all merges are added.
  void enable_whole_piece_lookup(const std::vector<int32_t>& ids);
  // The ids among `ids` that the merge loop turns their own bytes into (their shortcut changes no result).
  std::vector<int32_t> self_reaching(const std::vector<int32_t>& ids) const;
  // Throws unless every single byte is a token (byte-level BPE starts from bytes).
  void require_all_bytes(std::string_view what) const;

  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out, PieceCache& cache) const;

  size_t id_count() const { return id_bytes_.size(); }
  const std::string& bytes_of(int32_t id) const { return id_bytes_[static_cast<size_t>(id)]; }
  int32_t byte_id(unsigned char b) const { return byte_id_[b]; }
  size_t merge_count() const { return merge_count_; }

 private:
  struct Merge {
    int32_t rank, merged;
  };
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  const Merge* find_merge(int32_t a, int32_t b) const;
  int32_t find_whole(std::string_view piece) const;
  void merge_small(std::vector<int32_t>& sym) const;
  void merge_large(std::vector<int32_t>& sym) const;
  void rebuild_merge_table();

  std::vector<std::string> id_bytes_;
  std::array<int32_t, 256> byte_id_;
  // Open-addressing tables (power-of-two sizes, linear probing): the merge loop and the whole-piece lookup run
  // once per pair and once per piece, so they are the encoder's hot path.
  std::vector<std::pair<uint64_t, Merge>> merge_slots_;  // key kEmpty = free
  size_t merge_count_ = 0;
  std::vector<int32_t> whole_slots_;  // id, or -1 = free
  bool whole_piece_ = false;
};

}  // namespace kestrel::text
