#include "core/npy.h"

#include <bit>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>

#include "core/error.h"

namespace kestrel {
namespace {

static_assert(std::endian::native == std::endian::little, "the .npy code writes and reads host bytes as little-endian");

constexpr char kMagic[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};
constexpr size_t kAlign = 64;
// Version 1.0 stores the header length in 2 bytes, version 2.0 in 4.
constexpr size_t kPrefixV1 = sizeof(kMagic) + 2 + 2;
constexpr size_t kPrefixV2 = sizeof(kMagic) + 2 + 4;

// Element count of a shape, checking that the byte count numel * itemsize fits in int64.
int64_t checked_numel(const std::vector<int64_t>& shape, int64_t itemsize, const std::string& path) {
  int64_t numel = 1;
  for (const int64_t d : shape) {
    KESTREL_CHECK(d >= 0, "{}: negative dimension {} in the shape", path, d);
    KESTREL_CHECK(d == 0 || numel <= std::numeric_limits<int64_t>::max() / itemsize / d,
                  "{}: the shape's byte size overflows", path);
    numel *= d;
  }
  return numel;
}

std::string shape_tuple(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";  // a Python one-tuple
  return s + ")";
}

void write_array(const std::string& path, const void* data, const char* descr, int64_t itemsize,
                 const std::vector<int64_t>& shape) {
  const int64_t numel = checked_numel(shape, itemsize, path);
  std::string header =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", descr, shape_tuple(shape));
  // Spaces, then the newline that ends the header, up to the next multiple of 64 including the prefix.
  const size_t unpadded = kPrefixV1 + header.size() + 1;
  header.append((kAlign - unpadded % kAlign) % kAlign, ' ');
  header += '\n';
  KESTREL_CHECK(header.size() <= 0xFFFF, "{}: the .npy header for shape {} is too long for format 1.0", path,
                shape_tuple(shape));

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  KESTREL_CHECK(out.is_open(), "{}: cannot open for writing: {}", path, std::strerror(errno));
  const uint8_t prefix[4] = {1, 0, static_cast<uint8_t>(header.size() & 0xFF),
                             static_cast<uint8_t>(header.size() >> 8)};
  out.write(kMagic, sizeof(kMagic));
  out.write(reinterpret_cast<const char*>(prefix), sizeof(prefix));
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(numel * itemsize));
  out.close();
  KESTREL_CHECK(!out.fail(), "{}: writing failed: {}", path, std::strerror(errno));
}

// Byte size of the element types read_npy accepts: little-endian numbers and the one-byte types, which numpy
// marks '|' (no byte order).
std::optional<int64_t> itemsize_of(const std::string& descr) {
  static const std::pair<const char*, int64_t> kKnown[] = {
      {"<f2", 2}, {"<f4", 4}, {"<f8", 8}, {"<i2", 2}, {"<i4", 4}, {"<i8", 8}, {"<u2", 2},
      {"<u4", 4}, {"<u8", 8}, {"|i1", 1}, {"|u1", 1}, {"|b1", 1},
  };
  for (const auto& [name, size] : kKnown) {
    if (descr == name) return size;
  }
  return std::nullopt;
}

// A parser for the one Python literal a .npy header holds: a dict of three keys with a string, a bool and a
// tuple of non-negative ints. It accepts what numpy writes (any whitespace, a trailing comma, either quote).
class HeaderParser {
 public:
  HeaderParser(const std::string& text, const std::string& path) : text_(text), path_(path) {}

  NpyArray parse() {
    NpyArray array;
    bool have_descr = false, have_order = false, have_shape = false;
    expect('{');
    while (true) {
      skip_space();
      if (peek() == '}') break;
      const std::string key = parse_string();
      expect(':');
      if (key == "descr") {
        KESTREL_CHECK(!have_descr, "{}: .npy header repeats the key 'descr'", path_);
        have_descr = true;
        array.dtype = parse_string();
      } else if (key == "fortran_order") {
        KESTREL_CHECK(!have_order, "{}: .npy header repeats the key 'fortran_order'", path_);
        have_order = true;
        KESTREL_CHECK(!parse_bool(), "{}: Fortran-order .npy arrays are not supported", path_);
      } else if (key == "shape") {
        KESTREL_CHECK(!have_shape, "{}: .npy header repeats the key 'shape'", path_);
        have_shape = true;
        array.shape = parse_shape();
      } else {
        fail("{}: unexpected key '{}' in the .npy header", path_, key);
      }
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      KESTREL_CHECK(peek() == '}', "{}: malformed .npy header at byte {}: expected ',' or '}}'", path_, pos_);
    }
    ++pos_;
    skip_space();
    KESTREL_CHECK(pos_ == text_.size(), "{}: unexpected text after the .npy header dict at byte {}", path_, pos_);
    KESTREL_CHECK(have_descr && have_order && have_shape,
                  "{}: the .npy header lacks one of the keys 'descr', 'fortran_order', 'shape'", path_);
    return array;
  }

 private:
  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  void expect(char c) {
    skip_space();
    KESTREL_CHECK(peek() == c, "{}: malformed .npy header at byte {}: expected '{}'", path_, pos_, c);
    ++pos_;
  }

  std::string parse_string() {
    skip_space();
    const char quote = peek();
    KESTREL_CHECK(quote == '\'' || quote == '"', "{}: malformed .npy header at byte {}: expected a string", path_,
                  pos_);
    const size_t end = text_.find(quote, pos_ + 1);
    KESTREL_CHECK(end != std::string::npos, "{}: unterminated string in the .npy header", path_);
    std::string s = text_.substr(pos_ + 1, end - pos_ - 1);
    pos_ = end + 1;
    return s;
  }

