#include "model/safetensors.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Deterministic, distinct bytes for each tensor so that a mix-up between tensors is visible.
TensorData make_tensor(DType dtype, std::vector<int64_t> shape, uint8_t seed) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  TensorData t{dtype, std::move(shape), std::vector<uint8_t>(static_cast<size_t>(numel) * dtype_size(dtype))};
  for (size_t i = 0; i < t.bytes.size(); ++i) t.bytes[i] = static_cast<uint8_t>(seed * 31 + i * 7);
  return t;
}

std::vector<uint8_t> read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& p, const std::vector<uint8_t>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

uint64_t le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// A file assembled by hand: 8-byte little-endian length (the header's, unless overridden), header, data.
std::vector<uint8_t> raw_file(const std::string& header, size_t data_bytes,
                              std::optional<uint64_t> length_field = std::nullopt) {
  const uint64_t len = length_field.value_or(header.size());
  std::vector<uint8_t> out(8 + header.size() + data_bytes);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(len >> (8 * i));
  for (size_t i = 0; i < header.size(); ++i) out[8 + i] = static_cast<uint8_t>(header[i]);
  for (size_t i = 0; i < data_bytes; ++i) out[8 + header.size() + i] = static_cast<uint8_t>(i);
  return out;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kestrel_safetensors_test_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::string write_raw(const std::string& name, const std::string& header, size_t data_bytes,
                        std::optional<uint64_t> length_field = std::nullopt) {
    write_bytes(path(name), raw_file(header, data_bytes, length_field));
    return path(name);
  }

  // Opening the file must throw Error whose message contains every one of `parts`.
  static void expect_open_error(const std::string& file, std::initializer_list<std::string> parts) {
    try {
      SafetensorsFile f(file);
      ADD_FAILURE() << "no error for " << file;
    } catch (const Error& e) {
      const std::string msg = e.what();
      for (const std::string& part : parts) EXPECT_NE(msg.find(part), std::string::npos) << msg << "\nlacks: " << part;
    }
  }

  static void expect_checkpoint_error(const std::string& dir, std::initializer_list<std::string> parts) {
    try {
      Checkpoint c(dir);
      ADD_FAILURE() << "no error for checkpoint " << dir;
    } catch (const Error& e) {
      const std::string msg = e.what();
      for (const std::string& part : parts) EXPECT_NE(msg.find(part), std::string::npos) << msg << "\nlacks: " << part;
    }
  }

  // One valid entry of a hand-written header.
  static std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                           const std::string& offsets) {
    return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":" + offsets + "}";
  }

  fs::path dir_;
};

TEST(DType, NamesSizesAndParsing) {
  const std::vector<std::tuple<DType, std::string, size_t>> expected = {
      {DType::F64, "F64", 8}, {DType::F32, "F32", 4},   {DType::F16, "F16", 2},         {DType::BF16, "BF16", 2},
      {DType::I64, "I64", 8}, {DType::I32, "I32", 4},   {DType::I16, "I16", 2},         {DType::I8, "I8", 1},
      {DType::U64, "U64", 8}, {DType::U32, "U32", 4},   {DType::U16, "U16", 2},         {DType::U8, "U8", 1},
      {DType::BOOL, "BOOL", 1}, {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
      {DType::F8_E8M0, "F8_E8M0", 1}};
  for (const auto& [d, name, size] : expected) {
    EXPECT_EQ(dtype_name(d), name);
    EXPECT_EQ(dtype_size(d), size) << name;
    EXPECT_EQ(parse_dtype(name), d);
  }
  try {
    parse_dtype("F4_E2M1");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("F4_E2M1"), std::string::npos);
  }
  EXPECT_THROW(parse_dtype("f32"), Error);  // the spelling is case-sensitive
}

