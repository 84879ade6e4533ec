#include "cache/row_pool.h"

#include <cstdlib>

#include "core/error.h"

namespace kestrel {

namespace {
constexpr int64_t kAlignment = 4096;

uint8_t* allocate_rows(int64_t bytes) {
  const int64_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(kAlignment, static_cast<size_t>(rounded)));
  if (!p) fail("cannot allocate a cache pool of {} bytes", bytes);
  return p;
}
}  // namespace

RowPool::RowPool(int32_t num_rows, int64_t row_bytes, bool host_storage)
    : num_rows_(num_rows), row_bytes_(row_bytes), data_(nullptr, [](uint8_t* p) { std::free(p); }) {
  KESTREL_CHECK(num_rows > 0 && row_bytes > 0, "a cache pool needs rows (got {} rows of {} bytes)", num_rows,
                row_bytes);
  if (host_storage) data_.reset(allocate_rows(int64_t{num_rows} * row_bytes));
  meta_.resize(num_rows);
  for (int32_t r = 0; r < num_rows; ++r) push_back(free_, Where::free, r);
}

void RowPool::push_back(List& l, Where w, int32_t r) {
  Meta& m = meta_[r];
  m.where = w;
  m.prev = l.tail;
  m.next = -1;
  if (l.tail >= 0) meta_[l.tail].next = r;
  else l.head = r;
  l.tail = r;
  ++l.size;
}

void RowPool::remove(List& l, int32_t r) {
  Meta& m = meta_[r];
  if (m.prev >= 0) meta_[m.prev].next = m.next;
  else l.head = m.next;
  if (m.next >= 0) meta_[m.next].prev = m.prev;
  else l.tail = m.prev;
  m.prev = m.next = -1;
  m.where = Where::referenced;
  --l.size;
}

void RowPool::check(int32_t r) const {
  KESTREL_CHECK(r >= 0 && r < num_rows_, "row {} is outside the pool (0..{})", r, num_rows_ - 1);
}

int32_t RowPool::allocate() {
  int32_t r = free_.head;
  if (r >= 0) {
    remove(free_, r);
  } else {
    r = idle_.head;
    if (r < 0) return -1;
    remove(idle_, r);
    meta_[r].cached = false;
    if (on_evict_) on_evict_(r);
  }
  meta_[r].refs = 1;
  return r;
}

void RowPool::ref(int32_t r) {
  check(r);
  Meta& m = meta_[r];
  KESTREL_CHECK(m.where != Where::free, "row {} is free and cannot be referenced", r);
  if (m.where == Where::idle) remove(idle_, r);
  ++m.refs;
}

void RowPool::unref(int32_t r) {
  check(r);
  Meta& m = meta_[r];
  KESTREL_CHECK(m.refs > 0, "row {} has no reference to drop", r);
  if (--m.refs > 0) return;
  if (m.cached) push_back(idle_, Where::idle, r);
  else push_back(free_, Where::free, r);
}

void RowPool::mark_cached(int32_t r) {
  check(r);
  KESTREL_CHECK(meta_[r].refs > 0, "row {} must be held while its contents are registered", r);
  meta_[r].cached = true;
}

void RowPool::drop_cached(int32_t r) {
  check(r);
  Meta& m = meta_[r];
  m.cached = false;
  if (m.where == Where::idle) {
    remove(idle_, r);
    push_back(free_, Where::free, r);
  }
}

void RowPool::evict_idle() {
  while (idle_.head >= 0) {
    const int32_t r = idle_.head;
    remove(idle_, r);
    meta_[r].cached = false;
    if (on_evict_) on_evict_(r);
    push_back(free_, Where::free, r);
  }
}

void RowPool::check_consistency() const {
  int32_t n_free = 0, n_idle = 0;
  for (int32_t r = 0; r < num_rows_; ++r) {
    const Meta& m = meta_[r];
    switch (m.where) {
      case Where::free:
        KESTREL_CHECK(m.refs == 0 && !m.cached, "free row {} has {} references (cached: {})", r, m.refs, m.cached);
        ++n_free;
        break;
      case Where::idle:
        KESTREL_CHECK(m.refs == 0 && m.cached, "idle row {} has {} references (cached: {})", r, m.refs, m.cached);
        ++n_idle;
        break;
      case Where::referenced:
        KESTREL_CHECK(m.refs > 0, "row {} is neither free, idle nor referenced", r);
        break;
    }
  }
  KESTREL_CHECK(n_free == free_.size && n_idle == idle_.size, "pool lists hold {}/{} rows, flags say {}/{}",
                free_.size, idle_.size, n_free, n_idle);
  for (const List* l : {&free_, &idle_}) {
    int32_t count = 0, prev = -1;
    for (int32_t r = l->head; r >= 0; r = meta_[r].next) {
      KESTREL_CHECK(meta_[r].prev == prev, "pool list links are broken at row {}", r);
      prev = r;
      KESTREL_CHECK(++count <= num_rows_, "pool list has a cycle");
    }
    KESTREL_CHECK(count == l->size && prev == l->tail, "pool list length {} differs from its count {}", count,
                  l->size);
  }
}

}  // namespace kestrel