  bool parse_bool() {
    skip_space();
    for (const auto& [word, value] : {std::pair{"True", true}, std::pair{"False", false}}) {
      const size_t n = std::strlen(word);
      if (text_.compare(pos_, n, word) == 0) {
        pos_ += n;
        return value;
      }
    }
    fail("{}: malformed .npy header at byte {}: expected True or False", path_, pos_);
  }

  int64_t parse_dimension() {
    skip_space();
    KESTREL_CHECK(std::isdigit(static_cast<unsigned char>(peek())),
                  "{}: malformed .npy shape at byte {}: expected a non-negative integer", path_, pos_);
    int64_t value = 0;
    while (std::isdigit(static_cast<unsigned char>(peek()))) {
      const int digit = peek() - '0';
      KESTREL_CHECK(value <= (std::numeric_limits<int64_t>::max() - digit) / 10, "{}: .npy dimension overflows",
                    path_);
      value = value * 10 + digit;
      ++pos_;
    }
    return value;
  }

  std::vector<int64_t> parse_shape() {
    expect('(');
    std::vector<int64_t> shape;
    skip_space();
    if (peek() == ')') {
      ++pos_;
      return shape;
    }
    while (true) {
      shape.push_back(parse_dimension());
      skip_space();
      if (peek() == ')') {
        // "(3)" is the int 3 in Python, not a tuple.
        KESTREL_CHECK(shape.size() > 1, "{}: malformed .npy shape: a one-element tuple needs a trailing comma",
                      path_);
        ++pos_;
        return shape;
      }
      expect(',');
      skip_space();
      if (peek() == ')') {
        ++pos_;
        return shape;
      }
    }
  }

  const std::string& text_;
  const std::string& path_;
  size_t pos_ = 0;
};

template <typename T>
std::vector<T> copy_elements(const NpyArray& array, const char* descr) {
  KESTREL_CHECK(array.dtype == descr, "npy array has dtype '{}', not '{}'", array.dtype, descr);
  std::vector<T> values(array.data.size() / sizeof(T));
  std::memcpy(values.data(), array.data.data(), values.size() * sizeof(T));
  return values;
}

}  // namespace

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

std::vector<float> NpyArray::to_f32() const { return copy_elements<float>(*this, "<f4"); }
std::vector<int32_t> NpyArray::to_i32() const { return copy_elements<int32_t>(*this, "<i4"); }

void write_npy(const std::string& path, const float* data, const std::vector<int64_t>& shape) {
  write_array(path, data, "<f4", sizeof(float), shape);
}

void write_npy(const std::string& path, const int32_t* data, const std::vector<int64_t>& shape) {
  write_array(path, data, "<i4", sizeof(int32_t), shape);
}

NpyArray read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KESTREL_CHECK(in.is_open(), "{}: cannot open for reading: {}", path, std::strerror(errno));
  in.seekg(0, std::ios::end);
  const auto file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0, std::ios::beg);

  KESTREL_CHECK(file_size >= kPrefixV1, "{}: too short for a .npy file ({} bytes)", path, file_size);
  uint8_t prefix[kPrefixV2] = {};
  in.read(reinterpret_cast<char*>(prefix), kPrefixV1);
  KESTREL_CHECK(std::memcmp(prefix, kMagic, sizeof(kMagic)) == 0, "{}: not a .npy file (bad magic)", path);
  const int major = prefix[6], minor = prefix[7];
  KESTREL_CHECK((major == 1 || major == 2) && minor == 0, "{}: unsupported .npy format version {}.{}", path, major,
                minor);
  uint64_t header_len = prefix[8] | (static_cast<uint64_t>(prefix[9]) << 8);
  size_t prefix_len = kPrefixV1;
  if (major == 2) {
    KESTREL_CHECK(file_size >= kPrefixV2, "{}: too short for a .npy 2.0 file ({} bytes)", path, file_size);
    in.read(reinterpret_cast<char*>(prefix + kPrefixV1), kPrefixV2 - kPrefixV1);
    header_len |= (static_cast<uint64_t>(prefix[10]) << 16) | (static_cast<uint64_t>(prefix[11]) << 24);
    prefix_len = kPrefixV2;
  }
  KESTREL_CHECK(header_len <= file_size - prefix_len, "{}: .npy header length {} runs past the end of the file",
                path, header_len);
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  KESTREL_CHECK(in.good(), "{}: reading the .npy header failed", path);

  NpyArray array = HeaderParser(header, path).parse();
  const std::optional<int64_t> itemsize = itemsize_of(array.dtype);
  KESTREL_CHECK(itemsize.has_value(), "{}: unsupported .npy dtype '{}' (little-endian or one-byte numbers only)",
                path, array.dtype);
  const int64_t data_bytes = checked_numel(array.shape, *itemsize, path) * *itemsize;
  const uint64_t expected_size = prefix_len + header_len + static_cast<uint64_t>(data_bytes);
  KESTREL_CHECK(file_size == expected_size, "{}: file is {} bytes, but its .npy header ({} {}) implies {}", path,
                file_size, array.dtype, shape_tuple(array.shape), expected_size);
  array.data.resize(static_cast<size_t>(data_bytes));
  in.read(reinterpret_cast<char*>(array.data.data()), data_bytes);
  KESTREL_CHECK(in.good() || data_bytes == 0, "{}: reading the .npy data failed", path);
  return array;
}

}  // namespace kestrel