TEST_F(SafetensorsTest, ReadsHandWrittenFile) {
  // Two F32 values 1.0 and -2.0, then a BF16 scalar 1.5 (0x3FC0), little-endian.
  const std::string header =
      "{" + entry("x", "F32", "[2]", "[0,8]") + "," + entry("s", "BF16", "[]", "[8,10]") +
      ",\"__metadata__\":{\"format\":\"pt\"}}";
  std::vector<uint8_t> bytes = raw_file(header, 0);
  for (uint8_t b : {0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0xC0, 0xC0, 0x3F}) bytes.push_back(b);
  write_bytes(path("hand.safetensors"), bytes);

  SafetensorsFile f(path("hand.safetensors"));
  EXPECT_EQ(f.names(), (std::vector<std::string>{"s", "x"}));
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  const TensorView& x = f.get("x");
  EXPECT_EQ(x.dtype, DType::F32);
  EXPECT_EQ(x.shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(x.numel(), 2);
  ASSERT_EQ(x.bytes.size(), 8u);
  float v[2];
  std::memcpy(v, x.bytes.data(), 8);
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[1], -2.0f);
  const TensorView& s = f.get("s");
  EXPECT_EQ(s.dtype, DType::BF16);
  EXPECT_TRUE(s.shape.empty());
  EXPECT_EQ(s.numel(), 1);
  ASSERT_EQ(s.bytes.size(), 2u);
  EXPECT_EQ(s.bytes[0], 0xC0);
  EXPECT_EQ(s.bytes[1], 0x3F);
  EXPECT_TRUE(f.has("x"));
  EXPECT_FALSE(f.has("y"));
}

TEST_F(SafetensorsTest, EmptyHeaderAndEmptyDataSectionAreValid) {
  SafetensorsFile empty(write_raw("empty.safetensors", "{}", 0));
  EXPECT_TRUE(empty.names().empty());

  SafetensorsFile zero(write_raw("zero.safetensors", "{" + entry("z", "F32", "[3,0]", "[0,0]") + "}", 0));
  EXPECT_EQ(zero.get("z").numel(), 0);
  EXPECT_TRUE(zero.get("z").bytes.empty());
}

TEST_F(SafetensorsTest, WriteReadRoundTrip) {
  std::map<std::string, TensorData> tensors;
  tensors["a.f32"] = make_tensor(DType::F32, {2, 3}, 1);
  tensors["b.bf16"] = make_tensor(DType::BF16, {5}, 2);
  tensors["c.scalar"] = make_tensor(DType::F64, {}, 3);
  tensors["d.empty"] = make_tensor(DType::I32, {0, 4}, 4);
  tensors["e.u8"] = make_tensor(DType::U8, {3, 1, 3}, 5);  // 9 bytes: the next tensor starts unaligned
  tensors["f.fp8"] = make_tensor(DType::F8_E4M3, {7}, 6);
  tensors["g.i64"] = make_tensor(DType::I64, {2, 2}, 7);
  tensors["h.bool"] = make_tensor(DType::BOOL, {3}, 8);
  tensors["i.f16"] = make_tensor(DType::F16, {1, 1, 1, 2}, 9);
  tensors["j.u64"] = make_tensor(DType::U64, {1}, 10);
  tensors["k.i16"] = make_tensor(DType::I16, {3}, 11);
  tensors["l.u16"] = make_tensor(DType::U16, {2}, 12);
  tensors["m.u32"] = make_tensor(DType::U32, {2}, 13);
  tensors["n.i8"] = make_tensor(DType::I8, {4}, 14);
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "round trip"}};
  write_safetensors(path("rt.safetensors"), tensors, metadata);

  SafetensorsFile f(path("rt.safetensors"));
  std::vector<std::string> expected_names;
  for (const auto& [name, t] : tensors) expected_names.push_back(name);
  EXPECT_EQ(f.names(), expected_names);
  EXPECT_EQ(f.metadata(), metadata);
  for (const auto& [name, t] : tensors) {
    const TensorView& v = f.get(name);
    EXPECT_EQ(v.name, name);
    EXPECT_EQ(v.dtype, t.dtype) << name;
    EXPECT_EQ(v.shape, t.shape) << name;
    EXPECT_EQ(std::vector<uint8_t>(v.bytes.begin(), v.bytes.end()), t.bytes) << name;
  }

  // Layout: header length a multiple of 8, padded with spaces, data in name order with no gaps.
  const std::vector<uint8_t> bytes = read_bytes(path("rt.safetensors"));
  const uint64_t header_len = le64(bytes.data());
  EXPECT_EQ(header_len % 8, 0u);
  const std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<int64_t>(header_len));
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));
  std::vector<uint8_t> concatenated;
  for (const auto& [name, t] : tensors) concatenated.insert(concatenated.end(), t.bytes.begin(), t.bytes.end());
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin() + 8 + static_cast<int64_t>(header_len), bytes.end()), concatenated);
}

