// The cache of one GPU: one allocation of equal-size rows (spec CACHE.md), with the bookkeeping every row needs.
// A row is referenced (held by running requests, counted), idle-cached (nobody holds it, but its owner can name
// its contents, so a later request may take it again: kept in least-recently-used order), or free.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace kestrel {

class RowPool {
 public:
  // host_storage false: the bookkeeping only; the rows' bytes live elsewhere (a GPU's memory, owned by the model
  // runner), and base()/row() are null.
  RowPool(int32_t num_rows, int64_t row_bytes, bool host_storage = true);

  int32_t num_rows() const { return num_rows_; }
  int64_t row_bytes() const { return row_bytes_; }
  uint8_t* base() { return data_.get(); }
  const uint8_t* base() const { return data_.get(); }
  uint8_t* row(int32_t r) { return data_ ? data_.get() + r * row_bytes_ : nullptr; }

  // Rows allocate() can hand out: free rows plus idle cached rows.
  int32_t num_available() const { return free_.size + idle_.size; }
  int32_t num_free() const { return free_.size; }
  int32_t num_idle_cached() const { return idle_.size; }
  int32_t num_referenced() const { return num_rows_ - free_.size - idle_.size; }

  // Hands out a row with one reference: a free row if there is one, else the least recently used idle cached row,
  // which is evicted (the eviction handler is told first, so that its owner forgets what the row held).
  // Returns -1 when every row is referenced.
  int32_t allocate();
  // One more reference; an idle cached row becomes referenced again (a prefix-cache hit).
  void ref(int32_t r);
  // One reference less; at zero a cached row becomes idle (most recently used), any other row free.
  void unref(int32_t r);
  // The owner can name the row's contents from now on (it registered the row under a hash).
  void mark_cached(int32_t r);
  // The owner forgot the row's contents; an idle row becomes free.
  void drop_cached(int32_t r);
  // Every idle cached row is evicted (the handler told of each) and becomes free; referenced rows are kept.
  void evict_idle();
  int32_t ref_count(int32_t r) const { return meta_[r].refs; }
  bool is_cached(int32_t r) const { return meta_[r].cached; }

  void set_eviction_handler(std::function<void(int32_t)> h) { on_evict_ = std::move(h); }
  // Verifies the free and idle lists against reference counts and flags; throws Error on a mismatch.
  void check_consistency() const;

 private:
  enum class Where : uint8_t { free, idle, referenced };
  struct Meta {
    int32_t refs = 0;
    bool cached = false;
    Where where = Where::free;
    int32_t prev = -1, next = -1;
  };
  struct List {
    int32_t head = -1, tail = -1, size = 0;
  };
  void push_back(List& l, Where w, int32_t r);
  void remove(List& l, int32_t r);
  List& list_of(Where w) { return w == Where::free ? free_ : idle_; }
  void check(int32_t r) const;

  int32_t num_rows_;
  int64_t row_bytes_;
  std::unique_ptr<uint8_t[], void (*)(uint8_t*)> data_;
  std::vector<Meta> meta_;
  List free_, idle_;
  std::function<void(int32_t)> on_evict_;
};

}  // namespace kestrel
