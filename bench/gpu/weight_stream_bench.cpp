// Loading a checkpoint-sized file from disk to the GPU with the weight streamer (src/gpu/weight_stream.h).
//
// 1. Writes a file of --gb GB (default 15) of random bytes to --dir (default /tmp), fsyncs it and drops it from the
//    page cache: posix_fadvise(DONTNEED), then `echo 1 > /proc/sys/vm/drop_caches` where permitted. How much of the
//    file each left in the page cache is measured with mincore and printed, so a pass that read from memory shows.
// 2. The disk's raw sequential read speed: one thread reading 16 MiB preads (what dd bs=16M does), and 8 threads
//    reading interleaved 16 MiB pieces, each over the whole file after a drop.
// 3. For each streamer configuration (--configs), after a drop: a child process (forked before this process touches
//    CUDA, so that its peak RSS is its own) streams the file, cut into tensors of checkpoint-like sizes, into one
//    device buffer, and reports the time, GB/s, its peak RSS (getrusage ru_maxrss and /proc/self/status VmHWM), the
//    RSS that CUDA alone holds before the load, and a check of 64 random 1 MiB windows (plus both ends) against the
//    file. The goal is >= 2 GB/s with peak RSS <= 4 GiB + the ring.
// Passes whose expected time (at the slowest speed seen) no longer fits --budget-s seconds are skipped and named.
// Usage: weight_stream_bench [--dir D] [--gb N] [--configs T:CHUNK_MIB:CHUNKS[:noprefetch|:mmap],...]
//                            [--budget-s S] [--reuse] [--keep]
//   --reuse: use an existing file of the right size instead of writing it; --keep: do not delete it at the end.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "gpu/weight_stream.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr size_t kMiB = size_t{1} << 20;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Config {
  int threads = 8;
  size_t chunk_bytes = 16 * kMiB;
  int chunks_per_thread = 4;
  bool prefetch = true;
  bool mmap_source = false;  // HostSource over a mapping of the file (release_pages), instead of FileSource
  std::string text;
};

Config parse_config(const std::string& s) {
  Config c;
  c.text = s;
  std::vector<std::string> parts;
  std::stringstream in(s);
  for (std::string p; std::getline(in, p, ':');) parts.push_back(p);
  if (parts.size() < 3 || parts.size() > 4) fail("--configs: '{}' is not T:CHUNK_MIB:CHUNKS[:noprefetch|:mmap]", s);
  c.threads = std::stoi(parts[0]);
  c.chunk_bytes = static_cast<size_t>(std::stoull(parts[1])) * kMiB;
  c.chunks_per_thread = std::stoi(parts[2]);
  if (parts.size() == 4) {
    if (parts[3] == "noprefetch") c.prefetch = false;
    else if (parts[3] == "mmap") c.mmap_source = true;
    else fail("--configs: unknown option '{}' in '{}'", parts[3], s);
  }
  return c;
}

struct Args {
  std::string dir = "/tmp";
  double gb = 15.0;
  std::vector<Config> configs;
  double budget_s = 170.0;
  bool reuse = false, keep = false;
};

Args parse_args(int argc, char** argv) {
  Args a;
  std::string configs = "8:16:4,4:16:4,16:8:4,8:64:2,8:16:4:noprefetch,8:16:4:mmap";
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) fail("{} needs a value", k);
      return argv[++i];
    };
    if (k == "--dir") a.dir = value();
    else if (k == "--gb") a.gb = std::stod(value());
    else if (k == "--configs") configs = value();
    else if (k == "--budget-s") a.budget_s = std::stod(value());
    else if (k == "--reuse") a.reuse = true;
    else if (k == "--keep") a.keep = true;
    else fail("unknown argument '{}' (see the usage at the top of weight_stream_bench.cpp)", k);
  }
  std::stringstream in(configs);
  for (std::string c; std::getline(in, c, ',');) a.configs.push_back(parse_config(c));
  if (a.configs.empty()) fail("--configs names no configuration");
  return a;
}

