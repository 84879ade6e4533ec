#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <optional>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/tensor.h"

namespace kestrel {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Same limit as the reference implementation: a larger header is certainly not a real checkpoint, and
// parsing it would only let a malicious file exhaust memory.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kSingleFile = "model.safetensors";

// numel * element size, or nullopt when either product overflows int64 (sizes must also fit size_t and
// a signed offset, hence int64 rather than uint64).
std::optional<int64_t> checked_nbytes(const std::vector<int64_t>& shape, DType dtype) {
  int64_t n = 1;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return std::nullopt;
  if (__builtin_mul_overflow(n, static_cast<int64_t>(dtype_size(dtype)), &n)) return std::nullopt;
  return n;
}

// A JSON integer that is >= 0; nullopt for negative numbers, floats (including integers too large for
// uint64, which nlohmann parses as floats) and non-numbers.
std::optional<uint64_t> nonneg_integer(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

// What a rejected JSON value was, short enough for an error message: numbers verbatim, otherwise the type
// (a dump could be huge or deeply nested).
std::string describe(const json& v) {
  if (v.is_number() || v.is_boolean() || v.is_null()) return v.dump();
  return std::string("a JSON ") + v.type_name();
}

// nlohmann keeps the last of several equal keys in an object without telling; the parser callback sees
// every key, so duplicates are found here and rejected instead of being silently dropped.
json parse_json_rejecting_duplicates(const char* begin, const char* end, const std::string& what) {
  std::vector<std::set<std::string>> open_objects;
  std::optional<std::string> duplicate;
  auto track_keys = [&](int, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start: open_objects.emplace_back(); break;
      case json::parse_event_t::object_end: open_objects.pop_back(); break;
      case json::parse_event_t::key:
        if (!open_objects.back().insert(parsed.get<std::string>()).second && !duplicate)
          duplicate = parsed.get<std::string>();
        break;
      default: break;
    }
    return true;
  };
  json parsed;
  try {
    parsed = json::parse(begin, end, track_keys);
  } catch (const json::exception& e) {
    fail("{}: not valid JSON: {}", what, e.what());
  }
  if (duplicate) fail("{}: duplicate JSON key '{}'", what, *duplicate);
  return parsed;
}

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void write_le64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

}  // namespace