TEST_F(SafetensorsTest, WriterHeaderIsExact) {
  std::map<std::string, TensorData> tensors;
  tensors["w"] = make_tensor(DType::F16, {2, 3}, 1);
  tensors["b"] = make_tensor(DType::F32, {3}, 2);
  write_safetensors(path("exact.safetensors"), tensors);
  const std::vector<uint8_t> bytes = read_bytes(path("exact.safetensors"));
  const uint64_t header_len = le64(bytes.data());
  const json header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<int64_t>(header_len));
  const json expected = {{"b", {{"dtype", "F32"}, {"shape", {3}}, {"data_offsets", {0, 12}}}},
                         {"w", {{"dtype", "F16"}, {"shape", {2, 3}}, {"data_offsets", {12, 24}}}}};
  EXPECT_EQ(header, expected);
  EXPECT_EQ(bytes.size(), 8 + header_len + 24);
}

TEST_F(SafetensorsTest, WriterRejectsInconsistentTensors) {
  std::map<std::string, TensorData> tensors;
  tensors["short"] = TensorData{DType::F32, {4}, std::vector<uint8_t>(15)};
  try {
    write_safetensors(path("bad.safetensors"), tensors);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("short"), std::string::npos) << e.what();
  }
  std::map<std::string, TensorData> reserved;
  reserved["__metadata__"] = make_tensor(DType::U8, {1}, 1);
  EXPECT_THROW(write_safetensors(path("bad.safetensors"), reserved), Error);
  std::map<std::string, TensorData> negative;
  negative["neg"] = TensorData{DType::U8, {-1}, {}};
  EXPECT_THROW(write_safetensors(path("bad.safetensors"), negative), Error);
}

TEST_F(SafetensorsTest, ShardedCheckpointRoundTrip) {
  std::map<std::string, TensorData> tensors;
  for (int i = 0; i < 5; ++i) tensors[fmt::format("t{}", i)] = make_tensor(DType::U8, {10, 10}, static_cast<uint8_t>(i));
  tensors["t5.big"] = make_tensor(DType::F32, {100}, 5);  // 400 bytes: larger than a shard, so alone
  tensors["t6"] = make_tensor(DType::U8, {0}, 6);
  const std::string ckpt = path("sharded");
  write_checkpoint(ckpt, tensors, 250);

  // Greedy in name order with at most 250 bytes: {t0,t1}, {t2,t3}, {t4}, {t5.big}, {t6} (t6 is empty, but the
  // shard before it is already over the limit).
  const json index = json::parse(std::ifstream(fs::path(ckpt) / "model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 5 * 100 + 400);
  const json expected_map = {{"t0", "model-00001-of-00005.safetensors"}, {"t1", "model-00001-of-00005.safetensors"},
                             {"t2", "model-00002-of-00005.safetensors"}, {"t3", "model-00002-of-00005.safetensors"},
                             {"t4", "model-00003-of-00005.safetensors"}, {"t5.big", "model-00004-of-00005.safetensors"},
                             {"t6", "model-00005-of-00005.safetensors"}};
  EXPECT_EQ(index["weight_map"], expected_map);
  EXPECT_FALSE(fs::exists(fs::path(ckpt) / "model.safetensors"));

  Checkpoint c(ckpt);
  std::vector<std::string> expected_names;
  for (const auto& [name, t] : tensors) expected_names.push_back(name);
  EXPECT_EQ(c.names(), expected_names);
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(c.has(name));
    const TensorView& v = c.get(name);
    EXPECT_EQ(v.shape, t.shape) << name;
    EXPECT_EQ(std::vector<uint8_t>(v.bytes.begin(), v.bytes.end()), t.bytes) << name;
  }
  EXPECT_FALSE(c.has("t7"));
  try {
    c.get("t7");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("t7"), std::string::npos);
  }
}

