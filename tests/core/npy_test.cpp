// .npy tests: the exact bytes the writer produces (worked out from the format description), round trips,
// hand-built files in layouts numpy also writes (version 2.0, one-byte dtypes), and every malformation the
// reader must reject.
#include "core/npy.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/error.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;

class NpyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("kestrel_npy_test_" + std::to_string(::getpid()) + "_" + info->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  static std::string file_bytes(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  static void put_bytes(const std::string& p, const std::string& bytes) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }

  // A version-1.0 file with the given header text (padding not applied) and `data_bytes` bytes of data.
  std::string v1_file(const std::string& header, size_t data_bytes, char fill = '\x01') const {
    std::string bytes = std::string("\x93NUMPY", 6) + '\x01' + '\x00';
    bytes += static_cast<char>(header.size() & 0xFF);
    bytes += static_cast<char>(header.size() >> 8);
    return bytes + header + std::string(data_bytes, fill);
  }

  void expect_rejected(const std::string& bytes, const std::string& what_contains) {
    const std::string p = path("bad.npy");
    put_bytes(p, bytes);
    try {
      read_npy(p);
      ADD_FAILURE() << "accepted a file that should fail with '" << what_contains << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what_contains), std::string::npos) << e.what();
    }
  }

  fs::path dir_;
};

TEST_F(NpyTest, WriterProducesTheExactVersion1Layout) {
  const float data[6] = {1.0f, -2.0f, 0.5f, 3.25f, 0.0f, -0.0f};
  const std::string p = path("a.npy");
  write_npy(p, data, {2, 3});
  const std::string bytes = file_bytes(p);
  // 10-byte prefix + 59-character dict would be 69 bytes; padded with spaces and '\n' to 128.
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  ASSERT_EQ(dict.size(), 59u);
  ASSERT_EQ(bytes.size(), 128u + 24u);
  EXPECT_EQ(bytes.substr(0, 6), std::string("\x93NUMPY", 6));
  EXPECT_EQ(bytes[6], '\x01');
  EXPECT_EQ(bytes[7], '\x00');
  EXPECT_EQ(static_cast<uint8_t>(bytes[8]), 118);  // header length 128 - 10, little-endian
  EXPECT_EQ(static_cast<uint8_t>(bytes[9]), 0);
  EXPECT_EQ(bytes.substr(10, 118), dict + std::string(58, ' ') + "\n");
  // Data: little-endian fp32, C order. 1.0 = 0x3F800000, -2.0 = 0xC0000000.
  EXPECT_EQ(bytes.substr(128, 4), std::string("\x00\x00\x80\x3F", 4));
  EXPECT_EQ(bytes.substr(132, 4), std::string("\x00\x00\x00\xC0", 4));
  EXPECT_EQ(std::memcmp(bytes.data() + 128, data, sizeof(data)), 0);
}