int64_t TensorView::numel() const {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

namespace {

struct ParsedHeader {
  std::map<std::string, TensorView> tensors;
  std::map<std::string, std::string> metadata;
};

TensorView parse_entry(const std::string& path, const std::string& name, const json& entry,
                       std::span<const uint8_t> data) {
  const std::string where = fmt::format("{}: tensor '{}'", path, name);
  KESTREL_CHECK(entry.is_object(), "{}: entry is {}, not an object", where, describe(entry));
  for (const auto& [key, value] : entry.items())
    KESTREL_CHECK(key == "dtype" || key == "shape" || key == "data_offsets", "{}: unknown field '{}'", where, key);
  for (const char* field : {"dtype", "shape", "data_offsets"})
    KESTREL_CHECK(entry.contains(field), "{}: missing field '{}'", where, field);

  const json& dtype_json = entry["dtype"];
  KESTREL_CHECK(dtype_json.is_string(), "{}: field 'dtype' is {}, not a string", where, describe(dtype_json));
  const auto dtype = find_dtype(dtype_json.get<std::string>());
  KESTREL_CHECK(dtype.has_value(), "{}: unknown dtype '{}'", where, dtype_json.get<std::string>());

  const json& shape_json = entry["shape"];
  KESTREL_CHECK(shape_json.is_array(), "{}: field 'shape' is {}, not an array", where, describe(shape_json));
  std::vector<int64_t> shape;
  for (size_t i = 0; i < shape_json.size(); ++i) {
    const auto dim = nonneg_integer(shape_json[i]);
    KESTREL_CHECK(dim && *dim <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                  "{}: field 'shape' dim {} is {}, not a non-negative int64", where, i, describe(shape_json[i]));
    shape.push_back(static_cast<int64_t>(*dim));
  }
  const auto nbytes = checked_nbytes(shape, *dtype);
  KESTREL_CHECK(nbytes.has_value(), "{}: field 'shape' {} of {} overflows int64 bytes", where, shape_str(shape),
                dtype_name(*dtype));

  const json& offsets_json = entry["data_offsets"];
  KESTREL_CHECK(offsets_json.is_array() && offsets_json.size() == 2,
                "{}: field 'data_offsets' is {}, not an array [begin, end]", where, describe(offsets_json));
  const auto begin = nonneg_integer(offsets_json[0]), end = nonneg_integer(offsets_json[1]);
  KESTREL_CHECK(begin && end, "{}: field 'data_offsets' [{}, {}] must be non-negative integers", where,
                describe(offsets_json[0]), describe(offsets_json[1]));
  KESTREL_CHECK(*begin <= *end, "{}: field 'data_offsets' end {} < begin {}", where, *end, *begin);
  KESTREL_CHECK(*end <= data.size(), "{}: field 'data_offsets' [{}, {}] leave the data section of {} bytes", where,
                *begin, *end, data.size());
  KESTREL_CHECK(*end - *begin == static_cast<uint64_t>(*nbytes),
                "{}: field 'data_offsets' span {} bytes but shape {} of {} needs {}", where, *end - *begin,
                shape_str(shape), dtype_name(*dtype), *nbytes);
  return TensorView{name, *dtype, std::move(shape), data.subspan(*begin, *end - *begin)};
}

ParsedHeader parse_file(const std::string& path, const uint8_t* map, size_t size) {
  KESTREL_CHECK(size >= 8, "{}: file is {} bytes, shorter than the 8-byte header length", path, size);
  const uint64_t header_len = read_le64(map);
  KESTREL_CHECK(header_len <= kMaxHeaderBytes, "{}: header length {} exceeds the limit of {} bytes", path,
                header_len, kMaxHeaderBytes);
  KESTREL_CHECK(header_len <= size - 8, "{}: header length {} exceeds the {} bytes after the length field (truncated?)",
                path, header_len, size - 8);
  const char* header = reinterpret_cast<const char*>(map + 8);
  const std::span<const uint8_t> data(map + 8 + header_len, size - 8 - header_len);

  const json root = parse_json_rejecting_duplicates(header, header + header_len, path + ": header");
  KESTREL_CHECK(root.is_object(), "{}: header is {}, not an object", path, describe(root));

  ParsedHeader parsed;
  for (const auto& [key, value] : root.items()) {
    if (key == kMetadataKey) {
      KESTREL_CHECK(value.is_object(), "{}: '{}' is {}, not an object", path, kMetadataKey, describe(value));
      for (const auto& [mkey, mvalue] : value.items()) {
        KESTREL_CHECK(mvalue.is_string(), "{}: '{}' entry '{}' is {}, not a string", path, kMetadataKey, mkey,
                      describe(mvalue));
        parsed.metadata.emplace(mkey, mvalue.get<std::string>());
      }
      continue;
    }
    parsed.tensors.emplace(key, parse_entry(path, key, value, data));
  }

  // Zero-length tensors occupy no bytes, so they cannot overlap anything and are left out of the check.
  std::vector<const TensorView*> by_offset;
  for (const auto& [name, view] : parsed.tensors)
    if (!view.bytes.empty()) by_offset.push_back(&view);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorView* a, const TensorView* b) { return a->bytes.data() < b->bytes.data(); });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorView& prev = *by_offset[i - 1];
    const TensorView& cur = *by_offset[i];
    KESTREL_CHECK(prev.bytes.data() + prev.bytes.size() <= cur.bytes.data(),
                  "{}: data of tensors '{}' and '{}' overlap", path, prev.name, cur.name);
  }
  return parsed;
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  KESTREL_CHECK(fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail("{}: cannot stat: {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{}: not a regular file", path);
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    fail("{}: file is {} bytes, shorter than the 8-byte header length", path, size_);
  }
  void* map = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  KESTREL_CHECK(map != MAP_FAILED, "{}: cannot mmap {} bytes: {}", path, size_, std::strerror(map_errno));
  map_ = static_cast<const uint8_t*>(map);
  try {
    ParsedHeader parsed = parse_file(path_, map_, size_);
    tensors_ = std::move(parsed.tensors);
    metadata_ = std::move(parsed.metadata);
  } catch (...) {
    ::munmap(const_cast<uint8_t*>(map_), size_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { ::munmap(const_cast<uint8_t*>(map_), size_); }

bool SafetensorsFile::has(const std::string& name) const { return tensors_.count(name) != 0; }

const TensorView& SafetensorsFile::get(const std::string& name) const {
  const auto it = tensors_.find(name);
  KESTREL_CHECK(it != tensors_.end(), "{}: no tensor '{}'", path_, name);
  return it->second;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, view] : tensors_) out.push_back(name);
  return out;
}

