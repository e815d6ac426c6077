// .npy files (NumPy format 1.0; 2.0/3.0 are read too): little-endian, C order.
// The dtype is kept as its name ("float32", "float16", "bool", ...).
//
// Reading trusts nothing in the file: the header is parsed with a strict grammar (the
// Python literal subset numpy writes), every dim is range-checked, elements x itemsize
// is a checked multiplication (an overflow is a refusal: a wrapped size would let the
// kernel run on a claimed shape over a small buffer), and the data must be exactly as
// long as the shape says before anything is allocated for it.
#ifndef EDGE_APP_NPY_H_
#define EDGE_APP_NPY_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "fileio.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "edge_app reads and writes little-endian .npy data in place: little-endian hosts only"
#endif

namespace edge {

constexpr size_t kMaxNpyRank = 32;
// numpy's own reader refuses headers over 10000 bytes (max_header_size); ours are < 128.
constexpr uint64_t kMaxNpyHeaderBytes = 65536;

struct NpyError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct NpyHeader {
  std::string dtype;  // numpy name, e.g. "float32"
  size_t itemsize = 0;
  std::vector<int64_t> shape;
  uint64_t data_offset = 0;  // where the data starts
  uint64_t nbytes = 0;       // elements x itemsize, overflow-checked
};

struct NpyArray {
  std::string dtype;
  size_t itemsize = 0;
  std::vector<int64_t> shape;
  std::vector<char> data;  // C-order bytes
};

namespace npy_detail {

struct DescrInfo {
  const char* descr;  // little-endian / byte-order-free form
  const char* name;
  size_t itemsize;
};

inline const DescrInfo* Table() {
  static const DescrInfo t[] = {
      {"<f4", "float32", 4}, {"<f2", "float16", 2}, {"<f8", "float64", 8}, {"|b1", "bool", 1},
      {"|i1", "int8", 1},    {"<i2", "int16", 2},   {"<i4", "int32", 4},   {"<i8", "int64", 8},
      {"|u1", "uint8", 1},   {"<u2", "uint16", 2},  {"<u4", "uint32", 4},  {"<u8", "uint64", 8},
      {nullptr, nullptr, 0}};
  return t;
}

[[noreturn]] inline void Bad(const std::string& why) { throw NpyError(why); }

// The header dict: {'descr': '<f4', 'fortran_order': False, 'shape': (1, 16, 64), }
// Exactly these three keys, once each; a 1-tuple needs its comma, as in Python.
class HeaderParser {
 public:
  explicit HeaderParser(const std::string& h) : h_(h) {}

  void Parse(std::string* descr, bool* fortran, std::vector<int64_t>* shape) {
    bool seen_descr = false, seen_fortran = false, seen_shape = false;
    Ws();
    Expect('{');
    Ws();
    while (!At('}')) {
      std::string key = Quoted();
      Ws();
      Expect(':');
      Ws();
      if (key == "descr" && !seen_descr) {
        *descr = Quoted();
        seen_descr = true;
      } else if (key == "fortran_order" && !seen_fortran) {
        if (Word("True")) {
          *fortran = true;
        } else if (Word("False")) {
          *fortran = false;
        } else {
          Bad("fortran_order is not True or False");
        }
        seen_fortran = true;
      } else if (key == "shape" && !seen_shape) {
        Tuple(shape);
        seen_shape = true;
      } else {
        Bad("header key '" + key + "' unexpected or repeated");
      }
      Ws();
      if (At(',')) {
        ++i_;
        Ws();
      } else if (!At('}')) {
        Bad("header dict: expected ',' or '}'");
      }
    }
    ++i_;
    while (i_ < h_.size() && (h_[i_] == ' ' || h_[i_] == '\n')) ++i_;
    if (i_ != h_.size()) Bad("trailing bytes after the header dict");
    if (!seen_descr || !seen_fortran || !seen_shape) Bad("header lacks descr, fortran_order or shape");
  }