TEST_F(NpyTest, ShapeTuplesAndPadding) {
  const float one = 7.0f;
  std::vector<float> five(5, 1.0f);
  write_npy(path("scalar.npy"), &one, {});
  write_npy(path("vector.npy"), five.data(), {5});
  write_npy(path("empty.npy"), five.data(), {0, 4});
  const std::vector<int64_t> many(40, 1);
  write_npy(path("many.npy"), &one, many);

  // Every '<f4' dict is at least 53 characters plus the tuple, so with the 10-byte prefix and the newline the
  // data starts at 128 for short shapes; 40 dimensions make a 120-character tuple: 10 + 173 + 1 = 184 -> 192.
  const std::string scalar = file_bytes(path("scalar.npy"));
  EXPECT_NE(scalar.find("'shape': (), }"), std::string::npos);
  EXPECT_EQ(scalar.size(), 128u + 4u);
  const std::string vector = file_bytes(path("vector.npy"));
  EXPECT_NE(vector.find("'shape': (5,), }"), std::string::npos);
  EXPECT_EQ(vector.size(), 128u + 20u);
  const std::string empty = file_bytes(path("empty.npy"));
  EXPECT_NE(empty.find("'shape': (0, 4), }"), std::string::npos);
  EXPECT_EQ(empty.size(), 128u);
  const std::string many_bytes = file_bytes(path("many.npy"));
  EXPECT_EQ(many_bytes.size(), 192u + 4u);
  EXPECT_EQ(many_bytes[191], '\n');

  const NpyArray s = read_npy(path("scalar.npy"));
  EXPECT_TRUE(s.shape.empty());
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(s.to_f32(), std::vector<float>{7.0f});
  const NpyArray e = read_npy(path("empty.npy"));
  EXPECT_EQ(e.shape, (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(e.numel(), 0);
  EXPECT_TRUE(e.data.empty());
  EXPECT_EQ(read_npy(path("many.npy")).shape, many);
}

TEST_F(NpyTest, Float32AndInt32RoundTrip) {
  std::vector<float> f(3 * 4 * 5);
  for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(i) * 0.37f - 9.0f;
  write_npy(path("f.npy"), f.data(), {3, 4, 5});
  const NpyArray a = read_npy(path("f.npy"));
  EXPECT_EQ(a.dtype, "<f4");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(a.data.size(), f.size() * 4);
  EXPECT_EQ(a.to_f32(), f);
  EXPECT_THROW(a.to_i32(), Error);

  const std::vector<int32_t> v = {0, -1, 2147483647, -2147483647 - 1, 42, 7};
  write_npy(path("i.npy"), v.data(), {6, 1});
  const NpyArray b = read_npy(path("i.npy"));
  EXPECT_EQ(b.dtype, "<i4");
  EXPECT_EQ(b.shape, (std::vector<int64_t>{6, 1}));
  EXPECT_EQ(b.to_i32(), v);
  EXPECT_THROW(b.to_f32(), Error);
  const std::string bytes = file_bytes(path("i.npy"));
  EXPECT_EQ(bytes.substr(128 + 4, 4), std::string("\xFF\xFF\xFF\xFF", 4));  // -1
}

TEST_F(NpyTest, ReadsOtherLayoutsNumpyWrites) {
  // Version 2.0 (4-byte header length), int64, no padding, double-quoted strings, extra spaces.
  const std::string header = "{ \"descr\" : \"<i8\", \"shape\" : ( 3 , ) , \"fortran_order\" : False }\n";
  std::string bytes = std::string("\x93NUMPY", 6) + '\x02' + '\x00';
  const uint32_t len = static_cast<uint32_t>(header.size());
  for (int i = 0; i < 4; ++i) bytes += static_cast<char>((len >> (8 * i)) & 0xFF);
  const int64_t values[3] = {-5, 0, 1LL << 40};
  bytes += header + std::string(reinterpret_cast<const char*>(values), sizeof(values));
  put_bytes(path("v2.npy"), bytes);
  const NpyArray a = read_npy(path("v2.npy"));
  EXPECT_EQ(a.dtype, "<i8");
  EXPECT_EQ(a.shape, std::vector<int64_t>{3});
  ASSERT_EQ(a.data.size(), 24u);
  EXPECT_EQ(std::memcmp(a.data.data(), values, 24), 0);

  put_bytes(path("u1.npy"), v1_file("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 2), }\n", 4, '\x07'));
  const NpyArray b = read_npy(path("u1.npy"));
  EXPECT_EQ(b.dtype, "|u1");
  EXPECT_EQ(b.data, (std::vector<uint8_t>{7, 7, 7, 7}));
}

TEST_F(NpyTest, RejectsMalformedFiles) {
  const std::string good = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }\n";
  put_bytes(path("ok.npy"), v1_file(good, 8));
  EXPECT_NO_THROW(read_npy(path("ok.npy")));

  expect_rejected("", "too short");
  expect_rejected(std::string("\x93NUMPX\x01\x00", 8) + std::string(60, ' '), "bad magic");
  {
    std::string v3 = v1_file(good, 8);
    v3[6] = '\x03';
    expect_rejected(v3, "version 3.0");
    v3[6] = '\x01';
    v3[7] = '\x01';
    expect_rejected(v3, "version 1.1");
  }
  {
    std::string long_len = v1_file(good, 8);
    long_len[9] = '\x10';  // header length 4096 + 59
    expect_rejected(long_len, "runs past the end");
  }
  expect_rejected(v1_file(good, 7), "implies");  // truncated data
  expect_rejected(v1_file(good, 9), "implies");  // trailing bytes
  expect_rejected(v1_file("{'descr': '<f4', 'fortran_order': True, 'shape': (2,), }", 8), "Fortran-order");
  expect_rejected(v1_file("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", 8), "unsupported .npy dtype");
  expect_rejected(v1_file("{'descr': '<c8', 'fortran_order': False, 'shape': (2,), }", 16), "unsupported .npy dtype");
  expect_rejected(v1_file("{'descr': '<f4', 'shape': (2,), }", 8), "lacks");
  expect_rejected(v1_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", 8), "unexpected key");
  expect_rejected(v1_file("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", 8), "repeats");
  expect_rejected(v1_file("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }", 8), "non-negative");
  expect_rejected(v1_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2), }", 8), "trailing comma");
  expect_rejected(v1_file("{'descr': '<f4', 'fortran_order': False, 'shape': [2], }", 8), "expected '('");
  expect_rejected(v1_file("{'descr': '<f4', 'fortran_order': 0, 'shape': (2,), }", 8), "True or False");
  expect_rejected(v1_file("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), } x", 8), "after the .npy header");
  expect_rejected(v1_file("{'descr': '<f4' 'fortran_order': False, 'shape': (2,), }", 8), "expected ','");
  expect_rejected(v1_file("{'descr: '<f4', 'fortran_order': False, 'shape': (2,), }", 8), "expected ':'");
  expect_rejected(v1_file("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }", 8),
                  "overflows");
  expect_rejected(v1_file("{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 4), }", 8),
                  "overflows");
  EXPECT_THROW(read_npy(path("does_not_exist.npy")), Error);
}

TEST_F(NpyTest, WriterRejectsBadShapesAndPaths) {
  const float x[2] = {1.0f, 2.0f};
  EXPECT_THROW(write_npy(path("neg.npy"), x, {2, -1}), Error);
  EXPECT_THROW(write_npy(path("no_such_dir/x.npy"), x, {2}), Error);
}

}  // namespace
}  // namespace kestrel
