// GPU tests of the weight streamer (src/gpu/weight_stream.h): files and host buffers of random bytes, in many small
// and a few large tensors whose sizes are not multiples of the chunk, streamed into one device buffer with poisoned
// gaps between the tensors and compared byte for byte after finish(), on several thread / chunk / ring shapes; the
// progress reports; the pages of a file mapping given back as they are consumed; and the errors (missing file, file
// too short at enqueue, file cut short after enqueue, a bad device pointer), each naming the tensor and the file.
#include "gpu/weight_stream.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/runtime.h"

namespace kestrel::gpu {
namespace {

namespace fs = std::filesystem;

constexpr uint8_t kPoison = 0x5A;

#define REQUIRE_GPU() \
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t r = rng();
    for (size_t j = 0; j < 8 && i + j < n; ++j) b[i + j] = static_cast<uint8_t>(r >> (8 * j));
  }
  return b;
}

class TempDir {
 public:
  TempDir() : path_(fs::temp_directory_path() / ("kestrel_weight_stream_" + std::to_string(::getpid()))) {
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string write(const std::string& name, const std::vector<uint8_t>& bytes) const {
    const std::string p = (path_ / name).string();
    std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return p;
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

// A read-only private mapping of a whole file, as SafetensorsFile maps checkpoints.
class Mapping {
 public:
  explicit Mapping(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    size_ = static_cast<size_t>(fs::file_size(path));
    data_ = static_cast<const uint8_t*>(::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0));
    ::close(fd);
    if (data_ == MAP_FAILED) throw std::runtime_error("mmap failed");
  }
  ~Mapping() { ::munmap(const_cast<uint8_t*>(data_), size_); }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

  // The mapping's resident size from /proc/self/smaps.
  size_t resident_bytes() const {
    std::ifstream smaps("/proc/self/smaps");
    std::ostringstream start;
    start << std::hex << reinterpret_cast<uintptr_t>(data_) << "-";
    std::string line;
    bool ours = false;
    while (std::getline(smaps, line)) {
      if (line.rfind(start.str(), 0) == 0) ours = true;
      if (ours && line.rfind("Rss:", 0) == 0) return std::stoull(line.substr(4)) * 1024;
    }
    throw std::runtime_error("mapping not in /proc/self/smaps");
  }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// The tensors of one test: where they come from and what the device buffer must hold afterwards.
struct Layout {
  std::vector<uint8_t> image;  // the expected device buffer: every tensor at its place, poison in the gaps
  struct Tensor {
    std::string name;
    StreamSource source;
    size_t size, device_offset;
  };
  std::vector<Tensor> tensors;

  void add(std::string name, StreamSource source, const uint8_t* bytes, size_t size, size_t gap) {
    image.insert(image.end(), gap, kPoison);
    tensors.push_back({std::move(name), std::move(source), size, image.size()});
    image.insert(image.end(), bytes, bytes + size);
  }
};

struct Shape {
  int threads;
  size_t chunk_bytes;
  int chunks_per_thread;
  bool prefetch;
};

void stream_and_compare(const Shape& shape) {
  TempDir dir;
  const std::vector<uint8_t> a = random_bytes((9 << 20) + 333, 1), b = random_bytes((3 << 20) + 17, 2),
                             c = random_bytes(200'000, 3), host = random_bytes((5 << 20) + 3, 4),
                             mapped = random_bytes((2 << 20) + 5, 5);
  const std::string pa = dir.write("a.bin", a), pb = dir.write("b.bin", b), pc = dir.write("c.bin", c),
                    pm = dir.write("mapped.bin", mapped);
  const Mapping map(pm);

  Layout layout;
  std::mt19937 rng(7);
  size_t at = 0;
  for (int i = 0; i < 300; ++i) {  // many small tensors, back to back in the file as in a checkpoint
    const size_t n = 1 + rng() % 4000;
    layout.add("a.small." + std::to_string(i), FileSource{pa, at}, a.data() + at, n, rng() % 8);
    at += n;
  }
  layout.add("a.large", FileSource{pa, at}, a.data() + at, a.size() - at, 3);
  layout.add("b.first", FileSource{pb, 0}, b.data(), (1 << 20) + 1, 0);
  layout.add("b.after_a_hole", FileSource{pb, (1 << 20) + 4097}, b.data() + (1 << 20) + 4097,
             b.size() - (1 << 20) - 4097, 5);
  layout.add("c.whole", FileSource{pc, 0}, c.data(), c.size(), 1);
  layout.add("host.small", HostSource{host.data()}, host.data(), 777, 2);
  layout.add("host.large", HostSource{host.data() + 777}, host.data() + 777, host.size() - 777, 6);
  layout.add("mapped", HostSource{map.data(), true}, mapped.data(), mapped.size(), 4);
  layout.add("empty", FileSource{pc, c.size()}, nullptr, 0, 0);
  layout.image.insert(layout.image.end(), 16, kPoison);

  cuda::DeviceBuffer<uint8_t> device(layout.image.size());
  KESTREL_CUDA_CHECK(cudaMemset(device.get(), kPoison, device.size()));

  WeightStreamer streamer(shape.threads, shape.chunk_bytes, shape.chunks_per_thread,
                          WeightStreamOptions{shape.prefetch});
  EXPECT_EQ(streamer.ring_bytes(), shape.threads * shape.chunk_bytes * shape.chunks_per_thread);
  std::mutex reports_mutex;
  std::vector<StreamProgress> reports;
  streamer.set_progress(
      [&](const StreamProgress& p) {
        std::lock_guard lock(reports_mutex);
        reports.push_back(p);
      },
      0.0);
  uint64_t total = 0;
  for (const Layout::Tensor& t : layout.tensors) {
    streamer.enqueue(t.name, t.source, t.size, t.size ? device.get() + t.device_offset : nullptr);
    total += t.size;
  }
  streamer.finish();

  EXPECT_TRUE(cuda::to_host(device) == layout.image);
  ASSERT_FALSE(reports.empty());
  for (size_t i = 1; i < reports.size(); ++i) {
    EXPECT_GE(reports[i].bytes_done, reports[i - 1].bytes_done);
    EXPECT_GE(reports[i].tensors_done, reports[i - 1].tensors_done);
  }
  const StreamProgress& last = reports.back();
  EXPECT_TRUE(last.finished);
  EXPECT_EQ(last.bytes_done, total);
  EXPECT_EQ(last.bytes_total, total);
  EXPECT_EQ(last.tensors_done, static_cast<int64_t>(layout.tensors.size()));
  EXPECT_EQ(last.tensors_total, static_cast<int64_t>(layout.tensors.size()));
  for (size_t i = 0; i + 1 < reports.size(); ++i) EXPECT_FALSE(reports[i].finished);

  // The streamer takes more work after a finish: the first file once more, into a second buffer.
  cuda::DeviceBuffer<uint8_t> again(a.size());
  streamer.enqueue("a.again", FileSource{pa, 0}, a.size(), again.get());
  streamer.finish();
  EXPECT_TRUE(cuda::to_host(again) == a);
}

TEST(WeightStream, FilesAndHostBuffersArriveByteForByte) {
  REQUIRE_GPU();
  for (const Shape& shape : {Shape{3, (256 << 10) + 7, 2, true}, Shape{1, 1 << 20, 1, true},
                             Shape{8, 64 << 10, 4, false}, Shape{2, 5 << 20, 3, true}}) {
    SCOPED_TRACE(::testing::Message() << shape.threads << " threads, chunks of " << shape.chunk_bytes << " bytes, "
                                      << shape.chunks_per_thread << " per thread, prefetch " << shape.prefetch);
    stream_and_compare(shape);
    if (HasFatalFailure()) return;
  }
}

TEST(WeightStream, ReleasedMappingPagesLeaveTheResidentSet) {
  REQUIRE_GPU();
  TempDir dir;
  const std::vector<uint8_t> bytes = random_bytes((32 << 20) + 100, 9);
  const Mapping map(dir.write("m.bin", bytes));
  uint64_t sum = 0;
  for (size_t i = 0; i < map.size(); i += 4096) sum += map.data()[i];  // fault every page in
  EXPECT_GT(sum, 0u);
  ASSERT_GE(map.resident_bytes(), size_t{32} << 20);

  cuda::DeviceBuffer<uint8_t> device(map.size());
  WeightStreamer streamer(4, 1 << 20, 2);
  streamer.enqueue("mapped", HostSource{map.data(), true}, map.size(), device.get());
  streamer.finish();
  EXPECT_TRUE(cuda::to_host(device) == bytes);
  // At most the page where two pieces meet, when the later piece released it before the earlier one had read it.
  EXPECT_LE(map.resident_bytes(), (map.size() / (1 << 20) + 2) * 4096);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(WeightStream, MissingAndShortFilesAreNamedAtEnqueue) {
  REQUIRE_GPU();
  TempDir dir;
  const std::string present = dir.write("present.bin", random_bytes(1000, 1));
  cuda::DeviceBuffer<uint8_t> device(4096);
  WeightStreamer streamer(2, 4096, 2);
  const std::string missing = error_of([&] {
    streamer.enqueue("w.missing", FileSource{dir.file("absent.bin"), 0}, 10, device.get());
  });
  EXPECT_NE(missing.find(dir.file("absent.bin")), std::string::npos) << missing;
  EXPECT_NE(missing.find("w.missing"), std::string::npos) << missing;
  const std::string short_file =
      error_of([&] { streamer.enqueue("w.short", FileSource{present, 900}, 101, device.get()); });
  EXPECT_NE(short_file.find(present), std::string::npos) << short_file;
  EXPECT_NE(short_file.find("w.short"), std::string::npos) << short_file;
  EXPECT_NE(short_file.find("1000 bytes"), std::string::npos) << short_file;
  // Refused tensors leave the streamer usable.
  streamer.enqueue("w.fine", FileSource{present, 900}, 100, device.get());
  streamer.finish();
}

TEST(WeightStream, AFileCutShortAfterEnqueueFailsInFinish) {
  REQUIRE_GPU();
  TempDir dir;
  const std::vector<uint8_t> host = random_bytes(1 << 20, 2);
  const std::string path = dir.write("cut.bin", random_bytes(8 << 20, 3));
  cuda::DeviceBuffer<uint8_t> device(9 << 20);
  WeightStreamer streamer(1, 64 << 10, 1);
  // The single worker stops in its first progress report (after its first piece) until the file has been cut, so
  // it reads the file only afterwards.
  std::promise<void> cut;
  std::shared_future<void> cut_done = cut.get_future().share();
  streamer.set_progress([cut_done](const StreamProgress&) { cut_done.wait(); }, 0.0);
  streamer.enqueue("host.first", HostSource{host.data()}, host.size(), device.get());
  streamer.enqueue("w.cut", FileSource{path, 0}, 8 << 20, device.get() + host.size());
  fs::resize_file(path, 3 << 20);
  cut.set_value();
  const std::string e = error_of([&] { streamer.finish(); });
  EXPECT_NE(e.find("w.cut"), std::string::npos) << e;
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_NE(e.find("short read"), std::string::npos) << e;
  const std::string refused = error_of([&] { streamer.enqueue("w.later", HostSource{host.data()}, 1, device.get()); });
  EXPECT_NE(refused.find("an earlier copy failed"), std::string::npos) << refused;
}

TEST(WeightStream, BadShapesAreRefused) {
  REQUIRE_GPU();
  EXPECT_THROW(WeightStreamer(0, 4096, 2), Error);
  EXPECT_THROW(WeightStreamer(2, 0, 2), Error);
  EXPECT_THROW(WeightStreamer(2, 4096, 0), Error);
  WeightStreamer streamer(1, 4096, 1);
  EXPECT_THROW(streamer.enqueue("w", HostSource{nullptr}, 10, reinterpret_cast<void*>(0x1000)), Error);
  const uint8_t byte = 1;
  EXPECT_THROW(streamer.enqueue("w", HostSource{&byte}, 1, nullptr), Error);
}

// Last in the file: should the driver take the bad copy for a sticky error, no other test runs after it.
TEST(WeightStream, ABadDevicePointerFailsInFinishNamingTheTensor) {
  REQUIRE_GPU();
  const std::vector<uint8_t> host = random_bytes(1 << 16, 4);
  WeightStreamer streamer(2, 4096, 2);
  streamer.enqueue("w.nowhere", HostSource{host.data()}, host.size(), reinterpret_cast<void*>(0x10));
  const std::string e = error_of([&] { streamer.finish(); });
  EXPECT_NE(e.find("w.nowhere"), std::string::npos) << e;
  EXPECT_NE(e.find("CUDA error"), std::string::npos) << e;
}

}  // namespace
}  // namespace kestrel::gpu
