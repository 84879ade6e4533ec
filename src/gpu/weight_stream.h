// Copying checkpoint tensors from files (or host memory) to device memory through a bounded ring of pinned host
// buffers, on several threads, with file reads and host-to-device copies overlapping. The host keeps no copy of the
// model: what a load holds on the host is the ring (threads * chunks_per_thread * chunk_bytes of pinned memory) plus
// a little bookkeeping, whatever the model's size. File ranges are read with pread (nothing is mapped); host sources
// that are read-only file mappings can have their pages dropped from the resident set as they are consumed.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <variant>

namespace kestrel::gpu {

// A byte range of a file, starting at `offset` (the size is enqueue's).
struct FileSource {
  std::string path;
  uint64_t offset = 0;
};

// Host memory, e.g. a tensor inside a memory-mapped safetensors file. release_pages: after copying each piece, give
// its pages back with madvise(MADV_DONTNEED) so that they leave the process's resident set; only for read-only file
// mappings, which fault the same bytes back in if touched again (anonymous or written memory would lose its data).
struct HostSource {
  const void* data = nullptr;
  bool release_pages = false;
};

using StreamSource = std::variant<FileSource, HostSource>;

struct StreamProgress {
  int64_t tensors_done = 0, tensors_total = 0;
  uint64_t bytes_done = 0, bytes_total = 0;  // done: copied to the device (the copy has completed)
  double seconds = 0.0;                      // since the first enqueue
  bool finished = false;                     // the report of a finish() that succeeded
};
using ProgressFn = std::function<void(const StreamProgress&)>;

// A reporter for `out`: on a terminal, a bar redrawn in place (tensors, GiB, GiB/s) and ended with a newline when
// finished; otherwise nothing until finished, then one summary line.
ProgressFn terminal_progress(std::string label = "loading weights", std::FILE* out = stderr);

struct WeightStreamOptions {
  // posix_fadvise(WILLNEED) a window of threads * chunk_bytes ahead of the reads of each file, so that the disk
  // always has requests queued (every file also gets FADV_SEQUENTIAL).
  bool prefetch = true;
};

// Usage: enqueue every tensor, then finish(); the streamer can take more tensors after a finish() that succeeded.
// enqueue and finish are called from one thread; the copies run on the streamer's own threads, on the device that
// was current when it was constructed.
class WeightStreamer {
 public:
  // threads >= 1 worker threads, each with its own CUDA stream and chunks_per_thread >= 1 pinned buffers of
  // chunk_bytes >= 1 (2 or more let a thread read the next chunk while the last one is copied). Tensors larger than a
  // chunk are cut into chunk-sized pieces, which the threads take in enqueue order.
  WeightStreamer(int threads, size_t chunk_bytes, int chunks_per_thread, WeightStreamOptions options = {});
  // Stops taking pieces, waits for the copies in flight and frees the ring; what was not copied yet is dropped.
  ~WeightStreamer();
  WeightStreamer(const WeightStreamer&) = delete;
  WeightStreamer& operator=(const WeightStreamer&) = delete;

  // Called from the worker threads (one call at a time) at most every interval_s seconds while copying, and once by
  // each finish() that succeeds.
  void set_progress(ProgressFn fn, double interval_s = 0.1);

  // Copies `size` bytes from `source` to device_dst (device memory) and names them `name` in errors and progress.
  // Throws Error at once for a file that cannot be opened or is too short for the range, a null pointer with a
  // non-zero size, or a streamer whose earlier copy failed; the copy itself runs later (failures surface in finish).
  // A file's tensors load fastest enqueued in file order (the reads and the prefetch window move forward through it).
  void enqueue(std::string name, const StreamSource& source, size_t size, void* device_dst);

  // Waits until every enqueued tensor is on the device. Throws Error naming the tensor, its file and what went wrong
  // (a read error or short read, a CUDA error) if any piece failed; then no copy is in flight any more, and the
  // streamer refuses further work.
  void finish();

  size_t ring_bytes() const;  // the pinned host memory the streamer holds

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kestrel::gpu
