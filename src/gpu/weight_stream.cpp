#include "gpu/weight_stream.h"

#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::gpu {

namespace {

using Clock = std::chrono::steady_clock;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr int kMaxThreads = 256;

std::string errno_text(int err) { return std::generic_category().message(err); }

struct OpenFile {
  std::string path;
  int fd = -1;
  uint64_t size = 0;
  uint64_t prefetched_until = 0;  // guarded by State::mutex
  OpenFile() = default;
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;
  ~OpenFile() {
    if (fd >= 0) ::close(fd);
  }
};

// One enqueued tensor. Everything but `remaining` is fixed once enqueued, so the workers read it without the lock.
struct Item {
  std::string name;
  OpenFile* file = nullptr;  // a file source, or
  uint64_t file_offset = 0;
  const uint8_t* host = nullptr;  // a host source
  bool release_pages = false;
  size_t size = 0;
  uint8_t* dst = nullptr;
  size_t remaining = 0;  // bytes whose copy has not completed; guarded by State::mutex
};

// A chunk of one item, and the file range to advise WILLNEED for before reading it (advise_length 0: none).
struct Piece {
  Item* item = nullptr;
  size_t offset = 0, length = 0;
  uint64_t advise_offset = 0, advise_length = 0;
};

struct Slot {
  uint8_t* buffer = nullptr;  // chunk_bytes of the pinned ring
  cudaEvent_t copied = nullptr;
  std::optional<Piece> in_flight;  // the piece whose copy from `buffer` was issued last
};

struct Worker {
  cudaStream_t stream = nullptr;
  std::vector<Slot> slots;
  size_t next_slot = 0;
  bool busy = false;  // has taken pieces since it last drained; guarded by State::mutex
  std::thread thread;
};

std::string describe(const Piece& p) {
  const Item& item = *p.item;
  if (item.file)
    return fmt::format("tensor '{}' from {} (bytes {}..{} of the file)", item.name, item.file->path,
                       item.file_offset + p.offset, item.file_offset + p.offset + p.length);
  return fmt::format("tensor '{}' from host memory (bytes {}..{} of the tensor)", item.name, p.offset,
                     p.offset + p.length);
}

void read_range(const OpenFile& file, uint8_t* dst, size_t length, uint64_t offset) {
  size_t got = 0;
  while (got < length) {
    const ssize_t r = ::pread(file.fd, dst + got, length - got, static_cast<off_t>(offset + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      fail("read error at byte {}: {}", offset + got, errno_text(errno));
    }
    if (r == 0) fail("short read: the file ends at byte {}, {} bytes short of the range", offset + got, length - got);
    got += static_cast<size_t>(r);
  }
}

// The whole pages of [p, p + n) from the page holding p on; the page holding the end stays (the next piece's).
void release_pages(const uint8_t* p, size_t n) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) & ~(page - 1);
  if (end > begin && ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED) != 0)
    fail("madvise(MADV_DONTNEED) of the consumed pages failed: {}", errno_text(errno));
}

}  // namespace

struct WeightStreamer::State {
  int device = 0;
  size_t chunk_bytes = 0;
  WeightStreamOptions options;
  uint8_t* ring = nullptr;
  size_t ring_bytes = 0;
  std::vector<std::unique_ptr<Worker>> workers;

  std::mutex mutex;
  std::condition_variable work_ready, idle;
  std::map<std::string, std::unique_ptr<OpenFile>> files;
  std::deque<Item> items;  // a deque: enqueue appends without moving the items the workers hold pointers to
  size_t next_item = 0, next_offset = 0;
  int busy_workers = 0;
  bool stopping = false;
  std::optional<std::string> failure;
  int64_t tensors_done = 0, tensors_total = 0;
  uint64_t bytes_done = 0, bytes_total = 0;
  std::optional<Clock::time_point> started;

  std::mutex report_mutex;  // never taken while holding `mutex`
  ProgressFn progress;
  double interval_s = 0.1;
  Clock::time_point last_report;

  ~State() {
    {
      std::lock_guard lock(mutex);
      stopping = true;
    }
    work_ready.notify_all();
    for (auto& w : workers) {
      if (w->thread.joinable()) w->thread.join();
      for (Slot& s : w->slots)
        if (s.copied) cudaEventDestroy(s.copied);
      if (w->stream) cudaStreamDestroy(w->stream);
    }
    if (ring) cudaFreeHost(ring);  // cannot throw from a destructor
  }