 private:
  bool At(char c) const { return i_ < h_.size() && h_[i_] == c; }
  void Ws() {
    while (i_ < h_.size() && h_[i_] == ' ') ++i_;
  }
  void Expect(char c) {
    if (!At(c)) Bad(std::string("header dict: expected '") + c + "'");
    ++i_;
  }
  bool Word(const char* w) {
    size_t n = std::strlen(w);
    if (h_.compare(i_, n, w) != 0) return false;
    i_ += n;
    return true;
  }
  std::string Quoted() {
    if (!At('\'') && !At('"')) Bad("header dict: expected a quoted string");
    const char q = h_[i_++];
    std::string out;
    while (i_ < h_.size() && h_[i_] != q) {
      const char c = h_[i_++];
      if (c == '\\' || c < 0x20 || c > 0x7e) Bad("header dict: unexpected character in a string");
      if (out.size() >= 32) Bad("header dict: string too long");
      out.push_back(c);
    }
    Expect(q);
    return out;
  }
  // A non-negative decimal int64 without leading zeros.
  int64_t Int() {
    if (!(i_ < h_.size() && h_[i_] >= '0' && h_[i_] <= '9')) Bad("shape holds a non-integer");
    if (h_[i_] == '0' && i_ + 1 < h_.size() && h_[i_ + 1] >= '0' && h_[i_ + 1] <= '9') {
      Bad("shape holds a number with a leading zero");
    }
    int64_t v = 0;
    while (i_ < h_.size() && h_[i_] >= '0' && h_[i_] <= '9') {
      if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, h_[i_] - '0', &v)) {
        Bad("a dim of the shape exceeds int64");
      }
      ++i_;
    }
    return v;
  }
  void Tuple(std::vector<int64_t>* shape) {
    Expect('(');
    Ws();
    bool trailing_comma = false;
    while (!At(')')) {
      if (shape->size() == kMaxNpyRank) Bad("shape has more than " + std::to_string(kMaxNpyRank) + " dims");
      shape->push_back(Int());
      Ws();
      trailing_comma = At(',');
      if (trailing_comma) {
        ++i_;
        Ws();
      } else if (!At(')')) {
        Bad("shape: expected ',' or ')'");
      }
    }
    ++i_;
    if (shape->size() == 1 && !trailing_comma) Bad("shape (n) is not a tuple (write (n,))");
  }

  const std::string& h_;
  size_t i_ = 0;
};

}  // namespace npy_detail

// Bytes of the file that hold its header (magic, version, length, dict), from its first
// `avail` (at least 12, or the whole file) bytes.
inline uint64_t NpyHeaderEnd(const char* p, size_t avail) {
  using npy_detail::Bad;
  if (avail < 10 || std::memcmp(p, "\x93NUMPY", 6) != 0) Bad("bad magic");
  const unsigned char* u = reinterpret_cast<const unsigned char*>(p);
  if (u[6] == 1) return 10 + (u[8] | (uint64_t{u[9]} << 8));
  if (u[6] != 2 && u[6] != 3) Bad("format version " + std::to_string(u[6]));
  if (avail < 12) Bad("truncated header");
  uint64_t hlen = u[8] | (uint64_t{u[9]} << 8) | (uint64_t{u[10]} << 16) | (uint64_t{u[11]} << 24);
  if (hlen > kMaxNpyHeaderBytes) Bad("header longer than " + std::to_string(kMaxNpyHeaderBytes) + " bytes");
  return 12 + hlen;
}

// Parses the header held in the first `avail` bytes of a file of `file_size` bytes and
// checks that the data after it is exactly as long as the shape says.
inline NpyHeader ParseNpyHeader(const char* p, size_t avail, uint64_t file_size) {
  using npy_detail::Bad;
  const uint64_t end = NpyHeaderEnd(p, avail);
  if (end > avail || end > file_size) Bad("truncated header");
  const size_t start = reinterpret_cast<const unsigned char*>(p)[6] == 1 ? 10 : 12;
  const std::string dict(p + start, static_cast<size_t>(end - start));
  std::string descr;
  bool fortran = false;
  NpyHeader h;
  npy_detail::HeaderParser(dict).Parse(&descr, &fortran, &h.shape);
  if (fortran) Bad("Fortran order; save with np.ascontiguousarray");
  // "=" and "<" are the same on a little-endian host; "|" is byte-order free.
  std::string norm = descr;
  if (!norm.empty() && (norm[0] == '=' || norm[0] == '|')) norm[0] = '<';
  for (const npy_detail::DescrInfo* d = npy_detail::Table(); d->descr; ++d) {
    std::string want = d->descr;
    want[0] = '<';
    if (norm == want) {
      h.dtype = d->name;
      h.itemsize = d->itemsize;
    }
  }
  if (h.dtype.empty()) Bad("dtype " + descr + "; use little-endian float32, float16 or bool");
  uint64_t n = h.itemsize;
  for (int64_t d : h.shape) {
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) {
      Bad("its shape needs more than 2^64 bytes");
    }
  }
  h.nbytes = n;
  h.data_offset = end;
  const uint64_t have = file_size - end;
  if (have != n) {
    Bad("data is " + std::to_string(have) + " bytes, its shape needs " + std::to_string(n) +
        (have < n ? " (truncated)" : ""));
  }
  return h;
}