uint64_t splitmix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Random bytes from 8 threads, each writing its own range in 64 MiB pwrites; then fsync.
void write_random_file(const std::string& path, uint64_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create {}: {}", path, std::strerror(errno));
  constexpr int kWriters = 8;
  constexpr size_t kBuffer = 64 * kMiB;
  const uint64_t per = (size / kWriters + kBuffer - 1) / kBuffer * kBuffer;
  std::atomic<bool> failed = false;
  std::vector<std::thread> writers;
  for (int w = 0; w < kWriters; ++w)
    writers.emplace_back([&, w] {
      std::vector<uint64_t> buffer(kBuffer / 8);
      uint64_t state = 0x1234567ull * (w + 1);
      for (uint64_t at = w * per; at < std::min(size, (w + 1) * per); at += kBuffer) {
        for (uint64_t& x : buffer) x = splitmix(state);
        const size_t n = static_cast<size_t>(std::min<uint64_t>(kBuffer, size - at));
        size_t done = 0;
        while (done < n) {
          const ssize_t r = ::pwrite(fd, reinterpret_cast<const char*>(buffer.data()) + done, n - done,
                                     static_cast<off_t>(at + done));
          if (r <= 0) {
            if (r < 0 && errno == EINTR) continue;
            failed = true;
            return;
          }
          done += static_cast<size_t>(r);
        }
      }
    });
  for (auto& t : writers) t.join();
  if (failed) fail("writing {} failed: {}", path, std::strerror(errno));
  if (::fsync(fd) != 0) fail("fsync of {} failed: {}", path, std::strerror(errno));
  ::close(fd);
}

// The fraction of the file's pages in the page cache (mincore over a mapping that touches nothing).
double resident_fraction(const std::string& path, uint64_t size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return -1.0;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in_core((size + page - 1) / page);
  double fraction = -1.0;
  if (::mincore(map, size, in_core.data()) == 0) {
    size_t n = 0;
    for (unsigned char c : in_core) n += c & 1;
    fraction = static_cast<double>(n) / static_cast<double>(in_core.size());
  }
  ::munmap(map, size);
  return fraction;
}

bool fadvise_dontneed(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  const int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  return rc == 0;
}

// `echo 1 > /proc/sys/vm/drop_caches`: "" when it worked, else why not.
std::string drop_caches() {
  ::sync();
  const int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return std::strerror(errno);
  const bool ok = ::write(fd, "1", 1) == 1;
  const std::string why = ok ? "" : std::strerror(errno);
  ::close(fd);
  return why;
}

struct Dropper {
  std::string path;
  uint64_t size = 0;
  bool use_drop_caches = false;
  // Drops the file from the page cache; returns the fraction still resident.
  double drop() const {
    fadvise_dontneed(path);
    if (use_drop_caches) drop_caches();
    return resident_fraction(path, size);
  }
};

// A sequential pread loop: `readers` threads, reader r reading pieces r, r + readers, ... of 16 MiB.
double raw_read_gbps(const std::string& path, uint64_t size, int readers) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open {}: {}", path, std::strerror(errno));
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  constexpr size_t kPiece = 16 * kMiB;
  const uint64_t pieces = (size + kPiece - 1) / kPiece;
  std::atomic<uint64_t> got = 0;
  const Clock::time_point t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < readers; ++r)
    threads.emplace_back([&, r] {
      std::vector<char> buffer(kPiece);
      for (uint64_t p = static_cast<uint64_t>(r); p < pieces; p += static_cast<uint64_t>(readers)) {
        const ssize_t n = ::pread(fd, buffer.data(), kPiece, static_cast<off_t>(p * kPiece));
        if (n <= 0) return;
        got += static_cast<uint64_t>(n);
      }
    });
  for (auto& t : threads) t.join();
  const double s = since(t0);
  ::close(fd);
  if (got != size) fail("raw read of {} got {} of {} bytes", path, got.load(), size);
  return static_cast<double>(size) / s / 1e9;
}

// A checkpoint's mix of tensor sizes (embeddings and experts down to norms), none a multiple of a chunk.
std::vector<std::pair<uint64_t, uint64_t>> tensor_ranges(uint64_t size) {
  const uint64_t sizes[] = {117 * kMiB + 13, 29 * kMiB + 5, 8 * kMiB + 3, kMiB + 1, 16 << 10, (4 << 10) + 7};
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  uint64_t at = 0;
  for (size_t i = 0; at < size; ++i) {
    const uint64_t n = std::min(sizes[i % std::size(sizes)], size - at);
    ranges.emplace_back(at, n);
    at += n;
  }
  return ranges;
}

long status_kib(const char* key) {  // a "Key:   N kB" line of /proc/self/status
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind(key, 0) == 0) return std::stol(line.substr(std::strlen(key)));
  return -1;
}

struct ChildResult {
  double seconds = 0, ring_alloc_seconds = 0;
  uint64_t bytes = 0, ring_bytes = 0;
  long maxrss_kib = 0, hwm_kib = 0, cuda_rss_kib = 0;
  int tensors = 0;
  bool verified = false;
  char error[1024] = {};
};