  bool can_take() const { return !failure && !stopping && next_item < items.size(); }

  // Under the lock, with can_take().
  Piece take() {
    Item& item = items[next_item];
    Piece p{&item, next_offset, std::min(chunk_bytes, item.size - next_offset)};
    next_offset += p.length;
    if (next_offset == item.size) {
      ++next_item;
      next_offset = 0;
    }
    if (item.file && options.prefetch) {
      OpenFile& f = *item.file;
      const uint64_t begin = item.file_offset + p.offset;
      const uint64_t want = std::min<uint64_t>(f.size, begin + p.length + workers.size() * chunk_bytes);
      const uint64_t from = std::max(f.prefetched_until, begin);
      if (want > from) {
        p.advise_offset = from;
        p.advise_length = want - from;
        f.prefetched_until = want;
      }
    }
    return p;
  }

  void fail_with(std::string message) {
    {
      std::lock_guard lock(mutex);
      if (!failure) failure = std::move(message);
    }
    work_ready.notify_all();
  }

  StreamProgress snapshot() const {  // under the lock
    StreamProgress p;
    p.tensors_done = tensors_done;
    p.tensors_total = tensors_total;
    p.bytes_done = bytes_done;
    p.bytes_total = bytes_total;
    if (started) p.seconds = std::chrono::duration<double>(Clock::now() - *started).count();
    return p;
  }

  void maybe_report() {
    std::unique_lock report(report_mutex, std::try_to_lock);
    if (!report.owns_lock() || !progress) return;
    const Clock::time_point now = Clock::now();
    if (std::chrono::duration<double>(now - last_report).count() < interval_s) return;
    last_report = now;
    StreamProgress p;
    {
      std::lock_guard lock(mutex);
      p = snapshot();
    }
    progress(p);
  }

  // The copy from s.buffer has completed: its bytes are on the device.
  void retire(Slot& s) {
    const Piece p = *s.in_flight;
    s.in_flight.reset();
    {
      std::lock_guard lock(mutex);
      bytes_done += p.length;
      p.item->remaining -= p.length;
      if (p.item->remaining == 0) ++tensors_done;
    }
    maybe_report();
  }

  void process(Worker& w, const Piece& p) {
    Slot& s = w.slots[w.next_slot];
    w.next_slot = (w.next_slot + 1) % w.slots.size();
    if (s.in_flight) {
      try {
        KESTREL_CUDA_CHECK(cudaEventSynchronize(s.copied));
      } catch (const Error& e) {
        fail_with(fmt::format("copying {} to the device: {}", describe(*s.in_flight), e.what()));
        s.in_flight.reset();
        return;
      }
      retire(s);
    }
    const Item& item = *p.item;
    try {
      if (p.advise_length > 0)  // advice only: a file system that ignores it loses nothing
        ::posix_fadvise(item.file->fd, static_cast<off_t>(p.advise_offset), static_cast<off_t>(p.advise_length),
                        POSIX_FADV_WILLNEED);
      if (item.file) {
        read_range(*item.file, s.buffer, p.length, item.file_offset + p.offset);
      } else {
        std::memcpy(s.buffer, item.host + p.offset, p.length);
        if (item.release_pages) release_pages(item.host + p.offset, p.length);
      }
    } catch (const Error& e) {
      fail_with(fmt::format("reading {}: {}", describe(p), e.what()));
      return;
    }
    try {
      KESTREL_CUDA_CHECK(
          cudaMemcpyAsync(item.dst + p.offset, s.buffer, p.length, cudaMemcpyHostToDevice, w.stream));
      KESTREL_CUDA_CHECK(cudaEventRecord(s.copied, w.stream));
      s.in_flight = p;
    } catch (const Error& e) {
      fail_with(fmt::format("copying {} to the device: {}", describe(p), e.what()));
    }
  }