namespace {

std::string read_small_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  KESTREL_CHECK(in.is_open(), "{}: cannot open", path.string());
  std::string text;
  char buf[65536];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    text.append(buf, static_cast<size_t>(in.gcount()));
    KESTREL_CHECK(text.size() <= kMaxHeaderBytes, "{}: larger than {} bytes", path.string(), kMaxHeaderBytes);
  }
  KESTREL_CHECK(!in.bad(), "{}: read error", path.string());
  return text;
}

// Shard name -> tensors the index assigns to it.
std::map<std::string, std::vector<std::string>> read_index(const fs::path& index_path) {
  const std::string where = index_path.string();
  const std::string text = read_small_file(index_path);
  const json root = parse_json_rejecting_duplicates(text.data(), text.data() + text.size(), where);
  KESTREL_CHECK(root.is_object(), "{}: is {}, not an object", where, describe(root));
  KESTREL_CHECK(root.contains("weight_map"), "{}: missing field 'weight_map'", where);
  const json& weight_map = root["weight_map"];
  KESTREL_CHECK(weight_map.is_object(), "{}: field 'weight_map' is {}, not an object", where, describe(weight_map));
  std::map<std::string, std::vector<std::string>> shards;
  for (const auto& [tensor, shard] : weight_map.items()) {
    KESTREL_CHECK(shard.is_string(), "{}: weight_map entry '{}' is {}, not a file name", where, tensor,
                  describe(shard));
    const std::string file = shard.get<std::string>();
    // Shards live next to the index; a path would let an index reach files outside the checkpoint.
    KESTREL_CHECK(!file.empty() && file != "." && file != ".." && file.find('/') == std::string::npos,
                  "{}: weight_map entry '{}' names shard '{}', which is not a plain file name", where, tensor, file);
    shards[file].push_back(tensor);
  }
  return shards;
}

}  // namespace