// The whole array from a buffer (what the fuzz driver feeds).
inline NpyArray ParseNpy(const std::string& bytes) {
  NpyHeader h = ParseNpyHeader(bytes.data(), bytes.size(), bytes.size());
  NpyArray a{h.dtype, h.itemsize, h.shape, {}};
  a.data.assign(bytes.begin() + static_cast<std::ptrdiff_t>(h.data_offset), bytes.end());
  return a;
}

// An input file: a regular file (a FIFO or a device is refused before it is read) of
// at most max_file_bytes, its header parsed; the data is read only when asked for,
// after the caller has checked the shape.
class NpyFile {
 public:
  NpyFile(const std::string& path, uint64_t max_file_bytes) : path_(path) {
    file_ = OpenRegular(path, path, /*follow_links=*/true, max_file_bytes);
    try {
      std::string head(static_cast<size_t>(std::min<uint64_t>(file_.size(), 12)), '\0');
      if (!file_.ReadAt(0, &head[0], head.size())) Bad("changed while being read");
      uint64_t end = NpyHeaderEnd(head.data(), head.size());
      if (end > file_.size()) Bad("truncated header");
      head.resize(static_cast<size_t>(end));
      if (!file_.ReadAt(0, &head[0], head.size())) Bad("changed while being read");
      header_ = ParseNpyHeader(head.data(), head.size(), file_.size());
    } catch (const NpyError& e) {
      throw NpyError(path + ": not a .npy file this app reads (" + e.what() + ")");
    }
  }

  const NpyHeader& header() const { return header_; }

  NpyArray Read() const {
    NpyArray a{header_.dtype, header_.itemsize, header_.shape, {}};
    a.data.resize(static_cast<size_t>(header_.nbytes));
    if (!a.data.empty() && !file_.ReadAt(header_.data_offset, a.data.data(), a.data.size())) {
      throw NpyError(path_ + ": changed while being read");
    }
    return a;
  }

 private:
  [[noreturn]] static void Bad(const std::string& why) { npy_detail::Bad(why); }
  std::string path_;
  InFile file_;
  NpyHeader header_;
};

// Writes atomically (a fresh temporary sibling, then rename).
inline void WriteNpy(const std::string& path, const std::string& dtype,
                     const std::vector<int64_t>& shape, const void* data, size_t nbytes) {
  const char* descr = nullptr;
  for (const npy_detail::DescrInfo* d = npy_detail::Table(); d->descr; ++d) {
    if (dtype == d->name) descr = d->descr;
  }
  if (!descr) throw NpyError("cannot write dtype " + dtype + " to .npy");
  std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < shape.size(); ++i) {
    dict += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) dict += ",";
    if (i + 1 < shape.size()) dict += " ";
  }
  dict += "), }";
  size_t total = 10 + dict.size() + 1;  // magic+version+len, dict, '\n'
  size_t pad = (64 - total % 64) % 64;
  dict.append(pad, ' ');
  dict.push_back('\n');
  if (dict.size() > 65535) throw NpyError("cannot write a shape of rank " + std::to_string(shape.size()));
  std::string head = std::string("\x93NUMPY\x01\x00", 8);
  head.push_back(static_cast<char>(dict.size() & 0xff));
  head.push_back(static_cast<char>(dict.size() >> 8));
  WriteAtomic(path, head + dict, data, nbytes);
}

}  // namespace edge

#endif  // EDGE_APP_NPY_H_