  // Waits for the worker's copies in flight and credits them.
  void drain(Worker& w) {
    try {
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(w.stream));
    } catch (const Error& e) {
      // The stream does not say which copy failed: name the oldest one in flight.
      const Slot* oldest = nullptr;
      for (size_t i = 0; i < w.slots.size() && !oldest; ++i) {
        const Slot& s = w.slots[(w.next_slot + i) % w.slots.size()];
        if (s.in_flight) oldest = &s;
      }
      fail_with(oldest ? fmt::format("copying {} to the device: {}", describe(*oldest->in_flight), e.what())
                       : fmt::format("copying to the device: {}", e.what()));
      for (Slot& s : w.slots) s.in_flight.reset();
      return;
    }
    for (Slot& s : w.slots)
      if (s.in_flight) retire(s);
  }

  void run(Worker& w) {
    try {
      KESTREL_CUDA_CHECK(cudaSetDevice(device));
    } catch (const Error& e) {
      fail_with(fmt::format("weight streamer thread: {}", e.what()));
    }
    std::unique_lock lock(mutex);
    while (true) {
      if (can_take()) {
        if (!w.busy) {
          w.busy = true;
          ++busy_workers;
        }
        const Piece p = take();
        lock.unlock();
        process(w, p);
        lock.lock();
        continue;
      }
      if (w.busy) {  // nothing to take: finish what is in flight before reporting idle
        lock.unlock();
        drain(w);
        lock.lock();
        w.busy = false;
        --busy_workers;
        idle.notify_all();
        continue;
      }
      if (stopping) return;
      work_ready.wait(lock);
    }
  }
};

WeightStreamer::WeightStreamer(int threads, size_t chunk_bytes, int chunks_per_thread, WeightStreamOptions options)
    : state_(std::make_unique<State>()) {
  KESTREL_CHECK(threads >= 1 && threads <= kMaxThreads, "weight streamer: threads must be in [1, {}], got {}",
                kMaxThreads, threads);
  KESTREL_CHECK(chunk_bytes >= 1 && chunks_per_thread >= 1,
                "weight streamer: chunk_bytes and chunks_per_thread must be >= 1, got {} and {}", chunk_bytes,
                chunks_per_thread);
  size_t ring = 0;
  KESTREL_CHECK(!__builtin_mul_overflow(static_cast<size_t>(threads) * chunks_per_thread, chunk_bytes, &ring),
                "weight streamer: a ring of {} x {} x {} bytes overflows", threads, chunks_per_thread, chunk_bytes);
  State& s = *state_;
  s.chunk_bytes = chunk_bytes;
  s.options = options;
  KESTREL_CUDA_CHECK(cudaGetDevice(&s.device));
  if (cudaHostAlloc(reinterpret_cast<void**>(&s.ring), ring, cudaHostAllocDefault) != cudaSuccess) {
    cudaGetLastError();
    s.ring = nullptr;
    fail("weight streamer: cannot allocate a pinned staging ring of {:.2f} GiB ({} threads x {} chunks x {} bytes)",
         static_cast<double>(ring) / kGiB, threads, chunks_per_thread, chunk_bytes);
  }
  s.ring_bytes = ring;
  for (int t = 0; t < threads; ++t) {
    auto w = std::make_unique<Worker>();
    KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&w->stream, cudaStreamNonBlocking));
    w->slots.resize(static_cast<size_t>(chunks_per_thread));
    for (int c = 0; c < chunks_per_thread; ++c) {
      Slot& slot = w->slots[static_cast<size_t>(c)];
      slot.buffer = s.ring + (static_cast<size_t>(t) * chunks_per_thread + c) * chunk_bytes;
      KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&slot.copied, cudaEventDisableTiming));
    }
    s.workers.push_back(std::move(w));
  }
  for (auto& w : s.workers) w->thread = std::thread([&s, worker = w.get()] { s.run(*worker); });
}

WeightStreamer::~WeightStreamer() = default;

void WeightStreamer::set_progress(ProgressFn fn, double interval_s) {
  std::lock_guard report(state_->report_mutex);
  state_->progress = std::move(fn);
  state_->interval_s = interval_s;
}

size_t WeightStreamer::ring_bytes() const { return state_->ring_bytes; }