ChildResult stream_file(const Config& c, const std::string& path, uint64_t size) {
  ChildResult r;
  r.bytes = size;
  KESTREL_CUDA_CHECK(cudaSetDevice(0));
  KESTREL_CUDA_CHECK(cudaFree(nullptr));  // create the context before measuring what CUDA alone holds
  cuda::DeviceBuffer<uint8_t> device(static_cast<size_t>(size));
  r.cuda_rss_kib = status_kib("VmRSS:");
  const std::vector<std::pair<uint64_t, uint64_t>> ranges = tensor_ranges(size);
  r.tensors = static_cast<int>(ranges.size());

  const uint8_t* map = nullptr;
  if (c.mmap_source) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (m == MAP_FAILED) fail("mmap of {} failed: {}", path, std::strerror(errno));
    ::madvise(m, size, MADV_SEQUENTIAL);
    map = static_cast<const uint8_t*>(m);
  }
  const Clock::time_point t_ring = Clock::now();
  gpu::WeightStreamer streamer(c.threads, c.chunk_bytes, c.chunks_per_thread, gpu::WeightStreamOptions{c.prefetch});
  r.ring_alloc_seconds = since(t_ring);
  r.ring_bytes = streamer.ring_bytes();
  streamer.set_progress(gpu::terminal_progress("streaming " + c.text), 0.5);
  const Clock::time_point t0 = Clock::now();
  int i = 0;
  for (const auto& [offset, n] : ranges) {
    const std::string name = "tensor." + std::to_string(i++);
    if (map) streamer.enqueue(name, gpu::HostSource{map + offset, true}, n, device.get() + offset);
    else streamer.enqueue(name, gpu::FileSource{path, offset}, n, device.get() + offset);
  }
  streamer.finish();
  r.seconds = since(t0);
  if (map) ::munmap(const_cast<uint8_t*>(map), size);

  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  r.maxrss_kib = usage.ru_maxrss;
  r.hwm_kib = status_kib("VmHWM:");

  // Both ends and 64 random windows of 1 MiB against the file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  std::mt19937_64 rng(size);
  std::vector<uint8_t> want(kMiB), got(kMiB);
  r.verified = true;
  for (int w = 0; w < 66 && r.verified; ++w) {
    const uint64_t n = std::min<uint64_t>(kMiB, size);
    const uint64_t at = w == 0 ? 0 : w == 1 ? size - n : rng() % (size - n + 1);
    if (::pread(fd, want.data(), n, static_cast<off_t>(at)) != static_cast<ssize_t>(n)) fail("re-reading {}", path);
    KESTREL_CUDA_CHECK(cudaMemcpy(got.data(), device.get() + at, n, cudaMemcpyDeviceToHost));
    r.verified = std::equal(want.begin(), want.begin() + static_cast<long>(n), got.begin());
  }
  ::close(fd);
  return r;
}