Checkpoint::Checkpoint(const std::string& dir) {
  std::error_code ec;
  KESTREL_CHECK(fs::is_directory(dir, ec), "checkpoint '{}' is not a directory", dir);
  const fs::path root(dir);

  std::map<std::string, std::vector<std::string>> index;
  std::vector<fs::path> paths;
  if (fs::exists(root / kIndexFile, ec)) {
    index = read_index(root / kIndexFile);
    KESTREL_CHECK(!index.empty(), "{}: field 'weight_map' is empty", (root / kIndexFile).string());
    for (const auto& [shard, tensors] : index) {
      const fs::path shard_path = root / shard;
      KESTREL_CHECK(fs::is_regular_file(shard_path, ec), "{}: shard '{}' (holding tensor '{}') is missing",
                    (root / kIndexFile).string(), shard, tensors.front());
      paths.push_back(shard_path);
    }
  } else if (fs::exists(root / kSingleFile, ec)) {
    paths.push_back(root / kSingleFile);
  } else {
    for (const auto& entry : fs::directory_iterator(root, ec))
      if (entry.path().extension() == ".safetensors" && entry.is_regular_file(ec)) paths.push_back(entry.path());
    KESTREL_CHECK(!ec, "checkpoint '{}': cannot list the directory: {}", dir, ec.message());
    std::sort(paths.begin(), paths.end());
  }
  KESTREL_CHECK(!paths.empty(), "checkpoint '{}' has no {}, {} or *.safetensors files", dir, kIndexFile, kSingleFile);

  for (const fs::path& path : paths) {
    files_.push_back(std::make_unique<SafetensorsFile>(path.string()));
    const SafetensorsFile* file = files_.back().get();
    for (const std::string& name : file->names()) {
      const auto [it, inserted] = where_.emplace(name, file);
      KESTREL_CHECK(inserted, "checkpoint '{}': tensor '{}' is in both {} and {}", dir, name, it->second->path(),
                    file->path());
    }
    if (!index.empty()) {
      for (const std::string& name : index.at(path.filename().string()))
        KESTREL_CHECK(file->has(name), "{}: tensor '{}' is listed in {} but missing from the shard", file->path(),
                      name, kIndexFile);
    }
  }
}

bool Checkpoint::has(const std::string& name) const { return where_.count(name) != 0; }

const TensorView& Checkpoint::get(const std::string& name) const {
  const auto it = where_.find(name);
  KESTREL_CHECK(it != where_.end(), "checkpoint has no tensor '{}'", name);
  return it->second->get(name);
}

const SafetensorsFile& Checkpoint::file_of(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) fail("checkpoint has no tensor '{}'", name);
  return *it->second;
}