void WeightStreamer::enqueue(std::string name, const StreamSource& source, size_t size, void* device_dst) {
  State& s = *state_;
  {
    std::lock_guard lock(s.mutex);
    if (s.failure) fail("weight streamer: refusing tensor '{}': an earlier copy failed ({})", name, *s.failure);
  }
  KESTREL_CHECK(size == 0 || device_dst != nullptr, "weight streamer: tensor '{}' has no device destination", name);
  Item item;
  item.size = size;
  item.remaining = size;
  item.dst = static_cast<uint8_t*>(device_dst);
  if (const auto* file = std::get_if<FileSource>(&source)) {
    OpenFile* open = nullptr;
    {
      std::lock_guard lock(s.mutex);
      if (auto it = s.files.find(file->path); it != s.files.end()) open = it->second.get();
    }
    if (!open) {  // only this thread inserts, so the file cannot appear meanwhile
      auto f = std::make_unique<OpenFile>();
      f->path = file->path;
      f->fd = ::open(file->path.c_str(), O_RDONLY | O_CLOEXEC);
      if (f->fd < 0) fail("cannot open {} for tensor '{}': {}", file->path, name, errno_text(errno));
      struct stat st;
      if (::fstat(f->fd, &st) != 0) fail("cannot stat {} for tensor '{}': {}", file->path, name, errno_text(errno));
      f->size = static_cast<uint64_t>(st.st_size);
      ::posix_fadvise(f->fd, 0, 0, POSIX_FADV_SEQUENTIAL);  // advice only
      open = f.get();
      std::lock_guard lock(s.mutex);
      s.files.emplace(file->path, std::move(f));
    }
    uint64_t end = 0;
    KESTREL_CHECK(!__builtin_add_overflow(file->offset, static_cast<uint64_t>(size), &end) && end <= open->size,
                  "{} is too short for tensor '{}': it needs bytes {}..{}, the file has {} bytes", file->path, name,
                  file->offset, file->offset + size, open->size);
    item.file = open;
    item.file_offset = file->offset;
  } else {
    const auto& host = std::get<HostSource>(source);
    KESTREL_CHECK(size == 0 || host.data != nullptr, "weight streamer: tensor '{}' has no host source", name);
    item.host = static_cast<const uint8_t*>(host.data);
    item.release_pages = host.release_pages;
  }
  item.name = std::move(name);
  {
    std::lock_guard lock(s.mutex);
    if (!s.started) s.started = Clock::now();
    ++s.tensors_total;
    s.bytes_total += size;
    if (size == 0) {
      ++s.tensors_done;
      return;
    }
    s.items.push_back(std::move(item));
  }
  s.work_ready.notify_all();
}

void WeightStreamer::finish() {
  State& s = *state_;
  StreamProgress final_progress;
  {
    std::unique_lock lock(s.mutex);
    s.idle.wait(lock, [&] { return (s.failure || s.next_item >= s.items.size()) && s.busy_workers == 0; });
    // No worker holds a piece now: the items and files can go.
    s.items.clear();
    s.next_item = 0;
    s.next_offset = 0;
    s.files.clear();
    if (s.failure) throw Error(*s.failure);
    KESTREL_CHECK(s.bytes_done == s.bytes_total && s.tensors_done == s.tensors_total,
                  "weight streamer: finished with {} of {} bytes and {} of {} tensors accounted for", s.bytes_done,
                  s.bytes_total, s.tensors_done, s.tensors_total);
    final_progress = s.snapshot();
  }
  final_progress.finished = true;
  std::lock_guard report(s.report_mutex);
  if (s.progress) s.progress(final_progress);
}

ProgressFn terminal_progress(std::string label, std::FILE* out) {
  const bool tty = ::isatty(::fileno(out)) == 1;
  return [label = std::move(label), out, tty](const StreamProgress& p) {
    if (p.tensors_total == 0) return;  // nothing read (e.g. --load-format dummy, which reports what it made)
    const double done = static_cast<double>(p.bytes_done) / kGiB, total = static_cast<double>(p.bytes_total) / kGiB;
    const double rate = p.seconds > 0 ? done / p.seconds : 0.0;
    if (tty) {
      constexpr int kWidth = 30;
      const int filled = p.bytes_total > 0 ? static_cast<int>(kWidth * (done / total)) : kWidth;
      const std::string bar = std::string(static_cast<size_t>(filled), '#') + std::string(kWidth - filled, '.');
      std::fprintf(out, "\r[kestrel] %s [%s] %lld/%lld tensors  %.2f/%.2f GiB  %.2f GiB/s\x1b[K", label.c_str(),
                   bar.c_str(), static_cast<long long>(p.tensors_done), static_cast<long long>(p.tensors_total), done,
                   total, rate);
      if (p.finished) std::fputc('\n', out);
      std::fflush(out);
    } else if (p.finished) {
      std::fprintf(out, "[kestrel] %s: %lld tensors, %.2f GiB in %.2f s (%.2f GiB/s)\n", label.c_str(),
                   static_cast<long long>(p.tensors_total), total, p.seconds, rate);
    }
  };
}

}  // namespace kestrel::gpu