TEST_F(SafetensorsTest, ShardAssignmentIsGreedy) {
  // Hand-worked: sizes 100,100,100 with a limit of 250 give {a,b}, {c}; the empty tensor d joins c.
  std::map<std::string, TensorData> tensors;
  tensors["a"] = make_tensor(DType::U8, {100}, 1);
  tensors["b"] = make_tensor(DType::U8, {100}, 2);
  tensors["c"] = make_tensor(DType::U8, {100}, 3);
  tensors["d"] = make_tensor(DType::U8, {0}, 4);
  write_checkpoint(path("greedy"), tensors, 250);
  SafetensorsFile first(path("greedy/model-00001-of-00002.safetensors"));
  SafetensorsFile second(path("greedy/model-00002-of-00002.safetensors"));
  EXPECT_EQ(first.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(first.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  EXPECT_EQ(second.names(), (std::vector<std::string>{"c", "d"}));
}

TEST_F(SafetensorsTest, SingleShardCheckpointWritesModelSafetensors) {
  std::map<std::string, TensorData> tensors;
  tensors["a"] = make_tensor(DType::F32, {4}, 1);
  tensors["b"] = make_tensor(DType::F32, {4}, 2);
  const std::string ckpt = path("single");
  write_checkpoint(ckpt, tensors, 16);  // two shards and an index, then rewritten as one file
  EXPECT_TRUE(fs::exists(fs::path(ckpt) / "model.safetensors.index.json"));
  write_checkpoint(ckpt, tensors, 32);
  EXPECT_FALSE(fs::exists(fs::path(ckpt) / "model.safetensors.index.json"));  // the stale index is gone
  Checkpoint c(ckpt);
  EXPECT_EQ(c.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(std::vector<uint8_t>(c.get("b").bytes.begin(), c.get("b").bytes.end()), tensors["b"].bytes);
  EXPECT_THROW(write_checkpoint(ckpt, tensors, 0), Error);
}

TEST_F(SafetensorsTest, CheckpointFallsBackToAllSafetensorsFiles) {
  const std::string ckpt = path("loose");
  fs::create_directory(ckpt);
  std::map<std::string, TensorData> one, two;
  one["x"] = make_tensor(DType::F32, {2}, 1);
  two["y"] = make_tensor(DType::I8, {3}, 2);
  write_safetensors(ckpt + "/b.safetensors", one);
  write_safetensors(ckpt + "/a.safetensors", two);
  write_bytes(ckpt + "/notes.txt", {'h', 'i'});
  Checkpoint c(ckpt);
  EXPECT_EQ(c.names(), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(c.get("y").dtype, DType::I8);

  two["x"] = make_tensor(DType::F32, {2}, 3);
  write_safetensors(ckpt + "/a.safetensors", two);
  expect_checkpoint_error(ckpt, {"'x'", "a.safetensors", "b.safetensors"});
}

TEST_F(SafetensorsTest, CheckpointErrors) {
  expect_checkpoint_error(path("does_not_exist"), {"does_not_exist"});
  fs::create_directory(path("empty"));
  expect_checkpoint_error(path("empty"), {"empty"});
  expect_checkpoint_error(write_raw("file.safetensors", "{}", 0), {"file.safetensors", "not a directory"});
}

TEST_F(SafetensorsTest, IndexReferencingMissingShard) {
  std::map<std::string, TensorData> tensors;
  for (const char* n : {"a", "b", "c"}) tensors[n] = make_tensor(DType::U8, {8}, 1);
  const std::string ckpt = path("missing_shard");
  write_checkpoint(ckpt, tensors, 8);
  fs::remove(fs::path(ckpt) / "model-00002-of-00003.safetensors");
  expect_checkpoint_error(ckpt, {"model-00002-of-00003.safetensors", "'b'"});
}

TEST_F(SafetensorsTest, IndexReferencingTensorMissingFromShard) {
  std::map<std::string, TensorData> tensors;
  for (const char* n : {"a", "b"}) tensors[n] = make_tensor(DType::U8, {8}, 1);
  const std::string ckpt = path("missing_tensor");
  write_checkpoint(ckpt, tensors, 8);
  const fs::path index_path = fs::path(ckpt) / "model.safetensors.index.json";
  json index = json::parse(std::ifstream(index_path));
  index["weight_map"]["ghost"] = "model-00002-of-00002.safetensors";
  std::ofstream(index_path) << index.dump();
  expect_checkpoint_error(ckpt, {"'ghost'", "model-00002-of-00002.safetensors"});
}

TEST_F(SafetensorsTest, DuplicateTensorAcrossShards) {
  std::map<std::string, TensorData> tensors;
  for (const char* n : {"a", "b"}) tensors[n] = make_tensor(DType::U8, {8}, 1);
  const std::string ckpt = path("duplicate");
  write_checkpoint(ckpt, tensors, 8);
  // The second shard now also holds "a", which the index places in the first.
  std::map<std::string, TensorData> second;
  second["a"] = tensors["a"];
  second["b"] = tensors["b"];
  write_safetensors(ckpt + "/model-00002-of-00002.safetensors", second);
  expect_checkpoint_error(ckpt, {"'a'", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"});
}

TEST_F(SafetensorsTest, MalformedIndex) {
  std::map<std::string, TensorData> tensors;
  for (const char* n : {"a", "b"}) tensors[n] = make_tensor(DType::U8, {8}, 1);
  const std::string ckpt = path("bad_index");
  write_checkpoint(ckpt, tensors, 8);
  const std::string index_path = ckpt + "/model.safetensors.index.json";
  auto rewrite = [&](const std::string& text) { std::ofstream(index_path) << text; };
  rewrite("{\"metadata\": {}}");
  expect_checkpoint_error(ckpt, {"model.safetensors.index.json", "weight_map"});
  rewrite("{\"weight_map\": {\"a\": 3}}");
  expect_checkpoint_error(ckpt, {"model.safetensors.index.json", "'a'"});
  rewrite("{\"weight_map\": {\"a\": \"../outside.safetensors\"}}");
  expect_checkpoint_error(ckpt, {"'a'", "../outside.safetensors"});
  rewrite("{\"weight_map\": {\"a\": \"model-00001-of-00002.safetensors\", \"a\": \"x\"}}");
  expect_checkpoint_error(ckpt, {"duplicate", "'a'"});
  rewrite("{\"weight_map\": ");
  expect_checkpoint_error(ckpt, {"model.safetensors.index.json", "JSON"});
}

TEST_F(SafetensorsTest, TruncatedFile) {
  std::map<std::string, TensorData> tensors;
  tensors["first"] = make_tensor(DType::F32, {4}, 1);
  tensors["last"] = make_tensor(DType::F32, {4}, 2);
  write_safetensors(path("whole.safetensors"), tensors);
  const std::vector<uint8_t> whole = read_bytes(path("whole.safetensors"));
  const size_t header_end = 8 + le64(whole.data());
  ASSERT_EQ(whole.size(), header_end + 32);

  const std::string cut = path("cut.safetensors");
  for (size_t n : {size_t{0}, size_t{3}, size_t{7}}) {  // inside the length field
    write_bytes(cut, std::vector<uint8_t>(whole.begin(), whole.begin() + static_cast<int64_t>(n)));
    expect_open_error(cut, {cut, "shorter than the 8-byte header length"});
  }
  for (size_t n : {size_t{8}, size_t{9}, (8 + header_end) / 2, header_end - 1}) {  // inside the header
    write_bytes(cut, std::vector<uint8_t>(whole.begin(), whole.begin() + static_cast<int64_t>(n)));
    expect_open_error(cut, {cut, "header length"});
  }
  for (size_t n : {header_end, header_end + 5, header_end + 16, whole.size() - 1}) {  // inside the data
    write_bytes(cut, std::vector<uint8_t>(whole.begin(), whole.begin() + static_cast<int64_t>(n)));
    // "last" occupies the final 16 bytes, so every cut leaves it outside the data section.
    expect_open_error(cut, {cut, "data_offsets", "leave the data section"});
  }
  write_bytes(cut, std::vector<uint8_t>(whole.begin(), whole.end() - 1));
  expect_open_error(cut, {cut, "'last'"});
}

TEST_F(SafetensorsTest, HeaderLengthBeyondFile) {
  const std::string header = "{" + entry("x", "U8", "[4]", "[0,4]") + "}";
  expect_open_error(write_raw("long.safetensors", header, 4, header.size() + 5), {"long.safetensors", "header length"});
  expect_open_error(write_raw("huge.safetensors", header, 4, uint64_t{1} << 63), {"huge.safetensors", "limit"});
}

TEST_F(SafetensorsTest, HeaderNotJsonOrNotObject) {
  expect_open_error(write_raw("notjson.safetensors", "{\"x\": {", 0), {"notjson.safetensors", "not valid JSON"});
  expect_open_error(write_raw("garbage.safetensors", std::string("\x00\x01{}", 4), 0), {"garbage.safetensors", "JSON"});
  expect_open_error(write_raw("array.safetensors", "[1, 2]", 0), {"array.safetensors", "not an object"});
  expect_open_error(write_raw("number.safetensors", "42", 0), {"number.safetensors", "not an object"});
  expect_open_error(write_raw("entry.safetensors", "{\"x\": 5}", 0), {"entry.safetensors", "'x'", "not an object"});
}

TEST_F(SafetensorsTest, MissingFields) {
  expect_open_error(write_raw("m1.safetensors", "{\"t\":{\"shape\":[1],\"data_offsets\":[0,1]}}", 1),
                    {"m1.safetensors", "'t'", "dtype"});
  expect_open_error(write_raw("m2.safetensors", "{\"t\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 1),
                    {"m2.safetensors", "'t'", "shape"});
  expect_open_error(write_raw("m3.safetensors", "{\"t\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1),
                    {"m3.safetensors", "'t'", "data_offsets"});
  expect_open_error(
      write_raw("m4.safetensors", "{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"extra\":1}}", 1),
      {"m4.safetensors", "'t'", "extra"});
}

TEST_F(SafetensorsTest, WrongFieldTypes) {
  expect_open_error(write_raw("w1.safetensors", "{\"t\":{\"dtype\":5,\"shape\":[1],\"data_offsets\":[0,1]}}", 1),
                    {"'t'", "dtype"});
  expect_open_error(write_raw("w2.safetensors", "{" + entry("t", "U8", "\"1\"", "[0,1]") + "}", 1), {"'t'", "shape"});
  expect_open_error(write_raw("w3.safetensors", "{" + entry("t", "U8", "[1.0]", "[0,1]") + "}", 1), {"'t'", "shape"});
  expect_open_error(write_raw("w4.safetensors", "{" + entry("t", "U8", "[1]", "[0,1.0]") + "}", 1),
                    {"'t'", "data_offsets"});
  expect_open_error(write_raw("w5.safetensors", "{" + entry("t", "U8", "[1]", "[0]") + "}", 1), {"'t'", "data_offsets"});
  expect_open_error(write_raw("w6.safetensors", "{" + entry("t", "U8", "[1]", "[0,-1]") + "}", 1),
                    {"'t'", "data_offsets"});
  expect_open_error(write_raw("w7.safetensors", "{" + entry("t", "U8", "[1]", "[0,1,2]") + "}", 1),
                    {"'t'", "data_offsets"});
}

TEST_F(SafetensorsTest, UnknownDType) {
  expect_open_error(write_raw("dt.safetensors", "{" + entry("t", "F4", "[2]", "[0,1]") + "}", 1),
                    {"dt.safetensors", "'t'", "'F4'"});
}

TEST_F(SafetensorsTest, NegativeOrHugeDim) {
  expect_open_error(write_raw("neg.safetensors", "{" + entry("t", "U8", "[2,-1]", "[0,0]") + "}", 0),
                    {"neg.safetensors", "'t'", "shape", "-1"});
  expect_open_error(write_raw("big.safetensors", "{" + entry("t", "U8", "[9223372036854775808]", "[0,0]") + "}", 0),
                    {"big.safetensors", "'t'", "shape"});
}

TEST_F(SafetensorsTest, ShapeOverflow) {
  // 2^62 * 4 elements overflows int64; so does 2^62 * 2 bytes of F16 after the element count fits.
  expect_open_error(write_raw("ov1.safetensors", "{" + entry("t", "U8", "[4611686018427387904,4]", "[0,0]") + "}", 0),
                    {"ov1.safetensors", "'t'", "overflow"});
  expect_open_error(write_raw("ov2.safetensors", "{" + entry("t", "F32", "[4611686018427387904]", "[0,0]") + "}", 0),
                    {"ov2.safetensors", "'t'", "overflow"});
  // A zero dim makes the product zero no matter what else is there.
  SafetensorsFile ok(write_raw("ok.safetensors", "{" + entry("t", "F32", "[0,4611686018427387904]", "[0,0]") + "}", 0));
  EXPECT_EQ(ok.get("t").numel(), 0);
}

TEST_F(SafetensorsTest, OffsetsOutOfRange) {
  expect_open_error(write_raw("oor.safetensors", "{" + entry("t", "U8", "[4]", "[2,6]") + "}", 5),
                    {"oor.safetensors", "'t'", "leave the data section"});
  expect_open_error(write_raw("oor2.safetensors", "{" + entry("t", "U8", "[0]", "[6,6]") + "}", 5),
                    {"oor2.safetensors", "'t'", "leave the data section"});
  expect_open_error(
      write_raw("oor3.safetensors", "{" + entry("t", "U8", "[1]", "[18446744073709551615,18446744073709551615]") + "}", 5),
      {"oor3.safetensors", "'t'"});
}

TEST_F(SafetensorsTest, EndBeforeBegin) {
  expect_open_error(write_raw("rev.safetensors", "{" + entry("t", "U8", "[2]", "[4,2]") + "}", 8),
                    {"rev.safetensors", "'t'", "end 2 < begin 4"});
}

TEST_F(SafetensorsTest, SizeMismatch) {
  expect_open_error(write_raw("size.safetensors", "{" + entry("t", "F32", "[2,2]", "[0,12]") + "}", 16),
                    {"size.safetensors", "'t'", "needs 16"});
}

TEST_F(SafetensorsTest, OverlappingTensors) {
  const std::string header = "{" + entry("p", "F32", "[2]", "[0,8]") + "," + entry("q", "F32", "[2]", "[4,12]") + "}";
  expect_open_error(write_raw("overlap.safetensors", header, 12), {"overlap.safetensors", "'p'", "'q'", "overlap"});
  // Adjacent ranges and a zero-length tensor sitting at another tensor's offset are fine.
  const std::string adjacent = "{" + entry("p", "F32", "[2]", "[0,8]") + "," + entry("q", "F32", "[1]", "[8,12]") +
                               "," + entry("z", "F32", "[0]", "[4,4]") + "}";
  SafetensorsFile ok(write_raw("adjacent.safetensors", adjacent, 12));
  EXPECT_EQ(ok.get("q").bytes.data(), ok.get("p").bytes.data() + 8);
}

TEST_F(SafetensorsTest, DuplicateKeys) {
  const std::string header = "{" + entry("d", "U8", "[1]", "[0,1]") + "," + entry("d", "U8", "[1]", "[1,2]") + "}";
  expect_open_error(write_raw("dup.safetensors", header, 2), {"dup.safetensors", "duplicate", "'d'"});
  const std::string inner = "{\"t\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
  expect_open_error(write_raw("dup2.safetensors", inner, 1), {"dup2.safetensors", "duplicate", "'dtype'"});
}

TEST_F(SafetensorsTest, BadMetadata) {
  expect_open_error(write_raw("md1.safetensors", "{\"__metadata__\": [1]}", 0), {"md1.safetensors", "__metadata__"});
  expect_open_error(write_raw("md2.safetensors", "{\"__metadata__\": {\"k\": 1}}", 0),
                    {"md2.safetensors", "__metadata__", "'k'"});
}

TEST_F(SafetensorsTest, NotARegularFile) {
  fs::create_directory(path("dir.safetensors"));
  expect_open_error(path("dir.safetensors"), {"dir.safetensors"});
  expect_open_error(path("absent.safetensors"), {"absent.safetensors", "cannot open"});
}

TEST_F(SafetensorsTest, GetMissingTensorNamesIt) {
  SafetensorsFile f(write_raw("one.safetensors", "{" + entry("t", "U8", "[1]", "[0,1]") + "}", 1));
  try {
    f.get("nope");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nope"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("one.safetensors"), std::string::npos);
  }
}

// Mutated versions of a valid file must either open (with self-consistent views) or throw Error; anything else
// (a crash, a different exception type, a view outside the file) fails the test.
TEST_F(SafetensorsTest, FuzzMutatedFilesOnlyErrorOrSucceed) {
  std::map<std::string, TensorData> tensors;
  tensors["w"] = make_tensor(DType::F32, {3, 2}, 1);
  tensors["s"] = make_tensor(DType::BF16, {}, 2);
  tensors["z"] = make_tensor(DType::I64, {0}, 3);
  tensors["u"] = make_tensor(DType::U8, {5}, 4);
  write_safetensors(path("base.safetensors"), tensors, {{"format", "pt"}});
  const std::vector<uint8_t> base = read_bytes(path("base.safetensors"));
  const size_t header_end = 8 + le64(base.data());

  std::mt19937_64 rng(20240611);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  const std::string json_chars = "{}[]\",:-0123456789.eE \\";
  const std::vector<std::string> numbers = {"0", "1", "-1", "2147483648", "9223372036854775807",
                                            "9223372036854775808", "18446744073709551615", "18446744073709551616",
                                            "1e30", "-0", "4611686018427387904"};
  int opened = 0, rejected = 0;
  const auto start = std::chrono::steady_clock::now();
  constexpr int kIterations = 3000;
  int done = 0;
  for (; done < kIterations; ++done) {
    std::vector<uint8_t> bytes = base;
    size_t header_end_now = header_end;  // where the header ends, as far as the mutations so far moved it
    const int mutations = 1 + static_cast<int>(pick(3));
    for (int m = 0; m < mutations && bytes.size() > 8; ++m) {
      const size_t header_bytes = std::min(header_end_now, bytes.size()) - 8;
      switch (pick(6)) {
        case 0:  // any byte
          bytes[pick(bytes.size())] = static_cast<uint8_t>(rng());
          break;
        case 1:  // a header byte from the JSON alphabet
          if (header_bytes > 0) bytes[8 + pick(header_bytes)] = static_cast<uint8_t>(json_chars[pick(json_chars.size())]);
          break;
        case 2: {  // a number in the header replaced by an extreme one
          if (header_bytes == 0) break;
          std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<int64_t>(header_bytes));
          const size_t at = header.find_first_of("0123456789", pick(header.size()));
          if (at == std::string::npos) break;
          header.replace(at, header.find_first_not_of("0123456789", at) - at, numbers[pick(numbers.size())]);
          std::vector<uint8_t> rebuilt = raw_file(header, 0);
          rebuilt.insert(rebuilt.end(), bytes.begin() + 8 + static_cast<int64_t>(header_bytes), bytes.end());
          bytes = std::move(rebuilt);
          header_end_now = 8 + header.size();
          break;
        }
        case 3: {  // the length field nudged or replaced
          uint64_t len = le64(bytes.data());
          len = pick(4) == 0 ? rng() : len + pick(33) - 16;
          for (int i = 0; i < 8; ++i) bytes[i] = static_cast<uint8_t>(len >> (8 * i));
          break;
        }
        case 4:  // truncation
          bytes.resize(pick(bytes.size() + 1));
          break;
        case 5:  // bytes appended to the data section
          bytes.resize(bytes.size() + 1 + pick(16), 0xAB);
          break;
      }
    }
    // A fresh name each time: rewriting one file in place makes ext4 flush it on every close (auto_da_alloc).
    const std::string file = path(fmt::format("fuzz{}.safetensors", done));
    write_bytes(file, bytes);
    try {
      SafetensorsFile f(file);
      ++opened;
      for (const std::string& name : f.names()) {
        const TensorView& v = f.get(name);
        ASSERT_GE(v.numel(), 0);
        ASSERT_EQ(v.bytes.size(), static_cast<size_t>(v.numel()) * dtype_size(v.dtype)) << name;
        // The view lies inside the data section of the mapped file: its bytes equal the file's at some offset
        // past the header. Reading every byte also faults if the view pointed outside the mapping.
        const uint64_t header_len = le64(bytes.data());
        const size_t data_start = 8 + header_len;
        bool found = v.bytes.empty();
        for (size_t off = data_start; !found && off + v.bytes.size() <= bytes.size(); ++off)
          found = std::equal(v.bytes.begin(), v.bytes.end(), bytes.begin() + static_cast<int64_t>(off));
        ASSERT_TRUE(found) << name;
      }
    } catch (const Error&) {
      ++rejected;
    }
    fs::remove(file);
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(4)) break;
  }
  // The mutations must exercise both paths, or the loop tests nothing.
  EXPECT_GT(opened, 50) << "of " << done;
  EXPECT_GT(rejected, 50) << "of " << done;
  EXPECT_GE(done, 1000) << "fuzz loop too slow";
}

}  // namespace
}  // namespace kestrel