size_t Checkpoint::data_bytes() const {
  size_t n = 0;
  for (const auto& [name, file] : where_) n += file->get(name).bytes.size();
  return n;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

void write_safetensors(const std::string& path, const std::map<std::string, TensorData>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    KESTREL_CHECK(name != kMetadataKey, "{}: '{}' is reserved and cannot name a tensor", path, name);
    const auto nbytes = checked_nbytes(t.shape, t.dtype);
    KESTREL_CHECK(nbytes.has_value(), "{}: tensor '{}' has an invalid shape {}", path, name, shape_str(t.shape));
    KESTREL_CHECK(static_cast<uint64_t>(*nbytes) == t.bytes.size(),
                  "{}: tensor '{}' has {} bytes but shape {} of {} needs {}", path, name, t.bytes.size(),
                  shape_str(t.shape), dtype_name(t.dtype), *nbytes);
    header[name] = {{"dtype", dtype_name(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", json::array({offset, offset + t.bytes.size()})}};
    offset += t.bytes.size();
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;

  std::string text = header.dump();
  // Pad so that the data section starts 8-byte aligned (the length field itself is 8 bytes).
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t len[8];
  write_le64(len, text.size());

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  KESTREL_CHECK(out.is_open(), "{}: cannot create: {}", path, std::strerror(errno));
  out.write(reinterpret_cast<const char*>(len), sizeof len);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& [name, t] : tensors)
    out.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
  out.close();
  KESTREL_CHECK(!out.fail(), "{}: write failed", path);
}

void write_checkpoint(const std::string& dir, const std::map<std::string, TensorData>& tensors,
                      int64_t max_shard_bytes) {
  KESTREL_CHECK(max_shard_bytes > 0, "write_checkpoint '{}': max_shard_bytes {} must be positive", dir,
                max_shard_bytes);
  std::error_code ec;
  fs::create_directories(dir, ec);
  KESTREL_CHECK(!ec, "write_checkpoint '{}': cannot create the directory: {}", dir, ec.message());
  const fs::path root(dir);
  // Hugging Face loaders before transformers 4.48.2 reject shards without this entry.
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};

  // Greedy in name order; a tensor larger than the limit gets a shard of its own.
  std::vector<std::map<std::string, TensorData>> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (const auto& [name, t] : tensors) {
    if (!shards.back().empty() && shard_bytes + t.bytes.size() > static_cast<uint64_t>(max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().emplace(name, t);
    shard_bytes += t.bytes.size();
    total_bytes += t.bytes.size();
  }

  if (shards.size() == 1) {
    write_safetensors((root / kSingleFile).string(), shards[0], metadata);
    // A leftover index from an earlier sharded write would take precedence over the new file.
    fs::remove(root / kIndexFile, ec);
    KESTREL_CHECK(!ec, "{}: cannot remove the stale index: {}", (root / kIndexFile).string(), ec.message());
    return;
  }

  json weight_map = json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
    write_safetensors((root / file).string(), shards[i], metadata);
    for (const auto& [name, t] : shards[i]) weight_map[name] = file;
  }
  const json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  const fs::path index_path = root / kIndexFile;
  std::ofstream out(index_path);
  KESTREL_CHECK(out.is_open(), "{}: cannot create: {}", index_path.string(), std::strerror(errno));
  out << index.dump(2) << '\n';
  out.close();
  KESTREL_CHECK(!out.fail(), "{}: write failed", index_path.string());
}

}  // namespace kestrel

namespace kestrel {

void write_checkpoint_streamed(const std::string& dir, const std::vector<TensorSpec>& tensors,
                               const std::function<void(size_t, std::span<uint8_t>)>& fill, int64_t max_shard_bytes) {
  KESTREL_CHECK(max_shard_bytes > 0, "write_checkpoint '{}': max_shard_bytes {} must be positive", dir,
                max_shard_bytes);
  std::error_code ec;
  fs::create_directories(dir, ec);
  KESTREL_CHECK(!ec, "write_checkpoint '{}': cannot create the directory: {}", dir, ec.message());
  const fs::path root(dir);
  std::vector<uint64_t> bytes(tensors.size());
  std::vector<std::vector<size_t>> shards(1);
  uint64_t shard_bytes = 0, total_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    KESTREL_CHECK(t.name != kMetadataKey, "{}: '{}' is reserved and cannot name a tensor", dir, t.name);
    const auto nbytes = checked_nbytes(t.shape, t.dtype);
    KESTREL_CHECK(nbytes.has_value(), "{}: tensor '{}' has an invalid shape {}", dir, t.name, shape_str(t.shape));
    bytes[i] = static_cast<uint64_t>(*nbytes);
    if (!shards.back().empty() && shard_bytes + bytes[i] > static_cast<uint64_t>(max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += bytes[i];
    total_bytes += bytes[i];
  }
  json weight_map = json::object();
  std::vector<uint8_t> buf;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file = shards.size() == 1 ? std::string(kSingleFile)
                                                : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    json header = json::object();
    uint64_t offset = 0;
    for (size_t i : shards[s]) {
      header[tensors[i].name] = {{"dtype", dtype_name(tensors[i].dtype)},
                                 {"shape", tensors[i].shape},
                                 {"data_offsets", json::array({offset, offset + bytes[i]})}};
      offset += bytes[i];
      weight_map[tensors[i].name] = file;
    }
    header[kMetadataKey] = {{"format", "pt"}};
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    uint8_t len[8];
    write_le64(len, text.size());
    const std::string path = (root / file).string();
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    KESTREL_CHECK(out.is_open(), "{}: cannot create: {}", path, std::strerror(errno));
    out.write(reinterpret_cast<const char*>(len), sizeof len);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (size_t i : shards[s]) {
      buf.resize(bytes[i]);
      fill(i, buf);
      out.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size()));
    }
    out.close();
    KESTREL_CHECK(!out.fail(), "{}: write failed", path);
  }
  if (shards.size() == 1) {
    fs::remove(root / kIndexFile, ec);
    return;
  }
  const json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  std::ofstream out(root / kIndexFile);
  KESTREL_CHECK(out.is_open(), "{}: cannot create: {}", (root / kIndexFile).string(), std::strerror(errno));
  out << index.dump(2) << '\n';
}

}  // namespace kestrel