// Runs stream_file in a child process, so that this process never initialises CUDA and each configuration's peak
// RSS is measured from a fresh process.
ChildResult run_in_child(const Config& c, const std::string& path, uint64_t size) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) fail("pipe: {}", std::strerror(errno));
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) fail("fork: {}", std::strerror(errno));
  if (pid == 0) {
    ::close(pipe_fds[0]);
    ChildResult r;
    try {
      r = stream_file(c, path, size);
    } catch (const std::exception& e) {
      std::snprintf(r.error, sizeof r.error, "%s", e.what());
    }
    const ssize_t w = ::write(pipe_fds[1], &r, sizeof r);
    ::_exit(w == static_cast<ssize_t>(sizeof r) ? 0 : 1);
  }
  ::close(pipe_fds[1]);
  ChildResult r;
  size_t got = 0;
  while (got < sizeof r) {
    const ssize_t n = ::read(pipe_fds[0], reinterpret_cast<char*>(&r) + got, sizeof r - got);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(pipe_fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (got != sizeof r)
    std::snprintf(r.error, sizeof r.error, "the child died (status %d) before reporting", status);
  return r;
}

int run(const Args& a) {
  const Clock::time_point start = Clock::now();
  const uint64_t size = static_cast<uint64_t>(a.gb * 1e9);
  const std::string path = a.dir + "/kestrel_weight_stream_bench.bin";
  std::printf("file %s: %.2f GB (%.2f GiB)\n", path.c_str(), static_cast<double>(size) / 1e9,
              static_cast<double>(size) / kGiB);

  struct stat st {};
  if (a.reuse && ::stat(path.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_size) == size) {
    std::printf("write: reusing the existing file\n");
  } else {
    const Clock::time_point t = Clock::now();
    write_random_file(path, size);
    const double s = since(t);
    std::printf("write: %.1f s including fsync (%.2f GB/s)\n", s, static_cast<double>(size) / s / 1e9);
  }

  std::printf("page cache after writing: %.1f%% of the file resident\n", 100 * resident_fraction(path, size));
  const bool fadvise_ok = fadvise_dontneed(path);
  std::printf("posix_fadvise(DONTNEED): %s, %.1f%% resident after it\n", fadvise_ok ? "ok" : "failed",
              100 * resident_fraction(path, size));
  const std::string drop_error = drop_caches();
  std::printf("echo 1 > /proc/sys/vm/drop_caches: %s, %.1f%% resident after it\n",
              drop_error.empty() ? "ok" : ("not permitted (" + drop_error + ")").c_str(),
              100 * resident_fraction(path, size));
  const Dropper dropper{path, size, drop_error.empty()};

  std::optional<double> slowest_gbps;  // over the passes so far; before the first, a slow disk is assumed
  auto note_speed = [&](double gbps) { slowest_gbps = std::min(slowest_gbps.value_or(gbps), gbps); };
  auto fits = [&](const char* what) {
    const double expected = static_cast<double>(size) / (slowest_gbps.value_or(0.5) * 1e9) + 5.0;
    if (since(start) + expected <= a.budget_s) return true;
    std::printf("%s: skipped (%.0f s spent, ~%.0f s more needed, budget %.0f s)\n", what, since(start), expected,
                a.budget_s);
    return false;
  };
  auto raw = [&](int readers) {
    const std::string what = "raw read, " + std::to_string(readers) + " thread(s) of 16 MiB preads";
    if (!fits(what.c_str())) return;
    const double resident = dropper.drop();
    const double gbps = raw_read_gbps(path, size, readers);
    note_speed(gbps);
    std::printf("%s: %.2f GB/s (%.1f%% of the file was cached before)\n", what.c_str(), gbps, 100 * resident);
  };

  std::printf("\n");
  raw(1);
  int failures = 0;
  std::vector<std::string> rows;
  bool goal_met = false;
  auto stream = [&](const Config& c) {
    const std::string what = "streamer " + c.text;
    if (!fits(what.c_str())) return;
    const double resident = dropper.drop();
    const ChildResult r = run_in_child(c, path, size);
    if (r.error[0]) {
      std::printf("%s: FAILED: %s\n", what.c_str(), r.error);
      ++failures;
      return;
    }
    const double gbps = static_cast<double>(r.bytes) / r.seconds / 1e9;
    note_speed(gbps);
    const double bound_mib = 4096.0 + static_cast<double>(r.ring_bytes) / kMiB;
    const double peak_mib = static_cast<double>(std::max(r.maxrss_kib, r.hwm_kib)) / 1024.0;
    const bool rss_ok = peak_mib <= bound_mib;
    if (!r.verified) ++failures;
    if (gbps >= 2.0 && rss_ok && r.verified && resident < 0.01) goal_met = true;
    char row[512];
    std::snprintf(row, sizeof row, "| %-22s | %7.0f | %6.2f | %5.2f | %5.2f | %8.0f | %6.0f | %6.0f | %5.1f%% | %s | %s |",
                  c.text.c_str(), static_cast<double>(r.ring_bytes) / kMiB, r.seconds, gbps,
                  static_cast<double>(r.bytes) / r.seconds / kGiB, static_cast<double>(r.maxrss_kib) / 1024.0,
                  static_cast<double>(r.hwm_kib) / 1024.0, static_cast<double>(r.cuda_rss_kib) / 1024.0,
                  100 * resident, rss_ok ? "yes" : "NO", r.verified ? "yes" : "NO");
    rows.push_back(row);
    std::printf("%s: %.2f s, %.2f GB/s, %d tensors, peak RSS %.0f MiB (bound %.0f), ring allocated in %.2f s\n",
                what.c_str(), r.seconds, gbps, r.tensors, peak_mib, bound_mib, r.ring_alloc_seconds);
  };
  stream(a.configs.front());
  raw(8);
  for (size_t i = 1; i < a.configs.size(); ++i) stream(a.configs[i]);

  std::printf("\nconfigurations: threads:chunk MiB:chunks per thread[:option]; RSS in MiB; 'CUDA RSS' is the child's "
              "RSS after creating its context and device buffer, before the load\n");
  std::printf("| config | ring MiB | s | GB/s | GiB/s | ru_maxrss | VmHWM | CUDA RSS | cached | RSS <= 4 GiB + ring | "
              "bytes verified |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const std::string& row : rows) std::printf("%s\n", row.c_str());
  std::printf("\ngoal (>= 2 GB/s from disk, peak RSS <= 4 GiB + ring): %s\n", goal_met ? "met" : "NOT met");
  std::printf("total time %.1f s\n", since(start));
  if (!a.keep) ::unlink(path.c_str());
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace kestrel::bench

int main(int argc, char** argv) {
  try {
    return kestrel::bench::run(kestrel::bench::parse_args(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weight_stream_bench: %s\n", e.what());
    return 1;
  }
}
